#!/usr/bin/env python3
"""The benchmark sweep of docs/conventions.md section 5, one stage program run per point.

GPU stages: hidden size 2048 (H = 2048/d), 16384 tokens (B = 16384/N), N = 512..16384,
d in {64, 128}, causal and not where the stage has a mask, backward where it has one.
CPU stages: one head, N = 256..8192, d = 64. Rows are appended to <out>/<kind>.tsv.
--seq and --dtypes run a subset of the GPU points (without the memory-against-N points).
Progress (done/total, the current stage and shape, time left) goes to stderr.
"""
import argparse
import os
import subprocess
import sys
import time

import attn

GPU_N = [512, 1024, 2048, 4096, 8192, 16384]
CPU_N = [256, 512, 1024, 2048, 4096, 8192]
HIDDEN, TOKENS = 2048, 16384


def points(stage, gpu_n=GPU_N, dtypes=None):
    if stage.kind == "cpu":
        for n in CPU_N:
            yield ["-b", "1", "-H", "1", "-n", str(n), "-d", "64"]
        return
    for dtype in stage.dtypes:
        if dtypes and dtype not in dtypes:
            continue
        for d in (64, 128):
            if stage.dims and d not in stage.dims:
                continue
            for causal in ([False, True] if stage.causal else [False]):
                for n in gpu_n:
                    args = ["-b", str(TOKENS // n), "-H", str(HIDDEN // d), "-n", str(n),
                            "-d", str(d), "--dtype", dtype]
                    if causal:
                        args.append("--causal")
                    if stage.backward:
                        args.append("--backward")
                    yield args
    # Device memory against N at a fixed batch (with B = 16384/N the inputs are constant):
    # one forward per point, d = 64, H = 32, B = 1; only in the whole sweep.
    whole = gpu_n == GPU_N and not dtypes
    if whole and ("fp32" in stage.dtypes or stage.dtypes == ["fp16", "bf16"]):
        for n in GPU_N:
            yield ["-b", "1", "-H", str(HIDDEN // 64), "-n", str(n), "-d", "64",
                   "--dtype", stage.dtypes[0]]


def work(args):
    """A point's work, in proportion to its time: its FLOPs (B H N^2 d, causal halved, the
    backward 2.5 times the forward on top). Counting points instead said "about 0m59s left"
    of a sweep that took 3m53s: the last points, at the largest N, cost the most."""
    flags = {"--causal", "--backward"}
    v = dict(zip(*[iter([x for x in args if x not in flags])] * 2))
    w = float(v["-b"]) * float(v["-H"]) * float(v["-n"]) ** 2 * float(v["-d"])
    if "--causal" in args:
        w /= 2
    if "--backward" in args:
        w *= 3.5
    return w


def fmt_time(s):
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s"


def is_done(stage, args, rows):
    """Whether `rows` already hold this point: a bwd row for a --backward point, a fwd row
    of a run without --backward otherwise (attn.forward_only)."""
    flags = {"--causal", "--backward"}
    v = dict(zip(*[iter([x for x in args if x not in flags])] * 2))
    key = (stage, v.get("--dtype", "fp32"), v["-b"], v["-H"], v["-n"], v["-d"],
           "1" if "--causal" in args else "0")
    if "--backward" in args:
        return any(attn.shape_key(r) == key and r["direction"] == "bwd" for r in rows)
    return any(attn.shape_key(r) == key for r in attn.forward_only(rows))


def run(stages, out_dir, log=sys.stderr, budget=0, skip_done=None, gpu_n=GPU_N,
        dtypes=None, complete=None):
    """skip_done: a TSV whose points are not run again (to finish a sweep a budget cut).
    gpu_n, dtypes: a subset of the GPU sequence lengths and dtypes (a subset skips the
    memory-against-N points). complete: a set that gets the names of the stages all of whose
    points ran and succeeded. Returns the number of points that failed."""
    os.makedirs(out_dir, exist_ok=True)
    done = attn.read_rows(skip_done) if skip_done else []
    todo = [(s, a) for s in stages for a in points(s, gpu_n, dtypes)
            if not is_done(s.name, a, done)]
    t0, failures = time.time(), 0
    total_work, done_work = sum(work(a) for _, a in todo), 0.0
    # A stage that exits 77 (no device it can run on: stage 10 on a GPU other than Hopper)
    # is skipped, and the sweep goes on with the next one.
    skipped, unfinished = set(), set()
    for k, (stage, args) in enumerate(todo):
        if stage.name in skipped:
            continue
        elapsed = time.time() - t0
        if budget and elapsed > budget:
            print(f"sweep: stopped after {fmt_time(elapsed)} (budget {budget} s): "
                  f"{len(todo) - k} points not run, from {stage.name} {' '.join(args)}", file=log)
            unfinished |= {s.name for s, _ in todo[k:]}
            break
        # Time per unit of work so far, times the work left (a skipped stage's points too).
        left = elapsed / done_work * (total_work - done_work) if done_work else 0
        estimate = f", about {fmt_time(left)} left" if done_work else ""
        print(f"[{k + 1:3d}/{len(todo)}] {stage.name} {' '.join(args)}   "
              f"elapsed {fmt_time(elapsed)}{estimate}", file=log, flush=True)
        done_work += work(args)
        tsv = os.path.join(out_dir, f"{stage.kind}.tsv")
        r = subprocess.run([stage.path, "--bench", "--tsv", tsv] + args,
                           capture_output=True, text=True)
        if r.returncode == 77:
            why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "no CUDA device"
            for prefix in (f"{stage.name}: ", "skipped: "):
                why = why[len(prefix):] if why.startswith(prefix) else why
            print(f"    {stage.name} skipped ({why}): its other points are not run", file=log)
            skipped.add(stage.name)
            continue
        if r.returncode != 0:
            failures += 1
            unfinished.add(stage.name)
            print(f"    exit {r.returncode}: {r.stderr.strip()}", file=log)
    else:
        print(f"sweep: {len(todo)} points in {fmt_time(time.time() - t0)}, {failures} failed"
              f"{f', {len(skipped)} stages skipped' if skipped else ''} (rows in {out_dir})",
              file=log)
    if complete is not None:
        complete |= {s.name for s in stages} - skipped - unfinished
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True, help="folder of the stage programs")
    ap.add_argument("--out", required=True, help="folder for cpu.tsv / gpu.tsv")
    ap.add_argument("--kind", choices=["cpu", "gpu", "all"], default="all")
    ap.add_argument("--stages", nargs="*", help="only these stages")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds after which no new point starts (0: no limit)")
    ap.add_argument("--skip-done", help="a TSV of rows whose points are not run again")
    ap.add_argument("--seq", nargs="*", type=int, default=GPU_N,
                    help="GPU sequence lengths (default: the whole sweep)")
    ap.add_argument("--dtypes", nargs="*", help="only these dtypes (default: each stage's)")
    a = ap.parse_args()
    if any(n < 1 or n > TOKENS for n in a.seq):
        ap.error(f"--seq: sequence lengths must be in 1..{TOKENS} (B = {TOKENS}/N)")
    if a.budget < 0:
        ap.error("--budget must be 0 (no limit) or a positive number of seconds")
    if a.dtypes and set(a.dtypes) - {"fp32", "fp16", "bf16"}:
        ap.error("--dtypes: fp32, fp16 or bf16")
    if a.skip_done and not os.path.isfile(a.skip_done):
        ap.error(f"--skip-done: no file {a.skip_done}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out: {a.out} is not a folder")
    stages = attn.stages_or_exit(ap, a.bin, a.stages)
    stages = [s for s in stages if a.kind == "all" or s.kind == a.kind]
    sys.exit(1 if run(stages, a.out, budget=a.budget, skip_done=a.skip_done,
                           gpu_n=a.seq, dtypes=a.dtypes) else 0)


if __name__ == "__main__":
    main()
