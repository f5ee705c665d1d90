"""Where torch's DDP step goes, gloo against the gradcomm backend: the 8.4 M MLP of
torch_ddp_bench.py, DDP with a comm hook that records, per bucket, when DDP hands it over and
when its all-reduce completes (the future's callback), besides the end of forward, of backward
and of the step. Steps alternate between the two DDPs, each after an untimed one of its own.
Launched as run.sh launches; prints medians per variant in ms from the step's start."""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import gradcomm.torch  # noqa: F401  (registers the backend)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--hvd-init", action="store_true",
                    help="start gradcomm.torch's Horovod-style API first, as torch_ddp_bench.py "
                    "does (its negotiation thread then runs through every step)")
parser.add_argument("--close-negotiator", action="store_true",
                    help="with --hvd-init: close its negotiation thread before the steps")
parser.add_argument("--no-hook", action="store_true",
                    help="DDP's built-in all-reduce: only the step's marks are recorded")
args = parser.parse_args()

torch.set_num_threads(1)
if args.hvd_init:
    gradcomm.torch.init()
    if args.close_negotiator:
        gradcomm.torch._close_negotiators()
dist.init_process_group("gradcomm")
world = MPI.COMM_WORLD
groups = {"gloo": dist.new_group(backend="gloo"), "gradcomm": None}
clock = time.perf_counter


def make_model():
    torch.manual_seed(1)
    widths = [1024, 2048, 2048, 1024, 10]
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class Recorder:
    def __init__(self, group):
        self.group, self.events = group, []

    def hook(self, _state, bucket):
        self.events.append((f"call{bucket.index()}", clock()))
        tensor = bucket.buffer()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)

        def done(fut):
            self.events.append((f"done{bucket.index()}", clock()))
            return fut.value()[0].div_(dist.get_world_size())

        return work.get_future().then(done)


runs = {}
for name, group in groups.items():
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=group)
    recorder = Recorder(group)
    if not args.no_hook:
        ddp.register_comm_hook(None, recorder.hook)
    runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9), recorder)

g = torch.Generator().manual_seed(dist.get_rank())
x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)
loss_fn = torch.nn.CrossEntropyLoss()
marks = {name: [] for name in runs}
cpu = {name: [] for name in runs}


def step(ddp, opt, recorder):
    recorder.events = []
    t0 = clock()
    opt.zero_grad()
    loss = loss_fn(ddp(x), y)
    recorder.events.append(("forward", clock()))
    loss.backward()
    recorder.events.append(("backward", clock()))
    opt.step()
    recorder.events.append(("step", clock()))
    return {k: (t - t0) * 1e3 for k, t in recorder.events}


for i in range(args.steps + 1):
    for name, (ddp, opt, recorder) in runs.items():
        world.Barrier()
        step(ddp, opt, recorder)  # untimed lead-in
        world.Barrier()
        c0 = time.process_time()
        m = step(ddp, opt, recorder)
        c1 = time.process_time()
        if i > 0:
            marks[name].append(m)
            cpu[name].append((c1 - c0) * 1e3)



def thread_cpu():
    """CPU seconds of each of this process's threads, summed by thread name."""
    import os
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            stat = f.read()
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        out[name] = out.get(name, 0) + ticks / os.sysconf("SC_CLK_TCK")
    return out


rank = dist.get_rank()
print(f"rank {rank} threads " + " ".join(f"{k}:{v:.1f}s" for k, v in sorted(thread_cpu().items())
                                         if v > 0.05), flush=True)
for r in range(dist.get_world_size()):
    if r == rank:
        for name, ms in marks.items():
            keys = sorted(ms[0], key=lambda k: statistics.median(m[k] for m in ms))
            line = " ".join(f"{k} {statistics.median(m[k] for m in ms):6.1f}" for k in keys)
            print(f"rank {rank} {name:8s} {line}  cpu {statistics.median(cpu[name]):6.1f}",
                  flush=True)
    world.Barrier()
dist.destroy_process_group()
