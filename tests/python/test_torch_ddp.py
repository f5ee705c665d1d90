"""gradcomm.torch.DistributedDataParallel against torch's own DDP (gloo) trained side by side on
the same data from the same seed: parameters after N steps with SGD+momentum and Adam, no_sync
accumulation, unused parameters, gradient_as_bucket_view, compression hooks, buffers, join()
with uneven inputs, and the errors. Every rank checks its own replica, and that replicas are
bit-identical across ranks."""

import os
import time

import pytest
import torch
from conftest import Embedder, same_on_every_rank
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradcomm
import gradcomm.torch as gt

gradcomm.init()
RANK = gradcomm.rank()
SIZE = gradcomm.size()
torch.set_num_threads(1)  # ranks share the cores

# Both sum the same per-rank float32 gradients; only the order of the additions can differ
# (gloo's ring against gradcomm's algorithm): ~1e-7 relative per step.
TOLERANCE = 1e-5


class Net(torch.nn.Module):
    """Layers of several sizes, so small buckets split them; `extra` can be left out."""

    def __init__(self, seed, batchnorm=False):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(20, 64)
        self.bn = torch.nn.BatchNorm1d(64) if batchnorm else torch.nn.Identity()
        self.b = torch.nn.Linear(64, 48)
        self.extra = torch.nn.Linear(48, 48)
        self.c = torch.nn.Linear(48, 5)

    def forward(self, x, use_extra=True):
        h = torch.relu(self.b(torch.relu(self.bn(self.a(x)))))
        if use_extra:
            h = torch.relu(self.extra(h))
        return self.c(h)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def data(step, rows=12):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(rows, 20, generator=g), torch.randint(0, 5, (rows,), generator=g)


def optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


@pytest.mark.parametrize("optimizer_name,bucket_view", [("sgd", False), ("adam", False),
                                                         ("sgd", True)])
def test_matches_torch_ddp(gloo, optimizer_name, bucket_view):
    ours = gt.DistributedDataParallel(Net(5 + RANK), bucket_cap_mb=0.01, first_bucket_mb=0.004,
                                      gradient_as_bucket_view=bucket_view)
    ref = torch.nn.parallel.DistributedDataParallel(Net(5 + RANK), bucket_cap_mb=0.01,
                                                    gradient_as_bucket_view=bucket_view)
    # Both start from rank 0's parameters.
    assert torch.equal(flat(ours), flat(ref))
    assert same_on_every_rank(flat(ours))
    assert len(ours._gradcomm_buckets()) > 1
    opt_ours = optimizer(optimizer_name, ours.parameters())
    opt_ref = optimizer(optimizer_name, ref.parameters())
    for step in range(8):
        x, y = data(step)
        for model, opt in [(ours, opt_ours), (ref, opt_ref)]:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if bucket_view and step >= 1:  # after the first step, gradients live in the buckets
            view = ours._reducer.view(ours._names.index("a.weight"))
            assert ours.module.a.weight.grad.data_ptr() == view.data_ptr()
    assert relative(flat(ours), flat(ref)) <= TOLERANCE
    assert same_on_every_rank(flat(ours))


def test_no_sync_accumulates_then_reduces_the_sum(gloo):
    ours = gt.DistributedDataParallel(Net(9))
    ref = torch.nn.parallel.DistributedDataParallel(Net(9))
    for model in (ours, ref):
        model.zero_grad()
        with model.no_sync():
            for step in range(2):
                x, y = data(step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
        inside = model.module.a.weight.grad.clone()
        x, y = data(2)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.inside = inside
    # Inside no_sync nothing was reduced: the local sums differ across ranks (different data).
    assert torch.equal(ours.inside, ref.inside)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert relative(p.grad, q.grad) <= TOLERANCE
        assert same_on_every_rank(p.grad)


def test_unused_parameters_as_torch(gloo):
    ours = gt.DistributedDataParallel(Net(11), find_unused_parameters=True)
    ref = torch.nn.parallel.DistributedDataParallel(Net(11), find_unused_parameters=True)
    # Step 0: no rank uses `extra` (its gradient stays None); step 1: only rank 0 does, so every
    # rank gets the average in which the others count zero.
    for step, use in [(0, False), (1, RANK == 0)]:
        x, y = data(step)
        for model in (ours, ref):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x, use_extra=use), y).backward()
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert (p.grad is None) == (q.grad is None), (step, name)
            if p.grad is not None:
                assert relative(p.grad, q.grad) <= TOLERANCE, (step, name)
                assert same_on_every_rank(p.grad)
    assert ours.module.extra.weight.grad is not None


