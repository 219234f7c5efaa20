#!/usr/bin/env python3
"""gnuplot plots (PNG) from result rows, each stamped with the device, CUDA version and date.

Every drawing first writes its gnuplot data (<plot>_data/*.dat, not committed) and script
(<plot>.gp) from the TSV rows, then runs gnuplot, so the plots redraw from the rows alone.
Rows of more than one device (say two CPU folders) are drawn as separate series, each
named with its device. Where gnuplot is missing the data and scripts are still written,
and one line says how to install it."""
import argparse
import glob
import math
import os
import shutil
import subprocess
import sys

import attn

COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
          "#666666", "#1f78b4", "#b2182b", "#000000", "#8c564b", "#17becf", "#bcbd22"]


def human_bytes(n):
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def stamp(rows):
    devs = sorted({(r["device"], r["cuda"], r["date"]) for r in rows})
    return "; ".join(f"{d}, CUDA {c}, {t}" if c != "-" else f"{d}, {t}" for d, c, t in devs)


def fresh_data_dir(path):
    """<plot>_data/ beside the plot, emptied of the .dat files of an earlier drawing."""
    data_dir = os.path.splitext(path)[0] + "_data"
    os.makedirs(data_dir, exist_ok=True)
    for old in glob.glob(os.path.join(data_dir, "*.dat")):
        os.remove(old)
    return data_dir


def with_device(name, r, devices):
    """A series or bar name, followed by its device when the rows come from several."""
    return f"{name} ({r['device']})" if len(devices) > 1 else name


