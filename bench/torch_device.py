"""The device a torch benchmark rank runs on (bench/torch_allreduce_bench.py,
bench/torch_ddp_bench.py): the CPU, or with --device cuda the GPU of its rank. Ranks sharing one
GPU get their own NCCL_HOSTID (before any NCCL call), so that every NCCL communicator, torch's
and gradcomm's alike, connects them through NCCL's socket transport instead of refusing two ranks
on one device."""

import os

import torch


def bench_device(kind, rank):
    if kind != "cuda":
        return torch.device("cpu")
    os.environ.setdefault("NCCL_HOSTID", f"gradcomm-bench-{rank}")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
