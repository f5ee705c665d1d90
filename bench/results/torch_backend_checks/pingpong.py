"""What the backend's new checks cost a call: send/recv round trips (rank 0 sends, rank 1 sends
back) of 4 B and 1 MiB, and dist.all_reduce of 1 KiB and 256 KiB, float32, 2 ranks bound to a
core each. Medians over 9 rounds of 200 calls (50 for 1 MiB). Rank 0 prints one line.
    PYTHONPATH=<build>/python mpirun -np 2 --bind-to core PY pingpong.py"""
import statistics, time, torch, torch.distributed as dist
import gradcomm.torch  # noqa: F401
torch.set_num_threads(1)
dist.init_process_group("gradcomm")
R = dist.get_rank()


def pingpong(t):
    if R == 0:
        dist.send(t, 1); dist.recv(t, 1)
    else:
        dist.recv(t, 0); dist.send(t, 0)


res = {}
for name, f, calls in (("rtt 4 B", lambda t=torch.ones(1): pingpong(t), 200),
                       ("rtt 1 MiB", lambda t=torch.ones(1 << 18): pingpong(t), 50),
                       ("all_reduce 1 KiB", lambda t=torch.ones(256): dist.all_reduce(t), 200),
                       ("all_reduce 256 KiB", lambda t=torch.ones(1 << 16): dist.all_reduce(t),
                        200)):
    for _ in range(20):
        f()
    rounds = []
    for _ in range(9):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    res[name] = statistics.median(rounds)
if R == 0:
    print(" ".join(f"{k} {v:.2f}" for k, v in res.items()))
