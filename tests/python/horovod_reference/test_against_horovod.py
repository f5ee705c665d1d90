"""gradcomm.torch against the real Horovod (0.28.1, built by bench/horovod/env.sh), both in the
same processes: the same calls on the same inputs give bit-identical results, and the same
failures raise the same Python classes. Runs with the interpreter of Horovod's environment."""

import time

import pytest
import torch

horovod = pytest.importorskip("horovod.torch")
import gradcomm.torch as gc  # noqa: E402

horovod.init()
gc.init()
RANK, SIZE = gc.rank(), gc.size()
assert (horovod.rank(), horovod.size()) == (RANK, SIZE)
torch.set_num_threads(1)


def inputs(dtype, n=97, whole=False):
    g = torch.Generator().manual_seed(11 + RANK)
    x = torch.rand(n, generator=g, dtype=torch.float64) * 200 - 100
    return (x.round() if whole else x).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize("op,whole", [("Sum", True), ("Average", True), ("Max", False),
                                      ("Min", False)])
def test_allreduce_with_scale_factors(dtype, op, whole):
    """Sums on whole numbers (exact in any order); Min and Max on any values."""
    x = inputs(dtype, whole=whole)
    kw = dict(prescale_factor=0.3, postscale_factor=1.7)
    a = horovod.allreduce(x, op=getattr(horovod, op), name=f"h.{op}.{dtype}", **kw)
    b = gc.allreduce(x, op=getattr(gc, op), name=f"g.{op}.{dtype}", **kw)
    assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()
    a = horovod.allreduce(x, op=getattr(horovod, op))  # default factors, unnamed
    b = gc.allreduce(x, op=getattr(gc, op))
    assert torch.equal(a, b)


def test_integer_average():
    x = torch.full((4,), 49 if RANK == 0 else 0, dtype=torch.int64)
    a = horovod.allreduce(x, op=horovod.Average, postscale_factor=SIZE / 49)
    b = gc.allreduce(x, op=gc.Average, postscale_factor=SIZE / 49)
    assert torch.equal(a, b)


def test_grouped_allreduce():
    xs = [inputs(torch.float32, 13, True), inputs(torch.float64, 5, True)]
    a = horovod.grouped_allreduce(xs, op=horovod.Sum)
    b = gc.grouped_allreduce(xs, op=gc.Sum)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.float16, torch.float64])
def test_broadcast_allgather_alltoall(dtype):
    x = (torch.arange(2 * SIZE * 3) + 7 * RANK).to(dtype).view(2 * SIZE, 3)
    assert torch.equal(horovod.broadcast(x, root_rank=SIZE - 1), gc.broadcast(x, SIZE - 1))
    rows = x[:RANK + 1]
    assert torch.equal(horovod.allgather(rows), gc.allgather(rows))
    splits = torch.tensor([2 * SIZE - (SIZE - 1)] + [1] * (SIZE - 1), dtype=torch.int32)
    (a, ar), (b, br) = horovod.alltoall(x, splits=splits), gc.alltoall(x, splits=splits)
    assert torch.equal(a, b) and torch.equal(ar, br) and ar.dtype == br.dtype
    assert torch.equal(horovod.alltoall(x), gc.alltoall(x))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 2 * SIZE, 2 * SIZE + 1, 7 * SIZE + SIZE - 1])
def test_reducescatter(dtype, rows):
    """Whole numbers (exact in any order), every split of the first dimension (even, one row
    more on the first ranks, fewer rows than ranks), both ops, with and without factors."""
    x = inputs(dtype, rows * 3, whole=True).view(rows, 3)
    for op in ("Sum", "Average"):
        for kw in ({}, dict(prescale_factor=0.5, postscale_factor=3.0)):
            a = horovod.reducescatter(x, op=getattr(horovod, op), **kw)
            b = gc.reducescatter(x, op=getattr(gc, op), **kw)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (op, kw)
    vector = inputs(dtype, 2 * SIZE + 1, whole=True)  # 1-d: rows of one element
    assert torch.equal(horovod.reducescatter(vector, op=horovod.Sum),
                       gc.reducescatter(vector, op=gc.Sum))


def test_grouped_reducescatter_and_allgather():
    xs = [inputs(torch.float32, 3 * SIZE + 1, True),
          inputs(torch.int64, 4 * SIZE, True).view(-1, 2)]
    a = horovod.grouped_reducescatter(xs, op=horovod.Sum)
    b = gc.grouped_reducescatter(xs, op=gc.Sum)
    assert len(a) == len(b) == 2 and all(torch.equal(p, q) for p, q in zip(a, b))
    a = horovod.synchronize(horovod.grouped_reducescatter_async(xs, name="rs"))
    b = gc.synchronize(gc.grouped_reducescatter_async(xs, name="rs"))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    rows = [inputs(torch.float64, 2 * (RANK + 1)).view(-1, 2), torch.full((RANK,), RANK)]
    a, b = horovod.grouped_allgather(rows), gc.grouped_allgather(rows)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_reducescatter_errors():
    for lib in (horovod, gc):
        with pytest.raises(ValueError):  # a scalar
            lib.reducescatter(torch.tensor(3.0))
    for lib in (horovod, gc):  # ops other than Sum and Average: HorovodInternalError
        with pytest.raises(RuntimeError) as e:
            lib.reducescatter(torch.ones(2 * SIZE), op=lib.Max)
        assert any(c.__name__ == "HorovodInternalError" for c in type(e.value).__mro__)


def test_objects_and_join():
    obj = {"rank": RANK, "x": list(range(RANK))}
    assert horovod.broadcast_object(obj, root_rank=0) == gc.broadcast_object(obj, root_rank=0)
    assert horovod.allgather_object(obj) == gc.allgather_object(obj)
    # Joins a fifth of a second apart, so that the last to join is the same rank for both (of
    # ranks joining in one cycle, each library returns the one it processed last).
    time.sleep(0.2 * RANK)
    last = horovod.join()
    time.sleep(0.2 * RANK)
    assert gc.join() == last == SIZE - 1


def test_same_error_classes():
    for lib in (horovod, gc):
        with pytest.raises(ValueError):  # a handle that is not in flight
            lib.poll(987654)
        assert lib.synchronize(987654) is None
        with pytest.raises(ValueError):  # a dtype allreduce does not take
            lib.allreduce(torch.ones(3, dtype=torch.uint8))
        h = lib.allreduce_async(torch.ones(3), name="dup")
        with pytest.raises(ValueError):  # the same name while in flight
            lib.allreduce_async(torch.ones(3), name="dup")
        lib.synchronize(h)
    if SIZE > 1:
        for lib in (horovod, gc):  # shapes that differ: HorovodInternalError on every rank
            with pytest.raises(RuntimeError) as e:
                lib.allreduce(torch.ones(2, 3) if RANK else torch.ones(3, 2), name="shape")
            assert any(c.__name__ == "HorovodInternalError" for c in type(e.value).__mro__)


def test_optimizer_names_and_attributes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opts = [lib.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
        for lib in (horovod, gc)]
    assert sorted(opts[0]._parameter_names.values()) == sorted(opts[1]._parameter_names.values())
    for attr in ("backward_passes_per_step", "gradient_predivide_factor", "_synchronized",
                 "_should_synchronize", "sparse_as_dense"):
        assert getattr(opts[0], attr) == getattr(opts[1], attr), attr
    named = list(model.named_parameters())
    for lib in (horovod, gc):
        with pytest.raises(ValueError):
            lib.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=named + named[:1])
