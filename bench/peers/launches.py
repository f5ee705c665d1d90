#!/usr/bin/env python3
"""Repeated launches of bench/peers/run.sh for one MPI peer, cell by cell.

usage: python3 bench/peers/launches.py DIR PEER   (DIR/launch*.txt: each a run.sh output
file, DIR/PEER.txt of one launch; PEER names the peer in the output)

Per timing and size: gradcomm's and the peer's times in every launch (us; the peers tables'
columns: p50_us back to back, cycle_us in the cycle), their ratio launch by launch, and its
median and range.
"""
import glob
import os
import statistics
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    folder, peer = sys.argv[1], sys.argv[2]
    rows = {}
    for path in sorted(glob.glob(os.path.join(folder, "launch*.txt"))):
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
        print(f"{'':18} {peer} us {[round(x, 1) for x in v['mpi']]}")
        print(f"{'':18} ratio {[round(x, 2) for x in ratios]}  median "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
