"""Step time of torch's FSDP on the gradcomm backend against FSDP on gloo, in one run, the
variants' steps alternated so all see the same machine state (torch 2.x, CPU tensors):

  compute        the model alone, no communication
  fsdp-gloo      FullyShardedDataParallel over a gloo group
  fsdp-gradcomm  the same FSDP over a gradcomm group
  (with --fsdp2) fsdp2-gradcomm  FSDP2 (fully_shard) on the gradcomm group, and
                 fsdp2-gradcomm-alloc the same with set_allocate_memory_from_process_group_for_comm
                 (each all-gather output and reduce-scatter input from the backend's
                 allocate_tensor: gradcomm's registered memory)

FSDP all-gathers each unit's parameters before its forward and backward, and reduce-scatters
its gradients after backward (reduce_scatter_tensor: gradcomm's reduce_scatter, shm's staged
rounds on one host from 512 KiB). A step is zero_grad, forward, backward and an SGD step, each
rank on its own batch, timed at the slowest rank after an untimed lead-in step of the same
variant; rank 0 prints each variant's median and range and the ratio to fsdp-gloo. Both FSDPs
end with the same parameters (checked, float tolerance: the sums' order differs).

    PYTHONPATH=build/python mpirun -np 2 --bind-to core PY bench/torch_fsdp_bench.py
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import gradcomm.torch  # noqa: F401  (registers the backend)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--layers", default="1024,2048,2048,1024,10", help="MLP widths")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--fsdp2", action="store_true", help="add the FSDP2 variants")
args = parser.parse_args()

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)
dist.init_process_group("gradcomm")
RANK, SIZE = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
world = MPI.COMM_WORLD
widths = [int(w) for w in args.layers.split(",")]


def mlp():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def wrap(group):
    # One FSDP unit per linear layer (their gradients reduce-scatter as backward reaches them).
    model = mlp()
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear):
            model[i] = FSDP(layer, process_group=group, device_id=torch.device("cpu"))
    return FSDP(model, process_group=group, device_id=torch.device("cpu"))


def shard(allocate):
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if allocate:
        model.set_allocate_memory_from_process_group_for_comm(True)
    return model


variants = {"compute": mlp(), "fsdp-gloo": wrap(GLOO), "fsdp-gradcomm": wrap(None)}
if args.fsdp2:
    variants["fsdp2-gradcomm"] = shard(False)
    variants["fsdp2-gradcomm-alloc"] = shard(True)
optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in variants.items()}
times = {k: [] for k in variants}


def step(name, i):
    g = torch.Generator().manual_seed(1000 * i + RANK)
    x = torch.randn(args.batch, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (args.batch,), generator=g)
    optimizers[name].zero_grad()
    torch.nn.functional.cross_entropy(variants[name](x), y).backward()
    optimizers[name].step()


for i in range(args.steps):
    for name in variants:
        step(name, i)  # lead-in
        world.Barrier()
        t0 = time.perf_counter()
        step(name, i)
        times[name].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))

with FSDP.summon_full_params(variants["fsdp-gloo"]):
    want = torch.cat([p.detach().reshape(-1) for p in variants["fsdp-gloo"].parameters()])
with FSDP.summon_full_params(variants["fsdp-gradcomm"]):
    got = torch.cat([p.detach().reshape(-1) for p in variants["fsdp-gradcomm"].parameters()])
difference = ((got - want).norm() / want.norm()).item()
assert difference < 1e-4, difference
for name in ("fsdp2-gradcomm", "fsdp2-gradcomm-alloc"):
    if name in variants:
        got = torch.cat([p.full_tensor().detach().reshape(-1) for p in variants[name].parameters()])
        difference = max(difference, ((got - want).norm() / want.norm()).item())
        assert difference < 1e-4, (name, difference)
if RANK == 0:
    print(f"# FSDP, MLP {args.layers}, batch {args.batch}, {SIZE} ranks, torch "
          f"{torch.__version__}, {args.steps} steps; parameters within {difference:.1e}")
    gloo = statistics.median(times["fsdp-gloo"])
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{name:20s} {m * 1e3:8.2f} ms  ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})"
              f"  / fsdp-gloo {m / gloo:.2f}")
