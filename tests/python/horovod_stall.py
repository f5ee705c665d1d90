"""gradcomm.torch, a rank that stops calling: the others wait for a name it never submits (rank
given on the command line sleeps instead), and the stall watchdog must end the job."""
import sys
import time

import torch

import gradcomm.torch as hvd

hvd.init()
stopped = int(sys.argv[1])
hvd.allreduce(torch.ones(4), name="warm-up")
if hvd.rank() == stopped:
    time.sleep(120)
else:
    hvd.allreduce(torch.ones(4), name="never-on-the-stopped-rank")
print(f"rank {hvd.rank()}: not aborted", flush=True)
