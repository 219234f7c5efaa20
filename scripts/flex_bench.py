#!/usr/bin/env python3
"""Stage 13 (windows, softcap, varlen) beside PyTorch's FlexAttention with the same masks and
score modification, compiled, and beside stage 09 on dense work of the same kind, in one
process on one GPU: the comparison 13's README quotes; and on a Hopper GPU stage 14 (13's
windows on 10's and 12's kernels) on the window, beside 12's dense causal runs.

    python3 scripts/flex_bench.py --bin build/bin --out OUT

Cases (fp16, FlashAttention's sizes: 16384 tokens a batch, H = 2048 / d, d = 64 and 128):
  - window: causal with a window of 4096 keys on the left, N = 16384;
  - softcap: a cap of 50, causal, N = 4096 (B = 4) and N = 16384 (B = 1);
  - varlen: causal packed sequences of lengths drawn from 128-8192 (seeded), 16384 tokens;
and 09 causal at N = 4096 and 16384, the dense yardstick of the same tokens; 09 causal on each
packed sequence alone (B = 1, N its length), whose summed time does the same visible pairs as
the packed run; 12 causal at N = 16384 where 14 runs.

Timing: the stage programs time themselves (`--bench --backward`: CUDA events, warm-ups, the
median, the L2 flushed before each repeat; common/runner.c); FlexAttention is timed the same
way in this process (compare_pytorch.timed_median): the compiled flex_attention call, then
torch.autograd.grad of its output for the backward, the block mask built once before. A
FLOP count is the harness's: the visible (query, key) pairs with a window or varlen, else
4 B H N^2 d halved for causal; the backward 2.5x the forward.

Output: OUT/rows/masks.tsv, compare_pytorch's columns (the last four: window, softcap,
seqlens, seqlens_kv), the stage programs' rows and FlexAttention's (stage `flex_attention`),
and a ratio table on stdout: each 13 (and 14) case's time over FlexAttention's, and its
TFLOP/s over 09's (14's over 12's) at the same N and d; for varlen also 13's time over the
sum of 09's times on the sequences alone. Without PyTorch, FlexAttention, a CUDA device or the programs: one
"skipped" line, exit 0.
"""
import argparse
import datetime
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_pytorch  # noqa: E402  (its HEADER and timed_median: one convention)
from sweep import HIDDEN, TOKENS  # noqa: E402

WINDOW, CAP = 4096, 50.0
STAGE09, STAGE12 = "09_swizzle_pipeline", "12_hopper_backward"
STAGE13, STAGE14 = "13_window_softcap_varlen", "14_hopper_window"
LENGTHS = (128, 8192)  # the range varlen's lengths are drawn from
SEED = 13


def skipped(why):
    print(f"flex_bench: skipped: {why}")
    sys.exit(0)


