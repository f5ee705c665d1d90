"""The shortest overlapped step a timeline of blocking steps allows, given what the network's
own CPU work costs compute.

    overlap_floor.py TIMELINE_DIR SLOWDOWN [SLOWDOWN ...]

TIMELINE_DIR holds the GRADCOMM_TIMELINE files (t.rank*.json or any *.json) of a
`gradcomm-train --overlap off` run: backward packs each bucket as its gradients come, and the
blocking all-reduces after backward show what each bucket takes on the link with nothing else
running. For every step after the first, on every rank, this replays the step as an ideal
overlapped one would run:
  - forward as measured;
  - backward's work as measured, bucket k ready when backward reaches the point where the off
    run packed its last tensor;
  - the link carries one bucket at a time, in order, each for its measured blocking time;
  - while the link carries data, compute runs SLOWDOWN times slower (bench/network_tax.sh
    measures that factor with plain sockets, no MPI library);
  - after backward and the last bucket, unpack and the optimizer step as measured.
It prints, per SLOWDOWN, the median over steps of the ideal step and of the measured off step,
and their ratio: the best on/off ratio any library could reach on that machine and link.
"""

import glob
import json
import os
import statistics
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])


def steps(events):
    """Per step: forward, backward, bucket ready offsets, blocking all-reduce times, tail, step."""
    forwards = [e for e in events if e["name"] == "forward"]
    out = []
    for k in range(1, len(forwards) - 1):  # the first step makes connections; the last has no end
        t0, t1 = forwards[k]["ts"], forwards[k + 1]["ts"]
        inside = [e for e in events if t0 <= e["ts"] < t1]
        backward = next(e for e in inside if e["name"] == "backward")
        b0 = backward["ts"]
        ready = {}
        for e in inside:
            if e["name"] == "pack":
                bucket = e["args"]["bucket"]
                ready[bucket] = max(ready.get(bucket, 0.0), e["ts"] + e["dur"] - b0)
        reduces = [e["dur"] for e in inside
                   if e["name"] == "allreduce" and e["args"].get("bytes", 0) > 4096]
        if len(reduces) != len(ready):
            raise SystemExit("%s: %d buckets packed but %d all-reduces" % (path_name, len(ready),
                                                                           len(reduces)))
        tail = sum(e["dur"] for e in inside if e["name"] in ("unpack", "optimizer step"))
        out.append({"forward": forwards[k]["dur"], "backward": backward["dur"],
                    "ready": [ready[b] for b in sorted(ready)], "reduce": reduces, "tail": tail,
                    "step": t1 - t0})
    return out


def ideal(step, slowdown):
    """Ideal overlapped step (us): compute at 1/slowdown speed while the link is busy."""
    work_done, now, link_free = 0.0, 0.0, 0.0
    pending = list(zip(step["ready"], step["reduce"]))
    busy = []  # (start, end) of each transfer
    while pending:
        ready_work, duration = pending.pop(0)
        # Advance compute to the bucket's ready point, slowed where the link is busy.
        while work_done < min(ready_work, step["backward"]):
            speed = 1.0 / slowdown if now < link_free else 1.0
            until = link_free if now < link_free else float("inf")
            need = (min(ready_work, step["backward"]) - work_done) / speed
            dt = min(need, until - now)
            now += dt
            work_done += dt * speed
        start = max(now, link_free)
        link_free = start + duration
        busy.append((start, link_free))
    while work_done < step["backward"]:
        speed = 1.0 / slowdown if now < link_free else 1.0
        until = link_free if now < link_free else float("inf")
        dt = min((step["backward"] - work_done) / speed, until - now)
        now += dt
        work_done += dt * speed
    return step["forward"] + max(now, link_free) + step["tail"]


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    global path_name
    paths = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))
    all_steps = []
    for path in paths:
        path_name = path
        all_steps += steps(load(path))
    measured = statistics.median(s["step"] for s in all_steps) / 1e3
    for slowdown in map(float, sys.argv[2:]):
        best = statistics.median(ideal(s, slowdown) for s in all_steps) / 1e3
        print("slowdown %.2f: ideal overlapped step %.0f ms, measured off step %.0f ms, "
              "ratio %.2f" % (slowdown, best, measured, best / measured))


path_name = ""
if __name__ == "__main__":
    main()
