"""Summary of bench/horovod/compare.sh --separate: Horovod and gradcomm timed in separate
launches, alternated (launch H: compute,horovod; launch G: compute and the gradcomm variants).

    python bench/horovod/summary.py DIR     (DIR holds horovod.jsonl, gradcomm.jsonl, params/)

Per model, rank count and hosts: each variant's median step over the launches (and the range of
the launches' medians); the ratio to Horovod is the median of the per-pair ratios (the i-th G
launch against the i-th H launch, run one after the other), with their range. The compute alone
is shown from both kinds of launch: what Horovod's background thread costs the same computation.
Parameters: the last launch of each kind saved every variant's final parameters; their largest
difference from Horovod's."""

import json
import os
import statistics
import sys

import torch

directory = sys.argv[1]


def load(name):
    rows = {}
    with open(os.path.join(directory, name)) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault((r["model"], r["ranks"], r["hosts"]), []).append(r)
    return rows


horovod, gradcomm = load("horovod.jsonl"), load("gradcomm.jsonl")
print("| model | ranks, hosts | launches | compute (H / G launches) | horovod | variant | step "
      "| / horovod (pairs' median, range) | parameters vs horovod |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(horovod):
    model, ranks, hosts = key
    hs, gs = horovod[key], gradcomm.get(key, [])
    pairs = min(len(hs), len(gs))
    if pairs == 0:
        continue
    med = lambda rows, v: [r["variants"][v]["median_ms"] for r in rows if v in r["variants"]]
    h_steps = med(hs, "horovod")
    compute_h, compute_g = statistics.median(med(hs, "compute")), statistics.median(med(gs, "compute"))
    tag = "cnn" if model.startswith("CNN") else "mlp"
    params = os.path.join(directory, "params")
    ref_path = os.path.join(params, f"{tag}_np{ranks}_h{hosts}_horovod.pt")
    ref = torch.load(ref_path) if os.path.exists(ref_path) else None
    for v in [v for v in gs[0]["variants"] if v != "compute"]:
        g_steps = med(gs, v)
        ratios = [g / h for g, h in zip(g_steps[:pairs], h_steps[:pairs])]
        diff = "-"
        path = os.path.join(params, f"{tag}_np{ranks}_h{hosts}_{v}.pt")
        if ref is not None and os.path.exists(path):
            diff = f"{(torch.load(path) - ref).abs().max().item():.1e}"
        print(f"| {model} | {ranks}, {hosts} | {pairs} | {compute_h:.1f} / {compute_g:.1f} ms "
              f"| {statistics.median(h_steps):.1f} ms ({min(h_steps):.1f}-{max(h_steps):.1f}) "
              f"| {v} | {statistics.median(g_steps):.1f} ms ({min(g_steps):.1f}-{max(g_steps):.1f}) "
              f"| **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {diff} |")