def test_a_missing_gradient_without_find_unused_parameters_is_an_error():
    model = gt.DistributedDataParallel(Net(12))
    x, y = data(0)
    with pytest.raises(RuntimeError, match=r"extra.weight, extra.bias.*find_unused_parameters"):
        torch.nn.functional.cross_entropy(model(x, use_extra=False), y).backward()
    # The ranks stayed in step: the next iteration works.
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert same_on_every_rank(model.module.extra.weight.grad)


def test_a_gradient_missing_on_one_rank_only_fails_the_step_on_every_rank():
    # Rank 0 reaches `extra`, the others do not: they raise their own error, and rank 0 a
    # MismatchError naming them (it never reduces without their gradients, nor waits), its
    # gradients left as backward made them. The ranks stay in step: the next step is exact.
    model = gt.DistributedDataParallel(Net(16))
    x, y = data(0)
    if RANK == 0 and SIZE > 1:
        with pytest.raises(gradcomm.MismatchError, match="failed on rank"):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        local = Net(16)
        torch.nn.functional.cross_entropy(local(x), y).backward()
        for p, q in zip(model.parameters(), local.parameters()):
            assert torch.equal(p.grad, q.grad)  # nothing written back
    else:
        with pytest.raises(RuntimeError, match="extra.weight"):
            torch.nn.functional.cross_entropy(model(x, use_extra=False), y).backward()
    check_one_exact_step(model, Net(16))


def check_one_exact_step(model, reference):
    """One step of `model` (a DDP wrapper) whose gradients are the mean of every rank's
    (`reference`, unwrapped, run on every rank's batch here), on every rank."""
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(*data(1)[:1]), data(1)[1]).backward()
    for r in range(SIZE):
        g = torch.Generator().manual_seed(1000 + r)
        x, y = torch.randn(12, 20, generator=g), torch.randint(0, 5, (12,), generator=g)
        (torch.nn.functional.cross_entropy(reference(x), y) / SIZE).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert relative(p.grad, q.grad) <= TOLERANCE
        assert same_on_every_rank(p.grad)


@pytest.mark.parametrize("which", ["first", "last", "after"])
def test_a_hook_error_on_one_rank_fails_the_step_on_every_rank(which):
    # The last rank's reducer refuses one gradient in the middle of backward (made to, here):
    # the first one backward produces (its bucket not yet sent), the last (the buckets before
    # it sent already), or the last once it was marked (every bucket complete: a gradient that
    # came twice). That rank raises the refusal, every other one a MismatchError naming it
    # within seconds, with nothing written back; then the ranks go on together.
    model = gt.DistributedDataParallel(Net(18), bucket_cap_mb=0.002)
    bad = SIZE - 1
    refused = {"first": "c.bias", "last": "a.weight", "after": "a.weight"}[which]
    if RANK == bad:
        real_mark = model._reducer.mark

        def refusing(index, grad):
            if which == "after":
                real_mark(index, grad)
            if model._names[index] == refused:
                raise gradcomm.InvalidArgument(f"{refused}: refused on this rank")
            if which != "after":
                real_mark(index, grad)
        model._reducer.mark = refusing
    x, y = data(0)
    started = time.monotonic()
    try:
        if RANK == bad:
            with pytest.raises(gradcomm.InvalidArgument, match="refused on this rank"):
                torch.nn.functional.cross_entropy(model(x), y).backward()
        else:
            with pytest.raises(gradcomm.MismatchError, match=f"failed on rank {bad}"):
                torch.nn.functional.cross_entropy(model(x), y).backward()
    finally:
        if RANK == bad:
            del model._reducer.mark
    assert time.monotonic() - started < 10
    local = Net(18)
    torch.nn.functional.cross_entropy(local(x), y).backward()
    if RANK != bad:
        for p, q in zip(model.parameters(), local.parameters()):
            assert torch.equal(p.grad, q.grad)  # nothing written back
    check_one_exact_step(model, Net(18))


class NoWeightGrad(torch.autograd.Function):
    """Returns None as the weight's gradient: its hook runs with grad None."""

    @staticmethod
    def forward(ctx, x, w):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


