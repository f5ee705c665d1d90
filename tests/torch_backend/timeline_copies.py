"""One process, two copies of gradcomm (Python's module and the torch backend), each with a
timeline: run under mpirun with GRADCOMM_TIMELINE set (timeline_copies.sh). With --check DIR,
every rank's two files must be whole Chrome traces, each holding its copy's all-reduce."""

import glob
import json
import os
import sys

if len(sys.argv) == 3 and sys.argv[1] == "--check":
    files = sorted(glob.glob(os.path.join(sys.argv[2], "trace*.json")))
    names = [os.path.basename(f) for f in files]
    want = ["trace.2.rank0.json", "trace.2.rank1.json", "trace.rank0.json", "trace.rank1.json"]
    assert names == want, names
    for f in files:
        events = json.load(open(f))  # a whole trace: no copy overwrote the other's
        spans = [e for e in events if e.get("name") == "allreduce" and e.get("ph") == "X"]
        assert spans, f"{f}: no all-reduce"
    print("timeline copies: 4 whole traces")
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gradcomm.torch as hvd  # noqa: E402

hvd.init()
t = torch.ones(1000)
hvd.allreduce_(t, op=hvd.Sum, name="python-copy")  # gradcomm's Python module
dist.init_process_group("gradcomm")
dist.all_reduce(t)  # the torch backend's copy
assert torch.all(t == hvd.size() * hvd.size())
dist.destroy_process_group()
