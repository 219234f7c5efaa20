#!/usr/bin/env python3
"""The decode benchmark (docs/conventions.md section 5): stage 11 beside PyTorch's SDPA
backends on one new query per sequence against a KV cache, and both against the device's
copy bandwidth measured in the same run.

    python3 scripts/decode_bench.py --bin build/bin --lib build/lib --out OUT

Shapes: H = 32 query heads, Hkv = 8 key/value heads, d = 128, Nq = 1, fp16, B in {1, 8, 32},
every sequence's cache holding L keys, L = 1k, 2k, ..., 128k.

Timing: the stage programs' convention (CUDA events, 5 warm-ups, median of 20, the L2 flushed
before each repeat: compare_pytorch.timed_median), all in one process on the same tensors:
  - stage 11 through its library (libattn_11_split_kv_decode.so, common/stage_library.cu:
    the program's own kernels), called with the cache lengths as a decode step would pass
    them (host and device copies, both made before timing);
  - SDPA with enable_gqa=True under each backend forced in turn (flash, cudnn, efficient,
    math); a backend that refuses the shape or runs out of memory is reported, not timed;
  - python/bench.py's GPU spin after each flush, so that Python's dispatch of the call (a
    few microseconds beside kernels of 10 us at L = 1k) is queued before the start event
    rather than timed;
  - the ceiling of a kernel that reads K and V under this timing (the flush leaves the L2
    full of dirty lines, written back while the next call reads): torch.sum of K and of V,
    rows "torch_sum_kv" with timer "read";
  - the copy bandwidth: a 1 GiB device-to-device copy (bytes read plus written), before and
    after the shapes; the larger of the two is the reference;
  - at each shape, one settling pass of the read-only sum, timed and thrown away, then every
    contender timed in turn, --rounds times over (3 unless told), each figure the median of
    its rounds: the first contenders timed after a large shape ran slower than the same calls
    timed again (below, at the settling pass), so no figure depends on its contender's place
    in the order.
With --flush clean, the flush buffer is written and then read back before each repeat, so
that the timed call finds only clean lines in the L2 and writes nothing back: how much of a
call the convention's flush costs (the copy bandwidth is still measured the convention's way).
Then, with --program-batches, the stage program's own --bench run of the same shapes for
those batch sizes (it generates its inputs on the host: seconds at L = 128k), so that the
library's timing and the program's can be compared.

Bandwidth: a call reads K and V once, 2 B Hkv L d 2 bytes (Q, O and the partials are under
0.1% of it at L >= 1k); K/V bytes per second over the copy bandwidth is the fraction the
issue asks for (>= 0.8 at B = 1, L >= 32k).

Output, under OUT: rows/decode.tsv (compare_pytorch's TSV columns, then Hkv, cache_len,
kv_bytes, kv_gbps, copy_gbps, copy_fraction, timer (library, program, sdpa or read), chunk_keys
(rule, or the ATTN_DECODE_CHUNK_KEYS a row was measured with), best_sdpa (1 on the fastest
SDPA backend's row of each shape)); decode_summary.md (the table the README quotes, and
the verdict on the two targets); plots/decode_bandwidth.png and decode_time.png (gnuplot,
scripts/plots.py's way). --chunk-sweep adds rows of stage 11 with ATTN_DECODE_CHUNK_KEYS
forced to each length, at a few shapes (rows/decode_chunks.tsv), to measure the chunk rule.
--batch-invariant adds stage 11 in its batch-invariant mode (ATTN_DECODE_BATCH_INVARIANT=1:
fixed chunks, always merged) as one more contender at every shape, timed in the same rounds as
the rule (rows/decode_invariant.tsv, chunk_keys "invariant"), and a table of what it costs.
Each correctness check compares batch 0's O with float32 attention computed by PyTorch.
Without PyTorch, a CUDA device or the library: one "skipped" line, exit 0.
"""
import argparse
import ctypes
import datetime
import importlib.util
import os
import subprocess
import sys
import statistics
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import attn  # noqa: E402
from compare_pytorch import HEADER, NO_MASK_CELLS  # noqa: E402

