"""torch's DDP on the gradcomm backend with DDP_DISABLE_COMM_MEM=0 where /dev/shm is too small
for its buckets (small_shm.sh mounts a 1 MiB one, as containers' often are small): a bucket that
does not fit gets torch's memory with a warning, one that fits gets gradcomm's registered memory,
and both train as DDP over gloo does."""

import os

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradcomm.torch  # noqa: F401  (registers the backend)

torch.set_num_threads(1)
os.environ["DDP_DISABLE_COMM_MEM"] = "0"
dist.init_process_group("gradcomm")
RANK = dist.get_rank()
GLOO = dist.new_group(backend="gloo")


def registered(tensor):
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return "/dev/shm/gradcomm-" in " ".join(fields[5:])
    return False


def train(width, group):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 3))
    seen = []

    def hook(state, bucket):
        seen.append(registered(bucket.buffer()))
        return default_hooks.allreduce_hook(state, bucket)

    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + RANK)
        opt.zero_grad()
        ddp(torch.randn(8, width, generator=g)).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), seen


for width, fits in ((600, False), (16, True)):  # 1.4 MB of gradients per rank, and 1.2 KB
    ours, seen = train(width, None)
    theirs, _ = train(width, GLOO)
    assert seen and all(s == fits for s in seen), (width, seen)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5, width
    mine = ours.numpy().tobytes()
    assert MPI.COMM_WORLD.bcast(mine, root=0) == mine, "replicas differ"
MPI.COMM_WORLD.Barrier()
if RANK == 0:
    print("small /dev/shm: buckets in torch's memory where they do not fit, in gradcomm's where "
          "they do, both as gloo's")
dist.destroy_process_group()
