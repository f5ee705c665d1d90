"""Shared by the Python tests (pytest on every rank under mpirun)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI


def _free_port():
    port = 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return MPI.COMM_WORLD.bcast(port, root=0)


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed with gloo over loopback: the reference DDP runs on it."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=MPI.COMM_WORLD.Get_rank(),
                                world_size=MPI.COMM_WORLD.Get_size())
    return dist


def same_on_every_rank(tensor):
    """True when `tensor` holds the same bits on every rank."""
    mine = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return MPI.COMM_WORLD.allreduce(int(MPI.COMM_WORLD.bcast(mine, root=0) != mine)) == 0


class Embedder(torch.nn.Module):
    """A sparse embedding (sparse gradients) under a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.table = torch.nn.Embedding(40, 6, sparse=True)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.table(x).mean(1))
