"""torch.distributed on the "gradcomm" backend with CUDA tensors (torch 2.x), under mpirun on a GPU
machine (tests/gpu/run_on_device.sh torch). Skipped where torch sees no GPU.

- every collective on CUDA tensors against a reference computed on the CPU on each rank (every
  dtype and op of all_reduce; counts 0, 1, primes and large); all-gathers and reduce-scatters
  on NCCL in every form torch has, FSDP's in-place all-gather included;
- stream order: the collective waits for the caller's current stream, work.wait() makes that
  stream wait for the result, and neither blocks the host;
- torch's DDP, FSDP and FSDP2 on CUDA over gradcomm against DDP over torch's own nccl backend (or
  gloo where nccl cannot run): the same parameters;
- ranks that call different collectives get an error on every rank, and the group stays usable.

Ranks share the machine's GPU: each gets its own NCCL_HOSTID (set before any NCCL call), so NCCL
connects them through its socket transport instead of refusing two ranks on one device.
"""

import os
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from mpi4py import MPI  # noqa: E402

os.environ.setdefault("NCCL_HOSTID", f"gradcomm-torch-cuda-{MPI.COMM_WORLD.Get_rank()}")

import torch.distributed as dist  # noqa: E402

import gradcomm.torch  # noqa: E402,F401  (registers the backend)

# The CPU tests' inputs and serial reference.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_backend"))
import reference  # noqa: E402
from reference import values  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gradcomm")
RANK = dist.get_rank()
SIZE = dist.get_world_size()
DEV = torch.device("cuda", RANK % torch.cuda.device_count())
torch.cuda.set_device(DEV)
R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
COUNTS = [0, 1, 7, 1009, 65537]


def expected(op, dtype, n):
    return reference.expected(op, dtype, n, list(range(SIZE)))


def check(actual, want, dtype, op=None):
    assert actual.is_cuda
    reference.check(actual, want, dtype, op, RANK)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX],
                         ids=["sum", "avg", "product", "min", "max"])
@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool, torch.complex64], ids=str)
def test_all_reduce(dtype, op, count):
    if dtype == torch.bool and op == R.AVG:
        pytest.skip("AVG of bool is refused")
    if dtype.is_complex and op not in (R.SUM, R.AVG):
        pytest.skip("only SUM and AVG are defined on complex tensors")
    t = values(RANK, dtype, count).to(DEV)
    dist.all_reduce(t, op=op)
    check(t, expected(op, dtype, count), dtype, op)


def test_all_reduce_coalesced_and_reduce_scatter():
    for d in (torch.float32, torch.int64, torch.float16):  # torch wants one dtype per call
        counts = [1009, 7, 1, 0]
        ts = [values(RANK, d, n).to(DEV) for n in counts]
        dist.all_reduce_coalesced(ts)
        for t, n in zip(ts, counts):
            check(t, expected(R.SUM, d, n), d)
    n = 257
    full = expected(R.SUM, torch.float32, SIZE * n)
    src = values(RANK, torch.float32, SIZE * n).to(DEV)
    out = torch.empty(n, device=DEV)
    dist.reduce_scatter_tensor(out, src)
    check(out, full[RANK * n:(RANK + 1) * n], torch.float32)
    out2 = torch.empty(n, device=DEV)
    dist.reduce_scatter(out2, list(src.chunk(SIZE)))
    check(out2, full[RANK * n:(RANK + 1) * n], torch.float32)


@pytest.mark.parametrize("count", [0, 1, 7, 1009])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8,
                                   torch.float64, torch.complex64], ids=str)
