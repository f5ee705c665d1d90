"""torch.distributed.all_reduce on the gradcomm backend against gloo, and against gradcomm's own
call (no torch in between), in one run, rounds alternated, results checked:

  gloo            dist.all_reduce on a gloo group (torch's CPU backend)
  gradcomm        dist.all_reduce on a gradcomm group (the torch.distributed backend)
  gradcomm-native gradcomm's C++ all-reduce through its Python module (the same communicator
                  kind, no c10d, no progress engine)
  gradcomm-registered  dist.all_reduce on the gradcomm group of a tensor the backend allocated
                  (allocate_tensor, torch 2.x: gradcomm's registered memory, where torch's DDP
                  keeps its buckets with DDP_DISABLE_COMM_MEM=0; shm reduces it in place)
  nccl            dist.all_reduce on torch's own nccl backend (--device cuda)
  gradcomm-nonblocking  the gradcomm backend with GRADCOMM_NCCL_BLOCKING=0 (--device cuda): its
                  NCCL communicator non-blocking, as gradcomm made them before 2026-11-28

    PYTHONPATH=build/python mpirun -np 2 /usr/bin/python3 bench/torch_allreduce_bench.py

With --device cuda (torch 2.x on a GPU machine; default variants nccl,gradcomm) the tensors live
on the GPU and each timed call ends with torch.cuda.synchronize(), so a call's time is its time
to the result on the device. Ranks sharing one GPU get their own NCCL_HOSTID, so that both
backends' NCCL communicators connect them over NCCL's socket transport alike.

Each round runs one untimed call of its variant, then --iters timed calls back to back (the
median call of the round is kept); with --cycle the timed call follows a pass over a 64 MiB
buffer, as a training step's computation leaves the caches. Every variant's result is compared
with the exact sum after each round. Rank 0 prints, per size, the median and range over rounds of
each variant, its bus bandwidth, and the ratios.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import gradcomm
import gradcomm.torch  # noqa: F401  (registers the backend)
from torch_device import bench_device

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--sizes", default="1K,16K,256K,1M,4M,16M,64M", help="bytes per call")
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--iters", type=int, default=10, help="timed calls per round")
parser.add_argument("--cycle", action="store_true", help="a cache-clearing pass before each call")
parser.add_argument("--variants", default=None,
                    help="default gloo,gradcomm,gradcomm-native (cpu), nccl,gradcomm (cuda)")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--json", help="append one JSON object per run to this file")
args = parser.parse_args()

torch.set_num_threads(1)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
cuda = args.device == "cuda"
device = bench_device(args.device, rank)
default_variants = "nccl,gradcomm" if cuda else "gloo,gradcomm,gradcomm-native"
variants = (args.variants or default_variants).split(",")
dist.init_process_group("gradcomm")
groups = {"gradcomm": dist.group.WORLD, "gradcomm-registered": dist.group.WORLD}
if "gradcomm-nonblocking" in variants:  # a group's settings are read when it is made
    os.environ["GRADCOMM_NCCL_BLOCKING"] = "0"
    groups["gradcomm-nonblocking"] = dist.new_group(backend="gradcomm")
    del os.environ["GRADCOMM_NCCL_BLOCKING"]
for name in ("gloo", "nccl"):
    if name in variants:
        groups[name] = dist.new_group(backend=name)
if "gradcomm-native" in variants:
    if cuda:
        raise SystemExit("gradcomm-native takes host memory only: leave it out with --device cuda")
    gradcomm.init()
    native = gradcomm.world()
scratch = torch.zeros(16 << 20, device=device) if args.cycle else None


def parse(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def call(name, t):
    if name == "gradcomm-native":
        native._allreduce_ptr(t.data_ptr(), t.data_ptr(), t.numel(), "float32", "sum", None)
    else:
        dist.all_reduce(t, group=groups[name])
    if cuda:
        torch.cuda.synchronize()


results = []
for size_bytes in [parse(s) for s in args.sizes.split(",")]:
    n = max(1, size_bytes // 4)
    base = (torch.arange(n, dtype=torch.float32) % 7 + rank).to(device)
    want = ((torch.arange(n, dtype=torch.float32) % 7) * size + size * (size - 1) / 2).to(device)
    t = torch.empty(n, device=device)
    tensors = {v: t for v in variants}
    if "gradcomm-registered" in variants:  # collective: every rank allocates here
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        tensors["gradcomm-registered"] = backend.allocate_tensor(n, dtype=torch.float32,
                                                                 device=torch.device("cpu"))
    rounds = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name in order:
            t = tensors[name]
            t.copy_(base)
            call(name, t)  # the lead-in
            times = []
            for _ in range(args.iters):
                t.copy_(base)
                if scratch is not None:
                    scratch.add_(1.0)
                world.Barrier()
                t0 = time.perf_counter()
                call(name, t)
                times.append(time.perf_counter() - t0)
            if not torch.equal(t, want):  # exact: small integers in float32
                raise SystemExit(f"rank {rank}: {name} at {size_bytes} bytes: wrong result")
            slowest = world.allreduce(statistics.median(times), op=MPI.MAX)
            rounds[name].append(slowest)
    if rank == 0:
        row = {"bytes": size_bytes, "ranks": size, "cycle": args.cycle, "device": args.device}
        line = f"{size_bytes:>10d} B"
        for name in variants:
            med = statistics.median(rounds[name])
            busbw = 2 * (size - 1) / size * size_bytes / med / 1e9
            row[name] = {"median_us": 1e6 * med, "min_us": 1e6 * min(rounds[name]),
                         "max_us": 1e6 * max(rounds[name]), "busbw_GBps": busbw}
            line += (f"  {name} {1e6 * med:9.1f} us ({1e6 * min(rounds[name]):.0f}-"
                     f"{1e6 * max(rounds[name]):.0f}) {busbw:6.2f} GB/s")
        if "gloo" in row and "gradcomm" in row:
            row["gloo_over_gradcomm"] = row["gloo"]["median_us"] / row["gradcomm"]["median_us"]
            line += f"  gloo/gradcomm {row['gloo_over_gradcomm']:.2f}x"
        if "nccl" in row and "gradcomm" in row:
            row["gradcomm_over_nccl"] = row["gradcomm"]["median_us"] / row["nccl"]["median_us"]
            line += f"  gradcomm/nccl {row['gradcomm_over_nccl']:.2f}"
        if "nccl" in row and "gradcomm-nonblocking" in row:
            row["nonblocking_over_nccl"] = (row["gradcomm-nonblocking"]["median_us"] /
                                            row["nccl"]["median_us"])
            line += f"  nonblocking/nccl {row['nonblocking_over_nccl']:.2f}"
        if "gradcomm-registered" in row and "gradcomm" in row:
            row["registered_over_gradcomm"] = (row["gradcomm-registered"]["median_us"] /
                                               row["gradcomm"]["median_us"])
            line += f"  registered/gradcomm {row['registered_over_gradcomm']:.2f}"
        if "gradcomm-native" in row and "gradcomm" in row:
            row["gradcomm_over_native"] = (row["gradcomm"]["median_us"] /
                                           row["gradcomm-native"]["median_us"])
            line += f"  gradcomm/native {row['gradcomm_over_native']:.2f}"
        print(line, flush=True)
        results.append(row)
if rank == 0 and args.json:
    with open(args.json, "a") as f:
        f.write(json.dumps({"torch": torch.__version__, "device": args.device,
                            "results": results}) + "\n")
# The groups go while this thread still holds the tensors their workers last used: a gloo worker
# that dropped the last reference to one at interpreter exit would need the GIL then (an abort).
tensors.clear()
groups.clear()
dist.destroy_process_group()
