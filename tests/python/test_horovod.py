"""gradcomm.torch as horovod.torch: every call of Horovod's PyTorch API that gradcomm implements,
against references computed on every rank from every rank's known input (each rank's input is
a function of its rank), in every dtype, in place and not, blocking and async; the refusals;
DistributedOptimizer against gradcomm's DistributedDataParallel; and join() with uneven inputs."""

import copy
import gc
import json
import os
import time

import numpy as np
import pytest
import torch
from conftest import Embedder, same_on_every_rank
from mpi4py import MPI

import gradcomm
import gradcomm.torch as hvd

hvd.init()
RANK = hvd.rank()
SIZE = hvd.size()
torch.set_num_threads(1)

DTYPES = [torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def input_of(rank, count, dtype):
    """Small integers (exact in every dtype, products included) that differ per rank."""
    values = (torch.arange(count, dtype=torch.int64) * 7 + rank * 3) % 5 - 2 + (rank % 2)
    return values.to(dtype)


def reference(op, count, dtype):
    """The result computed here from every rank's input, in float64 then cast (NumPy)."""
    inputs = np.stack([input_of(r, count, torch.float64).numpy() for r in range(SIZE)])
    if op == hvd.Sum:
        out = inputs.sum(axis=0)
    elif op == hvd.Average:
        out = inputs.sum(axis=0)
        out = np.trunc(out / SIZE) if not dtype.is_floating_point else out / SIZE
    elif op == hvd.Min:
        out = inputs.min(axis=0)
    elif op == hvd.Max:
        out = inputs.max(axis=0)
    else:
        out = inputs.prod(axis=0)
    return torch.from_numpy(out).to(dtype)


def close(a, b):
    if a.dtype.is_floating_point:
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(a.dtype, 1e-12)
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_form(dtype, op):
    for count in (0, 1, 13, 1000):
        expected = reference(op, count, dtype)
        x = input_of(RANK, count, dtype)
        out = hvd.allreduce(x, op=op)
        assert torch.equal(x, input_of(RANK, count, dtype))  # the input is untouched
        assert close(out, expected), (count, out, expected)
        y = input_of(RANK, count, dtype)
        assert hvd.allreduce_(y, op=op) is y and close(y, expected)
        h = hvd.allreduce_async(input_of(RANK, count, dtype), op=op)
        assert close(hvd.synchronize(h), expected)
        z = input_of(RANK, count, dtype)
        h = hvd.allreduce_async_(z, op=op)
        while not hvd.poll(h):
            pass
        assert hvd.synchronize(h) is z and close(z, expected)
        assert same_on_every_rank(z)


def test_average_flag_scale_factors_and_compression():
    x = input_of(RANK, 100, torch.float32)
    with pytest.deprecated_call():
        assert close(hvd.allreduce(x, average=False), reference(hvd.Sum, 100, torch.float32))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert close(scaled, reference(hvd.Sum, 100, torch.float32) * 1.5)
    ints = hvd.allreduce(input_of(RANK, 100, torch.int64), op=hvd.Sum, postscale_factor=0.5)
    assert torch.equal(ints, (reference(hvd.Sum, 100, torch.float64) * 0.5).to(torch.int64))
    fp16 = hvd.allreduce(x * 0.1, op=hvd.Average, compression=hvd.Compression.fp16)
    assert fp16.dtype == torch.float32
    assert torch.allclose(fp16, reference(hvd.Average, 100, torch.float32) * 0.1, atol=1e-3)


def test_grouped_allreduce_every_form():
    shapes = [(3, 5), (0,), (1,), (17,), (4, 4, 2)]
    dtypes = [torch.float32, torch.int32, torch.float64, torch.bfloat16, torch.int64]
    inputs = [input_of(RANK, int(np.prod(s)), d).reshape(s) for s, d in zip(shapes, dtypes)]
    expected = [reference(hvd.Sum, int(np.prod(s)), d).reshape(s) for s, d in zip(shapes, dtypes)]
    outs = hvd.grouped_allreduce(inputs, op=hvd.Sum)
    assert all(close(o, e) for o, e in zip(outs, expected))
    copies = [t.clone() for t in inputs]
    assert hvd.grouped_allreduce_(copies, op=hvd.Sum) == copies
    assert all(close(o, e) for o, e in zip(copies, expected))
    h = hvd.grouped_allreduce_async(inputs, op=hvd.Sum)
    assert all(close(o, e) for o, e in zip(hvd.synchronize(h), expected))
    copies = [t.clone() for t in inputs]
    h = hvd.grouped_allreduce_async_(copies, op=hvd.Sum)
    assert all(close(o, e) for o, e in zip(hvd.synchronize(h), expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_every_form(dtype):
    root = SIZE - 1
    for count in (0, 1, 31):
        x = input_of(RANK, count, dtype)
        assert torch.equal(hvd.broadcast(x, root), input_of(root, count, dtype))
        assert torch.equal(x, input_of(RANK, count, dtype))
        y = input_of(RANK, count, dtype)
        assert hvd.broadcast_(y, root_rank=root) is y
        assert torch.equal(y, input_of(root, count, dtype))
        h = hvd.broadcast_async(input_of(RANK, count, dtype), root)
        assert torch.equal(hvd.synchronize(h), input_of(root, count, dtype))
        z = input_of(RANK, count, dtype)
        assert hvd.synchronize(hvd.broadcast_async_(z, root)) is z
        assert torch.equal(z, input_of(root, count, dtype))


def test_allgather_objects_and_barrier():
    # Every rank a different number of rows (rank 0 none at 2+ ranks).
    rows = RANK if SIZE > 1 else 2
    x = torch.full((rows, 3), float(RANK))
    out = hvd.allgather(x)
    sizes = [r if SIZE > 1 else 2 for r in range(SIZE)]
    assert out.shape == (sum(sizes), 3)
    assert torch.equal(out, torch.cat([torch.full((s, 3), float(r)) for r, s in
                                       enumerate(sizes)]))
    assert torch.equal(hvd.synchronize(hvd.allgather_async(x)), out)
    bf = hvd.allgather(torch.full((1,), RANK, dtype=torch.bfloat16))
    assert torch.equal(bf, torch.arange(SIZE).to(torch.bfloat16))
    if SIZE > 1:  # as Horovod: HorovodInternalError on every rank (here also a MismatchError)
        with pytest.raises(hvd.HorovodInternalError, match="must agree") as e:
            hvd.allgather(torch.zeros(2, 3 + (RANK == 1)))
        assert isinstance(e.value, hvd.MismatchError)
    assert hvd.broadcast_object({"rank": RANK, "s": "x" * RANK}, root_rank=SIZE - 1) == {
        "rank": SIZE - 1, "s": "x" * (SIZE - 1)}
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(SIZE)]
    hvd.barrier()
    uint8 = hvd.allgather(torch.full((2, 2), RANK, dtype=torch.uint8))
    assert uint8.tolist() == [[r, r] for r in range(SIZE) for _ in range(2)]


def split_rows(rows):
    """Horovod's split of a first dimension: the first rows % SIZE ranks one row more."""
    per, extra = divmod(rows, SIZE)
    return [per + (r < extra) for r in range(SIZE)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_every_form(dtype):
    """Sum and Average, blocking, async with scale factors (Horovod's arithmetic: integers
    truncated after each), grouped; against the reference; this rank keeps its rows."""
    for rows in (0, 1, SIZE, 2 * SIZE + 1, 101):
        x = input_of(RANK, rows * 3, dtype).view(rows, 3)
        before = x.clone()
        start = sum(split_rows(rows)[:RANK])
        mine = slice(start, start + split_rows(rows)[RANK])
        for op in (hvd.Sum, hvd.Average):
            want = reference(op, rows * 3, dtype).view(rows, 3)[mine]
            out = hvd.reducescatter(x, op=op)
            assert out.dtype == dtype and out.shape == want.shape and close(out, want), (rows, op)
            out = hvd.synchronize(hvd.reducescatter_async(x, name=f"rs.{rows}.{op}", op=op,
                                                          prescale_factor=2.0,
                                                          postscale_factor=1.5))
            sums = reference(hvd.Sum, rows * 3, torch.float64).view(rows, 3)[mine]
            scaled = sums * 3 if op == hvd.Sum else sums * 3 / SIZE
            if not dtype.is_floating_point:
                scaled = scaled.trunc()
            assert close(out, scaled.to(dtype)), (rows, op, "scaled")
        assert torch.equal(x, before)  # the input is not written
    a, b = input_of(RANK, 7, dtype), input_of(RANK, 4 * SIZE, dtype).view(2 * SIZE, 2)
    outs = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    assert close(outs[0], reference(hvd.Sum, 7, dtype)[sum(split_rows(7)[:RANK]):][
        :split_rows(7)[RANK]])
    assert close(outs[1], reference(hvd.Sum, 4 * SIZE, dtype).view(2 * SIZE, 2)[
        2 * RANK:2 * RANK + 2])
    handle = hvd.grouped_reducescatter_async([a, b], name="grs", op=hvd.Sum)
    assert all(close(p, q) for p, q in zip(hvd.synchronize(handle), outs))
    rows = [input_of(RANK, 2 * RANK, dtype).view(RANK, 2), input_of(RANK, 1, dtype)]
    gathered = hvd.grouped_allgather(rows)
    assert torch.equal(gathered[0], torch.cat([input_of(r, 2 * r, dtype).view(r, 2)
                                               for r in range(SIZE)]))
    assert torch.equal(gathered[1], torch.cat([input_of(r, 1, dtype) for r in range(SIZE)]))


def test_reducescatter_errors_and_mismatches():
    with pytest.raises(ValueError, match="scalar"):
        hvd.reducescatter(torch.tensor(2.0))
    with pytest.raises(hvd.HorovodInternalError, match="Average and Sum"):  # as Horovod
        hvd.reducescatter(torch.ones(4), op=hvd.Max)
    with pytest.raises(ValueError, match="unsupported dtype torch.uint8"):
        hvd.reducescatter(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="zero-sized dimension after the first"):
        hvd.reducescatter(torch.ones(4, 0))
    if SIZE > 1:  # shapes, ops or factors that differ: an error on every rank, not a hang
        with pytest.raises(hvd.HorovodInternalError, match="must agree"):
            hvd.reducescatter(torch.ones(2 * SIZE + RANK), name="rs.shape")
        with pytest.raises(hvd.MismatchError):
            hvd.reducescatter(torch.ones(4), name="rs.op", op=hvd.Sum if RANK else hvd.Average)
        with pytest.raises(hvd.MismatchError):
            hvd.grouped_reducescatter([torch.ones(4)] * (1 + (RANK == 1)), name="rs.list")
    assert hvd.reducescatter(torch.ones(SIZE), op=hvd.Sum).tolist() == [float(SIZE)]


def test_a_call_that_fails_on_one_rank_fails_on_every_rank_and_the_next_ones_match():
    """A call that fails on rank 0 before anything is sent (bad splits, a refused dtype, a
    scalar, a tensor that is not contiguous): the others' calls of it fail at once, naming rank
    0 and why, and the next calls, unnamed ones too, pair up as before (they once met the
    others' failed call and returned its data)."""
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    bad = torch.ones(3, dtype=torch.uint8)
    calls = [
        lambda: hvd.alltoall(torch.ones(2 * SIZE), splits=[5] * SIZE if RANK == 0 else None),
        lambda: hvd.allreduce(bad if RANK == 0 else torch.ones(3), name="fails.here"),
        lambda: hvd.grouped_allreduce([torch.ones(2), bad if RANK == 0 else torch.ones(3)]),
        # an iterator, read once: the failed call still names both parts
        lambda: hvd.grouped_allreduce(t for t in [torch.ones(2), bad if RANK == 0 else
                                                  torch.ones(3)]),
        lambda: hvd.reducescatter(torch.tensor(1.0) if RANK == 0 else torch.ones(SIZE)),
        lambda: hvd.allgather_async(torch.ones(3, 4)[:, ::2] if RANK == 0 else torch.ones(3, 2)),
    ]
    for i, call in enumerate(calls):
        start = time.monotonic()
        with pytest.raises(ValueError if RANK == 0 else hvd.MismatchError) as e:
            hvd.synchronize(call()) if i == 5 else call()
        if RANK != 0:
            assert "failed on rank 0 before it could run" in str(e.value), i
        assert time.monotonic() - start < 5, i
        got = hvd.alltoall(torch.full((SIZE,), float(RANK)))  # unnamed: in step again
        assert got.tolist() == [float(r) for r in range(SIZE)], i
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(SIZE)] * 2, i


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that differ")
@pytest.mark.parametrize("name", [None, "sparse.one"])
def test_a_sparse_allreduce_refused_on_one_rank_fails_on_every_rank(name):
    # Rank 0 passes a dense tensor: it raises; the others' allgathers fail at once naming it
    # (before, they waited for it, and its unnamed numbering fell three calls behind).
    sparse = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    started = time.monotonic()
    with pytest.raises(Exception) as e:
        hvd.sparse_allreduce_async(sparse.to_dense() if RANK == 0 else sparse, name, hvd.Sum)()
    assert ("sparse COO" if RANK == 0 else "failed on rank 0") in str(e.value), str(e.value)
    assert time.monotonic() - started < 10
    got = hvd.sparse_allreduce_async(sparse, name, hvd.Sum)().coalesce().to_dense()
    assert got.tolist() == (sparse.to_dense() * SIZE).tolist()
    assert hvd.allgather(torch.tensor([float(RANK)])).tolist() == [float(r) for r in range(SIZE)]


def test_autograd():
    x = torch.full((4,), float(RANK + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (RANK + 1)).sum().backward()
    # d/dx_r of sum_s (s+1) * sum_q x_q = sum_s (s+1)
    assert torch.allclose(x.grad, torch.full((4,), float(SIZE * (SIZE + 1) / 2)))
    x.grad = None
    hvd.allreduce(x).sum().backward()  # Average: the gradient is averaged too
    assert torch.allclose(x.grad, torch.ones(4))
    x.grad = None
    outs = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    (outs[0] + outs[1]).sum().backward()
    assert torch.allclose(x.grad, torch.full((4,), 3.0 * SIZE))
    x.grad = None
    hvd.broadcast(x, root_rank=0).sum().backward()  # as Horovod: averaged, on the root only
    assert torch.allclose(x.grad, torch.full((4,), 1.0 if RANK == 0 else 0.0))
    x.grad = None
    g = hvd.allgather(x.view(2, 2))
    (g * torch.arange(g.numel()).view_as(g)).sum().backward()
    mine = torch.arange(4 * RANK, 4 * RANK + 4).float()
    assert torch.allclose(x.grad, mine)
    assert not hvd.allreduce(x, op=hvd.Max).requires_grad
    # reducescatter, as Horovod's: the allgather of the output gradient, times SIZE for Sum
    x.grad = None
    y = hvd.reducescatter(x.view(4, 1).expand(4, SIZE).contiguous(), op=hvd.Sum)
    (y * (RANK + 1)).sum().backward()  # row i's gradient: SIZE x (its owner + 1), SIZE columns
    owners = [r for r, k in enumerate(split_rows(4)) for _ in range(k)]
    assert torch.allclose(x.grad, torch.tensor([SIZE * SIZE * (o + 1.0) for o in owners]))
    x.grad = None
    z = x.repeat(SIZE)  # 4 * SIZE rows: rank r keeps rows 4r..4r+3
    hvd.grouped_reducescatter([z])[0].mul(RANK + 1).sum().backward()
    assert torch.allclose(x.grad, torch.full((4,), float(SIZE * (SIZE + 1) / 2)))
    x.grad = None  # the scale factors scale the gradient too (2 x 1.5)
    hvd.reducescatter(x.repeat(SIZE), op=hvd.Sum, prescale_factor=2.0,
                      postscale_factor=1.5).sum().backward()
    assert torch.allclose(x.grad, torch.full((4,), 3.0 * SIZE * SIZE))
    x.grad = None
    g = hvd.grouped_allgather([x.view(2, 2)])[0]  # as allgather's: averaged, this rank's rows
    (g * torch.arange(g.numel()).view_as(g)).sum().backward()
    assert torch.allclose(x.grad, mine)


def test_errors_and_refusals():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(3), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="process sets"):
        hvd.ProcessSet([0])
    with pytest.raises(NotImplementedError, match="process sets"):
        hvd.allreduce(torch.ones(3), process_set=object())
    with pytest.raises(NotImplementedError, match="elastic"):
        hvd.elastic.run
    assert hvd.synchronize(123456) is None  # as Horovod: a handle not in flight
    with pytest.raises(ValueError, match="not a handle"):  # as Horovod
        hvd.poll(123456)
    with pytest.raises(ValueError, match="unsupported dtype torch.uint8"):
        hvd.allreduce(torch.ones(3, dtype=torch.uint8))
    # Shapes that differ across ranks: an error on every rank, not a hang.
    if SIZE > 1:
        with pytest.raises(hvd.HorovodInternalError):
            hvd.allreduce(torch.ones(5 + RANK))
        with pytest.raises(hvd.MismatchError):
            hvd.synchronize(hvd.allreduce_async_(torch.ones(5 if RANK else 6)))
        with pytest.raises(hvd.HorovodInternalError, match=r"\[2, 3\]"):  # same count
            hvd.allreduce(torch.ones(2, 3) if RANK else torch.ones(3, 2))
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(SIZE)))


