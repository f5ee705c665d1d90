"""mpi4py under libgradcomm_mpi.so: Allreduce and Iallreduce of NumPy arrays give NumPy's answer,
and the library's counters show gradcomm took them (and passed through what it must not take).

    mpirun -np 2 -x LD_PRELOAD=libgradcomm_mpi.so /usr/bin/python3 test_mpi4py.py [--with-gradcomm]

--with-gradcomm: also gradcomm's Python module in the same process (PYTHONPATH must find it).
"""
import ctypes
import sys

import numpy as np
from mpi4py import MPI


class Stats(ctypes.Structure):
    _fields_ = [("taken_calls", ctypes.c_ulonglong),
                ("taken_nonblocking_calls", ctypes.c_ulonglong),
                ("taken_bytes", ctypes.c_ulonglong),
                ("passed_calls", ctypes.c_ulonglong),
                ("passed_bytes", ctypes.c_ulonglong),
                ("passed_by_reason", ctypes.c_ulonglong * 9),
                ("min_bytes", ctypes.c_ulonglong)]


BELOW_THRESHOLD, DATATYPE, OP, NOT_SET_UP, INTERNAL = 0, 1, 2, 7, 8

process = ctypes.CDLL(None)
try:
    _get = process.gradcomm_mpi_get_stats
except AttributeError:
    sys.exit("test_mpi4py: libgradcomm_mpi.so is not loaded (LD_PRELOAD it)")
_get.argtypes = [ctypes.POINTER(Stats)]


def stats():
    s = Stats()
    assert _get(ctypes.byref(s)) == 0
    return s


comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print(f"test_mpi4py: rank {rank}: FAILED: {what}", file=sys.stderr, flush=True)


def inputs(dtype, count, r):
    """Rank r's input: small integers (and quarters for floats), exact in any order."""
    i = np.arange(count, dtype=np.int64)
    values = (i * 7 + r * 13) % 17 - 8
    if np.issubdtype(dtype, np.floating):
        return (values * 0.25).astype(dtype)
    return values.astype(dtype)


REDUCE = {"SUM": (MPI.SUM, lambda a: np.sum(a, axis=0)),
          "MAX": (MPI.MAX, lambda a: np.max(a, axis=0)),
          "MIN": (MPI.MIN, lambda a: np.min(a, axis=0))}

check(MPI.Query_thread() == MPI.THREAD_MULTIPLE, "mpi4py initializes at MPI_THREAD_MULTIPLE")
threshold = stats().min_bytes
for dtype in (np.float32, np.float64, np.int32, np.int64):
    for count in (1, 1021, 262147):
        for name, (op, reference) in REDUCE.items():
            expected = reference(np.stack([inputs(dtype, count, r) for r in range(size)]))
            mine = inputs(dtype, count, rank)
            taken = mine.nbytes >= threshold
            what = f"{np.dtype(dtype).name} x {count} {name}"

            before = stats()
            out = np.empty_like(mine)
            comm.Allreduce(mine, out, op=op)
            check(np.array_equal(out, expected), what + ": Allreduce result")
            check(stats().taken_calls == before.taken_calls + taken, what + ": Allreduce taken")

            before = stats()
            inplace = mine.copy()
            comm.Allreduce(MPI.IN_PLACE, inplace, op=op)
            check(np.array_equal(inplace, expected), what + ": in-place result")
            check(stats().taken_calls == before.taken_calls + taken, what + ": in-place taken")

            before = stats()
            out = np.zeros_like(mine)
            request = comm.Iallreduce(mine, out, op=op)
            request.Wait()
            check(np.array_equal(out, expected), what + ": Iallreduce result")
            after = stats()
            check(after.taken_nonblocking_calls == before.taken_nonblocking_calls + taken,
                  what + ": Iallreduce taken")

# Several requests in flight at once, completed by Waitall and Testall.
arrays = [inputs(np.float32, 100000 + k, rank) for k in range(4)]
outs = [np.empty_like(a) for a in arrays]
requests = [comm.Iallreduce(a, o, op=MPI.SUM) for a, o in zip(arrays, outs)]
MPI.Request.Waitall(requests)
for k, o in enumerate(outs):
    expected = np.sum(np.stack([inputs(np.float32, 100000 + k, r) for r in range(size)]), axis=0)
    check(np.array_equal(o, expected), f"Waitall request {k}")
