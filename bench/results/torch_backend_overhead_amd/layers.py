"""Where dist.all_reduce's time goes above gradcomm's own call, float32 sum, 2 ranks bound to a
core each (the values grow; only times are read): the backend object called directly
(Backend.allreduce with asyncOp False, then wait), gradcomm's own call through its Python module
(native), dist.all_reduce on the default group (the gradcomm backend), the backend object with
asyncOp True (the call handed to gradcomm's progress engine), and ProcessGroup.allreduce with
asyncOp False (torch's C++ dispatcher, none of dist.all_reduce's Python). Medians over 9 rounds
of 30 calls, the variants alternating. Rank 0 prints bytes and the five medians in us.
    PYTHONPATH=build/python mpirun -np 2 --bind-to core PY layers.py
"""
import time, statistics, sys, torch, torch.distributed as dist
from mpi4py import MPI
import gradcomm, gradcomm.torch  # noqa
torch.set_num_threads(1)
dist.init_process_group("gradcomm")
gradcomm.init()
pg = dist.distributed_c10d._get_default_group()
backend = pg._get_backend(torch.device("cpu"))
native = gradcomm.world()
w = MPI.COMM_WORLD
opts = dist.AllreduceOptions(); opts.asyncOp = False
optsA = dist.AllreduceOptions(); optsA.asyncOp = True
for n in (1 << 12, 1 << 16, 1 << 18, 1 << 20):
    t = torch.ones(n)
    def c(): backend.allreduce([t], opts).wait()
    def d(): native._allreduce_ptr(t.data_ptr(), t.data_ptr(), t.numel(), "float32", "sum", None)
    def e(): dist.all_reduce(t)
    def a(): backend.allreduce([t], optsA).wait()
    def g(): pg.allreduce([t], opts).wait()
    res = {}
    for rnd in range(9):
        for name, f in (("backend", c), ("native", d), ("dist.all_reduce", e),
                        ("backend-async", a), ("pg.allreduce", g)):
            for _ in range(5): f()
            times = []
            for _ in range(30):
                w.Barrier(); t0 = time.perf_counter(); f(); times.append(time.perf_counter() - t0)
            res.setdefault(name, []).append(statistics.median(times) * 1e6)
    if w.rank == 0:
        print(n * 4, " ".join(f"{k} {statistics.median(v):7.1f}" for k, v in res.items()))
