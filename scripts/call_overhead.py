#!/usr/bin/env python3
"""Wall time per call, back to back, of attention calls too small for the kernels to matter:
what a training step or a decode step pays per layer on the host. flash_stages beside each
SDPA backend, in one process, and a cProfile of the flash_stages calls (where the host time
goes: checks, dispatch, ctypes, allocation). The package is timed through both of its entry
points: SDPA's call on [B, H, N, d] (impl flash_stages) and FlashAttention's on [B, S, H, d]
(fs_flash_attn: flash_attn_func; fs_kvcache: flash_attn_with_kvcache, full caches).

    python3 scripts/call_overhead.py                      # the shapes below, every backend
    python3 scripts/call_overhead.py --tsv out.tsv --profile 25

Shapes (the PyTorch issue's): forward and forward + backward at B = 1, H = 8, N = 128, d = 64
and B = 1, H = 16, N = 1024, d = 128; decode (one query, H = 32, Hkv = 8, d = 128) at B = 1
and 8 with caches of 1k, 4k, 32k and 128k keys. A call is timed as the wall time of CALLS calls back to
back, then one synchronisation, divided by CALLS, the implementations taking turns round by
round (the median of ROUNDS): the kernels overlap the host's next call, so
a call costs max(host time, kernel time). Beside it, the GPU's span: CUDA events around the
same loop, which include the GPU's idle gaps, so a span near the wall time says the host is
the limit, and one well below it does not occur. The package runs its C++ operators where they
were built (FLASH_STAGES_PYTHON_OPERATORS=1 asks for its Python ones); the package column
says which. Without PyTorch, a CUDA device or the package: one "skipped" line, exit 0.
"""
import argparse
import contextlib
import cProfile
import datetime
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

CALLS, WARMUPS, ROUNDS = 200, 20, 7
TRAINING = [(1, 8, 8, 128, 128, 64), (1, 16, 16, 1024, 1024, 128)]  # B, H, Hkv, Nq, Nkv, d
DECODE = [(b, 32, 8, 1, n, 128) for b in (1, 8) for n in (1024, 4096, 32768, 131072)]


def skipped(why):
    print(f"call_overhead: skipped: {why}")
    sys.exit(0)


def per_call_us(torch, impls):
    """{implementation: (wall, GPU span)}, each the median over ROUNDS of (the time of CALLS
    calls back to back) / CALLS. The implementations take turns round by round, so that a
    drift of the machine (clocks, other processes) falls on all of them alike. impls: (name,
    call, the SDPA backend to select around it or None); one that raises is left out, with
    its reason printed."""
    from torch.nn.attention import sdpa_kernel

    def selected(backend):
        return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    live = []
    for name, fn, backend in impls:
        try:
            with selected(backend):
                for _ in range(WARMUPS):
                    fn()
            torch.cuda.synchronize()
            live.append((name, fn, backend))
        except Exception as e:  # a backend that refuses the shape: say so, go on
            print(f"{name:14s} refused: {str(e).splitlines()[0][:80]}")
    times = {name: ([], []) for name, _, _ in live}
    for _ in range(ROUNDS):
        for name, fn, backend in live:
            with selected(backend):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                for _ in range(CALLS):
                    fn()
                end.record()
                torch.cuda.synchronize()
            times[name][0].append((time.perf_counter() - t0) * 1e6 / CALLS)
            times[name][1].append(start.elapsed_time(end) * 1e3 / CALLS)
    return {name: (sorted(w)[ROUNDS // 2], sorted(g)[ROUNDS // 2])
            for name, (w, g) in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="*", default=["flash", "cudnn", "efficient", "math"],
                    choices=["flash", "cudnn", "efficient", "math"])
    ap.add_argument("--tsv", help="append rows: case, impl, wall_us, gpu_span_us, device, "
                    "cuda, date, package (--label and the operators the package ran)")
    ap.add_argument("--label", default="", help="the package column's name for this build "
                    "(a commit, say)")
    ap.add_argument("--profile", type=int, default=0,
                    help="print the top N functions of a cProfile of each flash_stages call")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        skipped("no PyTorch")
    if not torch.cuda.is_available():
        skipped("no CUDA device")
    try:
        import flash_stages
    except ImportError as e:
        skipped(f"flash_stages: {e}")
    if not flash_stages.stages():
        skipped("no stage library loaded")
    from torch.nn.attention import SDPBackend
    F = torch.nn.functional
    names = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    rows = []
    cases = [("fwd", s) for s in TRAINING] + [("fwd+bwd", s) for s in TRAINING] + \
        [("decode", s) for s in DECODE]
    for kind, (b, h, hkv, nq, nkv, d) in cases:
        grad = kind == "fwd+bwd"
        q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.float16, requires_grad=grad)
        k, v = (torch.randn(b, hkv, nkv, d, device="cuda", dtype=torch.float16,
                            requires_grad=grad) for _ in range(2))
        do = torch.randn_like(q)
        # The same values in FlashAttention's layout, [B, S, H, d], for its entry points.
        qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_(grad)
                      for x in (q, k, v))
        dos = do.transpose(1, 2).contiguous()
        gqa = hkv != h
        case = f"{kind} B={b} H={h} Hkv={hkv} Nq={nq} Nkv={nkv} d={d}"

        def call(attention, seq_major=False):
            args, d_out = ((qs, ks, vs), dos) if seq_major else ((q, k, v), do)

            def fn():
                o = attention(*args)
                if grad:
                    torch.autograd.grad(o, args, d_out)
            return fn
        # (implementation, call, the SDPA backend to select around the timing or None): the
        # package through SDPA's call, then FlashAttention's (flash_attn_with_kvcache for
        # decode, with full caches as SDPA's call has them)
        impls = [("flash_stages", call(lambda q, k, v: flash_stages.scaled_dot_product_attention(
            q, k, v, is_causal=nq > 1, enable_gqa=gqa)), None)]
        if kind == "decode":
            impls.append(("fs_kvcache", call(lambda q, k, v: flash_stages.flash_attn_with_kvcache(
                q, k, v, causal=nq > 1), seq_major=True), None))
        else:
            impls.append(("fs_flash_attn", call(lambda q, k, v: flash_stages.flash_attn_func(
                q, k, v, causal=nq > 1), seq_major=True), None))
        for name in a.backends:
            impls.append((f"sdpa_{name}", call(lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=nq > 1, enable_gqa=gqa)), names[name]))
        timed = per_call_us(torch, impls)
        for impl, (wall, gpu) in timed.items():
            print(f"{case:45s} {impl:14s} {wall:8.1f} us a call (GPU span {gpu:8.1f} us)",
                  flush=True)
            rows.append((case, impl, wall, gpu))
        if a.profile and "flash_stages" in timed:
            fn = impls[0][1]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(CALLS):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.profile)
            print(out.getvalue())
    if a.tsv:
        new = not os.path.exists(a.tsv)
        with open(a.tsv, "a") as f:
            if new:
                f.write("case\timpl\twall_us\tgpu_span_us\tdevice\tcuda\tdate\tpackage\n")
            dev = torch.cuda.get_device_name()
            today = datetime.date.today().isoformat()
            operators = "C++" if flash_stages._OPERATORS else "Python"
            package = f"{a.label} ({operators} operators)" if a.label else operators
            for case, impl, wall, gpu in rows:
                f.write(f"{case}\t{impl}\t{wall:.2f}\t{gpu:.2f}\t{dev}\t{torch.version.cuda}"
                        f"\t{today}\t{package}\n")

if __name__ == "__main__":
    main()
