"""gradcomm.torch, a rank that stops calling: the others wait for a name it never submits (rank
given on the command line sleeps instead), and the stall watchdog must end the job. With
STALL_POLL=1 they wait as Horovod's async users do, calling poll() in a loop with sleeps between
(before, a rank that only polled never counted as waiting, and the job never ended)."""
import os
import sys
import time

import torch

import gradcomm.torch as hvd

hvd.init()
stopped = int(sys.argv[1])
hvd.allreduce(torch.ones(4), name="warm-up")
if hvd.rank() == stopped:
    time.sleep(120)
elif os.environ.get("STALL_POLL") == "1":
    handle = hvd.allreduce_async(torch.ones(4), name="never-on-the-stopped-rank")
    while not hvd.poll(handle):
        time.sleep(0.05)
else:
    hvd.allreduce(torch.ones(4), name="never-on-the-stopped-rank")
print(f"rank {hvd.rank()}: not aborted", flush=True)