def test_introspection_and_timeline(tmp_path_factory):
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.mpi_enabled()
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    assert not hvd.gloo_built() and not hvd.nccl_built() and not hvd.ccl_built()
    assert 0 <= hvd.local_rank() < hvd.local_size() <= SIZE
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.cross_size() * hvd.local_size() == SIZE or not hvd.is_homogeneous()
    path = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tl") / "t.json"))
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(10))
    hvd.stop_timeline()
    with open(path.replace(".json", f".rank{RANK}.json")) as f:
        events = json.load(f)
    # One rank has nothing to reduce: the trace then only names the process and threads.
    assert any(e.get("name") == "allreduce" for e in events) or SIZE == 1
    assert any(e.get("name") == "process_name" for e in events)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.a = torch.nn.Linear(20, 64)
        self.b = torch.nn.Linear(64, 48)
        self.c = torch.nn.Linear(48, 5)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def data(step):
    g = torch.Generator().manual_seed(77 * step + RANK)
    return torch.randn(12, 20, generator=g), torch.randint(0, 5, (12,), generator=g)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("options", [{}, {"num_groups": 3}, {"backward_passes_per_step": 2},
                                     {"gradient_predivide_factor": 2.0},
                                     {"compression": hvd.Compression.fp16}])
def test_distributed_optimizer_matches_the_ddp_wrapper(options):
    passes = options.get("backward_passes_per_step", 1)
    ours = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=ours.named_parameters(), **options)
    ddp = hvd.DistributedDataParallel(Net())
    if "compression" in options:
        ddp.register_comm_hook(None, hvd.fp16_compress_hook)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        opt.zero_grad()
        ddp_opt.zero_grad()
        for k in range(passes):
            x, y = data(step * passes + k)
            torch.nn.functional.cross_entropy(ours(x), y).backward()
            if k + 1 < passes:
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
            else:
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        ddp_opt.step()
    if "num_groups" in options:
        assert len(opt._gradcomm_reducer.buckets()) == 3
    tolerance = 1e-3 if "compression" in options else 1e-6
    assert ((flat(ours) - flat(ddp)).norm() / flat(ddp).norm()).item() <= tolerance
    assert same_on_every_rank(flat(ours))


