"""gradcomm.torch matches calls by name, as Horovod: calls made in a different order on every
rank complete with the right results; a name some ranks never submit, or one that means
different things on different ranks, raises on every rank within seconds; duplicate names are a
ValueError. Then Horovod's semantics, each against Horovod's documented behaviour (its formula
computed here with NumPy): the scaling arithmetic bit for bit, dtypes, true asynchrony, error
classes, optimizer attributes and messages. Every rank checks its own result."""

import time
import warnings

import numpy as np
import pytest
import torch

import gradcomm.torch as hvd

hvd.init()
RANK = hvd.rank()
SIZE = hvd.size()
torch.set_num_threads(1)


def value(r, k, n, dtype):
    return (torch.arange(n, dtype=torch.float64) + 3 * r + k).to(dtype)


def test_shuffled_orders_complete():
    """Each rank makes the same 40 calls in its own order: named async allreduces, allgathers,
    broadcasts and grouped allreduces shuffled per rank; unnamed async allreduces at random
    places but in one order among themselves; blocking named allreduces in one order among
    themselves (as a program that blocks must have them)."""
    rng = np.random.default_rng(1000 + RANK)
    named = []
    for k in range(8):
        named.append(("allreduce", k))
        named.append(("allgather", k))
        named.append(("broadcast", k))
    named += [("grouped", k) for k in range(4)]
    rng.shuffle(named)
    unnamed = [("unnamed", k) for k in range(4)]
    blocking = [("blocking", k) for k in range(4)]
    calls = named
    for extra in (unnamed, blocking):  # keep each list's own order, at random places
        for item in extra:
            at = int(rng.integers(0, len(calls) + 1))
            calls = calls[:at] + [item] + calls[at:]
        # later items must come after earlier ones: re-sort within the list
        positions = sorted(i for i, c in enumerate(calls) if c in extra)
        for i, item in zip(positions, extra):
            calls[i] = item
    handles = {}
    for kind, k in calls:
        n = 5 + k
        if kind == "allreduce":
            t = value(RANK, k, n, torch.float32)
            handles[(kind, k)] = hvd.allreduce_async_(t, name=f"a{k}", op=hvd.Sum)
        elif kind == "allgather":
            t = torch.full((1 + RANK % 2, 2), float(RANK * 10 + k))
            handles[(kind, k)] = hvd.allgather_async(t, name=f"g{k}")
        elif kind == "broadcast":
            t = value(RANK, k, n, torch.int64)
            handles[(kind, k)] = hvd.broadcast_async_(t, root_rank=k % SIZE, name=f"b{k}")
        elif kind == "grouped":
            ts = [value(RANK, k, n, torch.float64), value(RANK, k, 3, torch.int32)]
            handles[(kind, k)] = hvd.grouped_allreduce_async_(ts, name=f"gr{k}", op=hvd.Sum)
        elif kind == "unnamed":
            t = value(RANK, k, n, torch.float64)
            handles[(kind, k)] = hvd.allreduce_async(t, op=hvd.Max)
        else:
            out = hvd.allreduce(value(RANK, k, n, torch.float32), name=f"s{k}", op=hvd.Sum)
            assert torch.equal(out, sum(value(r, k, n, torch.float32) for r in range(SIZE)))
    for (kind, k), h in handles.items():
        n = 5 + k
        out = hvd.synchronize(h)
        if kind == "allreduce":
            assert torch.equal(out, sum(value(r, k, n, torch.float32) for r in range(SIZE)))
        elif kind == "allgather":
            expected = torch.cat([torch.full((1 + r % 2, 2), float(r * 10 + k))
                                  for r in range(SIZE)])
            assert torch.equal(out, expected)
        elif kind == "broadcast":
            assert torch.equal(out, value(k % SIZE, k, n, torch.int64))
        elif kind == "grouped":
            assert torch.equal(out[0], sum(value(r, k, n, torch.float64) for r in range(SIZE)))
            assert torch.equal(out[1], sum(value(r, k, 3, torch.int32) for r in range(SIZE)))
        elif kind == "unnamed":
            assert torch.equal(out, value(SIZE - 1, k, n, torch.float64))


def test_allgather_and_barrier_in_different_orders_complete():
    """The order that hung: rank 0 gathers, then waits in a barrier; the others wait in the
    barrier first, then gather."""
    if RANK == 0:
        h = hvd.allgather_async(torch.full((2,), float(RANK)), name="dup")
        hvd.barrier()
        out = hvd.synchronize(h)
    else:
        hvd.barrier()
        out = hvd.allgather(torch.full((2,), float(RANK)), name="dup")
    assert out.tolist() == [float(r) for r in range(SIZE) for _ in range(2)]


