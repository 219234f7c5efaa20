#!/usr/bin/env python3
"""The stages called from PyTorch (flash_stages) beside PyTorch's SDPA backends, all timed in
one process the same way, and, with --bin, beside the stage programs' own timing of the
same points: the README's comparison in one Python command.

    python3 python/bench.py                                   # 07-09 fp16, SDPA flash, cudnn
    python3 python/bench.py --bin build/bin --tsv out.tsv     # and each stage program too
    python3 python/bench.py --stages 08_mma_sync 09_swizzle_pipeline --seq 4096 --dims 64 \\
        --causal 0 --backends flash

Points: docs/conventions.md section 5 (scripts/sweep.py): H = 2048/d, B = 16384/N, for each
d, causal or not, N. Timing: compare_pytorch.timed_median, the stage programs' convention
(CUDA events, 5 warm-ups, median of 20, L2 flushed before each repeat); forward is one call,
backward is torch.autograd.grad(o, (q, k, v), dO, retain_graph=True), as in
scripts/compare_pytorch.py. The stage programs time their backward pass alone too (delta,
dQ zeroing, dK/dV and dQ kernels: s->backward in common/runner.c), which is exactly what
flash_stages' backward operator launches.

What differs from compare_pytorch, on purpose: after each L2 flush a GPU spin
(torch.cuda._sleep, a few times the measured Python time per call, at least 0.5 ms) is
queued before the start event, so that Python's dispatch of the timed call (a custom
operator, and for the backward the autograd engine) overlaps the spin instead of leaving the
GPU idle inside the timed region. The stage programs get this for free: their few C
launches are queued while the flush's memset runs (tens of microseconds). Against a causal
forward of about 1 ms at N = 4096, where 5% is 50 us, Python's dispatch would otherwise
count. --include-launch turns the spin off (compare_pytorch's exact way); the table's
"host us" column shows the Python time per call that the spin hides.

Output: a table per point on stdout (TFLOP/s, % of each SDPA backend of this run, and with
--bin the ratio PyTorch ms / program ms, flagged "<-- outside 5%" at N = 4096, the
acceptance point); progress on stderr. --tsv appends rows in the stages' TSV format
(compare_pytorch.HEADER): stage "py_<stage>" for a stage measured from PyTorch,
"sdpa_<backend>" for SDPA, and the stage programs' own rows as they wrote them, so the three
never mix in the plots. device_bytes of the PyTorch rows is the peak PyTorch allocated during
the pass, less the L2 flush buffer. Without PyTorch, a CUDA device or the package the
script prints one "skipped" line and exits 0.
"""
import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import attn  # noqa: E402
from compare_pytorch import (HEADER, NO_MASK_CELLS, REPEATS, WARMUPS, flops,  # noqa: E402
                             timed_median)
from sweep import HIDDEN, TOKENS  # noqa: E402

DEFAULT_SEQ = [4096, 16384]
ACCEPT_N, ACCEPT_TOL = 4096, 0.05  # the criterion: within 5% at N = 4096
# The spin before each start event: a multiple of the measured Python time per call, so a
# slow host still gets its dispatch hidden; capped because a call that synchronizes inside
# cannot be hidden by any spin.
SPIN_FACTOR, SPIN_MIN_MS, SPIN_MAX_MS = 3.0, 0.5, 20.0


def skip(why):
    print(f"bench: skipped: {why}")
    sys.exit(0)


def first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:150]


def need_torch_and_package():
    try:
        import torch
    except ImportError:
        skip("PyTorch is not installed (pip install torch)")
    if not torch.cuda.is_available():
        skip("no CUDA device for PyTorch")
    try:
        import flash_stages
    except ModuleNotFoundError as e:
        if e.name != "flash_stages":
            skip(f"flash_stages did not import: {first_line(e)}")
        sys.path.insert(0, HERE)  # not installed: the checkout's own python/ folder
        try:
            import flash_stages
        except Exception as e:  # a library that fails to load raises OSError, not ImportError
            skip(f"flash_stages did not import: {first_line(e)}")
    except Exception as e:
        skip(f"flash_stages did not import: {first_line(e)}")
    if not flash_stages.stages():
        skip("no stage library loaded (build with `cmake -B build -DATTN_PYTHON=ON && "
             "cmake --build build`)")
    return torch, flash_stages


class Flush:
    """What timed_median zeroes before each timed repeat: a buffer twice the L2's size (as
    compare_pytorch and the programs use), then, when `cycles` is set, a GPU spin, so that
    the start event fires only after Python has queued the timed call."""

    def __init__(self, torch, nbytes):
        self.torch = torch
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.cycles = 0

    def zero_(self):
        self.buf.zero_()
        if self.cycles:
            self.torch.cuda._sleep(self.cycles)


