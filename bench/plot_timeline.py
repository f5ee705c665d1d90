#!/usr/bin/env python3
"""Draws one rank's gradcomm timeline (GRADCOMM_TIMELINE) as a PNG: a lane per thread, compute
(forward, backward, optimizer step) against communication (all-reduces, waits), so overlap is
seen at a glance.

usage: plot_timeline.py TIMELINE.json [--out PNG] [--from MS] [--to MS] [--title TEXT]
"""

import argparse
import json
import sys

COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer step": "#8172b2",
    "allreduce": "#dd8452",
    "queued": "#e5e5e5",
    "pack": "#937860",
    "unpack": "#da8bc3",
    "wait": "#c44e52",
    "finish": "#f2c4c4",
}


def load(path):
    with open(path) as f:
        events = json.load(f)
    names = {}
    spans = []
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
        elif e.get("ph") == "X":
            spans.append(e)
    return names, spans


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("--out", default=None, help="PNG file (default: TIMELINE with .png)")
    parser.add_argument("--from", dest="start", type=float, default=None, help="ms")
    parser.add_argument("--to", dest="end", type=float, default=None, help="ms")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names, spans = load(args.timeline)
    if not spans:
        sys.exit("plot_timeline: no spans in " + args.timeline)
    t0 = min(s["ts"] for s in spans)
    lo = args.start if args.start is not None else 0.0
    hi = args.end if args.end is not None else max(s["ts"] + s["dur"] - t0 for s in spans) / 1e3
    tids = sorted({s["tid"] for s in spans})
    lanes = {tid: i for i, tid in enumerate(tids)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.9 * len(tids)))
    used = set()
    for s in spans:
        start = (s["ts"] - t0) / 1e3
        width = s["dur"] / 1e3
        if start + width < lo or start > hi:
            continue
        name = s["name"]
        color = COLORS.get(name, "#999999")
        used.add(name)
        # Nested spans (an all-reduce inside a wait on the same thread) are drawn thinner on top.
        depth = 0.8 if name in ("forward", "backward", "optimizer step", "finish", "queued") else 0.5
        y = lanes[s["tid"]]
        ax.barh(y, width, left=start, height=depth, color=color, edgecolor="none")
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get(t, "thread %d" % t) for t in tids])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("ms")
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=COLORS.get(n, "#999999"), label=n) for n in sorted(used)],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(used), 9),
              frameon=False)
    ax.set_title(args.title or args.timeline)
    fig.tight_layout()
    out = args.out or (args.timeline[:-5] if args.timeline.endswith(".json") else
                       args.timeline) + ".png"
    fig.savefig(out, dpi=110)
    print("plot_timeline: wrote " + out)


if __name__ == "__main__":
    main(sys.argv[1:])