requests = [comm.Iallreduce(a, o, op=MPI.MAX) for a, o in zip(arrays, outs)]
while not MPI.Request.Testall(requests):
    pass
check(all(np.array_equal(o, np.max(np.stack([inputs(np.float32, len(o), r)
                                               for r in range(size)]), axis=0))
          for o in outs), "Testall results")

# What must reach MPI unchanged: a logical op, and a type gradcomm does not reduce (uint8).
before = stats()
flags = np.array([(i % (size + 1)) == rank for i in range(5000)], dtype=np.int32)
lor = np.empty_like(flags)
comm.Allreduce(flags, lor, op=MPI.LOR)
check(np.array_equal(lor, np.array([(i % (size + 1)) < size for i in range(5000)], dtype=np.int32)),
      "LOR result")
check(stats().passed_by_reason[OP] == before.passed_by_reason[OP] + 1, "LOR passed through")
before = stats()
small = np.full(8000, rank + 1, dtype=np.uint8)
out = np.empty_like(small)
comm.Allreduce(small, out, op=MPI.SUM)
check(np.all(out == size * (size + 1) // 2), "uint8 result")
check(stats().passed_by_reason[DATATYPE] == before.passed_by_reason[DATATYPE] + 1,
      "uint8 passed through")

# The lowercase (pickle) form and a sub-communicator.
sub = comm.Split(rank % 2, rank)
value = sub.allreduce(rank, op=MPI.SUM)
check(value == sum(r for r in range(size) if r % 2 == rank % 2), "pickled allreduce on a split")
big = np.full(50000, float(rank), dtype=np.float64)
sub.Allreduce(MPI.IN_PLACE, big, op=MPI.SUM)
check(big[0] == float(sum(r for r in range(size) if r % 2 == rank % 2)), "split Allreduce")
sub.Free()

# On a communicator other than MPI_COMM_WORLD, Iallreduce passes through until an Allreduce taken
# on it has set it up.
dup = comm.Dup()
vec = inputs(np.float64, 3001, rank)
expected = np.sum(np.stack([inputs(np.float64, 3001, r) for r in range(size)]), axis=0)
before = stats()
out = np.empty_like(vec)
dup.Iallreduce(vec, out, op=MPI.SUM).Wait()
check(np.array_equal(out, expected), "Iallreduce on a new communicator")
check(stats().passed_by_reason[NOT_SET_UP] == before.passed_by_reason[NOT_SET_UP] + 1,
      "Iallreduce on a new communicator passed through")
dup.Allreduce(vec, out, op=MPI.SUM)
before = stats()
out = np.empty_like(vec)
dup.Iallreduce(vec, out, op=MPI.SUM).Wait()
check(np.array_equal(out, expected), "Iallreduce after the first Allreduce")
check(stats().taken_nonblocking_calls == before.taken_nonblocking_calls + 1,
      "Iallreduce after the first Allreduce taken")
dup.Free()

# gradcomm's own Python module in the same process: its MPI_Allreduce calls (the `mpi` algorithm)
# reach the preloaded library, which passes them through (they are on gradcomm's communicators).
if "--with-gradcomm" in sys.argv:
    import gradcomm  # the test fails if the module does not load
    gradcomm.init()
    big = inputs(np.float32, 65537, rank)
    expected = np.sum(np.stack([inputs(np.float32, 65537, r) for r in range(size)]), axis=0)
    for algorithm in ("mpi", None):
        before = stats()
        result = gradcomm.allreduce(big, op="sum", algorithm=algorithm)
        check(np.array_equal(result, expected), f"gradcomm.allreduce ({algorithm}) result")
        after = stats()
        check(after.taken_calls == before.taken_calls,
              f"gradcomm.allreduce ({algorithm}) not taken again by the preload")
        if algorithm == "mpi":
            check(after.passed_by_reason[INTERNAL] > before.passed_by_reason[INTERNAL],
                  "gradcomm.allreduce (mpi) passed through as another gradcomm's")

total = comm.allreduce(len(failures), op=MPI.SUM)
if rank == 0:
    print("test_mpi4py: all checks passed" if total == 0 else f"test_mpi4py: {total} failures",
          flush=True)
sys.exit(1 if total else 0)
