"""Data-parallel PyTorch training with gradcomm: an MLP on scikit-learn's bundled digits
(1797 8x8 images, 10 classes; no download) under mpirun.

    mpirun -np 2 /usr/bin/python3 examples/torch_digits.py             # gradcomm
    mpirun -np 2 /usr/bin/python3 examples/torch_digits.py --backend ddp  # DDP with gloo
    mpirun -np 2 /usr/bin/python3 examples/torch_digits.py --compare   # both, steps alternated

--batch is the global batch (each rank trains on its 1/N); rank 0 prints test accuracy and the
median step time (forward, backward, gradient all-reduce, optimizer step). --compare trains two
identical replicas, one synchronised by gradcomm.torch.DistributedOptimizer and one by
DistributedDataParallel (gloo), alternating their steps so both see the same machine state.
(PYTHONPATH must hold the gradcomm package: <build>/python, or the install prefix.)"""

import argparse
import os
import socket
import statistics
import time

import torch
from mpi4py import MPI
from sklearn.datasets import load_digits

import gradcomm
import gradcomm.torch as gt

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--backend", choices=["gradcomm", "ddp"], default="gradcomm")
parser.add_argument("--compare", action="store_true", help="train with both, alternating steps")
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch", type=int, default=64, help="global batch")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

torch.set_num_threads(1)  # one core per rank
gradcomm.init()
rank, size = gradcomm.rank(), gradcomm.size()
if args.batch % size:
    raise SystemExit(f"--batch {args.batch} does not divide by {size} ranks")

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.int64)
g = torch.Generator().manual_seed(args.seed)
order = torch.randperm(len(x), generator=g)
test, train = order[:360], order[360:]


def make_model():
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, 10))


runs = {}
if args.compare or args.backend == "gradcomm":
    model = make_model()
    gt.broadcast_parameters(model.state_dict(), root=0)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                  named_parameters=model.named_parameters())
    runs["gradcomm"] = (model, model, opt)
if args.compare or args.backend == "ddp":
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = 0
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    runs["ddp"] = (model, ddp, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))

loss_fn = torch.nn.CrossEntropyLoss()
shard = args.batch // size
steps_per_epoch = len(train) // args.batch
times = {name: [] for name in runs}
for epoch in range(args.epochs):
    perm = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
    for step in range(steps_per_epoch):
        rows = perm[step * args.batch + rank * shard: step * args.batch + (rank + 1) * shard]
        for name, (model, forward, opt) in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(forward(x[rows]), y[rows])
            loss.backward()
            opt.step()
            times[name].append(time.perf_counter() - t0)

if rank == 0:
    for name, (model, _, _) in runs.items():
        with torch.no_grad():
            accuracy = (model(x[test]).argmax(dim=1) == y[test]).float().mean().item()
        params = sum(p.numel() for p in model.parameters())
        step_ms = 1e3 * statistics.median(times[name])
        print(f"{name:8s} {size} ranks, MLP 64-{args.hidden}-{args.hidden}-10 ({params} "
              f"parameters), global batch {args.batch}, {args.epochs} epochs: test accuracy "
              f"{accuracy:.4f}, median step {step_ms:.3f} ms")
    if len(runs) == 2:
        ratio = statistics.median(times["ddp"]) / statistics.median(times["gradcomm"])
        print(f"DDP (gloo) step time / gradcomm step time: {ratio:.2f}")
