"""Shared helpers of the scripts: finding the stage programs, reading result rows."""
import csv
import os
import re
import subprocess

STAGES = ["00_naive", "01_cpu_tiled", "02_online_softmax", "03_cuda_forward",
          "04_shared_memory", "05_causal", "06_backward", "07_tensor_cores",
          "08_mma_sync", "09_swizzle_pipeline", "10_hopper_wgmma", "11_split_kv_decode",
          "12_hopper_backward", "13_window_softcap_varlen", "14_hopper_window"]
# The stage each stage is a diff of, where it is not the one before it: 11 builds on 09, the
# fastest stage every GPU of compute capability 8.0+ runs, not on the Hopper-only 10; 12 on
# 10, whose forward it keeps; 13 on 09, so that windows, softcap and varlen run on every GPU
# of compute capability 8.0+; 14 on 12, whose backward (and 10's forward) it gives 13's
# windows.
PARENT = {"11_split_kv_decode": "09_swizzle_pipeline", "12_hopper_backward": "10_hopper_wgmma",
          "13_window_softcap_varlen": "09_swizzle_pipeline",
          "14_hopper_window": "12_hopper_backward"}
BASELINES = ["cublas_baseline"]

# The result folders the README's table and the GPU plots' CPU bars come from: the devices
# the committed numbers were measured on. A benchmark run on any other device writes its own
# folder (docs/results/<device>/) with its own plots, and leaves these alone.
REFERENCE_FOLDERS = {"gpu": "nvidia-h200", "cpu": "cpu-amd-epyc"}


class Stage:
    def __init__(self, path, line):
        f = line.rstrip("\n").split("\t")
        self.path, self.name, self.kind = path, f[0], f[1]
        self.dims = None if f[2] == "any" else [int(x) for x in f[2].split(",")]
        self.dtypes = f[3].split(",")
        self.causal, self.backward, self.idea = f[4] == "1", f[5] == "1", f[6]


def find_stages(bin_dir, names=STAGES + BASELINES):
    """The stage programs built in bin_dir, in ladder order, each asked what it supports."""
    found = []
    for name in names:
        path = os.path.join(bin_dir, name)
        if os.access(path, os.X_OK):
            out = subprocess.run([path, "--describe"], capture_output=True, text=True, check=True)
            found.append(Stage(path, out.stdout))
    return found


def stages_or_exit(parser, bin_dir, names=None):
    """find_stages for a script's --bin (and --stages): a clear usage error (exit 2) for a
    folder with no stage program or a name that is not one of them."""
    if not os.path.isdir(bin_dir):
        parser.error(f"--bin: no folder {bin_dir} (the stage programs are in build/bin after "
                     "the README's build)")
    found = find_stages(bin_dir)
    if not found:
        parser.error(f"--bin: no stage program in {bin_dir}")
    unknown = sorted(set(names or []) - {s.name for s in found} - {"pytorch"})
    if unknown:
        parser.error(f"--stages: not built in {bin_dir}: {', '.join(unknown)} (there: "
                     f"{', '.join(s.name for s in found)})")
    return [s for s in found if not names or s.name in names]


def read_rows(*paths):
    rows = []
    for path in paths:
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows += list(csv.DictReader(f, delimiter="\t"))
    return rows


def run_of(r):
    """A row's run: its date, and its optional `run` column, which keeps apart two runs of one
    date (it names the commit whose kernels were measured). A stage is compared with
    PyTorch's rows of its own run only."""
    return (r["date"], r.get("run") or "")


def latest(rows):
    """Where one point (stage, direction, shape, dtype, device) was measured in several runs,
    only the latest run's row: what a plot draws. Runs are ordered by date, and runs of one
    date by where their first row stands (rows are appended as they are measured)."""
    def point(r):
        return (r["stage"], r["direction"], r["dtype"], r["B"], r["H"], r["Nq"], r["Nkv"],
                r["d"], r["causal"], r["device"])
    first = {}
    for k, r in enumerate(rows):
        first.setdefault(run_of(r), k)

    def rank(r):
        return (r["date"], first[run_of(r)])
    last = {}
    for r in rows:
        if point(r) not in last or rank(r) >= last[point(r)]:
            last[point(r)] = rank(r)
    return [r for r in rows if rank(r) == last[point(r)]]


def shape_key(r):
    """(stage, dtype, B, H, N, d, causal) of a result row."""
    return (r["stage"], r["dtype"], r["B"], r["H"], r["Nq"], r["d"], r["causal"])


def forward_only(rows):
    """The rows of runs without --backward. A run with it writes its fwd row and then its
    bwd row, and that fwd row's device bytes also count dO, dQ, dK, dV: not the forward's
    memory. (The shape alone cannot tell them apart: at N = 16384 the fixed-batch memory
    point, B = 1, is also the sweep's B = 16384/N point.)"""
    def of_backward_run(k):
        nxt = rows[k + 1] if k + 1 < len(rows) else None
        return (nxt is not None and nxt["direction"] == "bwd"
                and shape_key(nxt) == shape_key(rows[k]))
    return [r for k, r in enumerate(rows) if r["direction"] == "fwd" and not of_backward_run(k)]


def result_folders(docs):
    """Every folder of docs/results that holds rows: {"cpu": [...], "gpu": [...]}, each
    sorted by name. A CPU folder is named cpu-<model>, a GPU folder <gpu name>."""
    out = {"cpu": [], "gpu": []}
    for name in sorted(os.listdir(docs)) if os.path.isdir(docs) else []:
        kind = "cpu" if name.startswith("cpu-") else "gpu"
        if os.path.exists(os.path.join(docs, name, f"{kind}.tsv")):
            out[kind].append(os.path.join(docs, name))
    return out


def reference_folder(docs, kind):
    """The folder of `kind` whose rows the README's table shows: REFERENCE_FOLDERS[kind] when
    it has rows, else the folder with the most rows (then the first by name); None if none."""
    folders = result_folders(docs)[kind]
    for f in folders:
        if os.path.basename(f) == REFERENCE_FOLDERS[kind]:
            return f
    if not folders:
        return None
    # sorted() is stable: among folders with as many rows, the first by name.
    return sorted(folders, key=lambda f: -len(read_rows(os.path.join(f, f"{kind}.tsv"))))[0]


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
