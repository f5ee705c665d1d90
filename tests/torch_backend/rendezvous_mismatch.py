"""torch's rendezvous variables set on one rank only: every rank raises when gradcomm.torch is
imported, naming that rank (before, the others waited for it without end in the broadcast of
rank 0's address, which runs before any watchdog). Then rank 0 failing to find its address:
every rank raises with rank 0's error."""
import os

from mpi4py import MPI

NAMES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
rank = MPI.COMM_WORLD.Get_rank()
for name in NAMES:
    os.environ.pop(name, None)

if rank == 0:
    os.environ["MASTER_PORT"] = "29500"
try:
    import gradcomm.torch  # noqa: F401
except RuntimeError as error:
    assert "are set on rank(s) 0 only" in str(error), error
else:
    raise SystemExit(f"rank {rank}: no error for variables set on rank 0 only")
os.environ.pop("MASTER_PORT", None)

import gradcomm._c10d as c10d  # noqa: E402  (imported by the attempt above)


def refusing():
    raise OSError("no port (injected)")


if rank == 0:
    c10d._free_port = refusing
try:
    import gradcomm.torch  # noqa: F401,F811
except RuntimeError as error:
    assert "rank 0 could not find its address" in str(error) and "injected" in str(error), error
else:
    raise SystemExit(f"rank {rank}: no error for rank 0's failure")
print(f"rank {rank}: both refused on every rank", flush=True)