def test_none_gradients_no_grad_forwards_and_hook_errors():
    net = Net(17)
    net.w = torch.nn.Parameter(torch.ones(3))
    model = gt.DistributedDataParallel(net)
    x, y = data(0)

    def loss_of(output):  # w's gradient comes back None from NoWeightGrad
        w = model.module.w
        return torch.nn.functional.cross_entropy(output, y) + \
            NoWeightGrad.apply(torch.ones(3), w).sum()

    loss = loss_of(model(x))
    with torch.no_grad():
        model(x)  # a forward for logging must not turn off the pending backward's all-reduce
    loss.backward()
    assert torch.equal(model.module.w.grad, torch.zeros(3))  # None counts as zeros, as torch
    for p in model.parameters():
        assert same_on_every_rank(p.grad)
    model.module.w.grad = None
    loss_of(model(x)).backward()  # None again, from an unset grad
    for p in model.parameters():
        assert same_on_every_rank(p.grad)


@pytest.mark.parametrize("ours_hook,torch_hook,tolerance", [
    (gt.fp16_compress_hook, default_hooks.fp16_compress_hook, 2e-3),
    (gt.bf16_compress_hook, default_hooks.bf16_compress_hook, 2e-2)])
def test_compression_hooks(gloo, ours_hook, torch_hook, tolerance):
    ours = gt.DistributedDataParallel(Net(13))
    ours.register_comm_hook(None, ours_hook)
    also = gt.DistributedDataParallel(Net(13))
    also.register_comm_hook(None, torch_hook)  # torch's function is accepted as the same hook
    plain = torch.nn.parallel.DistributedDataParallel(Net(13))
    models = [ours, also, plain]
    # torch 1.13's DDP runs its bf16 hook only with CUDA: the fp16 one is the reference.
    if torch_hook is default_hooks.fp16_compress_hook:
        ref = torch.nn.parallel.DistributedDataParallel(Net(13))
        ref.register_comm_hook(None, torch_hook)
        models.append(ref)
    x, y = data(0)
    for model in models:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert {b[1] for b in ours._gradcomm_buckets()} == {
        "float16" if ours_hook is gt.fp16_compress_hook else "bfloat16"}
    for i, (p, a, exact) in enumerate(zip(ours.parameters(), also.parameters(),
                                          plain.parameters())):
        assert torch.equal(p.grad, a.grad)
        assert relative(p.grad, exact.grad) <= tolerance
        assert same_on_every_rank(p.grad)
        if len(models) == 4:
            assert relative(list(models[3].parameters())[i].grad, exact.grad) <= tolerance


def test_buffers_follow_rank_0():
    model = gt.DistributedDataParallel(Net(14 + RANK, batchnorm=True))
    x, _ = data(0, rows=8)
    model(x)  # every rank updates its running stats from its own data ...
    model.eval()
    model(x)  # ... and the next forward (in eval mode: no update) starts from rank 0's
    assert same_on_every_rank(model.module.bn.running_mean)
    unsynced = gt.DistributedDataParallel(Net(14, batchnorm=True), broadcast_buffers=False)
    unsynced(x)
    unsynced.eval()
    unsynced(x)
    assert SIZE == 1 or not same_on_every_rank(unsynced.module.bn.running_mean)


def test_the_reducer_is_the_one_asked_for():
    # CPU models get the host reducer, or under GRADCOMM_TORCH_NEGOTIATED_REDUCER=1 (a leg of
    # the suite) the one CUDA models get where gradcomm's GPU path runs, so that these tests
    # exercise it; both front ends pick it alike.
    want = ("NegotiatedReducer" if os.environ.get("GRADCOMM_TORCH_NEGOTIATED_REDUCER") == "1"
            else "GradientReducer")
    ddp = gt.DistributedDataParallel(Net(16))
    opt = gt.DistributedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))
    assert type(ddp._reducer).__name__ == want
    assert type(opt._gradcomm_reducer).__name__ == want


