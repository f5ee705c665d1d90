#!/usr/bin/env python3
"""GRADCOMM_TIMELINE end to end: gradcomm-train at 2 ranks with overlap writes one Chrome trace
per rank that parses as JSON; on every thread the spans nest (any two are disjoint or one holds
the other); every submitted request was queued and run (a "queued" span per "submit"), and the
all-reduces name their algorithm and bytes; the trainer's forward, backward and optimizer spans
are there, one per step; bench/plot_timeline.py draws it.

usage: timeline_test.py MPIEXEC GRADCOMM_TRAIN PLOT_TIMELINE
"""

import json
import os
import subprocess
import sys
import tempfile

STEPS = 6


def check_nesting(spans, failures, label):
    by_thread = {}
    for s in spans:
        by_thread.setdefault(s["tid"], []).append(s)
    for tid, items in by_thread.items():
        items.sort(key=lambda s: (s["ts"], -s["dur"]))
        stack = []
        for s in items:
            start, end = s["ts"], s["ts"] + s["dur"]
            while stack and stack[-1][1] <= start + 1e-3:
                stack.pop()
            if stack and end > stack[-1][1] + 1e-3:
                failures.append("%s: thread %d: %s [%.3f, %.3f] overlaps %s without nesting"
                                % (label, tid, s["name"], start, end, stack[-1][2], ))
                return
            stack.append((start, end, s["name"]))


def main():
    mpiexec, train, plot = sys.argv[1:4]
    failures = []
    with tempfile.TemporaryDirectory() as work:
        base = os.path.join(work, "trace.json")
        env = dict(os.environ, GRADCOMM_TIMELINE=base)
        cmd = [mpiexec, "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca",
               "mpi_yield_when_idle", "1", train, "--model", "mlp", "--hidden", "256,256",
               "--features", "64", "--samples", "2048", "--batch", "256", "--steps", str(STEPS),
               "--fusion-threshold", "65536", "--algorithm", "ring", "--overlap", "on"]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            sys.exit("gradcomm-train failed:\n" + run.stdout + run.stderr)
        for rank in range(2):
            path = os.path.join(work, "trace.rank%d.json" % rank)
            label = "rank %d" % rank
            try:
                with open(path) as f:
                    events = json.load(f)
            except (OSError, ValueError) as e:
                failures.append("%s: %s does not parse: %s" % (label, path, e))
                continue
            spans = [e for e in events if e.get("ph") == "X"]
            names = [e["name"] for e in spans]
            submits = [e for e in events if e.get("ph") == "i" and e["name"] == "submit"]
            queued = [e for e in events if e.get("ph") == "b" and e["name"] == "queued"]
            ends = [e for e in events if e.get("ph") == "e" and e["name"] == "queued"]
            if sorted(e["id"] for e in queued) != sorted(e["id"] for e in ends):
                failures.append(label + ": queued spans not closed")
            reduces = [e for e in spans if e["name"] == "allreduce"]
            if not submits:
                failures.append(label + ": no request was submitted")
            if len(queued) != len(submits):
                failures.append("%s: %d submitted, %d queued" % (label, len(submits), len(queued)))
            if sorted(e["args"]["call"] for e in queued) != sorted(e["args"]["call"] for e in submits):
                failures.append(label + ": the queued calls are not the submitted ones")
            if len(reduces) < len(submits):
                failures.append("%s: %d all-reduces for %d requests" % (label, len(reduces), len(submits)))
            engine = {e["tid"] for e in events
                      if e.get("ph") == "M" and e["args"]["name"] == "progress engine"}
            for e in reduces:
                on_engine = e["tid"] in engine
                if (on_engine and e["args"].get("algorithm") != "ring") or \
                        not e["args"].get("algorithm") or e["args"].get("bytes", 0) <= 0:
                    failures.append(label + ": all-reduce without its algorithm and bytes: %r" % e)
                    break
            for name in ("forward", "backward", "optimizer step"):
                if names.count(name) != STEPS:
                    failures.append("%s: %d '%s' spans for %d steps" % (label, names.count(name), name, STEPS))
            if names.count("pack") == 0 or names.count("unpack") != STEPS:
                failures.append(label + ": pack/unpack spans missing")
            threads = {e["args"]["name"] for e in events if e.get("ph") == "M"}
            if not {"caller", "progress engine"} <= threads:
                failures.append(label + ": threads not named: %r" % threads)
            check_nesting(spans, failures, label)
        png = os.path.join(work, "trace.png")
        plotted = subprocess.run([sys.executable, plot, os.path.join(work, "trace.rank0.json"),
                                  "--out", png], capture_output=True, text=True, timeout=120)
        if plotted.returncode != 0 or not os.path.getsize(png) > 1000:
            failures.append("plot_timeline.py failed: " + plotted.stdout + plotted.stderr)
    if failures:
        print("\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print("timeline: all checks passed")


if __name__ == "__main__":
    main()