def varlen_lengths(total, seed=SEED):
    """Lengths uniform in LENGTHS (seeded) until they fill `total` tokens, the last trimmed
    (and kept at least 1 token) so that they add up to `total` exactly."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(rng.randint(*LENGTHS))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def cases():
    """(name, N, B, stage 13's options, the mask's description for FlexAttention)."""
    out = [("window", TOKENS, 1, ["--causal", "--window", f"{WINDOW},0"], ("window", WINDOW))]
    for n in (4096, TOKENS):
        out.append((f"softcap{n}", n, TOKENS // n, ["--causal", "--softcap", f"{CAP:g}"],
                    ("softcap", CAP)))
    lengths = varlen_lengths(TOKENS)
    out.append(("varlen", TOKENS, 1, ["--causal", "--seqlens", ",".join(map(str, lengths))],
                ("varlen", lengths)))
    return out


def visible_pairs(kind, n):
    """Causal (query, key) pairs a head sees, as the harness counts them for its FLOPs."""
    what, value = kind
    if what == "window":  # row i sees min(i, W) + 1 keys
        return sum(min(i, value) + 1 for i in range(n))
    if what == "varlen":
        return sum(m * (m + 1) // 2 for m in value)
    return n * n / 2  # causal without a window: the halved formula


def run_program(path, args):
    """The program's --bench --backward run, its rows appended to the TSV its args name."""
    r = subprocess.run([path, "--bench", "--backward", "--dtype", "fp16"] + args,
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith(os.path.basename(path)):
            print(line)
    if r.returncode != 0:
        print(f"  {os.path.basename(path)} exit {r.returncode}: {r.stderr.strip()[:300]}")
    return r.returncode


def summary(tsv, today):
    """Per 13 row of today: its time over FlexAttention's on the same case, and its TFLOP/s
    over 09's at the same N, d and direction (the dense causal yardstick)."""
    import csv
    with open(tsv, newline="") as f:
        rows = [r for r in csv.DictReader(f, delimiter="\t") if r["date"] == today]
    key = ("direction", "B", "H", "Nq", "d", "window", "softcap", "seqlens")
    flex = {tuple(r[c] for c in key): r for r in rows if r["stage"] == "flex_attention"}
    yardstick = {STAGE13: STAGE09, STAGE14: STAGE12}
    dense = {(r["stage"], r["direction"], r["B"], r["Nq"], r["d"]): r for r in rows
             if r["stage"] in yardstick.values()}
    print("| stage | case | d | pass | ms | FlexAttention ms | time vs Flex | TFLOP/s vs dense "
          "(09; 14: 12) | time vs 09 on the sequences alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["stage"] not in yardstick:
            continue
        fx = flex.get(tuple(r[c] for c in key))
        yard = dense.get((yardstick[r["stage"]], r["direction"], str(TOKENS // int(r["Nq"])),
                          r["Nq"], r["d"]))
        case = ("window" if r["window"] != "-" else "softcap" if r["softcap"] != "-" else
                "varlen" if r["seqlens"] != "-" else "plain")
        ratio = f"{float(r['ms']) / float(fx['ms']):.2f}" if fx else "-"
        vs_dense = f"{float(r['tflops']) / float(yard['tflops']):.2f}" if yard else "-"
        alone = "-"
        if case == "varlen":
            parts = [dense.get((STAGE09, r["direction"], "1", n, r["d"]))
                     for n in r["seqlens"].split(",")]
            if all(parts):
                alone = f"{float(r['ms']) / sum(float(x['ms']) for x in parts):.2f}"
        fx_ms = f"{float(fx['ms']):.3f}" if fx else "-"
        print(f"| {r['stage'][:2]} | {case} N={r['Nq']} B={r['B']} | {r['d']} | "
              f"{r['direction']} | {float(r['ms']):.3f} | {fx_ms} | {ratio} | {vs_dense} | "
              f"{alone} |")


def flex_case(torch, flex_attention, create_block_mask, kind, n, b, h, d, flush):
    """FlexAttention's (fwd ms, bwd ms) for the case, compiled, on fresh random inputs."""
    what, value = kind
    dev = "cuda"
    if what == "varlen":
        doc = torch.repeat_interleave(torch.arange(len(value), device=dev),
                                      torch.tensor(value, device=dev))

        def mask_mod(b_, h_, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
    elif what == "window":
        def mask_mod(b_, h_, q, kv):
            return (q >= kv) & (q - kv <= value)
    else:
        def mask_mod(b_, h_, q, kv):
            return q >= kv
    def softcap_mod(score, b_, h_, q, kv):
        return value * torch.tanh(score / value)
    score_mod = softcap_mod if what == "softcap" else None
    # The backward is timed by repeating it on one graph (retain_graph), which a compiled
    # backward that donates its saved buffers refuses; donation saves memory, not time.
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=dev)
    compiled = torch.compile(flex_attention)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    do = torch.randn(b, h, n, d, device=dev, dtype=torch.float16)

    def fwd():
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    ms_f = compare_pytorch.timed_median(torch, fwd, flush)
    o = fwd()
    ms_b = compare_pytorch.timed_median(
        torch, lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), flush)
    return ms_f, ms_b


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin", help="the stage programs' folder")
    ap.add_argument("--out", required=True, help="rows go to OUT/rows/masks.tsv")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    a = ap.parse_args()
    stage13, stage09 = os.path.join(a.bin, STAGE13), os.path.join(a.bin, STAGE09)
    for p in (stage13, stage09):
        if not os.access(p, os.X_OK):
            skipped(f"no {p}")
    stage14, stage12 = os.path.join(a.bin, STAGE14), os.path.join(a.bin, STAGE12)
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        skipped(f"PyTorch or FlexAttention does not import: {e}")
    if not torch.cuda.is_available():
        skipped("no CUDA device")
    os.makedirs(os.path.join(a.out, "rows"), exist_ok=True)
    tsv = os.path.join(a.out, "rows", "masks.tsv")
    prop = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * getattr(prop, "L2_cache_size", 64 << 20), dtype=torch.uint8,
                        device="cuda")
    stamp = (prop.name, str(prop.multi_processor_count), torch.version.cuda,
             datetime.date.today().isoformat())
    # 14 and 12 are built for sm_90a: run where the GPU is 9.0 and the programs exist.
    hopper = (torch.cuda.get_device_capability(0) == (9, 0) and
              all(os.access(p, os.X_OK) for p in (stage14, stage12)))
    for d in a.dims:
        h = HIDDEN // d
        for n in sorted({n for _, n, _, _, _ in cases()}):
            run_program(stage09, ["--causal", "-b", str(TOKENS // n), "-H", str(h), "-n",
                                  str(n), "-d", str(d), "--tsv", tsv])
        if hopper:
            run_program(stage12, ["--causal", "-b", "1", "-H", str(h), "-n", str(TOKENS), "-d",
                                  str(d), "--tsv", tsv])
        for n in varlen_lengths(TOKENS):  # 09 on each packed sequence alone
            run_program(stage09, ["--causal", "-b", "1", "-H", str(h), "-n", str(n), "-d",
                                  str(d), "--tsv", tsv])
        for name, n, b, opts, kind in cases():
            shape = ["-H", str(h), "-d", str(d), "--tsv", tsv]
            if kind[0] != "varlen":
                shape += ["-b", str(b), "-n", str(n)]
            run_program(stage13, opts + shape)
            if hopper and kind[0] == "window":
                run_program(stage14, opts + shape)
            try:
                ms_f, ms_b = flex_case(torch, flex_attention, create_block_mask, kind, n, b, h,
                                       d, flush)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                print(f"  flex_attention {name} d={d}: not run: {str(e).splitlines()[0][:160]}")
                torch.cuda.empty_cache()
                continue
            fl = 4.0 * b * h * d * visible_pairs(kind, n)
            if kind[0] == "varlen":
                lens = ",".join(map(str, kind[1]))
                cells = ("-", "-", lens, lens)
            else:
                cells = (f"{WINDOW},0", "-", "-", "-") if kind[0] == "window" else \
                    ("-", f"{CAP:g}", "-", "-")
            new = not os.path.exists(tsv)
            with open(tsv, "a") as f:
                if new:
                    f.write(compare_pytorch.HEADER)
                for direction, ms, fl_dir in (("fwd", ms_f, fl), ("bwd", ms_b, 2.5 * fl)):
                    f.write("\t".join(["flex_attention", direction, "fp16", str(b), str(h),
                                       str(n), str(n), str(d), "1", f"{ms:.4f}",
                                       f"{fl_dir / ms / 1e9:.2f}", "nan", "nan", "nan",
                                       "nan", "nan", "none",
                                       *stamp, *cells]) + "\n")
            print(f"flex_attention {name} d={d}: fwd {ms_f:.3f} ms, bwd {ms_b:.3f} ms")
            torch.cuda.empty_cache()
    print(f"rows: {tsv}")
    summary(tsv, stamp[3])


if __name__ == "__main__":
    main()
