"""The time of one blocking hvd.allreduce (Sum, float32) of gradcomm.torch, and of the real
Horovod beside it, from the moment every rank calls: what a metric or loss averaged once per step
costs. Two timings, alternating library by library, round by round (the median call of a round
at its slowest rank, results checked):
  b2b:   the calls back to back, an MPI barrier before each;
  cycle: every rank computes for --compute-ms first (a busy loop after the barrier), so that the
         negotiation threads have gone idle when the call comes, as between a training step's
         calls.
    mpirun -np 2 --bind-to core $(bench/horovod/env.sh) bench/horovod/latency.py
    mpirun -np 2 --bind-to core python3 bench/horovod/latency.py --libs gradcomm
"""
import argparse
import statistics
import time

import torch
from mpi4py import MPI

parser = argparse.ArgumentParser()
parser.add_argument("--libs", default="horovod,gradcomm")
parser.add_argument("--sizes", default="4,4096,262144,1048576", help="bytes")
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--calls", type=int, default=20, help="per round")
parser.add_argument("--compute-ms", type=float, default=5.0)
parser.add_argument("--label", default="", help="a name printed with each line")
args = parser.parse_args()

libs = {}
for name in args.libs.split(","):
    if name == "horovod":
        import horovod.torch as lib
    elif name == "gradcomm":
        import gradcomm.torch as lib
    else:
        raise SystemExit(f"unknown library {name!r}")
    lib.init()
    libs[name] = lib
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
torch.set_num_threads(1)


def spin(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def timed(lib, x, expected, compute_ms):
    world.Barrier()
    if compute_ms:
        spin(compute_ms)
    t0 = time.perf_counter()
    out = lib.allreduce(x, op=lib.Sum)
    elapsed = time.perf_counter() - t0
    if not torch.equal(out, expected):
        raise SystemExit(f"rank {rank}: wrong result from {lib.__name__}")
    return elapsed


for nbytes in (int(s) for s in args.sizes.split(",")):
    n = max(1, nbytes // 4)
    x = torch.arange(n, dtype=torch.float32) % 7 + rank
    expected = (torch.arange(n, dtype=torch.float32) % 7) * size + size * (size - 1) / 2
    for timing, compute_ms in (("b2b", 0.0), ("cycle", args.compute_ms)):
        rounds = {name: [] for name in libs}
        for r in range(args.rounds):
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                lib = libs[name]
                timed(lib, x, expected, 0.0)  # lead-in
                times = [timed(lib, x, expected, compute_ms) for _ in range(args.calls)]
                rounds[name].append(world.allreduce(statistics.median(times), op=MPI.MAX))
        if rank == 0:
            cells = []
            for name, v in rounds.items():
                cells.append(f"{name} {1e6 * statistics.median(v):8.1f} us "
                             f"({1e6 * min(v):.0f}-{1e6 * max(v):.0f})")
            if len(rounds) == 2:
                a, b = (statistics.median(v) for v in rounds.values())
                cells.append(f"{'/'.join(reversed(list(rounds)))} {b / a:.2f}")
            print(f"{args.label}{size} ranks {nbytes:>8d} B {timing:5s} " + "  ".join(cells),
                  flush=True)
