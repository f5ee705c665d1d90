"""gradcomm's Python module under mpirun (2 and 4 ranks from CTest), against NumPy references:
every dtype and op, in place and out of place, mpi4py sub-communicators, grouped all-reduce,
broadcast, the packer, and errors (gradcomm.Error with the message; the module stays usable).
Each test makes its collective calls on every rank before asserting, so a failure on one rank
cannot leave the others waiting."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import gradcomm

gradcomm.init()
RANK = gradcomm.rank()
SIZE = gradcomm.size()
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64]
OPS = ["sum", "average", "min", "max", "prod"]
COUNTS = [0, 1, 7, 1000, 65537]


def values(rank, count, dtype, op):
    """Small integers (exact in every dtype and in their sums and products)."""
    i = np.arange(count)
    if op == "prod":
        v = 1 + (rank + i) % 2  # 1 or 2: products stay below 2^SIZE
    else:
        v = (rank * 3 + i) % 11 - 5
    return v.astype(dtype)


def reference(count, dtype, op):
    stack = np.stack([values(r, count, dtype, op).astype(np.float64) for r in range(SIZE)])
    if op == "sum":
        return stack.sum(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    if op == "prod":
        return stack.prod(axis=0)
    total = stack.sum(axis=0)
    if np.issubdtype(dtype, np.integer):
        return np.trunc(total / SIZE)  # integer average truncates toward zero
    return total / SIZE


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS)
def test_every_dtype_and_op_against_numpy(dtype, op):
    failures = []
    for count in COUNTS:
        for algorithm in [None, "ring", "halving_doubling", "flat", "mpi"]:
            x = values(RANK, count, dtype, op)
            out = gradcomm.allreduce(x, op=op, algorithm=algorithm)            # new array
            inplace = x.copy()
            gradcomm.allreduce(inplace, op=op, algorithm=algorithm, out=inplace)  # in place
            given = np.empty_like(x)
            gradcomm.allreduce(x, op=op, algorithm=algorithm, out=given)      # into `out`
            ref = reference(count, dtype, op)
            tol = 1e-3 if dtype == np.float16 else 1e-6
            for name, got in [("new", out), ("inplace", inplace), ("out", given)]:
                if got.dtype != np.dtype(dtype) or got.shape != x.shape or not np.allclose(
                        got.astype(np.float64), ref, rtol=tol, atol=0):
                    failures.append(f"{name} count={count} algorithm={algorithm}")
            if not np.array_equal(x, values(RANK, count, dtype, op)):
                failures.append(f"input changed count={count} algorithm={algorithm}")
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_reduce_scatter_against_numpy(dtype, op):
    # Per block: 0, 1, 7 and 65537 elements (at 2+ ranks 65537 x 4+ bytes per block takes shm's
    # reduce-scatter with algorithm "shm"), with auto, ring and shm, into a new array and `out`.
    for count in [0, 1, 7, 65537]:
        for algorithm in [None, "ring", "shm"]:
            x = values(RANK, count * SIZE, dtype, op).reshape(SIZE, count)  # any shape
            want = reference(count * SIZE, dtype, op)[RANK * count:(RANK + 1) * count]
            got = gradcomm.reduce_scatter(x, op=op, algorithm=algorithm)
            assert got.dtype == np.dtype(dtype) and got.shape == (count,)
            assert np.allclose(got.astype(np.float64), want, rtol=1e-6, atol=0), (count, algorithm)
            into = np.empty(count, dtype=dtype)
            assert gradcomm.reduce_scatter(x, op=op, algorithm=algorithm, out=into) is into
            assert np.array_equal(into, got)
    if SIZE > 1:
        expect_error(gradcomm.InvalidArgument, "not a multiple of the",
                     lambda: gradcomm.reduce_scatter(np.ones(SIZE * 3 + 1, dtype=np.float32)))
    expect_error(gradcomm.InvalidArgument, "out has 2 elements",
                 lambda: gradcomm.reduce_scatter(np.ones(SIZE * 3, dtype=np.float32),
                                                 out=np.empty(2, dtype=np.float32)))


def test_shapes_are_kept_and_views_work():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * (RANK + 1)
    out = gradcomm.allreduce(x, op="sum")
    assert out.shape == (2, 3, 4)
    assert np.array_equal(out, np.arange(24, dtype=np.float32).reshape(2, 3, 4) *
                          (SIZE * (SIZE + 1) / 2))
    big = np.ones(100, dtype=np.float64)
    gradcomm.allreduce(big[10:20], op="sum", out=big[10:20])  # a contiguous slice, in place
    assert big[9] == 1 and big[10] == SIZE and big[19] == SIZE and big[20] == 1


def test_mpi4py_sub_communicators():
    color = RANK % 2
    sub = MPI.COMM_WORLD.Split(color, RANK)
    comm = gradcomm.Communicator(sub)
    members = [r for r in range(SIZE) if r % 2 == color]
    x = np.full(5, RANK, dtype=np.int64)
    out = gradcomm.allreduce(x, op="sum", comm=comm)
    assert comm.size() == len(members) and comm.rank() == members.index(RANK)
    assert np.all(out == sum(members))
    comm.free()
    sub.Free()


def test_grouped_allreduce_and_broadcast():
    a = np.full(3, RANK, dtype=np.float32)
    b = np.arange(5000, dtype=np.float64) + RANK
    c = np.full(7, 2 * RANK, dtype=np.int32)
    result = gradcomm.grouped_allreduce([a, b, c], op="sum", fusion_threshold=1024)
    s = SIZE * (SIZE - 1) // 2
    assert result[0] is a
    assert np.all(a == s) and np.array_equal(b, np.arange(5000) * SIZE + s) and np.all(c == 2 * s)
    v = np.full(4, RANK, dtype=np.float64)
    gradcomm.broadcast(v, root=SIZE - 1)
    assert np.all(v == SIZE - 1)


def test_packer_round_trip_through_an_allreduce():
    tensors = [np.full(3000, RANK + 1, dtype=np.float32), np.arange(5000, dtype=np.float32)]
    packer = gradcomm.GradientPacker(tensors, num_split=4)
    assert not packer.declined
    packer.pack()
    (buffer,) = packer.buffers()
    assert buffer.shape == (8000,) and buffer.dtype == np.float32
    gradcomm.allreduce(buffer, op="sum", out=buffer)
    packer.unpack()
    assert np.all(tensors[0] == SIZE * (SIZE + 1) / 2)
    assert np.array_equal(tensors[1], np.arange(5000, dtype=np.float32) * SIZE)
    tiny = gradcomm.GradientPacker([np.zeros(3, dtype=np.float32)])
    assert tiny.declined and "min_chunk" in tiny.decline_reason or tiny.decline_reason


def expect_error(cls, text, fn):
    with pytest.raises(cls) as info:
        fn()
    assert text in str(info.value), str(info.value)


def test_errors_name_the_problem_and_leave_the_module_usable():
    x = np.ones(8, dtype=np.float32)
    expect_error(gradcomm.InvalidArgument, "unknown op 'median'",
                 lambda: gradcomm.allreduce(x, op="median"))
    expect_error(gradcomm.Error, "unknown algorithm 'nope'",
                 lambda: gradcomm.allreduce(x, algorithm="nope"))
    expect_error(gradcomm.Error, "not C-contiguous",
                 lambda: gradcomm.allreduce(np.ones((4, 4), dtype=np.float32).T))
    expect_error(gradcomm.Error, "unsupported dtype",
                 lambda: gradcomm.allreduce(np.ones(4, dtype=np.uint8)))
    ro = np.ones(4, dtype=np.float32)
    ro.setflags(write=False)
    expect_error(gradcomm.Error, "read-only", lambda: gradcomm.allreduce(ro, out=ro))
    expect_error(gradcomm.Error, "out has 3 elements",
                 lambda: gradcomm.allreduce(x, out=np.ones(3, dtype=np.float32)))
    expect_error(gradcomm.Error, "not an array", lambda: gradcomm.allreduce([1.0, 2.0]))
    expect_error(gradcomm.Error, "root", lambda: gradcomm.broadcast(x, root=SIZE))
    assert issubclass(gradcomm.InvalidArgument, gradcomm.Error)
    out = gradcomm.allreduce(x, op="sum")  # still usable
    assert np.all(out == SIZE)


@pytest.mark.skipif(SIZE == 1, reason="needs 2 ranks")
@pytest.mark.parametrize("call", ["allreduce", "allreduce_async", "grouped_allreduce",
                                  "broadcast", "reduce_scatter"])
def test_a_bad_array_on_one_rank_fails_on_every_rank_and_the_ranks_stay_in_step(call):
    # The rank with the bad array raises its own error; the others, whose call it never makes,
    # a MismatchError naming it at once (not a wait for it, nor its next call in the failed
    # one's place), and every rank's next call meets the others' next.
    bad = SIZE - 1
    mine = RANK == bad
    good = np.ones(4 * SIZE, dtype=np.float32)
    strided = np.ones((4 * SIZE, 2), dtype=np.float32)[:, 0]
    array = strided if mine else good
    started = time.monotonic()
    with pytest.raises(gradcomm.Error) as e:
        if call == "allreduce":
            gradcomm.allreduce(array)
        elif call == "allreduce_async":
            gradcomm.allreduce_async(array).wait()
        elif call == "grouped_allreduce":
            gradcomm.grouped_allreduce([good.copy(), array])
        elif call == "broadcast":
            gradcomm.broadcast(array)
        else:
            gradcomm.reduce_scatter(array)
    if mine:
        assert isinstance(e.value, gradcomm.InvalidArgument), e.value
        assert "not C-contiguous" in str(e.value)
    else:
        assert isinstance(e.value, gradcomm.MismatchError), e.value
        assert f"the call failed on rank {bad} before it could run" in str(e.value)
    assert time.monotonic() - started < 5
    out = gradcomm.allreduce(np.full(4 * SIZE, RANK + 1.0, dtype=np.float32), op="sum")
    assert np.all(out == SIZE * (SIZE + 1) / 2)


def test_every_call_rejects_bad_arrays_before_communicating():
    x = np.ones(8, dtype=np.float32)
    ro = np.ones(4, dtype=np.float32)
    ro.setflags(write=False)
    bad = gradcomm.InvalidArgument
    # Byte order other than the machine's would be summed as garbage.
    expect_error(bad, "byte order", lambda: gradcomm.allreduce(np.ones(4, dtype=">f4")))
    expect_error(bad, "of float64", lambda: gradcomm.allreduce(x, out=np.ones(8)))
    buf = np.zeros(16, dtype=np.float32)
    expect_error(bad, "overlap partially", lambda: gradcomm.allreduce(buf[0:8], out=buf[1:9]))
    expect_error(bad, "read-only", lambda: gradcomm.allreduce(x, out=ro))
    # grouped_allreduce
    expect_error(bad, "not an array", lambda: gradcomm.grouped_allreduce([x, [1.0]]))
    expect_error(bad, "read-only", lambda: gradcomm.grouped_allreduce([x, ro]))
    expect_error(bad, "overlaps", lambda: gradcomm.grouped_allreduce([x, x]))
    expect_error(bad, "unknown op 'median'", lambda: gradcomm.grouped_allreduce([x], op="median"))
    expect_error(bad, "unknown algorithm 'nope'",
                 lambda: gradcomm.grouped_allreduce([x], algorithm="nope"))
    expect_error(bad, "unknown algorithm 'nope'",
                 lambda: gradcomm.grouped_allreduce([], algorithm="nope"))
    # broadcast
    expect_error(bad, "root -1", lambda: gradcomm.broadcast(x, root=-1))
    expect_error(bad, "read-only", lambda: gradcomm.broadcast(ro))
    expect_error(bad, "not C-contiguous",
                 lambda: gradcomm.broadcast(np.ones((4, 4), dtype=np.float32).T))
    # the packer
    expect_error(bad, "num_split", lambda: gradcomm.GradientPacker([x], num_split=0))
    expect_error(bad, "overlaps", lambda: gradcomm.GradientPacker([x, x]))
    expect_error(bad, "read-only", lambda: gradcomm.GradientPacker([ro]))
    # communicators
    expect_error(bad, "mpi4py communicator", lambda: gradcomm.Communicator("x"))
    intercomm = None
    if SIZE >= 2:
        half = MPI.COMM_WORLD.Split(RANK % 2, RANK)
        intercomm = half.Create_intercomm(0, MPI.COMM_WORLD, 1 - RANK % 2, 7)
        expect_error(bad, "intercommunicator", lambda: gradcomm.Communicator(intercomm))
        intercomm.Free()
        half.Free()
    spare = gradcomm.Communicator(MPI.COMM_WORLD)
    spare.free()
    expect_error(bad, "was freed", lambda: spare.allreduce(x))
    out = gradcomm.allreduce(x, op="sum")  # still usable, and in step on every rank
    assert np.all(out == SIZE)


def test_topology_queries():
    assert 0 <= gradcomm.local_rank() < gradcomm.local_size() <= SIZE
    assert "ring" in gradcomm.algorithm_names()


def test_allreduce_async_matches_blocking_and_releases_the_gil():
    import threading
    import time
    xs = [values(RANK, n, np.float32, "sum") for n in (1, 1000, 65537, 300007)]
    refs = [gradcomm.allreduce(x, op="sum", algorithm="ring") for x in xs]
    handles = [gradcomm.allreduce_async(x, op="sum", algorithm="ring") for x in xs]
    inplace = xs[2].copy()
    h_inplace = gradcomm.allreduce_async(inplace, op="sum", out=inplace)
    # Another Python thread runs while this one waits: wait() does not hold the GIL.
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    results = [h.wait() for h in reversed(handles)][::-1]
    h_inplace.wait()
    stop.set()
    ticker.join()
    for got, ref in zip(results, refs):
        assert np.array_equal(got, ref)
    assert np.array_equal(inplace, refs[2])
    assert handles[0].done()  # finished: done() again is True
    assert len(ticks) > 0
    # A handle never polled finishes while the caller sleeps.
    h = gradcomm.allreduce_async(np.ones(100000, dtype=np.float64), op="sum")
    deadline = time.monotonic() + 60
    while not h.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert np.all(h.wait() == SIZE)


def test_allreduce_async_errors():
    with pytest.raises(gradcomm.InvalidArgument, match="allreduce_async"):
        gradcomm.allreduce_async(np.ones(4), op="nope")
    with pytest.raises(gradcomm.InvalidArgument, match="unknown algorithm"):
        gradcomm.allreduce_async(np.ones(4), algorithm="nope")
    # The module is still usable.
    assert np.all(gradcomm.allreduce_async(np.ones(3), op="sum").wait() == SIZE)