STAGE = "11_split_kv_decode"
READ = "torch_sum_kv"  # rows of the read-only ceiling: torch.sum of K and of V, timer "read"
H, HKV, D, NQ = 32, 8, 128, 1
ROUNDS = 3  # interleaved timings of every contender at a shape (see the settling pass);
# --rounds sets more where contenders are within the spread of each other's rounds
BATCHES = [1, 8, 32]
LENGTHS = [1024 << k for k in range(8)]  # 1k .. 128k
COPY_BYTES = 1 << 30  # the copy's buffers: 20 times an H100's L2, so the copy streams HBM
O_CAP_FP16 = 4e-3  # common/check.c: the fp16 hard cap on O's error, per unit of max|V|
# The chunk lengths --chunk-sweep forces, and the shapes it forces them at: short, middle and
# long caches at B = 1, where the chunk rule matters most, and some at B = 8 and B = 32; the
# lengths past 4096 are the rule's own picks at the long caches (8192 at B = 1, 128k and
# B = 8, 16k; 16384 and 65536 at B = 8, 32k and 128k). Only lengths up to L are forced, and each shape also runs with one chunk per
# K/V head (chunk = L): no split, the grid of FlashAttention's forward over (sequence, K/V
# head) alone, which is what the split buys.
SWEEP_KEYS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536]
SWEEP_SHAPES = [(1, 1024), (1, 4096), (1, 8192), (1, 32768), (1, 131072), (8, 2048), (8, 16384),
                (8, 32768), (8, 131072), (32, 1024), (32, 2048), (32, 16384)]
EXTRA = ["Hkv", "cache_len", "kv_bytes", "kv_gbps", "copy_gbps", "copy_fraction", "timer",
         "chunk_keys", "best_sdpa"]
INVARIANT = "ATTN_DECODE_BATCH_INVARIANT"  # --batch-invariant: stage 11's mode, read per call
INVARIANT_KEYS = "invariant"  # the chunk_keys cell of the mode's rows (its fixed length)


def skip(why):
    print(f"decode_bench: skipped: {why}")
    sys.exit(0)


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kv_bytes(b, length):
    return 2 * b * HKV * length * D * 2


def flops(b, length):
    return 4.0 * b * H * NQ * length * D


class Writer:
    """Rows of one TSV file: compare_pytorch's columns, then EXTRA."""

    def __init__(self, path, stamp):
        self.path, self.stamp = path, stamp
        new = not os.path.exists(path)
        self.f = open(path, "a")
        if new:
            self.f.write(HEADER.rstrip("\n") + "\t" + "\t".join(EXTRA) + "\n")

    def row(self, stage, b, length, ms, workspace, peak, err, tol, check, copy_gbps, timer,
            chunk_keys="rule", best=0):
        """Writes one row; returns it as attn.read_rows would read it back."""
        gbps = kv_bytes(b, length) / ms / 1e6
        cells = [stage, "fwd", "fp16", b, H, NQ, length, D, 0, f"{ms:.5f}",
                 f"{flops(b, length) / ms / 1e9:.3f}", workspace, peak, 0,
                 "" if err is None else f"{err:.3g}", "" if tol is None else f"{tol:.3g}",
                 check, *self.stamp, *NO_MASK_CELLS, HKV, length, kv_bytes(b, length),
                 f"{gbps:.1f}", f"{copy_gbps:.1f}", f"{gbps / copy_gbps:.4f}", timer, chunk_keys,
                 best]
        cells = [str(c) for c in cells]
        self.f.write("\t".join(cells) + "\n")
        self.f.flush()
        return dict(zip(HEADER.rstrip("\n").split("\t") + EXTRA, cells))


def clean_flush(torch, nbytes, pybench):
    """--flush clean: the convention's flush (a buffer twice the L2's size, written) leaves
    the L2 full of dirty lines, and whatever runs next pays for writing back those it evicts
    (up to the L2's size, 50 MB on an H100: about 17 us at 3 TB/s). Reading the buffer after
    writing it evicts them before the timed region and leaves clean lines instead."""

    class Clean(pybench.Flush):
        def zero_(self):
            self.buf.zero_()
            self.buf.view(torch.int64).sum()  # read back: the dirty lines go now, not later
            if self.cycles:
                torch.cuda._sleep(self.cycles)

    return Clean(torch, nbytes)


