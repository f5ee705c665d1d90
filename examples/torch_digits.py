"""Data-parallel PyTorch training with gradcomm: a small CNN on scikit-learn's bundled digits
(1797 8x8 images, 10 classes; no download) under mpirun, trained three ways side by side:

  gradcomm-ddp   gradcomm.torch.DistributedDataParallel  (torch DDP users change one line)
  gradcomm-hvd   gradcomm.torch.DistributedOptimizer     (Horovod users change the import)
  torch-ddp      torch.nn.parallel.DistributedDataParallel with gloo, the reference

    mpirun -np 2 /usr/bin/python3 examples/torch_digits.py
    mpirun -np 2 /usr/bin/python3 examples/torch_digits.py --ways gradcomm-hvd
    scripts/hosts up 2 && GLOO_SOCKET_IFNAME=eth0 \\
        scripts/mpirun-hosts 2x1 -- /usr/bin/python3 examples/torch_digits.py   # two hosts

--batch is the global batch (each rank trains on its 1/N). The ways' steps are alternated so all
see the same machine state; rank 0 prints each one's test accuracy and median step time
(forward, backward with the gradients' all-reduce, optimizer step) and its ratio to torch-ddp.
(PYTHONPATH must hold the gradcomm package: <build>/python, or the install prefix.)"""

import argparse
import fcntl
import os
import socket
import statistics
import struct
import time

import torch
from mpi4py import MPI
from sklearn.datasets import load_digits

import gradcomm.torch as hvd  # Horovod's API; DistributedDataParallel lives here too

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ways", default="gradcomm-ddp,gradcomm-hvd,torch-ddp")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch", type=int, default=64, help="global batch")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--seed", type=int, default=1)
args = parser.parse_args()

torch.set_num_threads(1)  # one core per rank
hvd.init()
rank, size = hvd.rank(), hvd.size()
if args.batch % size:
    raise SystemExit(f"--batch {args.batch} does not divide by {size} ranks")

digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8
y = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
test, train = order[:360], order[360:]


def make_model():
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def init_gloo():
    import torch.distributed as dist
    ifname = os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    address = port = None
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the interface's IPv4
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
            address = socket.inet_ntoa(packed[20:24])
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
    address, port = MPI.COMM_WORLD.bcast((address, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=size)


def sgd(params):
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


runs = {}  # way -> (the model to evaluate, what forward runs through, its optimizer)
for way in args.ways.split(","):
    model = make_model()
    if way == "gradcomm-ddp":
        ddp = hvd.DistributedDataParallel(model)  # broadcasts rank 0's parameters
        runs[way] = (model, ddp, sgd(ddp.parameters()))
    elif way == "gradcomm-hvd":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters())
        runs[way] = (model, model, opt)
    elif way == "torch-ddp":
        init_gloo()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        runs[way] = (model, ddp, sgd(ddp.parameters()))
    else:
        raise SystemExit(f"unknown way {way!r} (gradcomm-ddp, gradcomm-hvd, torch-ddp)")

loss_fn = torch.nn.CrossEntropyLoss()
shard = args.batch // size
steps_per_epoch = len(train) // args.batch
times = {way: [] for way in runs}
for epoch in range(args.epochs):
    perm = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))]
    for step in range(steps_per_epoch):
        rows = perm[step * args.batch + rank * shard: step * args.batch + (rank + 1) * shard]
        for way, (model, forward, opt) in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(forward(x[rows]), y[rows]).backward()
            opt.step()
            times[way].append(time.perf_counter() - t0)

# A step takes as long as its slowest rank.
slowest = {way: [max(v) for v in zip(*MPI.COMM_WORLD.allgather(t))] for way, t in times.items()}
if rank == 0:
    params = sum(p.numel() for p in make_model().parameters())
    print(f"{size} ranks on {hvd.cross_size()} host(s), CNN ({params} parameters), global batch "
          f"{args.batch}, {args.epochs} epochs, steps alternated:")
    median = {way: statistics.median(t) for way, t in slowest.items()}
    for way, (model, _, _) in runs.items():
        with torch.no_grad():
            accuracy = (model(x[test]).argmax(dim=1) == y[test]).float().mean().item()
        line = (f"  {way:13s} test accuracy {accuracy:.4f}, median step "
                f"{1e3 * median[way]:.3f} ms")
        if way != "torch-ddp" and "torch-ddp" in median:
            line += f", {median[way] / median['torch-ddp']:.2f}x torch-ddp's"
        print(line)
