"""Members of a torch new_group on the gradcomm backend that disagree on who they are: an error on
every member, never a wait without end in MPI_Comm_create_group (which waits for every member
it was given). mpirun -np 3; every rank prints its line and checks its own errors.
1. Different lists: rank 0 is given [0, 1], ranks 1 and 2 [0, 1, 2]. Ranks 0 and 1 see each
   other's list and fail at once; rank 2 waits for rank 0, which never writes to it, until the
   group's timeout (3 s), and fails naming it. The world group stays usable, and a new_group the
   ranks agree on works.
2. A member that never calls: ranks 0 and 1 make new_group([0, 1, 2]), rank 2 does not: they fail
   within the timeout, naming rank 2."""
import datetime
import time

import torch
import torch.distributed as dist

import gradcomm.torch  # noqa: F401

TIMEOUT = datetime.timedelta(seconds=3)
dist.init_process_group("gradcomm")
rank, size = dist.get_rank(), dist.get_world_size()
assert size == 3, "run with mpirun -np 3"


def new_group_error(ranks):
    started = time.monotonic()
    try:
        dist.new_group(ranks, timeout=TIMEOUT)
    except RuntimeError as error:
        return str(error), time.monotonic() - started
    raise AssertionError(f"rank {rank}: new_group({ranks}) made a group")


# 1. Different lists.
message, seconds = new_group_error([0, 1] if rank == 0 else [0, 1, 2])
if rank in (0, 1):
    assert "disagree on the subgroup" in message, message
    assert "[0, 1]" in message and "[0, 1, 2]" in message, message
    assert seconds < 2.5, seconds
else:
    assert "world rank(s) 0 did not make the subgroup of ranks [0, 1, 2]" in message, message
    assert 2.5 < seconds < 15, seconds
t = torch.full((11,), float(rank))
dist.all_reduce(t)
assert torch.all(t == 3.0)
group = dist.new_group([0, 2], timeout=TIMEOUT)
if rank != 1:
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, group=group)
    assert torch.all(t == 4.0)
dist.barrier()

# 2. A member that never calls.
if rank != 2:
    message, seconds = new_group_error([0, 1, 2])
    assert "world rank(s) 2 did not make the subgroup of ranks [0, 1, 2]" in message, message
    assert 2.5 < seconds < 15, seconds
print(f"rank {rank}: subgroup mismatches fail on every member", flush=True)
