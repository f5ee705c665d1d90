"""Phases of one training step of the 8.4 M MLP (zero_grad, forward, backward, step), rank 0
medians of 30 steps: `plain` (no communication), `bv` (gradcomm DDP, gradient_as_bucket_view,
no overlap), `ddp` (gradcomm DDP, no overlap). Run with ranks bound to a core each:
    PYTHONPATH=build/python mpirun -np 2 --bind-to core PY step_phases.py bv
"""
import time, sys, statistics, torch
from mpi4py import MPI
import gradcomm.torch as hvd
torch.set_num_threads(1)
hvd.init()
world = MPI.COMM_WORLD
widths = [1024, 2048, 2048, 1024, 10]
def mk():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])
mode = sys.argv[1]
model = mk()
if mode == "bv":
    net = hvd.DistributedDataParallel(model, gradient_as_bucket_view=True, overlap=False)
elif mode == "ddp":
    net = hvd.DistributedDataParallel(model, overlap=False)
else:
    net = model
opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
g = torch.Generator().manual_seed(world.rank)
x = torch.randn(32, 1024, generator=g); y = torch.randint(0, 10, (32,), generator=g)
lf = torch.nn.CrossEntropyLoss()
ph = {"zero": [], "fwd": [], "bwd": [], "step": []}
for it in range(40):
    world.Barrier()
    t0 = time.perf_counter(); opt.zero_grad(); t1 = time.perf_counter()
    loss = lf(net(x), y); t2 = time.perf_counter()
    loss.backward(); t3 = time.perf_counter()
    opt.step(); t4 = time.perf_counter()
    if it >= 10:
        for k, a, b in (("zero", t0, t1), ("fwd", t1, t2), ("bwd", t2, t3), ("step", t3, t4)):
            ph[k].append((b - a) * 1e3)
if world.rank == 0:
    print(mode, " ".join(f"{k} {statistics.median(v):.1f}" for k, v in ph.items()))
