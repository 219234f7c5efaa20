#!/usr/bin/env python3
"""Regenerates the generated parts of the docs from the committed rows and sources, never by
hand: the README's results table (between <!-- results:begin --> and <!-- results:end -->)
ARCHITECTURE.md's table of consecutive-stage diffs (<!-- diffs:begin/end -->), and the table
of technique steps in the README of each stage that has them (<!-- steps:begin/end -->).

  python3 scripts/update_docs.py          # rewrite them in place
  python3 scripts/update_docs.py --check  # exit 1 if one is stale
"""
import argparse
import glob
import os
import re
import subprocess
import sys

import attn
import steps
from plots import human_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, D = "4096", "64"  # the table's size: FlashAttention's convention, H = 2048/d, B = 16384/N


def source_of(root, stage):
    hits = glob.glob(os.path.join(root, stage, "attention.c*"))
    return hits[0] if hits else None


def idea_of(root, stage):
    src = source_of(root, stage) or os.path.join(root, "common", f"{stage}.cu")
    if not os.path.exists(src):
        return ""
    m = re.search(r'attn_stage stage = \{\s*(?:\.name = )?"[^"]+",\s*(?:\.idea = )?"([^"]+)"',
                  open(src).read())
    return m.group(1) if m else ""


def pick(rows, **where):
    hits = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    return hits[0] if hits else None


