"""The shortest overlapped step a timeline of blocking steps allows, given what the network's
own CPU work costs compute.

    overlap_floor.py TIMELINE_DIR SLOWDOWN [SLOWDOWN ...]
    overlap_floor.py --link MB_PER_S TIMELINE_DIR

TIMELINE_DIR holds the GRADCOMM_TIMELINE files (*.json, one per rank) of a
`gradcomm-train --overlap off` run: backward packs each bucket as its gradients come, and the
blocking all-reduces after backward show what each bucket takes on the link with nothing else
running (including any wait for the slower rank to arrive). For every step after the first, on
every rank, this replays the step as an ideal overlapped one would run:
  - forward as measured;
  - backward's work as measured, bucket k ready when backward reaches the point where the off
    run packed its last tensor;
  - the link carries one bucket at a time, in order, each for its measured blocking time;
  - while the link carries data, compute runs SLOWDOWN times slower (bench/network_tax.sh
    measures that factor with plain sockets, no MPI library);
  - after backward and the last bucket, unpack, the optimizer step and whatever else the off
    step spent outside forward, backward and the all-reduces, as measured.
A step lasts as long as its slower rank. It prints, per SLOWDOWN, the median over steps of the
ideal step and of the measured off step, and their ratio: the best on/off ratio any library
could reach on that machine and link.

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


def timeline_files(directory):
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))
    if not paths:
        raise SystemExit("overlap_floor.py: no timeline files (*.json) in %s" % directory)
    return paths


def is_bucket_reduce(e):
    return e["name"] == "allreduce" and e["args"].get("bytes", 0) > 4096


def steps(path):
    """Per step of one rank: forward, backward, bucket ready offsets, blocking all-reduce times,
    what else the step spent after backward, and the step's length (all in us)."""
    events = load(path)
    forwards = [e for e in events if e["name"] == "forward"]
    out = []
    for k in range(1, len(forwards) - 1):  # the first step makes connections; the last has no end
        t0, t1 = forwards[k]["ts"], forwards[k + 1]["ts"]
        inside = [e for e in events if t0 <= e["ts"] < t1]
        backward = next(e for e in inside if e["name"] == "backward")
        ready = {}
        for e in inside:
            if e["name"] == "pack":
                bucket = e["args"]["bucket"]
                ready[bucket] = max(ready.get(bucket, 0.0), e["ts"] + e["dur"] - backward["ts"])
        reduces = [e["dur"] for e in inside if is_bucket_reduce(e)]
        if len(reduces) != len(ready):
            raise SystemExit("%s: %d buckets packed but %d all-reduces in a step" %
                             (path, len(ready), len(reduces)))
        step = t1 - t0
        out.append({"forward": forwards[k]["dur"], "backward": backward["dur"],
                    "ready": [ready[b] for b in sorted(ready)], "reduce": reduces,
                    "rest": step - forwards[k]["dur"] - backward["dur"] - sum(reduces),
                    "step": step})
    return out


def ideal(step, slowdown):
    """Ideal overlapped step (us): compute at 1/slowdown speed while the link is busy."""
    state = {"now": 0.0, "work": 0.0, "link_free": 0.0}

    def compute_until(work):
        # Advances backward's work to `work`, slowed while the link is busy.
        while state["work"] < work:
            busy = state["now"] < state["link_free"]
            speed = 1.0 / slowdown if busy else 1.0
            dt = (work - state["work"]) / speed
            if busy:
                dt = min(dt, state["link_free"] - state["now"])
            state["now"] += dt
            state["work"] += dt * speed

    for ready, duration in zip(step["ready"], step["reduce"]):
        compute_until(min(ready, step["backward"]))
        state["link_free"] = max(state["now"], state["link_free"]) + duration
    compute_until(step["backward"])
    return step["forward"] + max(state["now"], state["link_free"]) + step["rest"]


def main(directory, slowdowns):
    per_rank = [steps(path) for path in timeline_files(directory)]
    count = min(len(s) for s in per_rank)
    measured = statistics.median(max(r[i]["step"] for r in per_rank) for i in range(count)) / 1e3
    for slowdown in slowdowns:
        best = statistics.median(max(ideal(r[i], slowdown) for r in per_rank)
                                 for i in range(count)) / 1e3
        print("slowdown %.2f: ideal overlapped step %.0f ms, measured off step %.0f ms, "
              "ratio %.3f" % (slowdown, best, measured, best / measured))


def link_floor(directory, rate):
    for path in timeline_files(directory):
        steps_ready, current = [], None
        for e in load(path):
            if e["name"] != "pack":
                continue
            bucket = e["args"]["bucket"]
            if current is None or (bucket == 0 and max(current) > 0):
                current = {}
                steps_ready.append(current)
            ready, total = current.get(bucket, (0.0, 0))
            current[bucket] = (max(ready, e["ts"] + e["dur"]), total + e["args"]["bytes"])
        exposed = []
        for step in steps_ready[1:]:  # the first step makes connections
            link_free = 0.0
            for bucket in sorted(step):
                ready, size = step[bucket]
                link_free = max(link_free, ready) + size / rate  # bytes / (MB/s) = us
            exposed.append((link_free - max(ready for ready, _ in step.values())) / 1e3)
        if not exposed:
            raise SystemExit("%s: fewer than two steps of packs" % path)
        last = steps_ready[-1]
        print("%s: %d steps, buckets %s MB; least exposed after the last bucket: median %.0f ms "
              "(%.0f-%.0f)" % (os.path.basename(path), len(exposed),
                               "/".join("%.1f" % (last[b][1] / 1e6) for b in sorted(last)),
                               statistics.median(exposed), min(exposed), max(exposed)))


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--link":
        if len(sys.argv) != 4:
            raise SystemExit(__doc__)
        link_floor(sys.argv[3], float(sys.argv[2]))
    elif len(sys.argv) >= 3:
        main(sys.argv[1], [float(x) for x in sys.argv[2:]])
    else:
        raise SystemExit(__doc__)
