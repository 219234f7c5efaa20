#!/usr/bin/env python3
"""The benchmark command: the sweep of CONVENTIONS.md section 5 for every stage this machine
can run (and PyTorch's SDPA backends where scripts/compare_pytorch.py can run), written to
docs/results/<device>/ (cpu.tsv, gpu.tsv), then the plots and the README's results table.

Rows of a stage that was swept replace that stage's committed rows; every other row is kept,
so a CPU-only machine refreshes the CPU rows and keeps the committed GPU rows. Progress
(done/total, the current stage and shape, time left) goes to stderr.

  python3 scripts/bench.py --bin build/bin                    # everything this machine runs
  python3 scripts/bench.py --bin build/bin --stages 07_tensor_cores --budget 300
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import attn
import plots
import sweep
import update_docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def device_of(stage, tmp):
    """The device name a stage program stamps its rows with, or None without a device."""
    tsv = os.path.join(tmp, f"probe_{stage.name}.tsv")
    r = subprocess.run([stage.path, "-n", "16", "-H", "1", "--tsv", tsv], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return None
    rows = attn.read_rows(tsv)
    return rows[0]["device"] if rows else None


def folder_name(kind, device):
    return attn.slug(device) if kind == "gpu" else "cpu-" + attn.slug(device)


def merge(committed, fresh, swept_stages):
    """Rows of `fresh` replace the committed rows of the stages that were swept."""
    old = [r for r in attn.read_rows(committed) if r["stage"] not in swept_stages]
    new = attn.read_rows(fresh)
    rows = old + new
    if not rows:
        return
    header = list(new[0].keys()) if new else list(old[0].keys())
    with open(committed, "w") as f:
        f.write("\t".join(header) + "\n")
        for r in rows:
            f.write("\t".join(r.get(h, "") for h in header) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder of the stage programs")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--stages", nargs="*", help="only these stages (default: all)")
    ap.add_argument("--budget", type=float, default=0, help="seconds per sweep (0: no limit)")
    ap.add_argument("--no-pytorch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--pytorch-budget", type=float, default=0,
                    help="seconds for PyTorch's sweep (0: no limit)")
    a = ap.parse_args()
    stages = [s for s in attn.find_stages(a.bin) if not a.stages or s.name in a.stages]
    tmp = tempfile.mkdtemp(prefix="bench_")
    folders = []
    for kind in ("cpu", "gpu"):
        group = [s for s in stages if s.kind == kind]
        if not group:
            continue
        device = device_of(group[0], tmp)
        if device is None:
            print(f"bench: {kind.upper()} stages skipped: no CUDA device", file=sys.stderr)
            continue
        folder = os.path.join(a.docs, folder_name(kind, device))
        os.makedirs(folder, exist_ok=True)
        fresh = os.path.join(tmp, kind)
        print(f"bench: {len(group)} {kind.upper()} programs on {device} -> {folder}",
              file=sys.stderr)
        sweep.run(group, fresh, budget=a.budget)
        swept = {s.name for s in group}
        if kind == "gpu" and not a.no_pytorch and (not a.stages or "pytorch" in a.stages):
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_pytorch.py"),
                            "--bin", a.bin, "--out", fresh, "--budget", str(a.pytorch_budget)])
            # PyTorch's backends that wrote rows replace their committed rows.
            swept |= {r["stage"] for r in attn.read_rows(os.path.join(fresh, "gpu.tsv"))}
        merge(os.path.join(folder, f"{kind}.tsv"), os.path.join(fresh, f"{kind}.tsv"), swept)
        folders.append(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    redraw(a.docs)
    return 0


def redraw(docs):
    """Plots of every device folder (GPU folders also get the CPU rows, for the ladder), then
    the README's results table and ARCHITECTURE.md's diff table."""
    folders = sorted(d for d in (os.path.join(docs, x) for x in os.listdir(docs))
                     if any(os.path.exists(os.path.join(d, f)) for f in ("cpu.tsv", "gpu.tsv")))
    cpu = [d for d in folders if os.path.basename(d).startswith("cpu-")]
    for d in folders:
        extra = [] if d in cpu else cpu
        plots.draw([d] + extra, os.path.join(d, "plots"), cpu_plots=d in cpu)
    update_docs.update(ROOT)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--redraw":
        redraw(os.path.join(ROOT, "docs", "results"))
    else:
        sys.exit(main())