@pytest.mark.skipif(SIZE == 1, reason="one rank's call finishes at once")
def test_duplicate_name_in_flight_is_a_value_error():
    # Each rank submits its own name first: no other rank submits it before the barrier, so it
    # is surely in flight when this rank submits it again.
    mine = [torch.ones(3) for _ in range(SIZE)]
    handles = {RANK: hvd.allreduce_async_(mine[RANK], name=f"twice.{RANK}", op=hvd.Sum)}
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async_(torch.ones(3), name=f"twice.{RANK}")
    hvd.barrier()
    for r in range(SIZE):
        if r != RANK:
            handles[r] = hvd.allreduce_async_(mine[r], name=f"twice.{r}", op=hvd.Sum)
    for r, h in handles.items():
        assert hvd.synchronize(h).tolist() == [SIZE] * 3
    again = hvd.synchronize(hvd.allreduce_async_(torch.ones(3), name="twice.0", op=hvd.Sum))
    assert again.tolist() == [SIZE] * 3  # the name is free again once its call finished


def failing_after_one(real):
    """`real`, failing from its second call on (a fault injected into a grouped call's
    submissions), and the list of what its first call returned."""
    made = []

    def failing_second(*args, **kwargs):
        if made:
            raise RuntimeError("injected: the second submission fails")
        made.append(real(*args, **kwargs))
        return made[-1]
    return failing_second, made


@pytest.mark.parametrize("call,submitter", [("grouped_allreduce_async_", "_submit_allreduce"),
                                             ("grouped_allgather_async", "_allgather_submit")])
def test_a_grouped_call_failing_part_way_finishes_what_it_submitted(call, submitter,
                                                                   monkeypatch):
    # Every rank's grouped call submits its first tensor, then fails on the second (a fault
    # injected here). What it submitted runs anyway (the peers wait for it) into memory this
    # rank keeps alive, and is dropped once finished: no handle is left behind.
    import gradcomm.torch as module
    failing_second, made = failing_after_one(getattr(module, submitter))
    handles = dict(module._handles)
    parts = [torch.full((7,), float(RANK + 1)) for _ in range(3)]
    with monkeypatch.context() as patched:
        patched.setattr(module, submitter, failing_second)
        with pytest.raises(RuntimeError, match="injected"):
            getattr(hvd, call)(parts, name="part")
    assert len(module._abandoned) <= 1
    for _ in range(100):  # the abandoned part finishes within a few cycles (on every rank)
        left = torch.tensor([float(len(module._abandoned))])
        if hvd.allreduce(left, op=hvd.Max, name="after-part").item() == 0:
            break
    assert not module._abandoned and module._handles == handles
    first = made[0] if call == "grouped_allreduce_async_" else made[0][0]
    first.wait()  # it ran, without an error, on every rank (its values are not checked: the
    # call raised, and with GRADCOMM_TORCH_STAGE_ALL=1 it reduced a staging copy)
    assert parts[1].tolist() == [RANK + 1.0] * 7


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that differ")
@pytest.mark.parametrize("call,submitter", [("grouped_allreduce_async_", "_submit_allreduce"),
                                             ("grouped_allgather_async", "_allgather_submit")])
def test_a_grouped_call_failing_part_way_on_one_rank_fails_on_every_rank(call, submitter,
                                                                        monkeypatch):
    # Rank 0's grouped call fails on its second part (injected); the others submitted every
    # part. Rank 0 submits the parts it did not make as failed: the others' parts of those names
    # fail at once, naming it (before, they waited for rank 0 until the watchdog).
    import gradcomm.torch as module
    failing_second, _ = failing_after_one(getattr(module, submitter))
    parts = [torch.full((7,), float(RANK + 1)) for _ in range(3)]
    started = time.monotonic()
    if RANK == 0:
        with monkeypatch.context() as patched:
            patched.setattr(module, submitter, failing_second)
            with pytest.raises(RuntimeError, match="injected"):
                getattr(hvd, call)(parts, name="part-on-one")
    else:
        handle = getattr(hvd, call)(parts, name="part-on-one")
        with pytest.raises(Exception, match="failed on rank 0"):
            hvd.synchronize(handle)
    assert time.monotonic() - started < 10
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after-part-on-one")  # in step
    assert total.tolist() == [SIZE] * 2


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that differ")
def test_a_grouped_call_failing_after_its_name_on_one_rank_fails_on_every_rank(monkeypatch):
    # Rank 0's grouped all-reduce fails after it took its name and before any part is submitted
    # (staging a part: injected); it submits every part as failed, and the others' parts fail at
    # once, naming it (before, they waited for rank 0 until the watchdog).
    import gradcomm.torch as module
    parts = [torch.full((5,), float(RANK + 1)) for _ in range(2)]
    started = time.monotonic()
    if RANK == 0:
        def refusing(tensor, read=True):
            raise RuntimeError("injected: staging refused")
        with monkeypatch.context() as patched:
            patched.setattr(module, "staged", refusing)
            with pytest.raises(RuntimeError, match="injected"):
                hvd.grouped_allreduce_async_(parts, name="staged-on-one")
    else:
        handle = hvd.grouped_allreduce_async_(parts, name="staged-on-one")
        with pytest.raises(Exception, match="failed on rank 0"):
            hvd.synchronize(handle)
    assert time.monotonic() - started < 10
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after-staged-on-one")  # in step
    assert total.tolist() == [SIZE] * 2