def test_all_gathers_and_reduce_scatters(dtype, count):
    """All-gathers go through ncclAllGather (as words of the dtype's width; odd byte counts, such
    as 7 uint8, through the host), reduce-scatters through ncclReduceScatter (complex as its
    parts; int8 and uint8, which NCCL's gradcomm path widens, through an all-reduce): every form
    torch has, FSDP's in-place all-gather included, against the CPU reference."""
    mine = values(RANK, dtype, count).to(DEV)
    gathered = torch.cat([values(r, dtype, count) for r in range(SIZE)])
    out = torch.empty(SIZE * count, dtype=dtype, device=DEV)
    dist.all_gather_into_tensor(out, mine)
    check(out, gathered, dtype)
    outs = [torch.empty(count, dtype=dtype, device=DEV) for _ in range(SIZE)]
    dist.all_gather(outs, mine)
    check(torch.cat(outs), gathered, dtype)
    inplace = torch.zeros(SIZE * count, dtype=dtype, device=DEV)  # FSDP: input is my slice
    shard = inplace.narrow(0, RANK * count, count)
    shard.copy_(mine)
    dist.all_gather_into_tensor(inplace, shard)
    check(inplace, gathered, dtype)
    ops = [R.SUM, R.AVG] if dtype.is_complex else [R.SUM, R.MAX]
    for op in ops:
        full = expected(op, dtype, SIZE * count)
        src = values(RANK, dtype, SIZE * count).to(DEV)
        got = torch.empty(count, dtype=dtype, device=DEV)
        dist.reduce_scatter_tensor(got, src, op=op)
        check(got, full[RANK * count:(RANK + 1) * count], dtype, op)
        got2 = torch.empty(count, dtype=dtype, device=DEV)
        dist.reduce_scatter(got2, list(src.chunk(SIZE)) if count else
                            [torch.empty(0, dtype=dtype, device=DEV)] * SIZE, op=op)
        check(got2, full[RANK * count:(RANK + 1) * count], dtype, op)


@pytest.mark.parametrize("count", COUNTS)
def test_host_staged_collectives(count):
    d = torch.float32
    b = values(RANK, d, count).to(DEV)
    dist.broadcast(b, src=SIZE - 1)
    check(b, values(SIZE - 1, d, count), d)
    mine = torch.full((count,), float(RANK), device=DEV)
    outs = [torch.empty(count, device=DEV) for _ in range(SIZE)]
    dist.all_gather(outs, mine)
    for r, o in enumerate(outs):
        check(o, torch.full((count,), float(r)), d)
    flat = torch.empty(SIZE * count, device=DEV)
    dist.all_gather_into_tensor(flat, mine)
    check(flat, torch.arange(SIZE).repeat_interleave(count).float(), d)
    red = values(RANK, d, count).to(DEV)
    dist.reduce(red, dst=0)
    if RANK == 0:
        check(red, expected(R.SUM, d, count), d)
    gathered = [torch.empty(count, device=DEV) for _ in range(SIZE)] if RANK == 0 else None
    dist.gather(mine, gathered, dst=0)
    if RANK == 0:
        for r, o in enumerate(gathered):
            check(o, torch.full((count,), float(r)), d)
    scattered = torch.empty(count, device=DEV)
    pieces = [torch.full((count,), 10.0 + r, device=DEV) for r in range(SIZE)] if RANK == 0 else None
    dist.scatter(scattered, pieces, src=0)
    check(scattered, torch.full((count,), 10.0 + RANK), d)
    a2a_in = torch.arange(SIZE * 3, dtype=d, device=DEV) + 100 * RANK
    a2a_out = torch.empty(SIZE * 3, device=DEV)
    dist.all_to_all_single(a2a_out, a2a_in)
    want = torch.cat([torch.arange(RANK * 3, RANK * 3 + 3, dtype=d) + 100 * r for r in range(SIZE)])
    check(a2a_out, want, d)
    dist.barrier()


def test_send_recv_ring():
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    t = torch.full((1009,), float(RANK), device=DEV)
    got = torch.empty(1009, device=DEV)
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    reqs = [dist.isend(t, right), dist.irecv(got, left)]
    for r in reqs:
        r.wait()
    check(got, torch.full((1009,), float(left)), torch.float32)


def test_stream_order_without_blocking_the_host():
    """The collective starts after the kernels queued before it on the caller's stream, wait()
    orders the caller's stream after it, and neither call waits on the host."""
    side = torch.cuda.Stream(device=DEV)
    t = torch.zeros(1 << 20, device=DEV)
    dist.all_reduce(t)  # NCCL's communicator and its connections for this size, before timing
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the write
        t.fill_(RANK + 1.0)
        start = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        issued = time.perf_counter() - start
        pending = torch.cuda.Event()
        pending.record(side)
        assert not pending.query(), "the stream finished before the sleep: sleep too short"
        work.wait()
        waited = time.perf_counter() - start
        copy = t.clone()  # on `side`, after wait(): sees the reduced values
    assert issued < 0.05 and waited < 0.05, (issued, waited)
    side.synchronize()
    want = float(sum(range(1, SIZE + 1)))
    assert torch.all(copy == want).item(), f"rank {RANK}: {copy[:4]} != {want}"
    # The future follows torch's stream rules too: then() runs after the result is there.
    t.fill_(1.0)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.all(fut.wait() == 2.0 * SIZE).item()
    # get_future_result() completes once the GPU has run the call.
    if hasattr(torch._C._distributed_c10d.Work, "get_future_result"):
        from torch._C._distributed_c10d import WorkResult
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            work = dist.all_reduce(t, async_op=True)
            result = work.get_future_result()
            assert not result.done(), "the result future completed before the GPU ran the call"
            assert WorkResult(result.wait()) == WorkResult.SUCCESS
            assert side.query(), "the result future completed before the stream got there"
    # is_completed() says whether the GPU has run it, as on torch's NCCL backend.
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        work = dist.all_reduce(t, async_op=True)
        while not work.is_completed():
            time.sleep(0.001)
        assert side.query(), "is_completed() before the stream got there"


