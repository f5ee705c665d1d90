"""A rank that stops calling: the others wait in a torch.distributed all_reduce on the gradcomm
backend until the watchdog ends the job, its report naming the missing rank.
usage: mpirun -np N python stall.py MISSING_RANK [TIMEOUT_GIVEN_TO]
  TIMEOUT_GIVEN_TO: "init_process_group" or "new_group": that call is given a timeout of 3 s
  (torch's, which replaces GRADCOMM_TIMEOUT for its group), and the calls go to its group.
  Without it, GRADCOMM_TIMEOUT bounds them."""
import datetime
import sys
import time

import torch
import torch.distributed as dist

import gradcomm.torch  # noqa: F401

missing = int(sys.argv[1])
given_to = sys.argv[2] if len(sys.argv) > 2 else None
timeout = datetime.timedelta(seconds=3)
if given_to == "init_process_group":
    dist.init_process_group("gradcomm", timeout=timeout)
else:
    dist.init_process_group("gradcomm")
group = dist.new_group(timeout=timeout) if given_to == "new_group" else None
t = torch.ones(1000)
dist.all_reduce(t, group=group)  # every rank: call #0 is fine
if dist.get_rank() == missing:
    time.sleep(120)  # never arrives at the next call
else:
    dist.all_reduce(t, group=group)
print(f"rank {dist.get_rank()}: not aborted", flush=True)
