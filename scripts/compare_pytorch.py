#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention beside the stages (optional: needs PyTorch and a
CUDA GPU; without them it says so and exits 0, so the benchmark command still works).

1. Timing: each SDPA backend forced in turn (flash, cudnn, efficient, math) on the sweep of
   docs/conventions.md section 5, forward and backward, fp16 (bf16 too for flash and cuDNN,
   and fp32 for the backends that have it, to compare with the fp32 stages). Same convention
   as the stages: CUDA events, 5 warm-ups, median of 20 repeats, L2 flushed before each.
   Rows go to <out>/gpu.tsv with stage "sdpa_<backend>", in the stages' TSV format, so the
   plots draw them beside.
2. Checking: the half-precision stages (07 on) run a few shapes with --save; this script
   recomputes O, LSE, dQ, dK, dV in float64 with PyTorch and compares each stage's error with
   the error of PyTorch's own fp16/bf16 attention on the same inputs (FlashAttention's rule:
   O within 2x, dK and dV within 3x, dQ within 4x, plus the rounding floor). Exit 1 if any
   check fails.
"""
import argparse
import datetime
import math
import os
import statistics
import subprocess
import sys
import tempfile

from sweep import GPU_N, HIDDEN, TOKENS

WARMUPS, REPEATS = 5, 20
# The stage programs' TSV header (common/runner.c), so that these rows and theirs make one table.
# window, softcap, seqlens and seqlens_kv came last, with 13_window_softcap_varlen; a row of
# plain attention holds NO_MASK_CELLS there.
HEADER = ("stage\tdirection\tdtype\tB\tH\tNq\tNkv\td\tcausal\tms\ttflops\tworkspace_bytes\t"
          "device_bytes\tpeak_rss_bytes\tmax_err\ttol\tcheck\tdevice\tunits\tcuda\tdate\t"
          "window\tsoftcap\tseqlens\tseqlens_kv\n")
NO_MASK_CELLS = ("-", "-", "-", "-")


def need_torch():
    try:
        import torch
    except ImportError:
        print("compare_pytorch: skipped: PyTorch is not installed (pip install torch)")
        sys.exit(0)
    if not torch.cuda.is_available():
        print("compare_pytorch: skipped: no CUDA device for PyTorch")
        sys.exit(0)
    return torch


def backends(torch):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def timed_median(torch, fn, flush):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(REPEATS):
        flush.zero_()  # evicts L2: the buffer is twice its size
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # The stage programs' median (common/runner.c): of an even count, the mean of the two
    # middle times.
    return statistics.median(times)


def flops(b, h, n, d, causal):
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def bench(torch, out_dir, budget, names, seqs):
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    prop = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * getattr(prop, "L2_cache_size", 64 << 20), dtype=torch.uint8,
                        device="cuda")
    stamp = (prop.name, str(prop.multi_processor_count), torch.version.cuda,
             datetime.date.today().isoformat())
    tsv = os.path.join(out_dir, "gpu.tsv")
    new = not os.path.exists(tsv)
    cases = [(name, dtype) for name in names for dtype in ("fp16", "bf16", "fp32")
             if dtype == "fp16" or (dtype == "bf16" and name in ("flash", "cudnn")) or
             (dtype == "fp32" and name in ("efficient", "math"))]
    todo = [(name, dtype, d, causal, n) for name, dtype in cases for d in (64, 128)
            for causal in (False, True) for n in seqs]
    t0 = datetime.datetime.now()
    with open(tsv, "a") as f:
        if new:
            f.write(HEADER)
        for k, (name, dtype, d, causal, n) in enumerate(todo):
            elapsed = (datetime.datetime.now() - t0).total_seconds()
            if budget and elapsed > budget:
                print(f"compare_pytorch: stopped at its budget ({budget} s), "
                      f"{len(todo) - k} points not run", file=sys.stderr)
                break
            print(f"[{k + 1:3d}/{len(todo)}] sdpa_{name} {dtype} d={d} N={n} "
                  f"{'causal' if causal else ''}  elapsed {elapsed:.0f} s", file=sys.stderr,
                  flush=True)
            b, h = TOKENS // n, HIDDEN // d
            tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
            torch.manual_seed(0)
            try:
                q, k_, v = (torch.randn(b, h, n, d, device="cuda", dtype=tdt, requires_grad=True)
                            for _ in range(3))
                do = torch.randn(b, h, n, d, device="cuda", dtype=tdt)
                with sdpa_kernel(backends(torch)[name]):
                    torch.cuda.reset_peak_memory_stats()
                    fwd = lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=causal)
                    ms_f = timed_median(torch, fwd, flush)
                    peak = torch.cuda.max_memory_allocated()
                    o = fwd()
                    bwd = lambda: torch.autograd.grad(o, (q, k_, v), do, retain_graph=True)
                    ms_b = timed_median(torch, bwd, flush)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                print(f"    not run: {str(e).splitlines()[0][:120]}", file=sys.stderr)
                torch.cuda.empty_cache()
                continue
            fl = flops(b, h, n, d, causal)
            for direction, ms, fl_dir in (("fwd", ms_f, fl), ("bwd", ms_b, 2.5 * fl)):
                f.write("\t".join([f"sdpa_{name}", direction, dtype, str(b), str(h), str(n),
                                   str(n), str(d), str(int(causal)), f"{ms:.4f}",
                                   f"{fl_dir / ms / 1e9:.2f}", "0", str(peak), "0", "", "",
                                   "-", *stamp, *NO_MASK_CELLS]) + "\n")
            f.flush()
            del q, k_, v, do, o
            torch.cuda.empty_cache()


def reference(torch, q, k, v, do, scale, causal, dtype):
    """O, LSE, dQ, dK, dV of attention in `dtype` (bottom-right causal mask, rows that see no
    key give O = 0, LSE = -inf, zero gradients), with autograd."""
    q, k, v = (x.to(dtype).detach().requires_grad_(True) for x in (q, k, v))
    nq, nkv = q.shape[2], k.shape[2]
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # S in fp32 at least
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nkv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nkv - nq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # empty rows: exp(-inf - -inf)
    o = (p.to(dtype) @ v)
    (dq, dk, dv) = torch.autograd.grad(o, (q, k, v), do.to(dtype))
    return [x.double() for x in (o, lse, dq, dk, dv)]


HALF_STAGES = ["07_tensor_cores", "08_mma_sync", "09_swizzle_pipeline", "10_hopper_wgmma",
               "11_split_kv_decode", "12_hopper_backward"]


def check_half_stages(torch, bin_dir):
    """Whether every built half-precision stage is within the rule, and which were checked."""
    ok, checked = True, []
    try:
        import numpy  # noqa: F401  (check_stage reads the stages' .npy outputs with it)
    except ImportError:
        print("compare_pytorch: numpy is not installed (pip install numpy): outputs not checked")
        return ok, checked
    for stage in HALF_STAGES:
        ok &= check_stage(torch, bin_dir, stage)
        if os.access(os.path.join(bin_dir, stage), os.X_OK):
            checked.append(stage[:2])
    return ok, checked


def check_stage(torch, bin_dir, stage):
    import numpy as np  # check_half_stages made sure it imports
    path = os.path.join(bin_dir, stage)
    tag = stage[:2]
    if not os.access(path, os.X_OK):
        print(f"compare_pytorch: {stage} not built: outputs not checked")
        return True
    shapes = [["-b", "1", "-H", "2", "-n", "1000", "-d", "64"],
              ["-b", "2", "-H", "3", "--seq-q", "777", "--seq-kv", "1025", "-d", "128",
               "--causal"],
              ["-b", "1", "-H", "4", "--seq-q", "300", "--seq-kv", "200", "-d", "64", "--causal"]]
    ok = True
    for dtype in ("fp16", "bf16"):
        for args in shapes:
            with tempfile.TemporaryDirectory() as tmp:
                r = subprocess.run([path, "--backward", "--save", tmp, "--dtype", dtype] + args,
                                   capture_output=True, text=True)
                if r.returncode == 77:  # a GPU this stage does not run on (10: Hopper only)
                    print(f"{tag}: skipped: {r.stderr.strip()}")
                    return True
                if r.returncode != 0:
                    print(f"{tag} {dtype} {' '.join(args)}: exit {r.returncode}: {r.stderr}")
                    ok = False
                    continue
                t = {n: torch.from_numpy(np.load(os.path.join(tmp, n + ".npy"))).cuda()
                     for n in ("q", "k", "v", "do", "o", "lse", "dq", "dk", "dv")}
            d = t["q"].shape[-1]
            causal = "--causal" in args
            tdt = torch.float16 if dtype == "fp16" else torch.bfloat16
            ref = reference(torch, t["q"].double(), t["k"].double(), t["v"].double(),
                            t["do"].double(), 1 / math.sqrt(d), causal, torch.float64)
            low = reference(torch, t["q"], t["k"], t["v"], t["do"], 1 / math.sqrt(d), causal,
                            tdt)
            names, factors = ("O", "LSE", "dQ", "dK", "dV"), (2, 2, 4, 3, 3)
            got = [t[n].double() for n in ("o", "lse", "dq", "dk", "dv")]
            line = []
            for name, m, g, lo, rf in zip(names, factors, got, low, ref):
                fin = torch.isfinite(rf)
                err = (g[fin] - rf[fin]).abs().max().item() if fin.any() else 0.0
                base = (lo[fin] - rf[fin]).abs().max().item() if fin.any() else 0.0
                x = rf[fin].to(tdt)
                floor = 2 * ((x + 0.3 - 0.3) - x).abs().max().item() if fin.any() else 0.0
                good = err <= m * base + floor and bool((torch.isfinite(g) == fin).all())
                ok &= good
                line.append(f"{name} {err:.2e} (torch {dtype} {base:.2e}){'' if good else ' FAIL'}")
            print(f"{tag} {dtype} {' '.join(args)}: " + ", ".join(line))
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder of the stage programs")
    ap.add_argument("--out", required=True, help="folder for gpu.tsv")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the timing sweep")
    ap.add_argument("--no-bench", action="store_true",
                    help="only check the half-precision stages' outputs")
    ap.add_argument("--no-check", action="store_true", help="only time PyTorch")
    ap.add_argument("--backends", nargs="*", default=["flash", "cudnn", "efficient", "math"])
    ap.add_argument("--seq", nargs="*", type=int, default=GPU_N, help="sequence lengths")
    a = ap.parse_args()
    if any(n < 1 or n > 16384 for n in a.seq):
        ap.error("--seq: sequence lengths must be in 1..16384 (B = 16384/N)")
    if a.budget < 0:
        ap.error("--budget must be 0 (no limit) or a positive number of seconds")
    torch = need_torch()
    os.makedirs(a.out, exist_ok=True)
    ok, checked = (True, []) if a.no_check else check_half_stages(torch, a.bin)
    if not a.no_bench:
        bench(torch, a.out, a.budget, a.backends, a.seq)
    if a.no_check:
        verdict = "skipped the output check"
    elif not checked:
        verdict = "no half-precision stage is built: no output checked"
    else:
        verdict = (f"stages {' and '.join(checked)} outputs " + ("match" if ok else "DO NOT match")
                   + " PyTorch within FlashAttention's rule")
    print("compare_pytorch: " + verdict)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