def test_distributed_optimizer_rules():
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()  # gradients backward did not reach count as zeros
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(hvd.InvalidArgument, match="named_parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(NotImplementedError, match="custom compressors"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 compression=object())


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that differ")
def test_distributed_optimizers_that_differ_between_ranks_are_refused_on_every_rank():
    # Different buckets (fusion thresholds) on different ranks: refused where the optimizer is
    # made, on every rank (by either reducer: GRADCOMM_TORCH_NEGOTIATED_REDUCER=1 runs the one
    # CUDA gradients use), and the ranks go on together.
    model = Net()
    with pytest.raises(hvd.InvalidArgument, match="differ"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 fusion_threshold=256 if RANK == 0 else 1 << 20)
    # What the buckets do not say (each refused where, before, the ranks reduced without a
    # word): a gradient_predivide_factor of rank 0's own (every rank ended with other
    # gradients), and the same parameters listed in another order (gradients of different
    # parameters summed in one slot).
    with pytest.raises(hvd.InvalidArgument, match="differ in the optimizer's parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(),
                                 gradient_predivide_factor=2.0 if RANK == 0 else 1.0)
    params = list(model.parameters())
    with pytest.raises(hvd.InvalidArgument, match="differ in the optimizer's parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD(params[::-1] if RANK == 0 else params, lr=0.1))
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE
    # An argument refused on one rank only: that rank raises its refusal, the others at once
    # (before, they waited for it in the check of the settings until the watchdog).
    for bad in ({"gradient_predivide_factor": 0.0}, {"backward_passes_per_step": 0},
                {"compression": object()}, {"groups": [[torch.zeros(1)]]}):
        started = time.monotonic()
        with pytest.raises((hvd.InvalidArgument, NotImplementedError)) as e:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     **(bad if RANK == 0 else {}))
        assert ("differ in the optimizer's parameters" in str(e.value)) == (RANK != 0), bad
        assert time.monotonic() - started < 10, bad
    # The reducer under the optimizer and gradcomm's DDP: a parameter refused on one rank only.
    from gradcomm._torch_common import gradient_reducer
    started = time.monotonic()
    mine = torch.zeros(3, dtype=torch.uint8 if RANK == 0 else torch.float32)
    with pytest.raises(hvd.InvalidArgument) as e:
        gradient_reducer([mine], ["w"], "reducer")
    assert ("unsupported dtype" if RANK == 0 else "another rank refused") in str(e.value)
    assert time.monotonic() - started < 10
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that differ")
def test_an_object_that_cannot_be_pickled_on_one_rank_fails_on_every_rank():
    # The rank whose object cannot be pickled raises its own error; the others fail at once
    # naming it (before, they waited for it until the watchdog, and a retry on that rank paired
    # with their pending call and took its object). Then the ranks go on together.
    def unpicklable():  # a local function: pickle refuses it
        return 0
    bad = SIZE - 1
    for call in (lambda o: hvd.allgather_object(o), lambda o: hvd.broadcast_object(o, bad)):
        started = time.monotonic()
        with pytest.raises(Exception) as e:
            call(unpicklable if RANK == bad else RANK)
        if RANK != bad:
            assert f"failed on rank {bad}" in str(e.value), str(e.value)
        assert time.monotonic() - started < 10
        assert hvd.allgather_object(RANK) == list(range(SIZE))


def step_failing_on(bad, opt, unused):
    """opt.step() where rank `bad` cannot hand the reducer parameter `unused`'s gradient (made to
    refuse it): that rank raises the refusal, every other rank a MismatchError naming it."""
    if RANK != bad:
        with pytest.raises(hvd.MismatchError, match=f"failed on rank {bad}"):
            opt.step()
        return
    real_mark = opt._gradcomm_mark

    def refusing(index):
        if opt._gradcomm_params[index] is unused:
            raise hvd.InvalidArgument("unused: refused on this rank")
        real_mark(index)
    opt._gradcomm_mark = refusing
    try:
        with pytest.raises(hvd.InvalidArgument, match="refused on this rank"):
            opt.step()
    finally:
        del opt._gradcomm_mark


def test_a_step_that_fails_on_one_rank_fails_on_every_rank_and_keeps_them_in_step():
    # Rank 0 alone fails to hand the reducer a gradient for a parameter backward did not reach
    # (made to refuse it here): its step() raises its error, every other rank's a MismatchError
    # naming it (none reduces without rank 0's gradients), no rank's gradients or parameters
    # change, and every rank goes on together.
    model = Net()
    unused = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [unused], lr=0.1))
    x, y = data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()

    def grads():
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local, before = grads().clone(), flat(model).clone()
    step_failing_on(0, opt, unused)
    assert torch.equal(grads(), local)  # nothing written back
    assert torch.equal(flat(model), before)
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE
    opt.zero_grad()
    unused.grad = None
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    assert same_on_every_rank(grads())
    with opt.skip_synchronize():
        opt.step()