def results_table(root):
    docs = os.path.join(root, "docs", "results")
    # The reference folders (attn.REFERENCE_FOLDERS): a run on another CPU or GPU writes its
    # own folder, which this table names below but does not mix in.
    gpu_dir, cpu_dir = attn.reference_folder(docs, "gpu"), attn.reference_folder(docs, "cpu")
    cpu = attn.read_rows(os.path.join(cpu_dir, "cpu.tsv")) if cpu_dir else []
    gpu = attn.read_rows(os.path.join(gpu_dir, "gpu.tsv")) if gpu_dir else []
    lines = []
    if gpu:
        g, rel = gpu[0], os.path.relpath(gpu_dir, root)
        dates = " and ".join(sorted({r["date"] for r in gpu}))
        lines.append(f"GPU rows: {g['device']} ({g['units']} SMs), CUDA {g['cuda']}, {dates}, "
                     f"from [`{rel}/gpu.tsv`]({rel}/gpu.tsv).")
    if cpu:
        c, rel = cpu[0], os.path.relpath(cpu_dir, root)
        lines.append(f"CPU rows: {c['device']}, one core, {c['date']}, from "
                     f"[`{rel}/cpu.tsv`]({rel}/cpu.tsv).")
    folders = attn.result_folders(docs)
    others = [f for f in folders["gpu"] + folders["cpu"] if f not in (gpu_dir, cpu_dir)]
    if others:
        links = ", ".join(f"[`{os.path.relpath(f, root)}/`]({os.path.relpath(f, root)}/)"
                          for f in others)
        lines.append(f"Other devices, each with its own rows and plots, not in this table: "
                     f"{links}.")
    lines += ["", f"Forward and backward TFLOP/s at N = {N}, non-causal (GPU: H = 2048/d, "
              f"B = 16384/N; CPU: one head, d = 64); the forward as a percentage of PyTorch's "
              f"SDPA backends measured in the same command as the stage's rows (each stage's "
              f"latest run; the `run` column of the TSV names it): the half-precision stages of `flash` (FlashAttention-2) and `cudnn` "
              f"in fp16, the fp32 ones of `efficient` in fp32 (flash and cuDNN have no fp32); "
              f"a dash where the stage's run timed no such backend; "
              f"memory: CPU workspace at N = 8192, GPU device "
              f"memory of a forward run at N = 8192 (B = 1, H = 32, d = 64; inputs, outputs "
              f"and workspace).", "",
              "| stage | idea | dtype | fwd d=64 | fwd d=128 | bwd d=64 | bwd d=128 "
              "| % of SDPA, fwd d=64 / d=128 | memory |",
              "|---|---|---|---|---|---|---|---|---|"]
    # A stage's row is compared with SDPA measured in the same run (attn.run_of), the backends
    # of its precision: SDPA's rows for (backend, dtype, d, run).
    peers_of = {"fp32": (("efficient", "fp32"),)}
    half_peers = (("flash", "fp16"), ("cudnn", "fp16"))
    peers = {(name, dtype, d, run): pick([r for r in gpu if attn.run_of(r) == run],
                                         stage=f"sdpa_{name}", dtype=dtype, direction="fwd",
                                         Nq=N, d=d, causal="0")
             for name, dtype in half_peers + peers_of["fp32"]
             for d in ("64", "128") for run in {attn.run_of(r) for r in gpu}}

    def tf(r):
        if not r:
            return "-"
        x = float(r["tflops"])
        return f"{x:.3g}" if x >= 0.1 else f"{x * 1e3:.3g} G"

    for stage in attn.STAGES + attn.BASELINES:
        kind_rows = cpu if stage in attn.STAGES[:3] else gpu
        dtypes = sorted({r["dtype"] for r in kind_rows if r["stage"] == stage},
                        key=["fp32", "fp16", "bf16"].index)
        for dtype in dtypes:
            rows = [r for r in kind_rows if r["stage"] == stage and r["dtype"] == dtype]
            cells = {}
            for direction in ("fwd", "bwd"):
                for d in ("64", "128"):
                    where = dict(direction=direction, Nq=N, Nkv=N, d=d, causal="0")
                    if kind_rows is gpu:
                        where["B"] = str(16384 // int(N))
                    # A point measured in several runs: its latest row, as the plots draw.
                    cells[direction, d] = pick(attn.latest(rows), **where)
            ratios, found = [], False
            for name, peer_dtype in peers_of.get(dtype, half_peers) if kind_rows is gpu else ():
                pct = []
                for d in ("64", "128"):
                    r = cells["fwd", d]
                    f = peers.get((name, peer_dtype, d, attn.run_of(r))) if r else None
                    found = found or bool(r and f)
                    pct.append(f"{100 * float(r['tflops']) / float(f['tflops']):.1f}%"
                               if r and f else "-")
                ratios.append(f"{name} {' / '.join(pct)}")
            if not found:
                ratios = []  # no peer in the stage's run at all: one dash
            if kind_rows is cpu:
                m = pick(rows, direction="fwd", Nq="8192", d="64")
                memory = f"{human_bytes(int(m['workspace_bytes']))} workspace" if m else "-"
            else:
                m = pick(attn.forward_only(rows), direction="fwd", Nq="8192", d="64", B="1", H="32",
                         causal="0")
                memory = human_bytes(int(m["device_bytes"])) if m else "-"
            name = f"[`{stage}`]({stage}/)" if stage in attn.STAGES else f"`{stage}`"
            lines.append(f"| {name} | {idea_of(root, stage)}"
                         f" | {dtype} | {tf(cells['fwd', '64'])} | {tf(cells['fwd', '128'])} "
                         f"| {tf(cells['bwd', '64'])} | {tf(cells['bwd', '128'])} "
                         f"| {'; '.join(ratios) or '-'} | {memory} |")
    # One row per SDPA backend and dtype: its latest run at the table's size (the plots draw
    # the same), dated; each stage's % column above compares with SDPA of the stage's own run.
    first = {}
    for k, r in enumerate(gpu):
        first.setdefault(attn.run_of(r), k)
    peer_rows = (("flash", "fp16"), ("cudnn", "fp16"), ("efficient", "fp16"),
                 ("efficient", "fp32"))
    for name, dtype in peer_rows:
        rows = [r for r in gpu if r["stage"] == f"sdpa_{name}" and r["dtype"] == dtype
                and r["Nq"] == N and r["causal"] == "0"]
        if not rows:
            continue
        run = max({attn.run_of(r) for r in rows}, key=lambda run: (run[0], first[run]))
        rows = [r for r in rows if attn.run_of(r) == run]
        c = {(di, d): pick(rows, direction=di, d=d) for di in ("fwd", "bwd") for d in ("64", "128")}
        lines.append(f"| PyTorch SDPA `{name}`, {run[0]} | reference | {dtype} "
                     f"| {tf(c['fwd', '64'])} | {tf(c['fwd', '128'])} | {tf(c['bwd', '64'])} "
                     f"| {tf(c['bwd', '128'])} | | |")
    return "\n".join(lines)


# Stages 07 on are split by pass: attention.cu (descriptor, main) includes the pass files and
# the helper headers, in this reading order. A stage without a file of an earlier stage builds
# that one (10 and 11 build 09's backward, 12 10's forward, 14 12's products).
PASS_FILES = ["tiles.cuh", "mma.cuh", "hopper.cuh", "forward_softmax.cuh", "forward.cuh",
              "decode.cuh", "merge.cuh", "delta.cuh", "products.cuh", "backward_products.cuh",
              "backward.cuh", "attention.cu"]


def files_of(root, stage):
    """A stage's files by name: its pass files, or {"": its one source}."""
    split = [f for f in PASS_FILES if os.path.exists(os.path.join(root, stage, f))]
    if any(f != "attention.cu" for f in split):
        return {f: f"{stage}/{f}" for f in split}
    src = source_of(root, stage)
    return {"": os.path.relpath(src, root)} if src else {}


def changed_lines(root, command):
    out = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True,
                         text=True).stdout.splitlines()
    return sum(1 for x in out if x[:1] in "+-" and not x.startswith(("+++", "---")))