def copy_bandwidth(torch, pybench, flush, cycles):
    """GB/s of a device-to-device copy of COPY_BYTES, bytes read plus written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    ms, _, _ = pybench.measure(torch, lambda: dst.copy_(src), flush, cycles)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / ms / 1e6


def stage_call(torch, library, lib, q, k, v, scale):
    """Stage 11's forward through its library on PyTorch's tensors and current stream, every
    buffer (and the cache lengths, host and device) made outside the timed region: (call,
    workspace bytes, O). The call holds the buffers until it is dropped."""
    b, length = q.shape[0], k.shape[2]
    lens_host = (ctypes.c_int * b)(*([length] * b))
    lens_dev = torch.full((b,), length, dtype=torch.int32, device="cuda")
    p = library.Problem(b, H, NQ, length, D, 0, scale, library.DTYPE_FP16, HKV,
                        ctypes.cast(lens_host, ctypes.c_void_p))
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    ws_bytes = lib.forward_workspace(p)
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    bufs = library.Buffers(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                           lse.data_ptr(), None, None, None, None, ws.data_ptr(),
                           lens_dev.data_ptr())
    stream = torch.cuda.current_stream().cuda_stream
    held = (lens_host, lens_dev, lse, ws)

    def call():
        lib.forward(p, bufs, stream)  # raises StageLibraryError with the program's line
        return o

    call.held = held  # the buffers live as long as the call
    return call, ws_bytes, o


def reference_b0(torch, q, k, v, scale):
    """Batch 0's O in float32: its 32 query heads as 8 groups of 4 sharing a K/V head."""
    g = H // HKV
    qf = q[0].float().reshape(HKV, g * NQ, D)
    kf, vf = k[0].float(), v[0].float()
    p = torch.softmax(qf @ kf.transpose(1, 2) * scale, dim=-1)
    return (p @ vf).reshape(H, NQ, D), vf.abs().max().item()


def check_b0(torch, o, ref, max_v):
    err = (o[0].float() - ref).abs().max().item()
    tol = O_CAP_FP16 * max(1.0, max_v)
    ok = torch.isfinite(o).all().item() and err <= tol
    return err, tol, "ok" if ok else "fail"


def run_program(path, b, length, out_log):
    """The stage program's own --bench of the shape: (median ms, workspace bytes), or None."""
    with tempfile.TemporaryDirectory() as tmp:
        tsv = os.path.join(tmp, "rows.tsv")
        args = [path, "--bench", "--dtype", "fp16", "-b", str(b), "-H", str(H), "--heads-kv",
                str(HKV), "--seq-q", str(NQ), "--seq-kv", str(length), "-d", str(D),
                "--cache-lens", ",".join([str(length)] * b), "--tsv", tsv]
        r = subprocess.run(args, capture_output=True, text=True)
        out_log.write(" ".join(args) + f"\nexit {r.returncode}\n" + r.stdout + r.stderr)
        out_log.flush()
        if r.returncode != 0 or not os.path.exists(tsv):
            return None
        row = attn.read_rows(tsv)[0]
        return float(row["ms"]), int(row["workspace_bytes"])


