#!/usr/bin/env python3
"""The launches of this folder, per cell: gradcomm's and Intel MPI's times (us, the peers
tables' columns: p50_us back to back, cycle_us in the cycle) and their ratio, launch by launch."""
import glob
import os
import statistics

rows = {}
for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch*.txt"))):
    mode = header = None
    for line in open(path):
        if line.startswith("#") and "algorithm" in line:
            header = line[1:].split()
        elif line.startswith("--"):
            mode = "cycle" if "cycle" in line else "b2b"
        elif line.strip() and not line.startswith(("#", "==")):
            f = line.split()
            col = header.index("cycle_us" if mode == "cycle" else "p50_us")
            rows.setdefault((mode, int(f[0])), {}).setdefault(f[4], []).append(float(f[col]))
for (mode, size), v in sorted(rows.items()):
    ratios = [a / m for a, m in zip(v["auto"], v["mpi"])]
    print(f"{mode:5} {size:>9} B  gradcomm us {[round(x, 1) for x in v['auto']]}")
    print(f"{'':18} Intel MPI us {[round(x, 1) for x in v['mpi']]}")
    print(f"{'':18} ratio {[round(x, 2) for x in ratios]}  median {statistics.median(ratios):.2f}"
          f" ({min(ratios):.2f}-{max(ratios):.2f})")
