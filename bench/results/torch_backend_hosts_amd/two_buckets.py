"""DDP's two buckets of the 8.4 M MLP (8.4 and 25.2 MB) as two async dist.all_reduce calls
waited for together, gloo against the gradcomm backend, 8 rounds alternated (the first left
out). Launched as run.sh launches, with GRADCOMM_ALGORITHM=ring passed on."""

import statistics
import time

import torch
import torch.distributed as dist

import gradcomm.torch  # noqa: F401  (registers the backend)

dist.init_process_group("gradcomm")
gloo = dist.new_group(backend="gloo")
first, second = torch.ones(2_100_000), torch.ones(6_300_000)
times = {"gloo": [], "gradcomm": []}
for _ in range(8):
    for name, group in (("gloo", gloo), ("gradcomm", None)):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(t, group=group, async_op=True) for t in (first, second)]
        for work in works:
            work.wait()
        times[name].append((time.perf_counter() - t0) * 1e3)
if dist.get_rank() == 0:
    for name, ms in times.items():
        print(f"{name} median {statistics.median(ms[1:]):.1f} ms "
              f"range {min(ms[1:]):.1f}-{max(ms[1:]):.1f}")
dist.destroy_process_group()