def plot(rows, out_dir):
    plots = load_module("plots", os.path.join(HERE, "plots.py"))
    rows = [r for r in rows if r["timer"] in ("library", "sdpa", "read") and
            r["chunk_keys"] == "rule"]
    if not rows:
        return
    stamp = plots.stamp(rows)
    series_frac, series_ms = [], []
    for b in sorted({int(r["B"]) for r in rows}):
        mine = [r for r in rows if r["stage"] == STAGE and int(r["B"]) == b]
        best = [r for r in rows if r["best_sdpa"] == "1" and int(r["B"]) == b]
        read = [r for r in rows if r["stage"] == READ and int(r["B"]) == b and b == 1]
        for name, sel in ((f"11 B={b}", mine), (f"best SDPA B={b}", best),
                          (f"read only (torch.sum of K, V) B={b}", read)):
            if not sel:
                continue
            series_frac.append((name, [(int(r["cache_len"]), float(r["copy_fraction"]))
                                       for r in sel]))
            series_ms.append((name, [(int(r["cache_len"]), float(r["ms"])) for r in sel]))
    os.makedirs(out_dir, exist_ok=True)
    gps = [plots.gnuplot_file(
        os.path.join(out_dir, "decode_bandwidth.png"),
        "Decode: K/V bytes a second / copy bandwidth (H = 32, Hkv = 8, d = 128, fp16)",
        "cache length L (keys)", "fraction of the measured copy bandwidth",
        series_frac, stamp, logy=False, lines=[("target at B = 1, L >= 32k", 0.8)]),
        plots.gnuplot_file(
            os.path.join(out_dir, "decode_time.png"),
            "Decode: time per call (H = 32, Hkv = 8, d = 128, Nq = 1, fp16)",
            "cache length L (keys)", "median ms", series_ms, stamp)]
    import shutil
    if not shutil.which("gnuplot"):
        print("decode_bench: gnuplot not found; plot data and scripts are in " + out_dir)
        return
    for gp in gps:
        if gp:
            subprocess.run(["gnuplot", os.path.basename(gp)], cwd=os.path.dirname(gp),
                           check=True)


def plot_flush(rows, out_dir):
    """decode_flush.png from the rows of one command that timed the shapes twice: under the
    convention's flush and with --flush clean (that pass's `run` ends in -clean). B = 1: stage
    11, cuDNN and the read-only sum, each under both flushes."""
    plots = load_module("plots", os.path.join(HERE, "plots.py"))
    rows = [r for r in rows if int(r["B"]) == 1 and r["chunk_keys"] == "rule"]
    series = []
    for name, label in ((STAGE, "11"), ("sdpa_cudnn", "cuDNN"), (READ, "read only")):
        for clean in (False, True):
            sel = [r for r in rows if r["stage"] == name and
                   r.get("run", "").endswith("-clean") == clean]
            series.append((f"{label}, {'clean L2' if clean else 'convention (dirty L2)'}",
                           [(int(r["cache_len"]), float(r["copy_fraction"])) for r in sel]))
    os.makedirs(out_dir, exist_ok=True)
    gp = plots.gnuplot_file(
        os.path.join(out_dir, "decode_flush.png"),
        "Decode at B = 1: K/V bytes a second / copy bandwidth, by how the L2 was flushed",
        "cache length L (keys)", "fraction of the measured copy bandwidth", series,
        plots.stamp(rows), logy=False, lines=[("target at B = 1, L >= 32k", 0.8)], pairs=True)
    import shutil
    if gp and shutil.which("gnuplot"):
        subprocess.run(["gnuplot", os.path.basename(gp)], cwd=os.path.dirname(gp), check=True)