@pytest.mark.skipif(SIZE < 3, reason="needs a sub-communicator that leaves a rank out")
def test_optimizers_on_a_sub_communicator_and_the_world():
    # Ranks 0 and 1 step an optimizer on a communicator of their own (the others make none),
    # then every rank one on the world: the world's buckets mean the same on every rank.
    sub = gradcomm.Communicator(MPI.COMM_WORLD.Split(0 if RANK < 2 else 1))
    x, y = data(0)
    if RANK < 2:
        model = Net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=sub)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    assert same_on_every_rank(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    with opt.skip_synchronize():
        opt.step()


def test_broadcast_parameters_and_optimizer_state():
    torch.manual_seed(100 + RANK)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model(torch.randn(4, 8))  # running stats and num_batches_tracked (int64) differ per rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for t in model.state_dict().values():
        assert same_on_every_rank(t)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (RANK + 1))
    if RANK == 0:  # only the root has state
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 1e-3
    for p in model.parameters():
        assert same_on_every_rank(opt.state[p]["exp_avg"])


@pytest.mark.skipif(SIZE < 2 or os.environ.get("GRADCOMM_TORCH_NEGOTIATED_REDUCER") != "1",
                    reason="needs ranks that differ, and the negotiated reducer on CPU models")
def test_an_optimizer_whose_reducer_fails_to_plan_on_one_rank_fails_on_every_rank(monkeypatch):
    # The negotiated reducer's buckets (on the GPU: memory that one rank may lack) fail on rank 0
    # only: it raises its error, the others at once (before, they waited in the reducer's check
    # of its settings until the watchdog).
    from gradcomm import _torch_common
    if RANK == 0:
        def refusing(self):
            raise RuntimeError("injected: no memory for the buckets")
        monkeypatch.setattr(_torch_common.NegotiatedReducer, "_plan", refusing)
    model = torch.nn.Linear(4, 2)
    started = time.monotonic()
    with pytest.raises(Exception) as e:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    assert ("injected" if RANK == 0 else "differ in the reducer's settings") in str(e.value)
    assert time.monotonic() - started < 10
    monkeypatch.undo()
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE


