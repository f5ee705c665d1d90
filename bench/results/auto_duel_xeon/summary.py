#!/usr/bin/env python3
"""Per build and rank count: sizes within 1.1x of the best fixed algorithm, the median of
auto/best, and every miss (auto/best > 1.1, size, pick). usage: summary.py run.txt"""
import re
import statistics as st
import sys
from collections import defaultdict

rows = defaultdict(list)  # (np, build) -> [(bytes, auto/best, pick)]
key = None
for line in open(sys.argv[1]):
    m = re.match(r"=== np(\d+) round \d+ (\S+)", line)
    if m:
        key = m.groups()
        continue
    f = line.split()
    if key and len(f) >= 3 and f[0].isdigit():
        rows[key].append((int(f[0]), 1 / float(f[1]), f[2]))
for (np_, build), r in sorted(rows.items()):
    ratios = [x[1] for x in r]
    misses = [f"{x[1]:.2f} ({x[0]} B, {x[2]})" for x in r if x[1] > 1.1]
    print(f"np{np_} {build}: {sum(x <= 1.1 for x in ratios)} of {len(r)} within 1.1x, "
          f"median auto/best {st.median(ratios):.3f}; misses: {', '.join(misses) or 'none'}")