def summary(rows, copy, rounds, path):
    """decode_summary.md: per shape, 11 and every backend; the verdict on the targets."""
    lines = [f"Copy bandwidth measured in this run: {copy:.0f} GB/s (read plus written). "
             f"Each figure is the median of {rounds} interleaved rounds.", "",
             "| B | L | 11 ms (frac) | program ms | best SDPA | best ms (frac) | 11 / best speed "
             "| flash | cudnn | efficient | math |", "|" + "---|" * 11]
    fast_everywhere, shortfalls, target, ceiling = True, [], [], []
    for b in BATCHES:
        for length in LENGTHS:
            at = [r for r in rows if int(r["B"]) == b and int(r["cache_len"]) == length
                  and r["chunk_keys"] == "rule"]
            mine = [r for r in at if r["stage"] == STAGE and r["timer"] == "library"]
            prog = [r for r in at if r["stage"] == STAGE and r["timer"] == "program"]
            best = [r for r in at if r["best_sdpa"] == "1"]
            if not mine:
                continue
            m = mine[0]
            cells = [str(b), f"{length // 1024}k",
                     f"{float(m['ms']):.4f} ({float(m['copy_fraction']):.2f})",
                     f"{float(prog[0]['ms']):.4f}" if prog else "-"]
            if best:
                bb = best[0]
                speed = float(bb["ms"]) / float(m["ms"])
                cells += [bb["stage"].replace("sdpa_", ""),
                          f"{float(bb['ms']):.4f} ({float(bb['copy_fraction']):.2f})",
                          f"{speed:.2f}x"]
                if speed < 1:
                    fast_everywhere = False
                    shortfalls.append(f"B={b} L={length}: {speed:.2f}x")
            else:
                cells += ["-", "-", "-"]
            for name in ("flash", "cudnn", "efficient", "math"):
                r = [x for x in at if x["stage"] == f"sdpa_{name}"]
                cells.append(f"{float(r[0]['ms']):.4f}" if r else "not run")
            lines.append("| " + " | ".join(cells) + " |")
            if b == 1 and length >= 32768:
                target.append(float(m["copy_fraction"]))
                ceiling += [float(r["copy_fraction"]) for r in at if r["stage"] == READ]
    lines.append("")
    if target:
        lines.append(f"B = 1, L >= 32k: stage 11 reads K and V at {min(target):.2f}-"
                     f"{max(target):.2f} of the copy bandwidth (target >= 0.80): "
                     + ("met" if min(target) >= 0.8 else "NOT met"))
    if ceiling:
        lines.append(f"B = 1, L >= 32k: reading K and V alone (torch.sum of each, timed the same "
                     f"way) reaches {min(ceiling):.2f}-{max(ceiling):.2f} of it")
    lines.append("At least as fast as PyTorch's best SDPA backend at every shape: " +
                 ("yes" if fast_everywhere else "NO (" + "; ".join(shortfalls) + ")"))
    lines += chunk_table(rows)
    lines += invariant_table(rows)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def invariant_table(rows):
    """The --batch-invariant rows: stage 11's ms in the mode beside the rule's, same rounds."""
    inv = {(int(r["B"]), int(r["cache_len"])): float(r["ms"]) for r in rows
           if r["chunk_keys"] == INVARIANT_KEYS}
    if not inv:
        return []
    out = ["", f"Stage 11 with {INVARIANT}=1 (fixed chunks, always merged) beside the rule, ms:",
           "", "| B | L | rule | batch-invariant | mode / rule |", "|---|---|---|---|---|"]
    for (b, length), ms in sorted(inv.items()):
        rule = [float(r["ms"]) for r in rows if r["chunk_keys"] == "rule" and
                r["stage"] == STAGE and r["timer"] == "library" and int(r["B"]) == b and
                int(r["cache_len"]) == length]
        cells = [str(b), f"{length // 1024}k", f"{rule[0]:.4f}" if rule else "-", f"{ms:.4f}",
                 f"{ms / rule[0]:.2f}x" if rule else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def chunk_table(rows):
    """The --chunk-sweep rows: stage 11's ms at each forced chunk length beside the rule's
    (whose chunk count the workspace gives: chunks x B Hkv blocks of G Nq (d + 1) floats)."""
    forced = [r for r in rows if r["chunk_keys"] not in ("rule", INVARIANT_KEYS)]
    if not forced:
        return []
    keys = sorted({int(r["chunk_keys"]) for r in forced})
    out = ["", "Stage 11 with ATTN_DECODE_CHUNK_KEYS forced, ms (a chunk of L keys is one chunk "
           "per K/V head: no split):", "",
           "| B | L | rule: chunks, ms | " + " | ".join(str(k) for k in keys) + " |",
           "|" + "---|" * (3 + len(keys))]
    for b, length in sorted({(int(r["B"]), int(r["cache_len"])) for r in forced}):
        rule = [r for r in rows if r["chunk_keys"] == "rule" and r["timer"] == "library" and
                r["stage"] == STAGE and int(r["B"]) == b and int(r["cache_len"]) == length]
        cells = [str(b), f"{length // 1024}k"]
        if rule:
            # no workspace: one chunk, whose decode blocks write O themselves
            chunks = int(rule[0]["workspace_bytes"]) // (b * H * NQ * (D + 1) * 4) or 1
            cells.append(f"{chunks}, {float(rule[0]['ms']):.4f}")
        else:
            cells.append("-")
        for k in keys:
            r = [x for x in forced if int(x["B"]) == b and int(x["cache_len"]) == length and
                 int(x["chunk_keys"]) == k]
            cells.append(f"{float(r[0]['ms']):.4f}" if r else "")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", help="folder of the stage programs (for --program-batches)")
    ap.add_argument("--lib", help="folder of libattn_11_split_kv_decode.so (required but with "
                    "--redraw)")
    ap.add_argument("--redraw", metavar="DECODE_TSV",
                    help="only draw the plots of committed rows (no GPU, no PyTorch) into "
                    "OUT/plots")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", nargs="*", type=int, default=BATCHES)
    ap.add_argument("--lengths", nargs="*", type=int, default=LENGTHS)
    ap.add_argument("--backends", nargs="*", default=["flash", "cudnn", "efficient", "math"])
    ap.add_argument("--program-batches", nargs="*", type=int, default=[1],
                    help="batch sizes whose shapes the stage program also times itself")
    ap.add_argument("--chunk-sweep", action="store_true",
                    help="also time stage 11 with ATTN_DECODE_CHUNK_KEYS forced (SWEEP_KEYS "
                    "at SWEEP_SHAPES)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help=f"also time stage 11 with {INVARIANT}=1 at every shape, in the same "
                    "rounds as the rule (rows/decode_invariant.tsv)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="interleaved timings of every contender at each shape; each figure "
                    "is the median of its rounds")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds after which no new shape starts (0: no limit)")
    ap.add_argument("--flush", choices=("write", "clean"), default="write",
                    help="before each timed repeat: 'write' the flush buffer (the convention), "
                    "or 'clean': write it, then read it, so that the L2 holds no dirty lines "
                    "whose write-back the timed call would pay (the copy bandwidth is always "
                    "measured the convention's way)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    if a.redraw:
        rows = attn.read_rows(a.redraw)
        if any(r.get("run", "").endswith("-clean") for r in rows):
            plot_flush(rows, os.path.join(a.out, "plots"))
        else:
            plot(rows, os.path.join(a.out, "plots"))
        return
    if not a.lib:
        ap.error("--lib is required")
    for name in (INVARIANT, "ATTN_DECODE_CHUNK_KEYS"):
        if os.environ.get(name):
            ap.error(f"{name} is set in the environment, so the rule's rows would not be "
                     "the rule's; unset it (--batch-invariant and --chunk-sweep set theirs)")

    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed (pip install torch)")
    if not torch.cuda.is_available():
        skip("no CUDA device for PyTorch")
    lib_path = os.path.join(a.lib, f"libattn_{STAGE}.so")
    if not os.path.exists(lib_path):
        skip(f"{lib_path} not built (configure with -DATTN_PYTHON=ON)")
    library = load_module("flash_stages_library",
                          os.path.join(ROOT, "python", "flash_stages", "_library.py"))
    pybench = load_module("pybench", os.path.join(ROOT, "python", "bench.py"))
    from compare_pytorch import backends as sdpa_backends
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional

    prop = torch.cuda.get_device_properties(0)
    stamp = (prop.name, str(prop.multi_processor_count), torch.version.cuda,
             datetime.date.today().isoformat())
    rows_dir = os.path.join(a.out, "rows")
    os.makedirs(rows_dir, exist_ok=True)
    tsv = os.path.join(rows_dir, "decode.tsv")
    flush = pybench.Flush(torch, 2 * getattr(prop, "L2_cache_size", 64 << 20))
    copy_flush = flush
    if a.flush == "clean":
        flush = clean_flush(torch, flush.buf.numel(), pybench)
    cycles = pybench.spin_cycles_per_ms(torch)
    lib = library.StageLibrary(lib_path)
    scale = D ** -0.5
    t0 = time.time()
    copy_before = copy_bandwidth(torch, pybench, copy_flush, cycles)
    print(f"decode_bench: {prop.name}, copy bandwidth {copy_before:.0f} GB/s", flush=True)

    pending = []  # (writer args) until the copy bandwidth after the shapes is known
    program_log = open(os.path.join(a.out, "decode_program.log"), "a")
    for b in a.batches:
        for length in a.lengths:
            if a.budget and time.time() - t0 > a.budget:
                print(f"decode_bench: stopped at its budget ({a.budget} s) before B={b} "
                      f"L={length}", file=sys.stderr)
                break
            print(f"decode_bench: B={b} L={length}  elapsed {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            torch.manual_seed(0)
            q = torch.randn(b, H, NQ, D, device="cuda", dtype=torch.float16)
            k = torch.randn(b, HKV, length, D, device="cuda", dtype=torch.float16)
            v = torch.randn(b, HKV, length, D, device="cuda", dtype=torch.float16)
            ref, max_v = reference_b0(torch, q, k, v, scale)
            # A settling pass, timed and thrown away, then the contenders timed in --rounds
            # interleaved rounds, each contender's figure the median of its rounds: after a
            # large shape the first contenders timed at the next one ran 10-12% slower than
            # the same calls timed again (B = 32, L = 1k after B = 8, L = 128k on an H100:
            # stage 11, the read-only sum and SDPA flash alike, in whichever order), so no
            # contender's figure may depend on its place in the order. The settling pass is
            # the read-only ceiling below: reading K and V and nothing else (PyTorch's sum of
            # each, two kernels, like stage 11's decode and merge).
            def read_kv():
                return k.sum(dtype=torch.float32), v.sum(dtype=torch.float32)

            pybench.measure(torch, read_kv, flush, cycles)
            call, ws, o = stage_call(torch, library, lib, q, k, v, scale)
            contenders = [(STAGE, call), (READ, read_kv)]
            if a.batch_invariant:  # the variable is read at each call: workspace and launch
                os.environ[INVARIANT] = "1"
                try:
                    inv_call, inv_ws, inv_o = stage_call(torch, library, lib, q, k, v, scale)
                finally:
                    del os.environ[INVARIANT]

                def invariant(inv_call=inv_call):
                    # host time of the call's, measured with it and hidden behind the spin
                    os.environ[INVARIANT] = "1"
                    try:
                        return inv_call()
                    finally:
                        del os.environ[INVARIANT]
                contenders.insert(1, (INVARIANT_KEYS, invariant))
            for name in a.backends:
                def fwd(backend=sdpa_backends(torch)[name]):  # this backend, not the loop's last
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                contenders.append((f"sdpa_{name}", fwd))
            times = {name: [] for name, _ in contenders}
            peaks, refused = {}, set()  # a backend that refuses the shape is not asked again
            for _ in range(a.rounds):
                for name, fn in contenders:
                    if name in refused:
                        continue
                    try:
                        ms_c, _, peaks[name] = pybench.measure(torch, fn, flush, cycles)
                        times[name].append(ms_c)
                    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                        print(f"    {name}: not run: {str(e).splitlines()[0][:120]}",
                              file=sys.stderr)
                        refused.add(name)
                        torch.cuda.empty_cache()
            call()
            err, tol, verdict = check_b0(torch, o, ref, max_v)
            for name, fn in contenders:
                if name in refused:
                    continue
                ms_c = statistics.median(times[name])
                spread = f"(rounds {min(times[name]):.4f}-{max(times[name]):.4f})"
                if name == STAGE:
                    pending.append((STAGE, b, length, ms_c, ws, peaks[name], err, tol, verdict,
                                    "library"))
                    print(f"    {STAGE}: {ms_c:.4f} ms {spread}, "
                          f"{kv_bytes(b, length) / ms_c / 1e6:.0f} GB/s, err {err:.2e} {verdict}",
                          file=sys.stderr, flush=True)
                elif name == INVARIANT_KEYS:
                    fn()
                    err_i, tol_i, verdict_i = check_b0(torch, inv_o, ref, max_v)
                    pending.append((STAGE, b, length, ms_c, inv_ws, peaks[name], err_i, tol_i,
                                    verdict_i, "library", INVARIANT_KEYS))
                    print(f"    {STAGE} batch-invariant: {ms_c:.4f} ms {spread}, "
                          f"err {err_i:.2e} {verdict_i}", file=sys.stderr, flush=True)
                elif name == READ:
                    pending.append((READ, b, length, ms_c, 0, 0, None, None, "none", "read"))
                    print(f"    {READ}: {ms_c:.4f} ms {spread}", file=sys.stderr, flush=True)
                else:
                    err_b, tol_b, verdict_b = check_b0(torch, fn(), ref, max_v)
                    pending.append((name, b, length, ms_c, 0, peaks[name], err_b, tol_b,
                                    verdict_b, "sdpa"))
                    print(f"    {name}: {ms_c:.4f} ms {spread}", file=sys.stderr, flush=True)
            if a.chunk_sweep and (b, length) in SWEEP_SHAPES:
                for keys in sorted(set([k for k in SWEEP_KEYS if k <= length] + [length])):
                    os.environ["ATTN_DECODE_CHUNK_KEYS"] = str(keys)
                    try:
                        call, ws, o = stage_call(torch, library, lib, q, k, v, scale)
                        ms_k, _, peak_k = pybench.measure(torch, call, flush, cycles)
                    finally:
                        del os.environ["ATTN_DECODE_CHUNK_KEYS"]
                    pending.append((STAGE, b, length, ms_k, ws, peak_k, None, None, "none",
                                    "library", str(keys)))
            del q, k, v, ref, o, call, contenders
            if a.batch_invariant:
                del inv_call, inv_o
            torch.cuda.empty_cache()
            if a.bin and b in a.program_batches:
                got = run_program(os.path.join(a.bin, STAGE), b, length, program_log)
                if got:
                    pending.append((STAGE, b, length, got[0], got[1], 0, None, None, "none",
                                    "program"))
                    print(f"    {STAGE} program: {got[0]:.4f} ms", file=sys.stderr, flush=True)
                else:
                    print(f"    {STAGE} program: failed (decode_program.log)", file=sys.stderr)
        else:
            continue
        break
    copy_after = copy_bandwidth(torch, pybench, copy_flush, cycles)
    copy = max(copy_before, copy_after)
    print(f"decode_bench: copy bandwidth {copy_before:.0f} GB/s before, {copy_after:.0f} after; "
          f"the fractions use {copy:.0f}", flush=True)

    # The fastest SDPA backend of each shape, then every row.
    best = {}
    for r in pending:
        if r[9] == "sdpa":
            key = (r[1], r[2])
            if key not in best or r[3] < best[key][3]:
                best[key] = r
    main_rows = Writer(tsv, stamp)
    chunk_rows = Writer(os.path.join(rows_dir, "decode_chunks.tsv"), stamp) if a.chunk_sweep \
        else None
    invariant_rows = Writer(os.path.join(rows_dir, "decode_invariant.tsv"), stamp) \
        if a.batch_invariant else None
    rows = []
    for r in pending:
        stage_name, b, length, ms, ws, peak, err, tol, check, timer = r[:10]
        keys = r[10] if len(r) > 10 else "rule"
        w = main_rows if keys == "rule" else invariant_rows if keys == INVARIANT_KEYS \
            else chunk_rows
        rows.append(w.row(stage_name, b, length, ms, ws, peak, err, tol, check, copy, timer,
                          keys, int(best.get((b, length)) is r)))
    for w in (main_rows, chunk_rows, invariant_rows):
        if w:
            w.f.close()
    summary(rows, copy, a.rounds, os.path.join(a.out, "decode_summary.md"))
    plot(rows, os.path.join(a.out, "plots"))
    failed = [r for r in pending if r[8] == "fail"]
    for r in failed:
        print(f"decode_bench: {r[0]} B={r[1]} L={r[2]}: O differs from float32 attention by "
              f"{r[6]:.3g} (cap {r[7]:.3g})", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
