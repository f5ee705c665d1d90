#!/usr/bin/env python3
"""Medians and ranges of run.sh's or old_new.sh's output, per timing, size and build.

usage: summary.py run.txt"""
import re
import statistics as st
import sys
from collections import defaultdict

times = defaultdict(list)
labels = []
key = None
for line in open(sys.argv[1]):
    if line.startswith("==="):
        np_, which, mode = re.match(r"=== np(\d+) round \d+ (\S+) ?(.*)", line.strip()).groups()
        key = (np_, mode.strip() or "private b2b", which)
        if which not in labels:
            labels.append(which)
        continue
    fields = line.split()
    if len(fields) == 3 and key:
        times[key + (int(fields[0]),)].append(float(fields[1]))
for np_, mode in sorted({(k[0], k[1]) for k in times}):
    print(f"np{np_} {mode}")
    for size in sorted({k[3] for k in times if k[:2] == (np_, mode)}):
        row = [f"{w} {st.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
               for w in labels if (v := times.get((np_, mode, w, size)))]
        print(f"  {size:>6}  " + "  ".join(row))
