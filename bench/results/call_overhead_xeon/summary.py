"""Medians (ranges) of run.sh's output: shm's p50 per size, OLD and NEW, and NEW/OLD per round."""
import collections
import statistics
import sys

times = collections.defaultdict(list)  # (mode, which, bytes) -> [p50 per round]
mode = which = None
for line in open(sys.argv[1]):
    f = line.split()
    if line.startswith("==="):
        which, mode = f[4], " ".join(f[5:])
    elif line.startswith("WRONG"):
        print(line.strip())
    elif len(f) == 3 and which:
        times[(mode, which, int(f[0]))].append(float(f[1]))
for m in dict.fromkeys(k[0] for k in times):
    print(f"== {m}")
    for b in sorted({k[2] for k in times if k[0] == m}):
        old, new = times[(m, "OLD", b)], times[(m, "NEW", b)]
        r = [n / o for o, n in zip(old, new)]
        print(f"{b:>9} old {statistics.median(old):8.2f} new {statistics.median(new):8.2f}"
              f"  new/old {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
