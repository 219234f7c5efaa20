#!/usr/bin/env python3
"""gnuplot plots (PNG) from result rows, each stamped with the device, CUDA version and date.

Where gnuplot is missing the data and scripts are still written, and one line says how to
install it."""
import argparse
import glob
import os
import shutil
import subprocess
import sys

import attn

COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
          "#666666", "#1f78b4", "#b2182b"]


def human_bytes(n):
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def stamp(rows):
    devs = sorted({(r["device"], r["cuda"], r["date"]) for r in rows})
    return "; ".join(f"{d}, CUDA {c}, {t}" if c != "-" else f"{d}, {t}" for d, c, t in devs)


def gnuplot_file(path, title, xlabel, ylabel, series, stamp_text, logx=True, logy=True,
                 lines=()):
    """series: [(title, [(x, y), ...])]; lines: [(title, y)] horizontal reference lines."""
    data_dir = os.path.splitext(path)[0] + "_data"
    os.makedirs(data_dir, exist_ok=True)
    plots = []
    for k, (name, pts) in enumerate(series):
        if not pts:
            continue
        dat = os.path.join(data_dir, f"s{k}.dat")
        with open(dat, "w") as f:
            for x, y in sorted(pts):
                f.write(f"{x}\t{y}\n")
        rel = os.path.relpath(dat, os.path.dirname(path))
        plots.append(f"'{rel}' using 1:2 with linespoints lw 2 pt 7 lc rgb '{COLORS[k % 10]}' "
                     f"title '{name}' noenhanced")
    for k, (name, y) in enumerate(lines):
        plots.append(f"{y} with lines dt 2 lw 2 lc rgb '{COLORS[(k + 5) % 10]}' title '{name}' noenhanced")
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
    out = {}
    for r in rows:
        if all(str(r.get(k)) == str(v) for k, v in where.items()):
            out.setdefault(r["stage"], []).append(r)
    return out


def draw(result_dirs, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for d in result_dirs:
        rows += attn.read_rows(*sorted(glob.glob(os.path.join(d, "*.tsv"))))
    scripts = []
    cpu = [r for r in rows if r["cuda"] == "-" and r["direction"] == "fwd"]
    if cpu:
        st = stamp(cpu)
        groups = by_stage(cpu, H="1", B="1", d="64")
        scripts.append(gnuplot_file(
            os.path.join(out_dir, "cpu_time.png"), "CPU stages: forward time (1 head, d = 64)",
            "N (sequence length)", "median time (ms)",
            [(s, [(int(r["Nq"]), float(r["ms"])) for r in g]) for s, g in groups.items()], st))
        scripts.append(gnuplot_file(
            os.path.join(out_dir, "cpu_workspace.png"),
            "CPU stages: workspace (1 head, d = 64)", "N (sequence length)",
            "workspace (bytes)",
            [(s, [(int(r["Nq"]), int(r["workspace_bytes"])) for r in g])
             for s, g in groups.items()], st))
    gpu = [r for r in rows if r["cuda"] != "-"]
    for direction in ("fwd", "bwd"):
        for d in ("64", "128"):
            for causal in ("0", "1"):
                sel = [r for r in gpu if r["direction"] == direction and r["d"] == d
                       and r["causal"] == causal and int(r["B"]) * int(r["Nq"]) == 16384]
                if not sel:
                    continue
                groups = {}
                for r in sel:
                    key = r["stage"] + ("" if r["dtype"] == "fp32" else f" {r['dtype']}")
                    groups.setdefault(key, []).append(r)
                name = f"gpu_{direction}_d{d}{'_causal' if causal == '1' else ''}.png"
                scripts.append(gnuplot_file(
                    os.path.join(out_dir, name),
                    f"GPU {'forward' if direction == 'fwd' else 'backward'}, d = {d}, "
                    f"{'causal' if causal == '1' else 'non-causal'} (H = 2048/d, B = 16384/N)",
                    "N (sequence length)", "TFLOP/s",
                    [(s, [(int(r["Nq"]), float(r["tflops"])) for r in g])
                     for s, g in sorted(groups.items())], stamp(sel), logy=True))
        sel = [r for r in gpu if r["direction"] == "fwd" and r["d"] == "64" and r["causal"] == "0"
               and r["dtype"] in ("fp32", "fp16") and r["B"] == "1" and r["H"] == "32"]
        if direction == "fwd" and sel:
            groups = by_stage(sel)
            scripts.append(gnuplot_file(
                os.path.join(out_dir, "gpu_memory.png"),
                "GPU device memory, forward, d = 64 (B = 1, H = 32)",
                "N (sequence length)", "device bytes (inputs, outputs, workspace)",
                [(s, [(int(r["Nq"]), int(r["device_bytes"])) for r in g])
                 for s, g in sorted(groups.items())], stamp(sel)))
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
    a = ap.parse_args()
    draw(a.results, a.out)


if __name__ == "__main__":
    sys.exit(main())