def test_errors():
    net = Net(15)
    with pytest.raises(gradcomm.Error, match="device_ids"):
        gt.DistributedDataParallel(net, device_ids=[0])
    with pytest.raises(NotImplementedError, match="process_group"):
        gt.DistributedDataParallel(net, process_group=object())
    with pytest.raises(NotImplementedError, match="static_graph"):
        gt.DistributedDataParallel(net, static_graph=True)
    model = gt.DistributedDataParallel(net)
    with pytest.raises(NotImplementedError, match="custom Python comm hooks"):
        model.register_comm_hook(None, lambda state, bucket: None)
    x, y = data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        model.register_comm_hook(None, gt.fp16_compress_hook)
    with pytest.raises(NotImplementedError, match="gradient_as_bucket_view"):
        gt.DistributedDataParallel(Net(15), gradient_as_bucket_view=True).register_comm_hook(
            None, gt.bf16_compress_hook)
    # A model that differs on one rank: an error on every rank, before any gradient moves.
    torch.manual_seed(0)
    other = torch.nn.Linear(20, 5 if RANK == SIZE - 1 and SIZE > 1 else 4)
    if SIZE > 1:
        with pytest.raises(gradcomm.Error, match="ranks differ"):
            gt.DistributedDataParallel(other)
    # An argument refused on one rank only: that rank raises its refusal, the others at once
    # (before, they waited for it in the check of the module until the watchdog).
    for bad in ({"bucket_cap_mb": 0}, {"static_graph": True}, {"process_group": object()}):
        if SIZE == 1:
            break
        started = time.monotonic()
        with pytest.raises((gradcomm.Error, NotImplementedError)) as e:
            gt.DistributedDataParallel(Net(15), **(bad if RANK == 0 else {}))
        assert ("ranks differ" in str(e.value)) == (RANK != 0), (bad, str(e.value))
        assert time.monotonic() - started < 10, bad
    # Still usable.
    assert MPI.COMM_WORLD.allreduce(1) == SIZE


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_with_uneven_inputs_matches_torch_ddp(gloo, divide_by_initial):
    """Rank r has 3 + r batches: inside join(), the ranks that run out stand in for the others'
    steps (zeros in the same buckets, buffers from the highest rank still training), and at the
    end every rank takes the model of the last to finish, as torch's DDP does."""
    finals = []
    for make in (gt.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        model = make(Net(21, batchnorm=True), bucket_cap_mb=0.01, find_unused_parameters=True)
        opt = optimizer("sgd", model.parameters())
        with model.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(3 + RANK):
                x, y = data(step)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x, use_extra=step % 2 == 0), y).backward()
                opt.step()
        finals.append(torch.cat([flat(model), model.module.bn.running_mean]))
    assert relative(finals[0], finals[1]) <= TOLERANCE
    assert same_on_every_rank(finals[0])


@pytest.mark.skipif(SIZE == 1, reason="needs ranks that differ")
@pytest.mark.parametrize("argument", ["divide_by_initial_world_size", "throw_on_early_termination",
                                      "enable"])
def test_join_arguments_that_differ_between_ranks_are_refused_on_every_rank(argument):
    # divide_by_initial_world_size of rank 0's own scaled its gradients otherwise once a rank had
    # joined (a wrong average without a word); the others raised alone or made JoinControl alone.
    model = gt.DistributedDataParallel(Net(24))
    with pytest.raises(gradcomm.InvalidArgument, match="differ in join"):
        with model.join(**{argument: RANK == 0}):
            pass
    x, y = data(0)  # still in step
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert MPI.COMM_WORLD.allreduce(1) == SIZE


def test_join_throw_on_early_termination_raises_on_every_rank():
    model = gt.DistributedDataParallel(Net(23))

    def train():
        with model.join(throw_on_early_termination=True):
            for step in range(2 + RANK):
                x, y = data(step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
    if SIZE == 1:
        train()  # nobody to wait for: nothing raises
    else:
        with pytest.raises(RuntimeError, match="ran out of inputs"):
            train()
    # Every rank is out of the context and in step again.
    x, y = data(0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert same_on_every_rank(model.module.a.weight.grad)


@pytest.mark.skipif(SIZE < 2, reason="needs a joined rank and ranks that train")
def test_a_join_that_cannot_stand_in_fails_the_others_at_once():
    """The wrapper's join() stands in for its own forward and backward only. Rank 0 has no
    inputs while the others step a Horovod-style DistributedOptimizer inside the context: rank
    0 raises, and their step fails at once with a MismatchError naming it (before, they waited
    for rank 0 until the watchdog). Then every rank is in step again."""
    model = gt.DistributedDataParallel(Net(29))
    hvd_model = Net(31)
    opt = gt.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.1),
                                  named_parameters=hvd_model.named_parameters())
    if RANK == 0:
        with pytest.raises(RuntimeError, match="cannot stand in"):
            with model.join():
                pass  # no inputs
    else:
        start = time.monotonic()
        with pytest.raises(gradcomm.MismatchError, match="failed on rank 0"):
            with model.join():
                x, y = data(RANK)
                torch.nn.functional.cross_entropy(hvd_model(x), y).backward()
                opt.step()
        assert time.monotonic() - start < 10
    assert gt.allreduce(torch.ones(2), op=gt.Sum).tolist() == [SIZE, SIZE]
    assert MPI.COMM_WORLD.allreduce(1) == SIZE