def diff_table(root):
    lines = ["| from | to | command | changed lines |", "|---|---|---|---|"]
    stages = attn.STAGES
    for a, b in zip(stages, stages[1:]):
        a = attn.PARENT.get(b, a)
        fa, fb = files_of(root, a), files_of(root, b)
        if not fa or not fb:
            continue
        if "" in fa and "" not in fb:  # into the split: the pass files read in order
            rows = [f"diff -u {fa['']} <(cat {' '.join(fb.values())})"]
        elif "" in fa:
            rows = [f"diff -u {fa['']} {fb['']}"]
        else:
            rows = [f"diff -u {earlier_file(root, fa, fb, f)} {fb[f]}" for f in fb]
        for command in rows:
            changed = changed_lines(root, command)
            note = "" if changed <= 200 else " (over 200: see the stage README)"
            if changed > 200 and b in stages_with_steps(root):
                note = f" (over 200: shown in pieces by `{b}/steps/`)"
            lines.append(f"| `{a}` | `{b}` | `{command}` | {changed}{note} |")
        built = included_files(root, fb.values())
        for f in fa:
            if f and f not in fb and fa[f] in built:
                lines.append(f"| `{a}` | `{b}` | `{b}` builds `{fa[f]}` | 0 |")
    return "\n".join(lines)


def earlier_file(root, fa, fb, f):
    """What stage b's file f is a diff of: the parent's file f; else one the parent builds from
    an earlier stage (14's forward.cuh: the 10_hopper_wgmma/forward.cuh that 12 builds), unless
    b builds a file of that name from elsewhere too (12's backward.cuh is new beside the 09
    backward.cuh it builds); else none."""
    if f in fa:
        return fa[f]
    mine = set(fb.values())
    if any(os.path.basename(p) == f and p not in mine
           for p in included_files(root, fb.values())):
        return "/dev/null"
    built = sorted(p for p in included_files(root, fa.values()) if os.path.basename(p) == f)
    return built[-1] if built else "/dev/null"


def included_files(root, paths):
    """Every file the given ones include, directly or through others (quoted includes, resolved
    from the including file's folder), as paths relative to root."""
    seen, todo = set(), list(paths)
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen or not os.path.isfile(os.path.join(root, path)):
            continue
        seen.add(path)
        with open(os.path.join(root, path)) as f:
            for name in re.findall(r'^#include "([^"]+)"', f.read(), re.M):
                todo.append(os.path.join(os.path.dirname(path), name))
    return seen


def stages_with_steps(root):
    return [s for s in attn.STAGES if os.path.isfile(os.path.join(root, s, "steps", "BASE"))]


def steps_table(root, stage):
    """A stage's technique steps (scripts/steps.py): what each adds, and its changed lines."""
    lines = ["| step | what it adds | changed lines |", "|---|---|---|"]
    for path, counts in steps.step_lines(stage):
        description, _ = steps.split_patch(path)
        title = description[0].split(":", 1)[-1].strip().rstrip(".") if description else ""
        name = os.path.basename(path)
        text = ", ".join(f"{n} {c}" for n, c in counts.items())
        lines.append(f"| [`{name}`](steps/{name}) | {title} | {text} |")
    return "\n".join(lines)


def replace_between(path, tag, text, check):
    s = open(path).read()
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    if begin not in s or end not in s:
        print(f"update_docs: {path} has no {begin} ... {end} markers", file=sys.stderr)
        return False
    new = s[:s.index(begin) + len(begin)] + "\n" + text + "\n" + s[s.index(end):]
    if new == s:
        return True
    if check:
        print(f"update_docs: {os.path.relpath(path, ROOT)}: the {tag} table is stale "
              f"(run python3 scripts/update_docs.py)", file=sys.stderr)
        return False
    open(path, "w").write(new)
    print(f"update_docs: rewrote the {tag} table in {os.path.relpath(path, ROOT)}")
    return True


def update(root, check=False):
    ok = replace_between(os.path.join(root, "README.md"), "results", results_table(root), check)
    ok &= replace_between(os.path.join(root, "ARCHITECTURE.md"), "diffs", diff_table(root), check)
    for stage in stages_with_steps(root):
        ok &= replace_between(os.path.join(root, stage, "README.md"), "steps",
                              steps_table(root, stage), check)
    return ok


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    sys.exit(0 if update(ROOT, ap.parse_args().check) else 1)
