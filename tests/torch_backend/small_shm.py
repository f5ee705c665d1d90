"""torch's DDP on the gradcomm backend with DDP_DISABLE_COMM_MEM=0 where /dev/shm is too small
for its buckets (small_shm.sh mounts a 4 MiB one, as containers' often are small): a bucket that
does not fit gets torch's memory with a warning, one that fits gets gradcomm's registered memory,
and both train as DDP over gloo does."""

import gc
import os

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradcomm.torch  # noqa: F401  (registers the backend)
from reference import registered

torch.set_num_threads(1)
os.environ["DDP_DISABLE_COMM_MEM"] = "0"
dist.init_process_group("gradcomm")
RANK = dist.get_rank()
GLOO = dist.new_group(backend="gloo")


def train(width, group):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 3))
    seen = []

    def hook(state, bucket):
        buffer = bucket.buffer()
        seen.append((buffer.numel() * buffer.element_size(), registered(buffer)))
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


# 4 MB of gradients per rank (a segment of 8 MB for 2 ranks: it cannot fit) and 1.2 KB. After
# its first step DDP plans its buckets again in the order the gradients came: a bias may then
# get a bucket of its own, which fits. So each bucket is judged by its size.
for width in (1000, 16):
    ours, seen = train(width, None)
    theirs, _ = train(width, GLOO)
    assert seen, width
    for nbytes, is_registered in seen:
        assert is_registered == (nbytes < (256 << 10)), (width, seen)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5, width
    mine = ours.numpy().tobytes()
    assert MPI.COMM_WORLD.bcast(mine, root=0) == mine, "replicas differ"
# gloo's workers finish their last works (running the hook's Python callbacks) and go before the
# interpreter does: one still running then would need the GIL while Python finalizes (an abort).
# The DDPs (in reference cycles with their hooks) and their tensors go first.
del ours, theirs, seen
gc.collect()
dist.barrier(group=GLOO)
dist.destroy_process_group(GLOO)
dist.destroy_process_group()
MPI.COMM_WORLD.Barrier()
if RANK == 0:
    print("small /dev/shm: buckets in torch's memory where they do not fit, in gradcomm's where "
          "they do, both as gloo's")