def gnuplot_file(path, title, xlabel, ylabel, series, stamp_text, logx=True, logy=True,
                 lines=(), pairs=False, dashed=()):
    """series: [(title, [(x, y), ...])]; lines: [(title, y)] horizontal reference lines.
    pairs: series 2k and 2k + 1 are one contender measured two ways, drawn in one colour,
    the second dashed. dashed: the titles of series drawn dashed (the references: with more
    series than colours, a colour comes round again, and the dash tells them apart)."""
    data_dir = fresh_data_dir(path)
    plots = []
    for k, (name, pts) in enumerate(series):
        if not pts:
            continue
        dat = os.path.join(data_dir, f"s{k}.dat")
        with open(dat, "w") as f:
            for x, y in sorted(pts):
                f.write(f"{x}\t{y}\n")
        rel = os.path.relpath(dat, os.path.dirname(path))
        colour = COLORS[(k // 2 if pairs else k) % len(COLORS)]
        dash = " dt 2" if (pairs and k % 2) or name in dashed else ""
        plots.append(f"'{rel}' using 1:2 with linespoints lw 2 pt 7{dash} lc rgb '{colour}' "
                     f"title '{name}' noenhanced")
    for k, (name, y) in enumerate(lines):
        plots.append(f"{y} with lines dt 2 lw 2 lc rgb '{COLORS[(k + 5) % len(COLORS)]}' title '{name}' noenhanced")
    if not plots:
        return None
    gp = os.path.splitext(path)[0] + ".gp"
    with open(gp, "w") as f:
        f.write("set terminal pngcairo size 1000,640 font 'sans,11'\n")
        f.write(f"set output '{os.path.basename(path)}'\n")
        f.write(f"set title \"{title}\\n{{/*0.8 {stamp_text}}}\"\n")
        f.write(f"set xlabel '{xlabel}'\nset ylabel '{ylabel}'\n")
        f.write("set grid\nset key outside right top\n")
        if logx:
            f.write("set logscale x 2\n")
        if logy:
            f.write("set logscale y\n")
        f.write("plot " + ", \\\n     ".join(plots) + "\n")
    return gp


def by_stage(rows, **where):
    """The rows that match `where`, grouped into one series per stage (and device)."""
    devices = {r["device"] for r in rows}
    out = {}
    for r in rows:
        if all(str(r.get(k)) == str(v) for k, v in where.items()):
            out.setdefault(with_device(r["stage"], r, devices), []).append(r)
    return out


LADDER_N, LADDER_D = "4096", "64"


def predecessor(stage):
    order = attn.STAGES
    return order[order.index(stage) - 1] if stage in order and order.index(stage) > 0 else None


def ladder(rows, out_dir, prefix, only):
    """Forward TFLOP/s of every stage at N = 4096, d = 64 (log scale), PyTorch's SDPA
    backends as reference lines. CPU stages: one head; GPU stages: H = 32, B = 4."""
    bars, lines = [], []
    # The devices of each kind (True: CPU) among the rows this plot can show.
    devices = {True: {r["device"] for r in rows if r["cuda"] == "-"},
               False: {r["device"] for r in rows if r["cuda"] != "-"}}
    for r in rows:
        if r["direction"] != "fwd" or r["Nq"] != LADDER_N or r["d"] != LADDER_D or \
                r["causal"] != "0" or r["Nkv"] != LADDER_N:
            continue
        if r["cuda"] != "-" and int(r["B"]) * int(r["Nq"]) != 16384:
            continue
        sdpa = r["stage"].startswith("sdpa_")
        name = r["stage"] + ("" if r["dtype"] == "fp32" and not sdpa else f" {r['dtype']}")
        name = with_device(name, r, devices[r["cuda"] == "-"])
        if sdpa:
            if r["stage"] != "sdpa_math":
                lines.append((f"PyTorch {name}", float(r["tflops"])))
        elif not only or r["stage"] in only:
            bars.append((name, float(r["tflops"]), r))
    order = {s: k for k, s in enumerate(attn.STAGES + attn.BASELINES)}
    dtypes = ["fp32", "fp16", "bf16"]
    bars.sort(key=lambda b: (order.get(b[2]["stage"], 99), dtypes.index(b[2]["dtype"])))
    if not bars:
        return None
    path = os.path.join(out_dir, f"{prefix}ladder.png")
    data_dir = fresh_data_dir(path)
    with open(os.path.join(data_dir, "bars.dat"), "w") as f:
        for k, (name, tf, _) in enumerate(bars):
            f.write(f"{k}\t{tf}\t\"{name}\"\n")
    rel = os.path.relpath(os.path.join(data_dir, "bars.dat"), out_dir)
    plotted = [f"'{rel}' using 1:2:xtic(3) with boxes fs solid 0.7 lc rgb '#1b9e77' notitle",
               f"'{rel}' using 1:($2*1.15):(sprintf('%.3g', $2)) with labels notitle"]
    lines.sort(key=lambda x: -x[1])
    for k, (name, y) in enumerate(lines):
        plotted.append(f"{y} with lines dt 2 lw 2 lc rgb '{COLORS[(k + 1) % len(COLORS)]}' "
                       f"title '{name} {y:.0f}' noenhanced")
    gp = os.path.splitext(path)[0] + ".gp"
    with open(gp, "w") as f:
        f.write("set terminal pngcairo size 1100,640 font 'sans,11'\n")
        f.write(f"set output '{os.path.basename(path)}'\n")
        f.write(f"set title \"The ladder: forward TFLOP/s at N = {LADDER_N}, d = {LADDER_D} "
                f"(CPU: 1 head; GPU: H = 32, B = 4)\\n{{/*0.8 {stamp([b[2] for b in bars])}}}\"\n")
        f.write("set ylabel 'TFLOP/s (log scale)'\nset logscale y\nset grid ytics\n")
        f.write("set boxwidth 0.6\nset xtics rotate by -30 noenhanced\n")
        # The range from the data, a decade of room on each side: a fixed 0.001-30000 left a
        # CPU-only machine's bars (a few GFLOP/s) flat at the bottom.
        values = [b[1] for b in bars if b[1] > 0] + [y for _, y in lines if y > 0]
        lo = 10 ** (math.floor(math.log10(min(values))) - 1) if values else 0.001
        hi = 10 ** (math.ceil(math.log10(max(values))) + 1) if values else 30000
        f.write(f"set key top left vertical maxrows 3\nset yrange [{lo:g}:{hi:g}]\n")
        f.write(f"set xrange [-0.6:{len(bars) - 0.4}]\n")
        f.write("plot " + ", \\\n     ".join(plotted) + "\n")
    return gp


def histogram_script(out, title, axes, plotted):
    """The gnuplot script of a clustered bar chart (the A/B plots), written beside `out`."""
    gp = os.path.splitext(out)[0] + ".gp"
    with open(gp, "w") as f:
        f.write("set terminal pngcairo size 1200,640 font 'sans,11'\n")
        f.write(f"set output '{os.path.basename(out)}'\n")
        f.write(f"set title \"{title}\"\n" + axes)
        f.write("set style data histograms\nset style histogram clustered gap 1\n")
        f.write("set style fill solid 0.8 noborder\nset boxwidth 0.9\n")
        f.write("set key outside right top noenhanced\nset xtics noenhanced rotate by -25\n")
        f.write("plot " + ", \\\n     ".join(plotted) + "\n")
    return gp


# Stage 10's A/B table: each technique added to the one before, beside SDPA, from the
# newest command of 10_hopper_wgmma-ab.tsv that measured every step.
HOPPER_STEPS = [("09_swizzle_pipeline", "09 (mma.sync, cp.async)"),
                ("10_hopper_wgmma:tma_alone", "TMA alone"),
                ("10_hopper_wgmma:tma_wgmma", "+ wgmma"),
                ("10_hopper_wgmma:warp_specialized", "+ warp specialisation"),
                ("10_hopper_wgmma:overlap", "+ overlap (stage 10)"),
                ("sdpa_flash", "SDPA flash (FlashAttention-2)"), ("sdpa_cudnn", "SDPA cuDNN")]


def steps_chart(rows, steps, out, title):
    """A clustered bar chart of `steps` ([(stage, name)]) at every (d, N, causal) of `rows`."""
    points = sorted({(int(r["d"]), int(r["Nq"]), r["causal"]) for r in rows})
    value = {(r["stage"], int(r["d"]), int(r["Nq"]), r["causal"]): float(r["tflops"])
             for r in rows}
    data_dir = fresh_data_dir(out)
    dat = os.path.join(data_dir, "steps.dat")
    with open(dat, "w") as f:
        for d, n, causal in points:
            label = f"d={d} N={n // 1024}k{' causal' if causal == '1' else ''}"
            f.write(f"\"{label}\"\t" + "\t".join(
                str(value.get((stage, d, n, causal), "NaN")) for stage, _ in steps) + "\n")
    rel = os.path.relpath(dat, os.path.dirname(out))
    plotted = [f"'{rel}' using {k + 2}:xtic(1) title '{name}' lc rgb '{COLORS[k]}'"
               for k, (_, name) in enumerate(steps)]
    return histogram_script(out, f"{title}\\n{{/*0.8 {stamp(rows)}}}",
                            "set ylabel 'TFLOP/s'\nset grid ytics\nset yrange [0:*]\n", plotted)


def hopper_steps(result_dir, out_dir):
    path = os.path.join(result_dir, "10_hopper_wgmma-ab.tsv")
    if not os.path.exists(path):
        return None
    rows = [r for r in attn.read_rows(path) if r["direction"] == "fwd" and r["dtype"] == "fp16"]
    runs = [r["run"] for r in rows if r["stage"] == HOPPER_STEPS[1][0]]
    if not runs:
        return None
    rows = [r for r in rows if r["run"] == runs[-1]]
    return steps_chart(rows, HOPPER_STEPS, os.path.join(out_dir, "10_hopper_wgmma_steps.png"),
                       "Stage 10, what each Hopper technique bought: forward TFLOP/s, fp16 "
                       f"(H = 2048/d, B = 16384/N), command {runs[-1]}")


# Stage 12's technique steps: each step's program beside SDPA, backward, from the one command
# of 12_hopper_backward-steps.tsv.
BACKWARD_STEPS = [("12_hopper_backward:step:01", "1: 09 (mma.sync, cp.async)"),
                  ("12_hopper_backward:step:02", "2: + TMA"),
                  ("12_hopper_backward:step:03", "3: + wgmma"),
                  ("12_hopper_backward:step:04", "4: + warp specialisation"),
                  ("12_hopper_backward:step:05", "5: + third stage"),
                  ("12_hopper_backward:step:06", "6: + early release"),
                  ("12_hopper_backward:step:07", "7: + shared space, descriptors"),
                  ("12_hopper_backward:step:08", "8: + dQ by box"),
                  ("12_hopper_backward:step:09", "9: + mask split"),
                  ("sdpa_flash", "SDPA flash (FlashAttention-2)"), ("sdpa_cudnn", "SDPA cuDNN")]


def backward_steps(result_dir, out_dir):
    path = os.path.join(result_dir, "12_hopper_backward-steps.tsv")
    if not os.path.exists(path):
        return None
    rows = [r for r in attn.read_rows(path) if r["direction"] == "bwd" and r["dtype"] == "fp16"]
    return steps_chart(rows, BACKWARD_STEPS,
                       os.path.join(out_dir, "12_hopper_backward_steps.png"),
                       "Stage 12, what each step bought: backward TFLOP/s, fp16 "
                       "(H = 2048/d, B = 16384/N), one command")


# Stage 09's A/B table: what the stage gains over each switch turned off alone, forward and
# backward, each from the newest command of 09_swizzle_pipeline-ab.tsv that timed that
# switch in that direction (a switch of one direction is drawn in the other too where that
# command timed both: what it then shows is the noise of timing the same kernel twice).
SWIZZLE_SWITCHES = [("swizzle_off", "swizzle"), ("whole_tiles_off", "whole tiles"),
                    ("split_waits_off", "split K/V waits"),
                    ("ffma_fold_off", "exponent in one FFMA"), ("rows16_bc64", "128 x 128 tile"),
                    ("paired_atomics_off", "paired dQ atomics"), ("qsteps1", "query steps"),
                    ("warp_keys16", "32-key dK/dV warps"), ("deterministic", "atomic dQ")]


def swizzle_switches(result_dir, out_dir):
    path = os.path.join(result_dir, "09_swizzle_pipeline-ab.tsv")
    if not os.path.exists(path):
        return None
    rows = [r for r in attn.read_rows(path) if r["dtype"] == "fp16"]
    name = "09_swizzle_pipeline:"
    # Each switch's row against the stage's rows timed just before it in the same command
    # (`base`, or `base2` for a second pass), point by point.
    gains, runs, last_base = {}, {}, {}
    for r in rows:
        point = (r["run"], r["direction"], int(r["d"]), r["Nq"], r["causal"])
        label = r["stage"][len(name):] if r["stage"].startswith(name) else None
        if label in ("base", "base2"):
            last_base[point] = float(r["tflops"])
        elif label and point in last_base:
            key = (label, r["direction"], int(r["d"]))
            if runs.get(key) != r["run"]:
                runs[key], gains[key] = r["run"], []
            gains[key].append(last_base[point] / float(r["tflops"]) - 1)
    used = sorted({runs[(label, direction, d)] for label, _ in SWIZZLE_SWITCHES
                   for direction in ("fwd", "bwd") for d in (64, 128)
                   if (label, direction, d) in runs})
    if not used:
        return None
    rows = [r for r in rows if r["run"] in used]

    def gain(label, direction, d):
        """Mean over the points of (stage / switched off - 1), in %."""
        g = gains.get((label, direction, d))
        return f"{100 * sum(g) / len(g):.1f}" if g else "NaN"

    out = os.path.join(out_dir, "09_swizzle_pipeline_switches.png")
    data_dir = fresh_data_dir(out)
    dat = os.path.join(data_dir, "switches.dat")
    with open(dat, "w") as f:
        for label, title in SWIZZLE_SWITCHES:
            f.write(f"\"{title}\"\t" + "\t".join(gain(label, direction, d) for direction in
                                                   ("fwd", "bwd") for d in (64, 128)) + "\n")
    rel = os.path.relpath(dat, out_dir)
    series = ["forward, d = 64", "forward, d = 128", "backward, d = 64", "backward, d = 128"]
    plotted = [f"'{rel}' using {k + 2}:xtic(1) title '{t}' lc rgb '{COLORS[k]}'"
               for k, t in enumerate(series)]
    return histogram_script(
        out, "Stage 09, what each technique buys: TFLOP/s gain over the stage with it switched "
        "off\\n{/*0.8 mean of N = 4096 and 16384, causal and not, fp16 (H = 2048/d, B = "
        f"16384/N), commands {', '.join(used)}; {stamp(rows)}}}",
        "set ylabel 'gain (%)'\nset grid ytics\n", plotted)


# The package's host time per call (scripts/call_overhead.py): each small call, the package as
# it is (the first `package` in the file) through SDPA's call and, where that run has it,
# FlashAttention's (flash_attn_func, or flash_attn_with_kvcache for decode), beside SDPA's
# backends measured in the same process (flash and cuDNN; efficient and math where that run
# has them). Older runs stay in the file, unplotted: a host-bound call's time moves from run
# to run, SDPA's as much as the package's, so only one run's bars compare.
def call_overhead(result_dir, out_dir):
    rows = attn.read_rows(os.path.join(result_dir, "call_overhead.tsv"))
    if not rows:
        return None
    now = rows[0]["package"]
    measured = {r["impl"] for r in rows if r["package"] == now}
    fa_call = ("fs_flash_attn", "fs_kvcache")
    # (the impls a bar takes its value from, the first one a case has; package; title)
    # The build's label goes in the title: in the key it would squeeze the bars.
    bars = [(("flash_stages",), now, "flash_stages")]
    if measured & set(fa_call):
        bars[0] = (("flash_stages",), now, "flash_stages, SDPA call")
        bars.append((fa_call, now, "flash_stages, FlashAttention call"))
    bars += [((impl,), now, impl.replace("sdpa_", "SDPA ")) for impl in
             ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math") if impl in measured]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    value = {(r["case"], r["impl"], r["package"]): r["wall_us"] for r in rows}

    def bar_value(case, impls, package):
        return next((value[(case, i, package)] for i in impls if (case, i, package) in value),
                    "NaN")
    out = os.path.join(out_dir, "call_overhead.png")
    dat = os.path.join(fresh_data_dir(out), "call_overhead.dat")
    def label(case):  # "decode B=8 H=32 Hkv=8 Nq=1 Nkv=4096 d=128" -> "decode B=8 4k keys"
        kind, *sizes = case.split()
        n = dict(x.split("=") for x in sizes)
        if kind == "decode":
            return f"decode B={n['B']} {int(n['Nkv']) // 1024}k keys"
        return f"{kind} H={n['H']} N={n['Nq']} d={n['d']}"
    with open(dat, "w") as f:
        for case in cases:
            f.write(f"\"{label(case)}\"\t" + "\t".join(bar_value(case, impls, p)
                                                 for impls, p, _ in bars) + "\n")
    rel = os.path.relpath(dat, out_dir)
    plotted = [f"'{rel}' using {k + 2}:xtic(1) title '{name}' lc rgb '{COLORS[k]}'"
               for k, (_, _, name) in enumerate(bars)]
    return histogram_script(
        out, "Wall time per call, back to back (fp16; causal but decode; B = 1 unless given)"
        f"\\n{{/*0.8 {stamp(rows)}; the package: {now}}}",
        "set ylabel 'wall time per call (us)'\nset grid ytics\nset logscale y\n"
        "set yrange [10:*]\n", plotted)


# Stages 13 and 14 beside FlexAttention with the same masks and softcap, compiled, and beside 09's
# dense causal runs of as many tokens, its yardstick (scripts/flex_bench.py, one process):
# TFLOP/s of the visible (query, key) pairs, each case forward and backward.
MASK_BARS = [("13_window_softcap_varlen", "stage 13"), ("flex_attention", "FlexAttention"),
             ("09_swizzle_pipeline", "09, dense causal, as many tokens"),
             ("14_hopper_window", "stage 14 (Hopper: the window)")]
CASES = ["window", "softcap", "varlen"]


def masks(result_dir, out_dir):
    rows = attn.read_rows(os.path.join(result_dir, "13_window_softcap_varlen-flex.tsv"))
    if not rows:
        return None

    def case(r):
        return next((name for name, col in (("window", "window"), ("softcap", "softcap"),
                                            ("varlen", "seqlens")) if r[col] != "-"), None)
    # 09's dense rows of as many tokens as each case (B = 16384 / N); its rows on each packed
    # sequence alone, and 12's dense rows (14's yardstick), are for flex_bench's table only.
    dense = {(r["direction"], r["Nq"], r["d"]): r["tflops"] for r in rows
             if r["stage"] == MASK_BARS[2][0] and int(r["B"]) * int(r["Nq"]) == 16384}
    value, points = {}, []
    for r in rows:
        if r["stage"] not in (MASK_BARS[0][0], MASK_BARS[1][0], MASK_BARS[3][0]):
            continue
        point = (int(r["d"]), r["direction"] == "bwd", CASES.index(case(r)), int(r["Nq"]))
        value[(r["stage"],) + point] = r["tflops"]
        value[(MASK_BARS[2][0],) + point] = dense.get((r["direction"], r["Nq"], r["d"]), "NaN")
        if point not in points:
            points.append(point)
    out = os.path.join(out_dir, "13_masks.png")
    dat = os.path.join(fresh_data_dir(out), "masks.dat")
    with open(dat, "w") as f:
        for point in sorted(points):
            d, bwd, k, n = point
            label = f"{CASES[k]} N={n // 1024}k d={d} {'bwd' if bwd else 'fwd'}"
            f.write(f"\"{label}\"\t" + "\t".join(
                str(value.get((stage,) + point, "NaN")) for stage, _ in MASK_BARS) + "\n")
    rel = os.path.relpath(dat, out_dir)
    plotted = [f"'{rel}' using {k + 2}:xtic(1) title '{name}' lc rgb '{COLORS[k]}'"
               for k, (_, name) in enumerate(MASK_BARS)]
    return histogram_script(
        out, "Stages 13 and 14 beside FlexAttention: window 4096, softcap 50, varlen (fp16, causal)"
        f"\\n{{/*0.8 {stamp(rows)}; TFLOP/s of the visible pairs}}",
        "set ylabel 'TFLOP/s'\nset grid ytics\nset yrange [0:*]\n", plotted)


def draw(result_dirs, out_dir, stage=None, cpu_plots=True):
    """Every plot, or with `stage` the per-stage form: that stage beside its predecessor."""
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d in result_dirs:
        rows += attn.read_rows(os.path.join(d, "cpu.tsv"), os.path.join(d, "gpu.tsv"))
    rows = attn.latest(rows)  # PyTorch's rows were measured again beside later stages
    only = {stage, predecessor(stage)} - {None} if stage else None
    prefix = f"{stage}_" if stage else ""

    def keep(name):
        return not only or name.split(" ")[0] in only

    rows_all = rows
    rows = [r for r in rows if keep(r["stage"]) or r["stage"].startswith("sdpa_")]
    scripts = [ladder(rows_all, out_dir, prefix, only)]
    cpu = [r for r in rows if r["cuda"] == "-" and r["direction"] == "fwd"] if cpu_plots else []
    if cpu and (not only or any(keep(r["stage"]) for r in cpu)):
        st = stamp(cpu)
        groups = by_stage(cpu, H="1", B="1", d="64")
        scripts.append(gnuplot_file(
            os.path.join(out_dir, f"{prefix}cpu_time.png"), "CPU stages: forward time (1 head, d = 64)",
            "N (sequence length)", "median time (ms)",
            [(s, [(int(r["Nq"]), float(r["ms"])) for r in g]) for s, g in groups.items()], st))
        scripts.append(gnuplot_file(
            os.path.join(out_dir, f"{prefix}cpu_workspace.png"),
            "CPU stages: workspace (1 head, d = 64)", "N (sequence length)",
            "workspace (bytes)",
            [(s, [(int(r["Nq"]), int(r["workspace_bytes"])) for r in g])
             for s, g in groups.items()], st))
    gpu = [r for r in rows if r["cuda"] != "-"]
    if only and not any(keep(r["stage"]) for r in gpu):
        gpu = []
    for direction in ("fwd", "bwd"):
        for d in ("64", "128"):
            for causal in ("0", "1"):
                sel = [r for r in gpu if r["direction"] == direction and r["d"] == d
                       and r["causal"] == causal and int(r["B"]) * int(r["Nq"]) == 16384]
                if not sel:
                    continue
                groups, devices = {}, {r["device"] for r in sel}
                for r in sel:
                    sdpa = r["stage"].startswith("sdpa_")
                    key = r["stage"] + ("" if r["dtype"] == "fp32" and not sdpa
                                        else f" {r['dtype']}")
                    if sdpa and (
                            r["stage"] == "sdpa_math" or r["dtype"] == "bf16"):
                        continue  # fewer lines: math is the slow path, bf16 ~ fp16
                    groups.setdefault(with_device(key, r, devices), []).append(r)
                name = f"{prefix}gpu_{direction}_d{d}{'_causal' if causal == '1' else ''}.png"
                scripts.append(gnuplot_file(
                    os.path.join(out_dir, name),
                    f"GPU {'forward' if direction == 'fwd' else 'backward'}, d = {d}, "
                    f"{'causal' if causal == '1' else 'non-causal'} (H = 2048/d, B = 16384/N)",
                    "N (sequence length)", "TFLOP/s",
                    [(s, [(int(r["Nq"]), float(r["tflops"])) for r in g])
                     for s, g in sorted(groups.items())], stamp(sel), logy=True,
                    dashed={s for s in groups if s.startswith("sdpa_")}))
        sel = [r for r in gpu if r["direction"] == "fwd" and r["d"] == "64" and r["causal"] == "0"
               and r["dtype"] in ("fp32", "fp16") and r["B"] == "1" and r["H"] == "32"
               and not r["stage"].startswith("sdpa_")]
        without_backward = attn.forward_only(gpu)
        sel = [r for r in sel if r in without_backward]
        if direction == "fwd" and sel:
            groups = by_stage(sel)
            scripts.append(gnuplot_file(
                os.path.join(out_dir, f"{prefix}gpu_memory.png"),
                "GPU device memory, forward, d = 64 (B = 1, H = 32)",
                "N (sequence length)", "device bytes (inputs, outputs, workspace)",
                [(s, [(int(r["Nq"]), int(r["device_bytes"])) for r in g])
                 for s, g in sorted(groups.items())], stamp(sel)))
    if not only:
        scripts += [hopper_steps(d, out_dir) for d in result_dirs]
        scripts += [backward_steps(d, out_dir) for d in result_dirs]
        scripts += [swizzle_switches(d, out_dir) for d in result_dirs]
        scripts += [call_overhead(d, out_dir) for d in result_dirs]
        scripts += [masks(d, out_dir) for d in result_dirs]
    scripts = [s for s in scripts if s]
    if not shutil.which("gnuplot"):
        print(f"plots: gnuplot not found; data and scripts written to {out_dir}. Install it "
              f"(Debian/Ubuntu: sudo apt-get install gnuplot-nox) and run the plots again.")
        return scripts
    for gp in scripts:
        subprocess.run(["gnuplot", os.path.basename(gp)], cwd=os.path.dirname(gp), check=True)
        print(f"plots: wrote {os.path.splitext(gp)[0]}.png")
    return scripts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", nargs="+", required=True, help="folders of .tsv rows")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", help="the per-stage form: this stage beside its predecessor")
    a = ap.parse_args()
    missing = [r for r in a.results if not os.path.isdir(r)]
    if missing:
        ap.error(f"--results: no folder {', '.join(missing)}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out: {a.out} is not a folder")
    if a.stage and a.stage not in attn.STAGES + attn.BASELINES:
        ap.error(f"--stage: no stage named {a.stage}")
    draw(a.results, a.out, a.stage)


if __name__ == "__main__":
    sys.exit(main())