def test_a_dropped_recv_still_delivers():
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    got = torch.zeros(33, device=DEV)
    if RANK == 1:
        dist.isend(torch.full((33,), 7.0, device=DEV), 0).wait()
    elif RANK == 0:
        work = dist.irecv(got, 1)
        del work  # never waited for: completing it delivers the data
        torch.cuda.synchronize()
        check(got, torch.full((33,), 7.0), torch.float32)
    dist.barrier()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(20, 256)
        self.b = torch.nn.Linear(256, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train_ddp(group, steps=5):
    model = Net().to(DEV)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEV], process_group=group,
                                                    bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * i + RANK)
        x, y = torch.randn(12, 20, generator=g).to(DEV), torch.randint(0, 5, (12,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y.to(DEV)).backward()
        opt.step()
    torch.cuda.synchronize()
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def test_ddp_on_cuda_matches_the_reference_backend():
    try:
        torch_backend = dist.new_group(backend="nccl")
    except Exception:  # noqa: BLE001  (no nccl in this torch: gloo takes CUDA tensors too)
        torch_backend = dist.new_group(backend="gloo")
    ours = train_ddp(None)
    theirs = train_ddp(torch_backend)
    mine = ours.numpy().tobytes()
    assert MPI.COMM_WORLD.allreduce(int(MPI.COMM_WORLD.bcast(mine, root=0) != mine)) == 0
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours - theirs).abs().max()


def fsdp_net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 5)).to(DEV)


def fsdp_train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + RANK)).to(DEV)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    torch.cuda.synchronize()


def test_fsdp_on_cuda_matches_ddp():
    """FSDP and FSDP2 on CUDA over gradcomm (their all-gathers and reduce-scatters on NCCL) end
    where torch's DDP on CUDA over nccl ends."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    try:
        reference_group = dist.new_group(backend="nccl")
    except Exception:  # noqa: BLE001
        reference_group = dist.new_group(backend="gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(fsdp_net(), device_ids=[DEV],
                                                    process_group=reference_group)
    fsdp_train(ddp)
    want = torch.cat([p.detach().reshape(-1).cpu() for p in ddp.module.parameters()])
    sharded = FSDP(fsdp_net(), device_id=DEV, use_orig_params=True)
    fsdp_train(sharded)
    with FSDP.summon_full_params(sharded):
        got = torch.cat([p.detach().reshape(-1).cpu() for p in sharded.parameters()])
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    fully_shard = getattr(torch.distributed.fsdp, "fully_shard", None)
    if fully_shard is None:
        return
    model = fsdp_net()
    fully_shard(model)  # FSDP2 on the default (gradcomm) group's CUDA mesh
    fsdp_train(model)
    got = torch.cat([p.full_tensor().detach().reshape(-1).cpu() for p in model.parameters()])
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_ranks_that_disagree_fail_on_every_rank_and_the_group_stays_usable():
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    with pytest.raises(RuntimeError, match="disagree"):
        t = torch.ones(100 + (RANK == 1), device=DEV)
        dist.all_reduce(t)
        torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="disagree"):  # an all-gather against a reduce-scatter
        t = torch.ones(4 * SIZE, device=DEV)
        if RANK == 0:
            dist.all_gather_into_tensor(t, t.narrow(0, 0, 4))
        else:
            dist.reduce_scatter_tensor(t.narrow(0, 0, 4), t)
        torch.cuda.synchronize()
    t = torch.ones(10, device=DEV)
    dist.all_reduce(t)
    check(t, torch.full((10,), float(SIZE)), torch.float32)


def test_mixed_devices_are_refused_before_communication():
    with pytest.raises(RuntimeError, match="one device"):
        dist.all_gather_into_tensor(torch.empty(SIZE * 3), torch.ones(3, device=DEV))