@pytest.mark.skipif(SIZE < 2, reason="needs ranks that differ")
def test_an_optimizer_state_stand_in_step_failing_off_the_root_fails_on_every_rank():
    # The root loaded its state (no stand-in step there); the others' stand-in step fails: the
    # root's broadcast fails at once, naming a failed rank (before, it waited for them).
    class Refusing(torch.optim.SGD):
        def step(self, closure=None):
            if RANK != 0:
                raise RuntimeError("injected: no stand-in step")
            return super().step(closure)

    model = torch.nn.Linear(4, 2)
    opt = Refusing(model.parameters(), lr=0.1, momentum=0.9)
    if RANK == 0:
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    started = time.monotonic()
    with pytest.raises(Exception) as e:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert ("failed on rank" in str(e.value)) if RANK == 0 else ("injected" in str(e.value))
    assert time.monotonic() - started < 10
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE


# horovod.torch's public names (0.28) a training script may use.
HOROVOD_NAMES = """init shutdown is_initialized rank size local_rank local_size cross_rank cross_size
is_homogeneous mpi_built mpi_enabled mpi_threads_supported gloo_built gloo_enabled nccl_built
ddl_built ccl_built cuda_built rocm_built start_timeline stop_timeline Average Sum Adasum Min Max
Product Compression allreduce allreduce_ allreduce_async allreduce_async_ grouped_allreduce
grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_ broadcast broadcast_
broadcast_async broadcast_async_ allgather allgather_async synchronize poll barrier join
broadcast_object allgather_object broadcast_parameters broadcast_optimizer_state
DistributedOptimizer ProcessSet global_process_set add_process_set remove_process_set alltoall
reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async
grouped_allgather grouped_allgather_async alltoall_async SyncBatchNorm elastic
sparse_allreduce_async""".split()


