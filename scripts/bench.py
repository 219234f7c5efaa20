#!/usr/bin/env python3
"""The benchmark command: the sweep of docs/conventions.md section 5 for every stage this
machine can run (and PyTorch's SDPA backends where scripts/compare_pytorch.py can run),
written to docs/results/<device>/ (cpu.tsv, gpu.tsv), then the plots and the README's
results table.

The folder is named after the device the programs stamp their rows with: cpu-<model> for
the CPU stages, the GPU's name for the GPU stages. Rows of a stage whose every point ran and
succeeded replace that stage's rows in that folder; the rows of a stage a budget cut, a
failure or a missing device left unfinished are added beside its committed rows (a plot
draws each point's latest row); every other row is kept, so a CPU-only machine refreshes
its CPU rows and keeps the committed GPU rows. On a CPU or GPU other than the committed
ones the rows go to a new folder with its own plots; the README's table keeps showing the
reference folders (scripts/attn.py, REFERENCE_FOLDERS) and names the others. Only the
folders this run wrote are redrawn (and the GPU folders, when the reference CPU folder was
one of them: their ladder shows its rows). Progress (done/total, the current stage and
shape, time left) goes to stderr.

  python3 scripts/bench.py --bin build/bin                    # everything this machine runs
  python3 scripts/bench.py --bin build/bin --stages 07_tensor_cores --budget 300
  python3 scripts/bench.py --redraw                           # every plot and table, no run
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


# The columns stage 13's options added to the rows ("-" where a run has none).
MASK_COLUMNS = ("window", "softcap", "seqlens", "seqlens_kv")


def merge(committed, fresh, replaced_stages):
    """Every row of `fresh` is added; the committed rows of `replaced_stages` are dropped."""
    old = [r for r in attn.read_rows(committed) if r["stage"] not in replaced_stages]
    new = attn.read_rows(fresh)
    rows = old + new
    if not rows:
        return
    header = list(new[0].keys()) if new else list(old[0].keys())
    header += [h for h in (old[0].keys() if old else []) if h not in header]  # e.g. `run`
    with open(committed, "w") as f:
        f.write("\t".join(header) + "\n")
        for r in rows:  # a row from before the mask columns had none: "-", as the stages write
            f.write("\t".join(r.get(h, "-" if h in MASK_COLUMNS else "") for h in header) + "\n")


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
    if a.budget < 0 or a.pytorch_budget < 0:
        ap.error("a budget is 0 (no limit) or a positive number of seconds")
    stages = attn.stages_or_exit(ap, a.bin, a.stages)
    tmp = tempfile.mkdtemp(prefix="bench_")
    folders, failures = [], 0
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
        complete = set()
        failures += sweep.run(group, fresh, budget=a.budget, complete=complete)
        if kind == "gpu" and not a.no_pytorch and (not a.stages or "pytorch" in a.stages):
            fresh_tsv = os.path.join(fresh, "gpu.tsv")
            before = {row["stage"] for row in attn.read_rows(fresh_tsv)}
            r = subprocess.run([sys.executable,
                                os.path.join(ROOT, "scripts", "compare_pytorch.py"), "--bin",
                                a.bin, "--out", fresh, "--budget", str(a.pytorch_budget)])
            failures += r.returncode != 0
            # PyTorch's backends replace their committed rows after a whole, clean sweep.
            if r.returncode == 0 and not a.pytorch_budget:
                complete |= {row["stage"] for row in attn.read_rows(fresh_tsv)} - before
        merge(os.path.join(folder, f"{kind}.tsv"), os.path.join(fresh, f"{kind}.tsv"), complete)
        folders.append(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    redraw(a.docs, only=folders)
    if failures:
        print(f"bench: {failures} points failed (their rows are missing; see above)",
              file=sys.stderr)
    return 1 if failures else 0


def redraw(docs, only=None):
    """The plots of every device folder (or of those in `only`), then the README's results
    table and ARCHITECTURE.md's diff table. A GPU folder's ladder also shows the CPU stages,
    from the reference CPU folder only, so another CPU's rows never enter committed plots."""
    folders = attn.result_folders(docs)
    cpu_ref = attn.reference_folder(docs, "cpu")
    chosen = None if only is None else {os.path.abspath(f) for f in only}
    for d in folders["cpu"]:
        if chosen is None or os.path.abspath(d) in chosen:
            plots.draw([d], os.path.join(d, "plots"), cpu_plots=True)
    for d in folders["gpu"]:
        if chosen is None or os.path.abspath(d) in chosen or (
                cpu_ref and os.path.abspath(cpu_ref) in chosen):
            plots.draw([d] + ([cpu_ref] if cpu_ref else []), os.path.join(d, "plots"),
                       cpu_plots=False)
    update_docs.update(ROOT)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--redraw":
        redraw(os.path.join(ROOT, "docs", "results"))
    else:
        sys.exit(main())
