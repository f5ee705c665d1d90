"""The shortest overlapped step a timeline of blocking steps allows, given what the network's
own CPU work costs compute.

    overlap_floor.py TIMELINE_DIR SLOWDOWN [SLOWDOWN ...]
    overlap_floor.py --link MB_PER_S TIMELINE_DIR

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

--link: for timelines without forward and backward spans (gradcomm.torch's reducer, whose
packs still mark when each bucket was ready). Each bucket takes bytes / MB_PER_S on the link
(2 ranks: every byte crosses each direction once), one at a time, from when it was ready. It
prints, per rank, the median over steps of the time from the last bucket's readiness (about the
end of backward) to the end of the link's work: the least communication any library leaves
exposed with those buckets, at no CPU cost.
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


def link_floor(directory, rate):
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        events = load(path)
        steps_ready, current = [], None
        for e in events:
            if e["name"] != "pack":
                continue
            bucket = e["args"]["bucket"]
            if bucket == 0 and (current is None or max(current) > 0):
                current = {}
                steps_ready.append(current)
            end = e["ts"] + e["dur"]
            size = e["args"]["bytes"]
            ready, total = current.get(bucket, (0.0, 0))
            current[bucket] = (max(ready, end), total + size)
        exposed = []
        for step in steps_ready[1:]:  # the first step makes connections
            link_free = 0.0
            for bucket in sorted(step):
                ready, size = step[bucket]
                link_free = max(link_free, ready) + size / rate  # bytes / (MB/s) = us
            exposed.append((link_free - step[max(step)][0]) / 1e3)
        print("%s: %d steps, buckets %s MB; least exposed after the last bucket: median %.0f ms "
              "(%.0f-%.0f)" % (os.path.basename(path), len(exposed),
                               "/".join("%.1f" % (steps_ready[-1][b][1] / 1e6)
                                        for b in sorted(steps_ready[-1])),
                               statistics.median(exposed), min(exposed), max(exposed)))


path_name = ""
if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--link":
        link_floor(sys.argv[3], float(sys.argv[2]))
        sys.exit(0)
    main()
