"""reducescatter (Sum, float32) of gradcomm.torch against the real Horovod 0.28.1 in the same
processes, calls alternating round by round (7 rounds of 10 calls each, the median call of a
round at its slowest rank), results compared bit for bit. Horovod stays initialized throughout,
so its background thread runs during gradcomm's calls too (docs/results/torch.md: it slows what
else the process does). Run with the interpreter of bench/horovod/env.sh's environment:
    mpirun -np 2 --bind-to core $(bench/horovod/env.sh) \
        bench/results/horovod_0.28.1/reducescatter/bench.py
"""
import statistics
import time

import horovod.torch as horovod
import torch
from mpi4py import MPI

import gradcomm.torch as gc

horovod.init()
gc.init()
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
torch.set_num_threads(1)
libs = {"horovod": horovod, "gradcomm": gc}
for nbytes in (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
    n = nbytes // 4
    x = (torch.arange(n, dtype=torch.float32) % 13 + rank).view(size, -1)
    outs = {name: lib.reducescatter(x, op=lib.Sum) for name, lib in libs.items()}
    assert torch.equal(outs["horovod"], outs["gradcomm"])
    rounds = {name: [] for name in libs}
    for r in range(7):
        for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            lib = libs[name]
            lib.reducescatter(x, op=lib.Sum)  # lead-in
            times = []
            for _ in range(10):
                world.Barrier()
                t0 = time.perf_counter()
                lib.reducescatter(x, op=lib.Sum)
                times.append(time.perf_counter() - t0)
            rounds[name].append(world.allreduce(statistics.median(times), op=MPI.MAX))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in rounds.items()}
        print(f"{nbytes:>10d} B  horovod {1e6 * med['horovod']:9.1f} us "
              f"({1e6 * min(rounds['horovod']):.0f}-{1e6 * max(rounds['horovod']):.0f})  "
              f"gradcomm {1e6 * med['gradcomm']:9.1f} us "
              f"({1e6 * min(rounds['gradcomm']):.0f}-{1e6 * max(rounds['gradcomm']):.0f})  "
              f"gradcomm/horovod {med['gradcomm'] / med['horovod']:.2f}", flush=True)
