#!/usr/bin/env python3
"""The tour: every stage this machine can run, on its default problem and checked, in one
table; then the CPU sweep (time and workspace against N) and the plots."""
import argparse
import os
import subprocess
import sys
import textwrap

import attn
import plots
import sweep

IDEA_WIDTH = 58  # characters of the idea column; a longer idea is cut at a word, with "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="committed results to draw beside")
    ap.add_argument("--gpu-not-built", metavar="WHY",
                    help="the GPU stages were not built, and why (configure's reason)")
    a = ap.parse_args()
    # Line by line, so that the table and the sweep's progress (stderr) keep their order in a
    # log or a pipe.
    sys.stdout.reconfigure(line_buffering=True)
    stages = attn.stages_or_exit(ap, a.bin)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out: {a.out} is not a folder")
    # Every output folder made and proved writable before any stage runs: a path that cannot
    # be written should cost a second, not the minutes of the sweep.
    for folder in (a.out, os.path.join(a.out, "sweep"), os.path.join(a.out, "plots")):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            ap.error(f"--out: cannot make {folder}: {e.strerror}")
        if not os.access(folder, os.W_OK | os.X_OK):
            ap.error(f"--out: {folder} is not writable")
    tsv = os.path.join(a.out, "tour.tsv")
    if os.path.exists(tsv):
        os.remove(tsv)
    print("The tour: each stage on its default problem (B=1 H=4 N=512 d=64), checked against "
          "the float64 reference.\n")
    if a.gpu_not_built:
        print(f"  The GPU stages 03-13 were not built: {a.gpu_not_built}.\n")
    failed, ran = [], []
    for s in stages:
        r = subprocess.run([s.path, "--tsv", tsv], capture_output=True, text=True)
        if r.returncode == 77:
            # The program's one line, without its "name: " and "skipped: " prefixes.
            why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "no CUDA device"
            for prefix in (f"{s.name}: ", "skipped: "):
                why = why[len(prefix):] if why.startswith(prefix) else why
            print(f"  {s.name:<18} skipped: {why}")
        elif r.returncode != 0:
            failed.append(s.name)
            print(f"  {s.name:<18} FAILED (exit {r.returncode}): {r.stderr.strip()}")
        else:
            ran.append(s)
    rows = attn.read_rows(tsv)
    if rows:
        ideas = {s.name: s.idea for s in stages}
        print(f"\n{'stage':<18} {'idea':<{IDEA_WIDTH}} {'max err':>8} {'time':>10} "
              f"{'speed':>14} {'workspace':>10}")
        for r in rows:
            tf = float(r["tflops"])
            speed = f"{tf:.2f} TFLOP/s" if tf >= 1 else f"{tf * 1e3:.2f} GFLOP/s"
            # One line per stage: the idea cut at a word (the README's ladder and each
            # stage's --help have it whole), so that the table reads as a table.
            idea = textwrap.shorten(ideas.get(r["stage"], ""), IDEA_WIDTH, placeholder="...")
            print(f"{r['stage']:<18} {idea:<{IDEA_WIDTH}} "
                  f"{float(r['max_err']):8.1e} {float(r['ms']):8.2f}ms {speed:>14} "
                  f"{plots.human_bytes(int(r['workspace_bytes'])):>10}")
        devices = list(dict.fromkeys(r["device"] for r in rows))  # CPU, then GPU, once each
        print(f"\non {' and '.join(devices)}, {rows[0]['date']}")
    cpu = [s for s in stages if s.kind == "cpu"]
    print("\nThe CPU sweep (one head, d = 64, N = 256..8192): time and workspace against N.")
    sweep_dir = os.path.join(a.out, "sweep")
    if os.path.exists(os.path.join(sweep_dir, "cpu.tsv")):
        os.remove(os.path.join(sweep_dir, "cpu.tsv"))
    sweep_failures = sweep.run(cpu, sweep_dir)
    results = [sweep_dir] + ([a.results] if a.results and os.path.isdir(a.results) else [])
    plots.draw(results, os.path.join(a.out, "plots"))
    if failed or sweep_failures:
        print(f"\nThe tour: {len(failed)} stages failed their check, {sweep_failures} sweep "
              "points failed (above).")
    sys.exit(1 if failed or sweep_failures else 0)


if __name__ == "__main__":
    main()