def spin_cycles_per_ms(torch):
    """torch.cuda._sleep counts GPU clock cycles; how many make a millisecond on this GPU now
    (None where this PyTorch has no _sleep)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep(1_000_000)
    times = []
    for _ in range(5):
        start.record()
        sleep(1_000_000)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1e6 / sorted(times)[2]


def host_ms(torch, fn):
    """Python's time to queue one call (the GPU idle, so no launch waits for a free slot):
    the median of 3 after 2 warm-ups, which take the first-call costs (cuDNN plans, the
    caching allocator's first blocks) out of it."""
    times = []
    for i in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 2:
            times.append((t1 - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[1]


def measure(torch, fn, flush, cycles_per_ms):
    """(median ms, Python ms per call, peak device bytes less the flush buffer) of fn."""
    host = host_ms(torch, fn)
    if cycles_per_ms:
        spin = min(SPIN_MAX_MS, max(SPIN_MIN_MS, SPIN_FACTOR * host))
        flush.cycles = int(spin * cycles_per_ms)
    torch.cuda.reset_peak_memory_stats()
    try:
        ms = timed_median(torch, fn, flush)
    finally:
        flush.cycles = 0
    return ms, host, torch.cuda.max_memory_allocated() - flush.buf.numel()


def time_impl(torch, call, q, k, v, do, flush, cycles_per_ms, backward):
    """{"fwd": (ms, host ms, peak), "bwd": ... when `backward`} of call(q, k, v)."""
    # Fresh leaves on the shared storage: every implementation of a point sees the same data.
    qg, kg, vg = (x.detach().requires_grad_(backward) for x in (q, k, v))

    def fwd():
        return call(qg, kg, vg)

    out = {"fwd": measure(torch, fwd, flush, cycles_per_ms)}
    if backward:
        o = fwd()

        def bwd():
            return torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

        out["bwd"] = measure(torch, bwd, flush, cycles_per_ms)
    return out


def unsupported(info, tdt, d, causal):
    if tdt not in info.dtypes:
        have = ", ".join(str(t).replace("torch.", "") for t in info.dtypes)
        return f"takes {have}, not {str(tdt).replace('torch.', '')}"
    if info.head_dims and d not in info.head_dims:
        return f"supports head dims {list(info.head_dims)}, not {d}"
    if causal and not info.causal:
        return "has no causal mask"
    return None


def run_program(torch, path, b, h, n, d, dtype, causal, backward):
    """The stage program's own --bench run of the point: ({direction: row}, its TSV lines)
    or (None, why)."""
    # The program allocates its own buffers in another process: give back what PyTorch's
    # allocator holds but does not use.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The package takes the deterministic dQ path under torch's deterministic mode or with
    # ATTN_DETERMINISTIC=1; the program must take the same path to time the same work.
    deterministic = (torch.are_deterministic_algorithms_enabled() or
                     os.environ.get("ATTN_DETERMINISTIC") == "1")
    env = dict(os.environ, ATTN_DETERMINISTIC="1" if deterministic else "0")
    with tempfile.TemporaryDirectory() as tmp:
        tsv = os.path.join(tmp, "rows.tsv")
        args = [path, "--bench", "-b", str(b), "-H", str(h), "-n", str(n), "-d", str(d),
                "--dtype", dtype, "--tsv", tsv]
        if causal:
            args.append("--causal")
        if backward:
            args.append("--backward")
        r = subprocess.run(args, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            msg = (r.stderr.strip() or r.stdout.strip()).splitlines()
            return None, f"program exit {r.returncode}: {msg[0][:120] if msg else ''}"
        rows = {row["direction"]: row for row in attn.read_rows(tsv)}
        with open(tsv) as f:
            lines = f.read().splitlines()[1:]
    return rows, lines


def tsv_row(stage, direction, dtype, b, h, n, d, causal, ms, peak, stamp):
    """compare_pytorch's row format, so these rows read like its SDPA rows."""
    fl = flops(b, h, n, d, causal) * (2.5 if direction == "bwd" else 1.0)
    return "\t".join([stage, direction, dtype, str(b), str(h), str(n), str(n), str(d),
                      str(int(causal)), f"{ms:.4f}", f"{fl / ms / 1e9:.2f}", "0", str(peak),
                      "0", "", "", "-", *stamp, *NO_MASK_CELLS]) + "\n"


def fmt_pair(a, b, spec, width):
    def one(x):
        return "-" if x is None else format(x, spec)
    return f"{one(a) + '/' + one(b):>{width}}"


def print_point(label, n, results, backends, b, h, d, causal):
    """One block of the table: a line per implementation measured at this point."""
    tf = {"fwd": flops(b, h, n, d, causal), "bwd": 2.5 * flops(b, h, n, d, causal)}
    head = f"  {'implementation':<30}{'fwd TF/s':>9}{'bwd TF/s':>9}"
    head += "".join(f"{'% ' + x + ' f/b':>15}" for x in backends)
    head += f"{'host us f/b':>13}{'py/prog f/b':>14}"
    print(label)
    print(head)
    flagged = []
    for name, res in results:
        if isinstance(res, str):
            print(f"  {name:<30}{res}")
            continue
        ms = {dr: res[dr][0] for dr in ("fwd", "bwd") if dr in res}
        line = f"  {name:<30}"
        line += "".join(f"{tf[dr] / ms[dr] / 1e9:9.1f}" if dr in ms else f"{'-':>9}"
                        for dr in ("fwd", "bwd"))
        for x in backends:
            ref = dict(results).get(f"sdpa_{x}")
            pct = [100 * ref[dr][0] / ms[dr] if isinstance(ref, dict) and dr in ref
                   and dr in ms else None for dr in ("fwd", "bwd")]
            line += fmt_pair(*pct, ".1f", 15)
        hosts = [res[dr][1] * 1e3 if dr in res and res[dr][1] is not None else None
                 for dr in ("fwd", "bwd")]
        line += fmt_pair(*hosts, ".0f", 13)
        ratio = res.get("ratio", {})
        if ratio:
            line += fmt_pair(ratio.get("fwd"), ratio.get("bwd"), ".3f", 14)
            bad = [dr for dr, r in ratio.items() if abs(r - 1) > ACCEPT_TOL]
            if n == ACCEPT_N and bad:
                line += "  <-- outside 5%"
                flagged += [(name, dr, ratio[dr]) for dr in bad]
        print(line)
    print(flush=True)
    return flagged


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="*",
                    help="stages to time (default: every loaded stage that has --dtype)")
    ap.add_argument("--seq", nargs="*", type=int, default=DEFAULT_SEQ, help="sequence lengths")
    ap.add_argument("--dims", nargs="*", type=int, default=[64, 128], help="head dims")
    ap.add_argument("--causal", choices=["both", "0", "1"], default="both")
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    ap.add_argument("--backends", nargs="*", default=["flash", "cudnn"],
                    choices=["flash", "cudnn", "efficient", "math"], help="SDPA backends")
    ap.add_argument("--bin", help="folder of the stage programs: also run each program at "
                    "each point and report PyTorch ms / program ms")
    ap.add_argument("--tsv", help="append result rows to this file")
    ap.add_argument("--include-launch", action="store_true",
                    help="no GPU spin before the start event: Python's dispatch time stays "
                    "in the timing, as in scripts/compare_pytorch.py")
    a = ap.parse_args()

    torch, fs = need_torch_and_package()
    from torch.nn.attention import sdpa_kernel
    from compare_pytorch import backends as sdpa_backends
    F = torch.nn.functional
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]

    loaded = fs.stages()
    if a.stages is None:
        names = [s for s in loaded if tdt in fs.stage_info(s).dtypes]
    else:
        names = [s for s in a.stages if s in loaded]
        for s in a.stages:
            if s not in loaded:
                print(f"bench: {s} is not loaded (loaded: {', '.join(loaded)})",
                      file=sys.stderr)
    causals = {"both": [False, True], "0": [False], "1": [True]}[a.causal]
    points = [(d, c, n) for d in a.dims for c in causals for n in a.seq]

    prop = torch.cuda.get_device_properties(0)
    flush = Flush(torch, 2 * getattr(prop, "L2_cache_size", 64 << 20))
    # The programs stamp their rows with the UTC date (common/runner.c): the same here.
    stamp = (prop.name, str(prop.multi_processor_count), str(torch.version.cuda),
             datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    cycles_per_ms = None if a.include_launch else spin_cycles_per_ms(torch)
    lib_dir = getattr(fs, "LIBRARY_DIR", None)
    print(f"{prop.name} ({prop.multi_processor_count} SMs), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; stage libraries: {lib_dir or 'unknown'}; programs: "
          f"{a.bin or 'not run (no --bin)'}")
    if a.bin and lib_dir and (os.path.realpath(os.path.dirname(os.path.abspath(a.bin))) !=
                              os.path.realpath(os.path.dirname(lib_dir))):
        print("note: the programs and the libraries come from different build folders; "
              "their kernels may differ")
    how = ("Python's dispatch included (--include-launch)" if a.include_launch else
           "Python's dispatch hidden behind a GPU spin before the start event"
           if cycles_per_ms else "Python's dispatch included: this torch has no "
           "torch.cuda._sleep")
    print(f"timing: CUDA events, {WARMUPS} warm-ups, median of {REPEATS}, L2 flushed before "
          f"each; {how}\n", flush=True)

    out = None
    if a.tsv:  # opened now: a bad path should fail before minutes of timing, not after
        new = not os.path.exists(a.tsv) or os.path.getsize(a.tsv) == 0
        out = open(a.tsv, "a")
        if new:
            out.write(HEADER)

    total = len(points) * (len(a.backends) + len(names))
    k, t0, flagged, compared = 0, time.time(), [], 0
    for d, causal, n in points:
        b, h = max(1, TOKENS // n), HIDDEN // d
        label = (f"d={d} N={n} {'causal' if causal else 'non-causal'} "
                 f"(B={b}, H={h}, {a.dtype})")
        results = []  # (name, {"fwd": (ms, host, peak), "bwd": ..., "ratio": ...} or why)
        torch.manual_seed(0)
        try:
            q, k_, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=tdt)
                            for _ in range(4))
        except RuntimeError as e:  # OutOfMemoryError is one
            print(f"{label}\n  inputs not allocated: {first_line(e)}\n", flush=True)
            torch.cuda.empty_cache()
            k += len(a.backends) + len(names)
            continue

        def progress(what):
            print(f"[{k:3d}/{total}] {what} d={d} N={n}{' causal' if causal else ''}, "
                  f"elapsed {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

        for backend in a.backends:
            k += 1
            progress(f"sdpa_{backend}")
            name = f"sdpa_{backend}"
            try:
                with sdpa_kernel(sdpa_backends(torch)[backend]):
                    res = time_impl(
                        torch, lambda x, y, z: F.scaled_dot_product_attention(
                            x, y, z, is_causal=causal), q, k_, v, do, flush, cycles_per_ms,
                        True)
                results.append((name, res))
            except RuntimeError as e:
                results.append((name, f"not run: {first_line(e)}"))
            torch.cuda.empty_cache()

        for stage in names:
            k += 1
            progress(f"py_{stage}" + (" and its program" if a.bin else ""))
            info = fs.stage_info(stage)
            why = unsupported(info, tdt, d, causal)
            if why:
                results.append((f"py_{stage}", f"not supported: {stage} {why}"))
                continue
            try:
                res = time_impl(
                    torch, lambda x, y, z: fs.scaled_dot_product_attention(
                        x, y, z, is_causal=causal, stage=stage), q, k_, v, do, flush,
                    cycles_per_ms, info.backward)
            except (RuntimeError, ValueError) as e:  # FlashStagesError is a ValueError
                results.append((f"py_{stage}", f"not run: {first_line(e)}"))
                torch.cuda.empty_cache()
                continue
            results.append((f"py_{stage}", res))
            if not a.bin:
                continue
            path = os.path.join(a.bin, stage)
            if not os.access(path, os.X_OK):
                results.append((f"{stage} (program)", f"no program at {path}"))
                continue
            rows, lines = run_program(torch, path, b, h, n, d, a.dtype, causal, info.backward)
            if rows is None:
                results.append((f"{stage} (program)", lines))
                continue
            prog = {dr: (float(r["ms"]), None, int(r["device_bytes"]))
                    for dr, r in rows.items() if dr in res}
            res["ratio"] = {dr: res[dr][0] / prog[dr][0] for dr in prog}
            compared += len(prog) if n == ACCEPT_N else 0
            results.append((f"{stage} (program)", prog))
            if out:
                out.write("".join(line + "\n" for line in lines))

        if out:
            for name, res in results:
                if isinstance(res, dict) and not name.endswith("(program)"):
                    for dr in ("fwd", "bwd"):
                        if dr in res:
                            out.write(tsv_row(name, dr, a.dtype, b, h, n, d, causal,
                                              res[dr][0], res[dr][2], stamp))
            out.flush()
        flagged += print_point(label, n, results, a.backends, b, h, d, causal)
        del q, k_, v, do
        torch.cuda.empty_cache()

    print(f"bench: {len(points)} points in {time.time() - t0:.0f} s"
          + (f", rows appended to {a.tsv}" if a.tsv else ""))
    if not a.bin:
        print("bench: no --bin: PyTorch was not compared with the stage programs")
    elif not compared:
        print(f"bench: no PyTorch-against-program ratio at N = {ACCEPT_N}")
    elif not flagged:
        print(f"bench: PyTorch against the programs at N = {ACCEPT_N}: all {compared} "
              f"ratios within {ACCEPT_TOL:.0%}")
    else:
        print(f"bench: PyTorch against the programs at N = {ACCEPT_N}: {len(flagged)} of "
              f"{compared} ratios outside {ACCEPT_TOL:.0%}: " +
              ", ".join(f"{name} {dr} {r:.3f}" for name, dr, r in flagged))
    if out:
        out.close()


if __name__ == "__main__":
    main()
