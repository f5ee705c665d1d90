#!/usr/bin/env python3
"""Summarises series of bench/shm_report.sh runs, as docs/results/shm.md's tables show them.

usage: /usr/bin/python3 bench/shm_series.py DIR   (DIR/s1, DIR/s2, ... each one series' CSVs)

For each rank count, buffer kind (registered in place, private out of place, private in place),
timing and size: the median of shm's vs_mpi over the series,
its range, how many series met the issue's target (registered in place 4x and private 2x on
2 ranks, 2x on more), the median busbw and of_bound, and the machine state each series saw
(f: far, n: near). Then the 8-byte latencies of every series.
"""
import csv
import glob
import os
import statistics
import sys


def rows(path):
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    series = sorted(d for d in glob.glob(sys.argv[1] + "/s*") if os.path.isdir(d))
    for ranks in (2, 4):
        for buffers in ("registered", "private", "private_inplace"):
            target = (4.0 if buffers == "registered" else 2.0) if ranks == 2 else 2.0
            for timing in ("b2b", "cycle"):
                for mib in (1, 4, 16, 64):
                    got = []
                    for s in series:
                        for r in rows(f"{s}/shm_np{ranks}_{buffers}_{timing}.csv"):
                            if r["algorithm"] == "shm" and int(r["size"]) == mib << 20:
                                got.append(r)
                    if not got:
                        continue
                    x = [float(r["vs_mpi"]) for r in got]
                    met = sum(v >= target for v in x)
                    print(f"np{ranks} {buffers:10} {timing:5} {mib:3} MiB: "
                          f"x{statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f}; "
                          f"{met}/{len(x)} >= {target:g}) busbw "
                          f"{statistics.median(float(r['busbw']) for r in got):.1f} GB/s "
                          f"of_bound {statistics.median(float(r['of_bound']) for r in got):.2f} "
                          f"({min(float(r['of_bound']) for r in got):.2f}-"
                          f"{max(float(r['of_bound']) for r in got):.2f}) "
                          f"states {''.join(r['state'][:1] for r in got)}")
    for ranks in (2, 4):
        for s in series:
            got = rows(f"{s}/shm_np{ranks}_8B.csv")
            if got:
                print(f"np{ranks} 8 B {s.rsplit('/', 1)[-1]}: " + "  ".join(
                    f"{r['algorithm']} {float(r['p50_us']):.2f} us" for r in got))


if __name__ == "__main__":
    main()