def test_import_line_is_the_only_change():
    assert hvd.__name__ == "gradcomm.torch"
    assert [name for name in HOROVOD_NAMES if not hasattr(hvd, name)] == []
    assert hvd.Compression.fp16 is not hvd.Compression.none


def test_scheduler_made_before_wrapping_and_groups():
    model = Net()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(base, step_size=1)  # puts a counting `step` on the instance
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), groups=2)
    assert len(opt._gradcomm_reducer.buckets()) == 2  # an int is a number of groups
    x, y = data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # all-reduces first: the step's result is the same on every rank
    assert same_on_every_rank(flat(model))


def join_training(seed):
    """A small model with a DistributedOptimizer whose buckets hold a layer each, and its
    single-process reference (the join tests)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference_model = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   fusion_threshold=64)
    return model, opt, reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.1)


def join_batch(r, k):
    """Rank r's batch of step k."""
    g = torch.Generator().manual_seed(100 * r + k)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def test_join_stands_in_for_allreduces_and_optimizer_steps():
    """Rank r trains 2 + r steps, then joins. Meanwhile the ranks still training all-reduce in
    every form (an async one left in flight across the step), call the world between backward
    and step(), and step a DistributedOptimizer whose buckets hold one layer each; the joined
    ranks contribute zeros to Sum and Average (which still divides by every rank) and nothing
    to Min and Max. The reference is computed here from every rank's data."""
    model, opt, reference_model, reference_opt = join_training(3)
    assert len(opt._gradcomm_reducer.buckets()) > 1
    batch = join_batch

    for k in range(2 + RANK):
        active = [r for r in range(SIZE) if 2 + r > k]
        total = float(sum(r + 1 for r in active))
        y = torch.full((5,), RANK + 1, dtype=torch.int64)
        pending = hvd.allreduce_async_(y, op=hvd.Max)  # synchronized after the step
        x = torch.full((7,), float(RANK + 1))
        assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((7,), total))
        assert torch.allclose(hvd.allreduce(x), torch.full((7,), total / SIZE))
        assert torch.equal(hvd.allreduce(x, op=hvd.Min), torch.full((7,), float(min(active) + 1)))
        group = [torch.full((3,), RANK + 1, dtype=torch.int32), torch.full((5,), 1.0,
                                                                            dtype=torch.float64)]
        hvd.grouped_allreduce_(group, op=hvd.Sum, fusion_threshold=16)
        assert group[0].tolist() == [int(total)] * 3 and group[1].tolist() == [len(active)] * 5
        hvd.barrier()
        opt.zero_grad()
        xb, yb = batch(RANK, k)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        hvd.allreduce(loss.detach(), op=hvd.Sum)  # a world call between backward and step()
        opt.step()
        assert torch.equal(hvd.synchronize(pending),
                           torch.full((5,), max(active) + 1, dtype=torch.int64))
        reference_opt.zero_grad()
        for r in active:  # every active rank's gradient, summed, over all ranks
            xr, yr = batch(r, k)
            torch.nn.functional.mse_loss(reference_model(xr), yr).backward()
        for p in reference_model.parameters():
            p.grad /= SIZE
        reference_opt.step()
        for p, q in zip(model.parameters(), reference_model.parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert hvd.join() == SIZE - 1
    # Everyone trains again after it, and refuses a bad call before any round.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]
    with pytest.raises(hvd.InvalidArgument, match="unknown algorithm"):
        hvd.allreduce(torch.ones(2), algorithm="no-such-algorithm")
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that joins and one that trains")
def test_a_rank_without_data_joins_before_the_first_step():
    """Rank 0 joins at once; the others step a DistributedOptimizer twice (its first steps, where
    the host reducer plans its buckets again) while it stands in; then rank 0 takes their model
    and every rank steps once more, all with the same model, equal to the reference."""
    model, opt, reference_model, reference_opt = join_training(5)
    batch = join_batch

    def step(k, active):
        if RANK in active:
            opt.zero_grad()
            xb, yb = batch(RANK, k)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
        reference_opt.zero_grad()
        for r in active:
            xr, yr = batch(r, k)
            torch.nn.functional.mse_loss(reference_model(xr), yr).backward()
        for p in reference_model.parameters():
            p.grad /= SIZE
        reference_opt.step()

    training = list(range(1, SIZE))
    for k in range(2):
        step(k, training)
    last = hvd.join()
    assert last in training  # the ranks that trained join in one cycle or in several
    # As with Horovod, the rank that sat out takes the model of one that trained.
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    step(2, list(range(SIZE)))
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert same_on_every_rank(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that joins and ranks that train")
def test_a_step_that_fails_on_one_rank_while_another_has_joined():
    """Rank 0 joins at once; the others hold their buckets until step(). The last rank's first
    step fails (a gradient refused in synchronize(), made to): it raises its error after the
    join round, the other training ranks a MismatchError naming it, and rank 0 stands in on.
    The next step is exact, and rank 0 takes the model of the last rank to join."""
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference_model = copy.deepcopy(model)
    unused = torch.nn.Parameter(torch.zeros(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [unused], lr=0.1),
                                   fusion_threshold=64)
    assert len(opt._gradcomm_reducer.buckets()) > 1
    bad = SIZE - 1
    if RANK == 0:
        last = hvd.join()
    else:
        for k in range(2):
            opt.zero_grad()
            xb, yb = join_batch(RANK, k)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            if k == 1:
                opt.step()
            else:
                step_failing_on(bad, opt, unused)
        last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    for r in range(1, SIZE):  # step 1 of every training rank, averaged over every rank
        xr, yr = join_batch(r, 1)
        (torch.nn.functional.mse_loss(reference_model(xr), yr) / SIZE).backward()
    torch.optim.SGD(reference_model.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that joins and ranks that train")
def test_a_joined_rank_without_the_optimizer_fails_the_step_on_every_rank():
    """Rank 0 drops its DistributedOptimizer and joins, so it cannot stand in for the others'
    steps: each one fails at once on every training rank, naming rank 0, with nothing reduced
    (they waited for rank 0 until the watchdog before). Rank 0 warns at once, stays joined
    until they join too, then raises. A negotiated reducer's steps go on (the negotiator
    stands in for its buckets). Then every rank all-reduces as before."""
    model, opt, _, _ = join_training(13)
    negotiated = opt._gradcomm_reducer.negotiated
    if RANK == 0:
        del opt
        gc.collect()
        if negotiated:
            hvd.join()
        else:
            with pytest.warns(UserWarning, match="does not hold"), \
                    pytest.raises(hvd.InvalidArgument, match="does not hold"):
                hvd.join()
    else:
        for k in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            xb, yb = join_batch(RANK, k)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            if negotiated:
                opt.step()
                continue
            start = time.monotonic()
            with pytest.raises(hvd.InvalidArgument, match="joined rank 0 .*cannot stand in"):
                opt.step()
            assert time.monotonic() - start < 10
            for p, b, g in zip(model.parameters(), before, grads):  # no step, nothing reduced
                assert torch.equal(p, b) and torch.equal(p.grad, g)
        hvd.join()
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]


def test_join_stands_in_for_broadcast_and_allgather_and_refuses_alltoall():
    """While rank 0 has joined, the others broadcast (from a rank still training), gather
    (rank 0 adds no rows) and reducescatter (rank 0 adds zeros); their alltoall fails on them,
    and rank 0 stays in join() until they join too. Ranks 1.. race to join last; every rank
    names the same one."""
    if SIZE == 1:
        assert hvd.join() == 0
        return
    if RANK == 0:
        last = hvd.join()
    else:
        assert hvd.broadcast(torch.full((3,), float(RANK)), root_rank=1).tolist() == [1.0] * 3
        assert hvd.allgather(torch.full((1,), RANK)).tolist() == list(range(1, SIZE))
        with pytest.raises(hvd.HorovodInternalError, match="joined"):
            hvd.alltoall(torch.ones(SIZE))
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE - 1] * 2
        # rank 0 stands in with zeros, and keeps no rows
        assert hvd.reducescatter(torch.ones(2 * SIZE + 1), op=hvd.Sum).tolist() == [
            float(SIZE - 1)] * split_rows(2 * SIZE + 1)[RANK]
        last = hvd.join()
    assert hvd.allgather(torch.tensor([last])).tolist() == [last] * SIZE
    assert 1 <= last < SIZE
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]


