import os, time, statistics, torch, torch.distributed as dist
import gradcomm.torch  # noqa
dist.init_process_group("gradcomm")
gloo = dist.new_group(backend="gloo")
r = dist.get_rank()
a = torch.ones(2_100_000); b = torch.ones(6_300_000)  # 8.4 MB, 25.2 MB: DDP's two buckets
res = {"gloo": [], "gradcomm": []}
for it in range(8):
    for name, g in (("gloo", gloo), ("gradcomm", None)):
        dist.barrier()
        t0 = time.perf_counter()
        w1 = dist.all_reduce(a, group=g, async_op=True)
        w2 = dist.all_reduce(b, group=g, async_op=True)
        w1.wait(); w2.wait()
        res[name].append((time.perf_counter() - t0) * 1e3)
if r == 0:
    for k, v in res.items():
        print(k, "median %.1f ms range %.1f-%.1f" % (statistics.median(v[1:]), min(v[1:]), max(v[1:])))
dist.destroy_process_group()
