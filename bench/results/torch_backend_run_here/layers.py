"""dist.all_reduce on the gradcomm backend against gradcomm's own call, float32 sum, any torch:
gradcomm's call through its Python module (native), dist.all_reduce(t) (torch 2.2 and later run
it on the caller's thread: asyncOp false; torch 1.13 hands every call to the backend as
non-blocking), and dist.all_reduce(t, async_op=True).wait(). Medians over 9 rounds of 30 calls,
the variants alternating. Rank 0 prints bytes and the medians in us.
    PYTHONPATH=build/python mpirun -np 2 --bind-to core PY layers.py
"""
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import gradcomm
import gradcomm.torch  # noqa: F401

torch.set_num_threads(1)
dist.init_process_group("gradcomm")
gradcomm.init()
native = gradcomm.world()
w = MPI.COMM_WORLD
for n in (1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20):
    t = torch.ones(n)
    variants = (
        ("native", lambda: native._allreduce_ptr(t.data_ptr(), t.data_ptr(), t.numel(),
                                                 "float32", "sum", None)),
        ("dist.all_reduce", lambda: dist.all_reduce(t)),
        ("async+wait", lambda: dist.all_reduce(t, async_op=True).wait()),
    )
    res = {}
    for rnd in range(9):
        for name, f in variants:
            for _ in range(5):
                f()
            times = []
            for _ in range(30):
                w.Barrier()
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            res.setdefault(name, []).append(statistics.median(times) * 1e6)
    if w.rank == 0:
        print(n * 4, " ".join(f"{k} {statistics.median(v):7.1f}" for k, v in res.items()),
              flush=True)