def test_join_switched_off(monkeypatch):
    """GRADCOMM_JOIN=0 on every rank: optimizer steps make no join round, and join() says so."""
    monkeypatch.setenv("GRADCOMM_JOIN", "0")
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [SIZE, SIZE]
    with pytest.raises(NotImplementedError, match="GRADCOMM_JOIN=0"):
        hvd.join()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.int64], ids=str)
def test_gpu_scaling_matches_the_negotiators_arithmetic(dtype):
    """The CUDA path scales on the tensor's stream with torch's ops (scale_on_device), the host
    path on the negotiation thread: run on CPU tensors here, both must give the same bits for
    factors that round (0.3, 1/size) and integers that truncate and saturate."""
    from gradcomm._torch_common import scale_on_device
    big = torch.iinfo(dtype).max // 2 if not dtype.is_floating_point else 1e4
    x = (torch.arange(1009) % 13 - 6).to(dtype) * (hvd.rank() + 3)
    x[:2] = torch.tensor([big, -big]).to(dtype)  # integers saturate past their range (x 3.7)
    for op, pre, post in ((hvd.Sum, 0.3, 3.7), (hvd.Average, 1.7, 1.0), (hvd.Sum, 1.0, 0.1)):
        want = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
        mine = x.clone()
        scale_on_device(mine, pre)
        total = hvd.allreduce(mine, op=hvd.Sum)
        scale_on_device(total, post / hvd.size() if op == hvd.Average else post)
        assert torch.equal(total, want), (dtype, op, pre, post, (total != want).nonzero()[:4])