def test_poll_on_a_grouped_handle_is_false_while_any_part_runs():
    # One part failed, another still runs: the call has not finished. synchronize() waits for
    # every part, then raises the failed part's error.
    import gradcomm.torch as module

    class Failed:
        def done(self):
            raise module.CommError("poll test: this part failed")

        def wait(self):
            self.done()

    class Running:
        finished = False

        def done(self):
            return self.finished

        def wait(self):
            self.finished = True

    running = Running()
    h = module._register(next(module._next_handle), [Failed(), running], lambda: None, ())
    assert not hvd.poll(h)
    running.finished = True
    assert hvd.poll(h)
    running.finished = False
    with pytest.raises(hvd.HorovodInternalError, match="this part failed"):
        hvd.synchronize(h)
    assert running.finished and h not in module._handles
    with pytest.raises(ValueError):
        hvd.poll(h)


@pytest.mark.skipif(SIZE == 1, reason="needs 2 ranks")
def test_a_name_only_some_ranks_submit_raises_on_every_rank_within_seconds():
    started = time.monotonic()
    with pytest.raises(hvd.HorovodInternalError, match="submitted by rank") as e:
        if RANK == 0:
            hvd.allreduce(torch.ones(2), name="only-rank-0")
        else:
            hvd.allgather(torch.ones(2), name="not-on-rank-0")
    assert isinstance(e.value, hvd.MismatchError)
    assert time.monotonic() - started < 5
    # The ranks go on afterwards.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() == [SIZE] * 2


@pytest.mark.skipif(SIZE == 1, reason="needs 2 ranks")
def test_one_name_different_dtypes_or_roots_raises_on_every_rank():
    with pytest.raises(hvd.HorovodInternalError, match="must agree"):
        hvd.broadcast_(torch.ones(4, dtype=torch.int8 if RANK else torch.uint8), 0, name="d")
    with pytest.raises(hvd.HorovodInternalError, match="root"):
        hvd.broadcast_(torch.ones(4), RANK % 2, name="r")
    with pytest.raises(hvd.HorovodInternalError, match="factors"):
        hvd.allreduce(torch.ones(4), name="f", prescale_factor=1.0 + (RANK == 1))


# ---- Horovod's semantics --------------------------------------------------------------------
def horovod_scale(x, factor):
    """Horovod's ScaleBuffer on the CPU: float32 and float16 in float32 with the factor rounded
    to float, float64 in double, integers in double truncated toward zero."""
    if x.dtype in (np.float32, np.float16):
        return (np.float32(factor) * x.astype(np.float32)).astype(x.dtype)
    if x.dtype == np.float64:
        return factor * x
    return np.trunc(factor * x.astype(np.float64)).astype(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32,
                                   torch.int64])
def test_scale_factors_bit_identical_to_horovods_formula(dtype):
    """Max is exact in any order, so prescale (before) and postscale (after) are seen bit for
    bit; Average is Sum then postscale / size, on integer-valued inputs whose sum is exact."""
    g = torch.Generator().manual_seed(5)
    inputs = [(torch.rand(257, generator=g, dtype=torch.float64) * 200 - 100) for _ in
              range(SIZE)]
    inputs = [x.to(dtype) for x in inputs]
    pre, post = 0.3, 1.7
    out = hvd.allreduce(inputs[RANK], op=hvd.Max, prescale_factor=pre, postscale_factor=post)
    scaled = [horovod_scale(x.numpy(), pre) for x in inputs]
    expected = horovod_scale(np.maximum.reduce(scaled), post)
    assert np.array_equal(out.numpy(), expected), dtype
    whole = [x.to(torch.float64).round().to(dtype) for x in inputs]
    out = hvd.allreduce(whole[RANK], op=hvd.Average, postscale_factor=post)
    total = np.sum([x.numpy().astype(np.float64) for x in whole], axis=0).astype(
        whole[0].numpy().dtype)
    expected = horovod_scale(total, post / SIZE)
    assert np.array_equal(out.numpy(), expected), dtype


