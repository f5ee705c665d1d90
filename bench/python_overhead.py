"""What a Python gradcomm.allreduce call adds to the C++ call: 8-byte in-place all-reduces,
timed in alternating rounds of N calls from Python and N calls from a C++ loop inside the same
process (Communicator._bench_allreduce), medians over rounds.
usage: mpirun -np 2 /usr/bin/python3 bench/python_overhead.py [--rounds R] [--calls N]"""

import argparse
import statistics
import time

import numpy as np

import gradcomm

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=21)
parser.add_argument("--calls", type=int, default=2000)
parser.add_argument("--algorithm", default=None)
args = parser.parse_args()

comm = gradcomm.init()
x = np.ones(2, dtype=np.float32)  # 8 bytes
for _ in range(200):  # warm-up (auto's calibration, caches)
    gradcomm.allreduce(x, op="sum", out=x, algorithm=args.algorithm)
py_times, cpp_times = [], []
for _ in range(args.rounds):
    t0 = time.perf_counter()
    for _ in range(args.calls):
        gradcomm.allreduce(x, op="sum", out=x, algorithm=args.algorithm)
    py_times.append((time.perf_counter() - t0) / args.calls)
    cpp_times.append(comm._bench_allreduce(x, args.calls, "sum", args.algorithm) / args.calls)
py_us = 1e6 * statistics.median(py_times)
cpp_us = 1e6 * statistics.median(cpp_times)
if gradcomm.rank() == 0:
    print(f"{gradcomm.size()} ranks, 8 B float32 sum, algorithm {args.algorithm or 'default'}: "
          f"Python {py_us:.2f} us/call, C++ {cpp_us:.2f} us/call, added {py_us - cpp_us:.2f} us "
          f"(medians of {args.rounds} alternating rounds of {args.calls} calls)")