def sparse_of(rank, shape=(30, 4)):
    """Rank `rank`'s sparse COO tensor: rank 1's empty, the others with repeated rows."""
    g = torch.Generator().manual_seed(5 + rank)
    nnz = 0 if rank == 1 else 2 + 3 * rank
    return torch.sparse_coo_tensor(torch.randint(0, shape[0], (1, nnz), generator=g),
                                   torch.randn(nnz, *shape[1:], generator=g), shape)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_sparse_allreduce_async(op):
    handle = hvd.sparse_allreduce_async(sparse_of(RANK), name="sparse.x", op=op)
    got = handle()
    want = sum(sparse_of(r).to_dense() for r in range(SIZE))
    want = want / SIZE if op == hvd.Average else want
    assert got.is_sparse and got._nnz() == sum(sparse_of(r)._nnz() for r in range(SIZE))
    assert torch.allclose(got.to_dense(), want, atol=1e-6)
    # Sizes that differ: an error on every rank, and the ranks go on together.
    if SIZE > 1:
        other = sparse_of(RANK, (31, 4) if RANK == SIZE - 1 else (30, 4))
        handle = hvd.sparse_allreduce_async(other, name="sparse.y", op=op)
        with pytest.raises(hvd.InvalidArgument, match="differ in size"):
            handle()
    with pytest.raises(hvd.InvalidArgument, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(3), name="sparse.z", op=op)
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == SIZE


def embedder_batch(step, rank):
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randint(0, 40, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g)


@pytest.mark.parametrize("sparse_as_dense,op", [(False, hvd.Average), (True, hvd.Average),
                                                 (False, hvd.Sum)])
def test_sparse_gradients_are_averaged_and_stay_sparse(sparse_as_dense, op):
    # As Horovod: the embedding's gradient is averaged (or summed) and handed to the optimizer
    # sparse, so SparseAdam (which takes sparse gradients only) steps it: densely reduced in
    # the first step, gathered by rows from the second (the ranks agree on it after the
    # first). The reference: every rank's batches through one model here.
    model, ref = Embedder(), Embedder()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.table.parameters())),
                                   named_parameters=model.table.named_parameters(),
                                   sparse_as_dense=sparse_as_dense, op=op)
    dense_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.out.parameters(), lr=0.1),
                                         named_parameters=model.out.named_parameters())
    ref_sparse = torch.optim.SparseAdam(list(ref.table.parameters()))
    if op == hvd.Sum:  # the table's gradient summed over the ranks, the rest averaged
        ref.table.weight.register_hook(lambda g: g * SIZE)
    ref_dense = torch.optim.SGD(ref.out.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        dense_opt.zero_grad()
        x, y = embedder_batch(step, RANK)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        assert model.table.weight.grad.is_sparse
        with opt.skip_synchronize():
            opt.step()
        dense_opt.step()
        ref_sparse.zero_grad()
        ref_dense.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(ref(*embedder_batch(step, r)[:1]),
                                                     embedder_batch(step, r)[1])
                   for r in range(SIZE))
        (loss / SIZE).backward()
        ref_sparse.step()
        ref_dense.step()
        # Agreed after the first step: rows from then on (dense with sparse_as_dense, and with
        # a negotiated reducer).
        dense = sparse_as_dense or opt._gradcomm_reducer.negotiated
        assert opt._gradcomm_rows == ({} if dense else {0: 1})
    assert same_on_every_rank(flat(model))
    assert torch.allclose(flat(model), flat(ref), atol=1e-5), (flat(model) - flat(ref)).abs().max()
    # A step where rank 0's backward does not reach the table: it offers no rows (zeros on the
    # dense path) and gets the others' back, sparse. (Another rank must reach it: torch
    # 1.13's SparseAdam fails on an empty sparse gradient.)
    if SIZE < 2:
        return
    opt.zero_grad()
    dense_opt.zero_grad()
    x, y = embedder_batch(9, RANK)
    out = model.out(torch.zeros(5, 6)) if RANK == 0 else model(x)
    torch.nn.functional.cross_entropy(out, y).backward()
    opt.synchronize()
    assert model.table.weight.grad.is_sparse
    assert same_on_every_rank(model.table.weight.grad.to_dense())
    with opt.skip_synchronize():
        opt.step()
    dense_opt.step()


def test_sparse_gradients_while_a_rank_without_data_has_joined():
    # Rank 0 joins at once and stands in for the others' three steps: dense zeros in the first
    # (the table still has its bucket slot), no rows in the next two (the ranks agreed on the
    # sparse table at the end of the first, the joined rank included). Average still divides
    # by every rank. The reference: the training ranks' batches through one model here.
    model, ref = Embedder(), Embedder()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    training = list(range(1, SIZE)) or [0]
    for step in range(3):
        if RANK in training:
            opt.zero_grad()
            x, y = embedder_batch(step, RANK)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert model.table.weight.grad.is_sparse
        ref_opt.zero_grad()
        (sum(torch.nn.functional.cross_entropy(ref(embedder_batch(step, r)[0]),
                                               embedder_batch(step, r)[1])
             for r in training) / SIZE).backward()
        ref_opt.step()
    hvd.join()
    if RANK in training:
        assert torch.allclose(flat(model), flat(ref), atol=1e-6), \
            (flat(model) - flat(ref)).abs().max()
    assert opt._gradcomm_rows == ({} if opt._gradcomm_reducer.negotiated else {0: 1})
