#!/usr/bin/env python3
"""The tour: every stage this machine can run, on its default problem and checked, in one
table; then the CPU sweep (time and workspace against N) and the plots."""
import argparse
import os
import subprocess
import sys

import attn
import plots
import sweep


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="committed results to draw beside")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tsv = os.path.join(a.out, "tour.tsv")
    if os.path.exists(tsv):
        os.remove(tsv)
    stages = attn.find_stages(a.bin)
    print("The tour: each stage on its default problem (B=1 H=4 N=512 d=64), checked against "
          "the float64 reference.\n")
    failed, ran = [], []
    for s in stages:
        r = subprocess.run([s.path, "--tsv", tsv], capture_output=True, text=True)
        if r.returncode == 77:
            print(f"  {s.name:<18} skipped: {r.stderr.strip()}")
        elif r.returncode != 0:
            failed.append(s.name)
            print(f"  {s.name:<18} FAILED (exit {r.returncode}): {r.stderr.strip()}")
        else:
            ran.append(s)
    rows = attn.read_rows(tsv)
    if rows:
        ideas = {s.name: s.idea for s in stages}
        print(f"\n{'stage':<18} {'idea':<58} {'max err':>8} {'time':>10} {'speed':>14} "
              f"{'workspace':>10}")
        for r in rows:
            tf = float(r["tflops"])
            speed = f"{tf:.2f} TFLOP/s" if tf >= 1 else f"{tf * 1e3:.2f} GFLOP/s"
            print(f"{r['stage']:<18} {ideas.get(r['stage'], '')[:58]:<58} "
                  f"{float(r['max_err']):8.1e} {float(r['ms']):8.2f}ms {speed:>14} "
                  f"{plots.human_bytes(int(r['workspace_bytes'])):>10}")
        print(f"\non {rows[0]['device']}, {rows[0]['date']}")
    cpu = [s for s in stages if s.kind == "cpu"]
    print("\nThe CPU sweep (one head, d = 64, N = 256..8192): time and workspace against N.")
    sweep_dir = os.path.join(a.out, "sweep")
    if os.path.exists(os.path.join(sweep_dir, "cpu.tsv")):
        os.remove(os.path.join(sweep_dir, "cpu.tsv"))
    sweep.run(cpu, sweep_dir)
    results = [sweep_dir] + ([a.results] if a.results and os.path.isdir(a.results) else [])
    plots.draw(results, os.path.join(a.out, "plots"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
