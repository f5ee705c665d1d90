"""A rank that stops calling: the others wait in a torch.distributed all_reduce on the gradcomm
backend until the watchdog (GRADCOMM_TIMEOUT) ends the job, its report naming the missing rank.
usage: mpirun -np N python stall.py MISSING_RANK"""
import sys
import time

import torch
import torch.distributed as dist

import gradcomm.torch  # noqa: F401

dist.init_process_group("gradcomm")
missing = int(sys.argv[1])
t = torch.ones(1000)
dist.all_reduce(t)  # every rank: call #0 is fine
if dist.get_rank() == missing:
    time.sleep(120)  # never arrives at the next call
else:
    dist.all_reduce(t)
print(f"rank {dist.get_rank()}: not aborted", flush=True)