def test_integer_average_multiplies_by_the_reciprocal():
    """As Horovod: sum * (1.0 / size) truncated (49 * (1/49) is 0.99999999999999989 in
    double); not an integer division."""
    t = torch.full((3,), 49 if RANK == 0 else 0, dtype=torch.int64)
    out = hvd.allreduce(t, op=hvd.Average, postscale_factor=SIZE / 49)
    assert out.tolist() == [int(np.trunc(49.0 * ((SIZE / 49) / SIZE)))] * 3


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool,
                                   torch.bfloat16, torch.complex64])
def test_broadcast_takes_every_dtype(dtype):
    t = (torch.arange(6) * (RANK + 1) % 2).to(dtype)
    out = hvd.broadcast(t, root_rank=SIZE - 1, name=f"dtype.{dtype}")
    assert torch.equal(out, (torch.arange(6) * SIZE % 2).to(dtype))
    assert torch.equal(hvd.allgather(t.view(2, 3)), torch.cat(
        [(torch.arange(6) * (r + 1) % 2).to(dtype).view(2, 3) for r in range(SIZE)]))


@pytest.mark.skipif(SIZE == 1, reason="needs 2 ranks")
def test_allgather_async_is_asynchronous():
    """poll() is False until every rank has submitted: rank 0 submits at once, the others a
    quarter of a second later."""
    hvd.barrier()
    if RANK == 0:
        h = hvd.allgather_async(torch.ones(1), name="late")
        assert not hvd.poll(h)
    else:
        time.sleep(0.25)
        h = hvd.allgather_async(torch.ones(1), name="late")
    assert hvd.synchronize(h).tolist() == [1.0] * SIZE


def test_alltoall_with_and_without_splits():
    send = [RANK + 1 + j for j in range(SIZE)]  # rank r sends r+1+j rows to rank j
    t = torch.cat([torch.full((n, 2), float(100 * RANK + j)) for j, n in enumerate(send)])
    out, received = hvd.alltoall(t, splits=torch.tensor(send, dtype=torch.int32), name="a2a")
    assert received.tolist() == [r + 1 + RANK for r in range(SIZE)]
    assert torch.equal(out, torch.cat([torch.full((r + 1 + RANK, 2), float(100 * r + RANK))
                                       for r in range(SIZE)]))
    even = torch.arange(SIZE * 2, dtype=torch.int64) + 10 * RANK
    assert hvd.alltoall(even).tolist() == [10 * r + 2 * RANK + i for r in range(SIZE)
                                           for i in range(2)]
    x = t.clone().requires_grad_()
    y, _ = hvd.alltoall(x, splits=send)
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(t, 2.0))


def test_optimizer_names_attributes_errors_and_warning():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    base = torch.optim.SGD([{"params": model[0].parameters()},
                            {"params": model[1].parameters()}], lr=0.1)
    opt = hvd.DistributedOptimizer(base)
    assert sorted(opt._parameter_names.values()) == [
        "allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
        "allreduce.noname.1.1"]
    assert opt.backward_passes_per_step == 1 and opt.op == hvd.Average
    assert not opt._synchronized and opt._should_synchronize
    assert set(opt._allreduce_delay.values()) == {1} and len(opt._requires_update) == 4
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named + named[:1])
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named[:2])
    model(torch.ones(1, 3)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize\\(\\) context after"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(1, 3)).sum().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()


def test_broadcast_optimizer_state_without_gradients_or_state():
    """Horovod's test_broadcast_state_no_grad: a parameter without grad, an optimizer without
    state; broadcasting its state makes the state (a zero-gradient step) on every rank."""
    class ModelNoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([0, 1]).int(), requires_grad=False)
            self.b = torch.nn.Parameter(torch.ones(2, 3))

    model = ModelNoGrad()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001,
                                                   weight_decay=1e-6, momentum=0.9,
                                                   nesterov=True),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    assert opt.param_groups[0]["params"][0].grad is None
    assert torch.equal(hvd.broadcast(grad, root_rank=0), grad)
