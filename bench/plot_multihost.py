"""Plots busbw against size from bench/multihost.sh's CSV files, one panel per layout (measured:
solid; auto's cost model for ring and hierarchical: dashed), and prints a markdown table of
median times with ring / hierarchical and auto / best-fixed ratios.
usage: plot_multihost.py OUT_DIR RATE LAYOUT..."""
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1])
rate = sys.argv[2]
layouts = sys.argv[3:]
FIXED = ("hierarchical", "ring", "halving_doubling")
COLORS = {"hierarchical": "C0", "ring": "C1", "halving_doubling": "C2", "auto": "C3", "mpi": "C7"}


def load(layout):
    rows = list(csv.DictReader((out / f"{layout}_{rate}.csv").open()))
    table = {}
    for r in rows:
        table.setdefault(int(r["size"]), {})[r["algorithm"]] = r
    return table, int(rows[0]["ranks"])


def ms(us):
    return f"{float(us) / 1e3:.2f}"


fig, axes = plt.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 4.2), sharey=True,
                         squeeze=False)
lines = []
for ax, layout in zip(axes[0], layouts):
    table, n = load(layout)
    sizes = sorted(table)
    factor = 2 * (n - 1) / n
    for algorithm, color in COLORS.items():
        pts = [(s, float(table[s][algorithm]["busbw"])) for s in sizes if algorithm in table[s]]
        label = "MPI_Allreduce" if algorithm == "mpi" else algorithm
        ax.plot(*zip(*pts), "-", color=color, marker="o", ms=3, label=label)
    for algorithm in ("hierarchical", "ring"):
        pts = [(s, s / float(table[s][algorithm]["model_us"]) / 1e3 * factor) for s in sizes
               if float(table[s][algorithm]["model_us"]) > 0]
        ax.plot(*zip(*pts), "--", color=COLORS[algorithm], lw=1, label=f"{algorithm} (model)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_title(f"{layout} ({n} ranks), links {rate}, float32 sum")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)

    lines.append(f"\n{layout} ({n} ranks), links shaped to {rate}: median ms per call "
                 "(model: auto's cost model, ms)\n")
    lines.append("| size | hierarchical | ring | halving_doubling | auto (pick) | MPI_Allreduce "
                 "| ring / hierarchical | auto / best | model hier. | model ring |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        row = table[s]
        best = min(float(row[a]["p50_us"]) for a in FIXED)
        label = f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
        lines.append(
            f"| {label} | {ms(row['hierarchical']['p50_us'])} | {ms(row['ring']['p50_us'])} "
            f"| {ms(row['halving_doubling']['p50_us'])} "
            f"| {ms(row['auto']['p50_us'])} ({row['auto']['picks'].replace('halving_doubling', 'hd')}) "
            f"| {ms(row['mpi']['p50_us'])} "
            f"| {float(row['ring']['p50_us']) / float(row['hierarchical']['p50_us']):.2f}× "
            f"| {float(row['auto']['p50_us']) / best:.2f}× "
            f"| {ms(row['hierarchical']['model_us'])} | {ms(row['ring']['model_us'])} |")
axes[0][0].set_ylabel("busbw (GB/s)")
fig.tight_layout()
fig.savefig(out / f"multihost_busbw_{rate}.png", dpi=110)
print("\n".join(lines))
print(f"\nwrote {out / f'multihost_busbw_{rate}.png'}")