def test_join_with_no_sync_and_a_rank_without_data(gloo):
    """Accumulation inside join (no_sync every other batch), and rank 0 with no batch at all,
    against torch's DDP join."""
    finals = []
    for make in (gt.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        model = make(Net(25, batchnorm=True), bucket_cap_mb=0.01)
        opt = optimizer("sgd", model.parameters())
        with model.join():
            for step in range(0 if RANK == 0 else 2 * RANK + 1):
                x, y = data(step)
                if step % 2 == 0:
                    opt.zero_grad()
                    with model.no_sync():
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                else:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
        finals.append(torch.cat([flat(model), model.module.bn.running_mean]))
    assert relative(finals[0], finals[1]) <= TOLERANCE
    assert same_on_every_rank(finals[0])


def test_fp16_hook_divides_before_the_sum_as_torch(gloo):
    """Gradients of 40000 on every rank: their float16 sum would overflow (65504), their average
    does not. As torch's hook, gradcomm's divides each rank's gradient first."""
    results = []
    for make in (gt.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        model = make(torch.nn.Linear(8, 1, bias=False))
        hook = gt.fp16_compress_hook if make is gt.DistributedDataParallel else \
            default_hooks.fp16_compress_hook
        model.register_comm_hook(None, hook)
        model(torch.full((1, 8), 40000.0)).sum().backward()  # weight's gradient: 40000
        results.append(model.module.weight.grad.clone())
    assert torch.equal(results[0], torch.full((1, 8), 40000.0))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("bucket_view,accumulate", [(False, 1), (True, 1), (False, 3)])
def test_sparse_gradients_match_torch_ddp(gloo, bucket_view, accumulate):
    # Both reduce the embedding's gradient as a sparse tensor (gathering every rank's rows) and
    # hand SparseAdam the mean, sparse; with no_sync, rows accumulated over several backwards.
    ours = gt.DistributedDataParallel(Embedder(), gradient_as_bucket_view=bucket_view)
    ref = torch.nn.parallel.DistributedDataParallel(Embedder())
    assert all(0 not in b[2] for b in ours._gradcomm_buckets())  # the table has no slot
    opts = [(ours, torch.optim.SparseAdam(list(ours.module.table.parameters())),
             torch.optim.SGD(ours.module.out.parameters(), lr=0.1)),
            (ref, torch.optim.SparseAdam(list(ref.module.table.parameters())),
             torch.optim.SGD(ref.module.out.parameters(), lr=0.1))]
    for step in range(4):
        g = torch.Generator().manual_seed(31 * step + RANK)
        x, y = torch.randint(0, 40, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g)
        for model, sparse_opt, dense_opt in opts:
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            for k in range(accumulate - 1):
                with model.no_sync():
                    torch.nn.functional.cross_entropy(model(x.roll(k + 1, 0)), y).backward()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            assert model.module.table.weight.grad.is_sparse
            sparse_opt.step()
            dense_opt.step()
    assert relative(flat(ours), flat(ref)) <= TOLERANCE
    assert same_on_every_rank(flat(ours))


@pytest.mark.skipif(SIZE < 2, reason="needs a rank whose forward reaches the table")
def test_sparse_gradients_stay_sparse_on_a_rank_that_did_not_reach_them():
    # Rank 0's forward skips the embedding: its gradient there is the others' mean (zeros stood
    # in for rank 0's), sparse on every rank, as the module says it is.
    class Skipping(Embedder):
        def forward(self, x, skip=False):
            return self.out(torch.zeros(x.shape[0], 6) if skip else self.table(x).mean(1))

    model = gt.DistributedDataParallel(Skipping(), find_unused_parameters=True)
    x = torch.randint(0, 40, (5, 3), generator=torch.Generator().manual_seed(RANK))
    model(x, skip=RANK == 0).sum().backward()
    grad = model.module.table.weight.grad
    assert grad is not None and grad.is_sparse
    assert same_on_every_rank(grad.to_dense())


def test_sparse_gradients_with_join_and_uneven_inputs():
    # Rank r trains r + 2 steps; the ranks that have left offer no rows for the others' steps.
    # The reference: the same steps here, each the mean over the ranks still training
    # (join(divide_by_initial_world_size=False)).
    model = gt.DistributedDataParallel(Embedder())
    ref = Embedder()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)

    def batch(step, rank):
        g = torch.Generator().manual_seed(17 * step + rank)
        return torch.randint(0, 40, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)

    with model.join(divide_by_initial_world_size=False):
        for step in range(RANK + 2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(*batch(step, RANK)[:1]),
                                              batch(step, RANK)[1]).backward()
            assert model.module.table.weight.grad.is_sparse
            opt.step()
    for step in range(SIZE + 1):
        ranks = [r for r in range(SIZE) if step < r + 2]
        ref_opt.zero_grad()
        (sum(torch.nn.functional.cross_entropy(ref(batch(step, r)[0]), batch(step, r)[1])
             for r in ranks) / len(ranks)).backward()
        ref_opt.step()
    assert same_on_every_rank(flat(model))
    assert relative(flat(model), flat(ref)) <= TOLERANCE


@pytest.mark.parametrize("dense_too", [True, False])
def test_a_sparse_gradient_refused_on_one_rank_fails_the_step_on_every_rank(dense_too):
    # The sparse table's gradient is refused on the last rank (made to, here): that rank raises
    # it, every other one a MismatchError naming it, instead of gathering the others' rows alone
    # (the table with a dense layer, whose buckets fail; the table alone, whose row gathers
    # fail). Then a step that every rank completes, the rows of every rank in it.
    module = Embedder() if dense_too else torch.nn.Embedding(40, 6, sparse=True)
    model = gt.DistributedDataParallel(module)
    table = module.table if dense_too else module
    bad = SIZE - 1

    def batch(step, rank):
        return torch.randint(0, 40, (5, 3), generator=torch.Generator().manual_seed(step + rank))
    if RANK == bad:
        real_mark = model._reducer.mark

        def refusing(index, grad):
            if model._params[index] is table.weight:
                raise gradcomm.InvalidArgument("table: refused on this rank")
            real_mark(index, grad)
        model._reducer.mark = refusing
    try:
        if RANK == bad:
            with pytest.raises(gradcomm.InvalidArgument, match="refused on this rank"):
                model(batch(0, RANK)).sum().backward()
        else:
            with pytest.raises(gradcomm.MismatchError, match=f"failed on rank {bad}"):
                model(batch(0, RANK)).sum().backward()
    finally:
        if RANK == bad:
            del model._reducer.mark
    model.zero_grad()
    model(batch(1, RANK)).sum().backward()
    grad = table.weight.grad
    assert grad is not None and grad.is_sparse
    assert same_on_every_rank(grad.to_dense())
    reference = Embedder() if dense_too else torch.nn.Embedding(40, 6, sparse=True)
    for r in range(SIZE):
        (reference(batch(1, r)).sum() / SIZE).backward()
    ref_table = reference.table if dense_too else reference
    assert torch.allclose(grad.to_dense(), ref_table.weight.grad.to_dense(), atol=1e-6)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that joins and ranks that train")
def test_a_step_that_fails_on_one_rank_while_another_has_joined():
    # Rank 0 has no data: inside join() it stands in for the others' steps. The last rank's
    # first step fails (a gradient refused there, made to): it raises its error, the other
    # training ranks a MismatchError naming it, and rank 0 stands in on. The next step is
    # exact (rank 0's zeros in it), and every rank leaves join() with the same model.
    model = gt.DistributedDataParallel(Net(26), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = Net(26)
    bad = SIZE - 1
    with model.join():
        for step in range(0 if RANK == 0 else 2):
            x, y = data(step)
            opt.zero_grad()
            if step == 0 and RANK == bad:
                real_mark = model._reducer.mark

                def refusing(index, grad):
                    if model._names[index] == "a.weight":
                        raise gradcomm.InvalidArgument("a.weight: refused on this rank")
                    real_mark(index, grad)
                model._reducer.mark = refusing
                try:
                    with pytest.raises(gradcomm.InvalidArgument, match="refused on this rank"):
                        torch.nn.functional.cross_entropy(model(x), y).backward()
                finally:
                    del model._reducer.mark
                continue
            if step == 0 and SIZE > 2:
                with pytest.raises(gradcomm.MismatchError, match=f"failed on rank {bad}"):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                continue
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for r in range(1, SIZE):  # step 1 of every training rank, averaged over every rank
        g = torch.Generator().manual_seed(1000 + r)
        x, y = torch.randn(12, 20, generator=g), torch.randint(0, 5, (12,), generator=g)
        (torch.nn.functional.cross_entropy(reference(x), y) / SIZE).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert relative(flat(model), flat(reference)) <= TOLERANCE
    assert same_on_every_rank(flat(model))
