"""Plots busbw against size from bench/shm_report.sh's CSV files: shm, ring, MPI_Allreduce and
the memory-traffic bound (busbw / of_bound), one panel per rank count."""
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
for ax, np_ in zip(axes, (2, 4)):
    for name, suffix, style in (("", "", "-"), (" registered", "_registered", "--")):
        path = out / f"shm_np{np_}{suffix}.csv"
        if not path.exists():
            continue
        rows = list(csv.DictReader(path.open()))
        for algorithm in ("shm", "ring", "mpi"):
            pts = [(int(r["size"]), float(r["busbw"])) for r in rows if r["algorithm"] == algorithm]
            if suffix and algorithm == "ring":
                continue
            label = ("MPI_Allreduce" if algorithm == "mpi" else algorithm) + name
            ax.plot(*zip(*pts), style, marker="o", ms=3, label=label)
        if not suffix:
            bound = [float(r["busbw"]) / float(r["of_bound"]) for r in rows if float(r["of_bound"]) > 0]
            if bound:
                ax.axhline(sum(bound) / len(bound), color="gray", ls=":", label="bound (STREAM, 2nS)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_title(f"{np_} ranks, float32 sum")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
axes[0].set_ylabel("busbw (GB/s)")
fig.tight_layout()
fig.savefig(out / "shm_busbw.png", dpi=110)
print(f"wrote {out / 'shm_busbw.png'}")
