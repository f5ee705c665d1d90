"""gradcomm.torch's own front ends (the Horovod-style API and the DDP wrapper) on CUDA tensors,
under mpirun on a GPU machine (tests/gpu/run_on_device.sh torch). Skipped where torch sees no
GPU. The all-reduces, and the DDP wrapper's and DistributedOptimizer's buckets, reduce CUDA
tensors on the GPU (NCCL through the negotiator; the buckets are a NegotiatedReducer's), the
other calls through pinned host copies: these tests check the results on every rank against
references computed on the CPU (the scale factors bit for bit against the same calls on CPU
tensors), that results land on the tensor's device, that the calls wait for the caller's current
stream, that ranks may submit names in different orders, and that training matches the same
training on CPU tensors (Horovod API) and torch's own DDP (DDP wrapper), with compression,
accumulation, groups, gradient_as_bucket_view and backward on a side stream.
"""

import contextlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from mpi4py import MPI  # noqa: E402

os.environ.setdefault("NCCL_HOSTID", f"gradcomm-frontends-{MPI.COMM_WORLD.Get_rank()}")

import torch.distributed as dist  # noqa: E402

import gradcomm  # noqa: E402
import gradcomm.torch as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_backend"))
import reference  # noqa: E402
from reference import values  # noqa: E402

torch.set_num_threads(1)
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
DEV = torch.device("cuda", RANK % torch.cuda.device_count())
torch.cuda.set_device(DEV)
COUNTS = [0, 1, 7, 1009]


def check(actual, want, dtype, op=None):
    assert actual.is_cuda and actual.device == DEV, actual.device
    reference.check(actual, want, dtype, op, RANK)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64],
                         ids=str)
def test_allreduce(dtype, count):
    R = dist.ReduceOp
    ranks = list(range(SIZE))
    t = values(RANK, dtype, count).to(DEV)
    check(hvd.allreduce(t, op=hvd.Sum), reference.expected(R.SUM, dtype, count, ranks), dtype)
    if dtype.is_floating_point:
        check(hvd.allreduce(t, op=hvd.Average), reference.expected(R.AVG, dtype, count, ranks),
              dtype, R.AVG)
    check(hvd.allreduce(t, op=hvd.Max), reference.expected(R.MAX, dtype, count, ranks), dtype)
    hvd.allreduce_(t, op=hvd.Sum)  # in place
    check(t, reference.expected(R.SUM, dtype, count, ranks), dtype)


def test_async_grouped_and_scaled():
    R = dist.ReduceOp
    ranks = list(range(SIZE))
    a = values(RANK, torch.float32, 1009).to(DEV)
    h = hvd.allreduce_async_(a, op=hvd.Sum, name="a")
    while not hvd.poll(h):
        pass
    check(hvd.synchronize(h), reference.expected(R.SUM, torch.float32, 1009, ranks),
          torch.float32)
    a, b = values(RANK, torch.float32, 1009).to(DEV), values(RANK, torch.float32, 7).to(DEV)
    out = hvd.grouped_allreduce([a, b], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    check(out[0], reference.expected(R.SUM, torch.float32, 1009, ranks), torch.float32)
    check(out[1], reference.expected(R.SUM, torch.float32, 7, ranks), torch.float32)


def test_allreduces_run_on_the_gpu():
    from gradcomm._torch_common import gpu_reduces
    assert gpu_reduces(torch.ones(1, device=DEV)), "gradcomm's GPU module did not load here"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.int64], ids=str)
def test_scale_factors_match_the_host_path_bit_for_bit(dtype):
    """Prescale and postscale run on the GPU in Horovod's arithmetic, as the host path runs them:
    the same results bit for bit (factors exact in binary, so the sums' order cannot differ)."""
    for op, pre, post in ((hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25), (hvd.Sum, 0.25, 1.0)):
        cpu = values(RANK, dtype, 1009) * (RANK + 3)
        want = hvd.allreduce(cpu, op=op, prescale_factor=pre, postscale_factor=post)
        got = hvd.allreduce(cpu.to(DEV), op=op, prescale_factor=pre, postscale_factor=post)
        assert got.is_cuda and torch.equal(got.cpu(), want), (dtype, op, pre, post)


def test_names_in_any_order_and_fused_buckets():
    """Ranks submit named GPU all-reduces in different orders; a small fusion threshold splits
    a grouped call into several fused buckets and tensors reduced alone."""
    R = dist.ReduceOp
    ranks = list(range(SIZE))
    counts = [1, 300, 7, 5000, 0, 64]
    tensors = {k: values(RANK, torch.float32, n).to(DEV) * (k + 1) for k, n in enumerate(counts)}
    order = list(tensors) if RANK % 2 == 0 else list(reversed(tensors))
    handles = {k: hvd.allreduce_async_(tensors[k], op=hvd.Sum, name=f"order.{k}") for k in order}
    for k, n in enumerate(counts):
        check(hvd.synchronize(handles[k]),
              reference.expected(R.SUM, torch.float32, n, ranks) * (k + 1), torch.float32)
    group = [values(RANK, torch.float32, n).to(DEV) for n in counts]
    out = hvd.grouped_allreduce(group, op=hvd.Sum, fusion_threshold=2048)
    for t, n in zip(out, counts):
        check(t, reference.expected(R.SUM, torch.float32, n, ranks), torch.float32)


def test_gpu_allreduce_waits_for_the_callers_stream():
    side = torch.cuda.Stream(device=DEV)
    t = torch.zeros(1 << 16, device=DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        t.fill_(RANK + 1.0)
        h = hvd.allreduce_async_(t, op=hvd.Sum, name="after-sleep")
        hvd.synchronize(h)
        got = t.clone()
    side.synchronize()
    assert torch.all(got == float(sum(range(1, SIZE + 1)))).item()


def test_broadcast_allgather_alltoall():
    d = torch.float32
    t = values(RANK, d, 1009).to(DEV)
    hvd.broadcast_(t, root_rank=SIZE - 1)
    check(t, values(SIZE - 1, d, 1009), d)
    rows = torch.full((RANK + 1, 3), float(RANK), device=DEV)  # uneven first dimensions
    got = hvd.allgather(rows)
    check(got, torch.cat([torch.full((r + 1, 3), float(r)) for r in range(SIZE)]), d)
    splits = [1 + (RANK + j) % 2 for j in range(SIZE)]  # rows this rank sends to rank j
    send = torch.cat([torch.full((s, 2), 100.0 * RANK + j) for j, s in enumerate(splits)]).to(DEV)
    out, received = hvd.alltoall(send, splits=splits)
    want = torch.cat([torch.full((1 + (r + RANK) % 2, 2), 100.0 * r + RANK) for r in range(SIZE)])
    check(out, want, d)
    assert received.tolist() == [1 + (r + RANK) % 2 for r in range(SIZE)]


def test_reducescatter_and_grouped_allgather():
    """Through pinned host copies, as the other non-all-reduce calls: each rank's rows of the
    sum, on the tensor's device; grouped_allgather's list."""
    d = torch.float32
    rows = 2 * SIZE + 1  # the first rank gets a row more
    x = torch.stack([values(RANK, d, 4)] * rows).to(DEV) * torch.arange(
        1, rows + 1, device=DEV, dtype=d).unsqueeze(1)
    out = hvd.reducescatter(x, op=hvd.Sum)
    assert out.device == x.device
    mine = 2 + (RANK == 0)
    start = 0 if RANK == 0 else 3 + 2 * (RANK - 1)
    total = sum(values(r, d, 4) for r in range(SIZE))
    check(out, torch.stack([total * (start + i + 1) for i in range(mine)]), d)
    got = hvd.grouped_allgather([torch.full((RANK + 1, 2), float(RANK), device=DEV)])
    assert got[0].device == x.device
    check(got[0], torch.cat([torch.full((r + 1, 2), float(r)) for r in range(SIZE)]), d)


def test_the_copy_in_waits_for_the_callers_stream():
    side = torch.cuda.Stream(device=DEV)
    t = torch.zeros(1 << 16, device=DEV)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # GPU time queued before the write
        t.fill_(RANK + 1.0)
        out = hvd.allreduce(t, op=hvd.Sum)
        copy = out.clone()  # on `side`, after the result came back on it
    side.synchronize()
    assert torch.all(copy == float(sum(range(1, SIZE + 1)))).item()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(20, 64)
        self.b = torch.nn.Linear(64, 5)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batch(i, device):
    g = torch.Generator().manual_seed(1000 * i + RANK)
    x, y = torch.randn(12, 20, generator=g), torch.randint(0, 5, (12,), generator=g)
    return x.to(device), y.to(device)


def params(model):
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def train_hvd(device, steps=4, passes=1, **options):
    model = Net().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **options)
    kind = type(opt._gradcomm_reducer).__name__
    assert kind == ("NegotiatedReducer" if device.type == "cuda" else "GradientReducer"), kind
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for i in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(10 * i + k, device)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return params(model)


@pytest.mark.parametrize("options", [
    {}, {"passes": 2}, {"compression": hvd.Compression.fp16}, {"num_groups": 2},
    {"fusion_threshold": 256, "gradient_predivide_factor": 2.0}, {"op": hvd.Sum}])
def test_distributed_optimizer_on_cuda_matches_cpu(options):
    on_gpu = train_hvd(DEV, **options)
    on_cpu = train_hvd(torch.device("cpu"), **options)
    mine = on_gpu.numpy().tobytes()
    assert MPI.COMM_WORLD.allreduce(int(MPI.COMM_WORLD.bcast(mine, root=0) != mine)) == 0
    loose = "compression" in options
    assert torch.allclose(on_gpu, on_cpu, rtol=1e-2 if loose else 1e-4,
                          atol=1e-3 if loose else 1e-5), (on_gpu - on_cpu).abs().max()


def train_ddp(wrap, steps=4, stream=None, check=None):
    """Trains a wrapped Net; with `stream`, the steps run there (the wrapper was made on the
    default stream), each backward after 50 ms of GPU time queued there, so that a reduction
    that does not wait for the stream it is given reads stale gradients."""
    model = Net().to(DEV)
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for i in range(steps):
            x, y = batch(i, "cpu")  # the wrappers move inputs to device_ids[0]
            opt.zero_grad()
            if i == 1:
                with ddp.no_sync():  # accumulated locally, all-reduced with the next step's
                    torch.nn.functional.cross_entropy(ddp(x), y.to(DEV)).backward()
            loss = torch.nn.functional.cross_entropy(ddp(x), y.to(DEV))
            if stream is not None:
                torch.cuda._sleep(50_000_000)
            loss.backward()
            opt.step()
            if check is not None:
                check(ddp, model)
    torch.cuda.synchronize()
    return params(model)


_torch_groups = {}


def torch_group():
    if not dist.is_initialized():
        dist.init_process_group("gradcomm")
    if "g" not in _torch_groups:
        try:
            _torch_groups["g"] = dist.new_group(backend="nccl")
        except Exception:  # noqa: BLE001  (no nccl in this torch: gloo takes CUDA tensors too)
            _torch_groups["g"] = dist.new_group(backend="gloo")
    return _torch_groups["g"]


@pytest.mark.parametrize("variant", ["plain", "bucket_view", "fp16", "side_stream"])
def test_ddp_wrapper_on_cuda_matches_torch_ddp(variant):
    group = torch_group()
    made = []

    def ours_wrap(m):
        ddp = hvd.DistributedDataParallel(m, device_ids=[DEV], find_unused_parameters=True,
                                          gradient_as_bucket_view=variant == "bucket_view",
                                          bucket_cap_mb=0.01, first_bucket_mb=0.002)
        if variant == "fp16":
            ddp.register_comm_hook(None, hvd.fp16_compress_hook)
        made.append(ddp)
        return ddp

    def theirs_wrap(m):
        ddp = torch.nn.parallel.DistributedDataParallel(
            m, device_ids=[DEV], process_group=group, find_unused_parameters=True)
        if variant == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return ddp

    def aliased(ddp, model):  # from the second step on, each gradient is its bucket's slot
        if variant == "bucket_view" and ddp._reducer.iterations() > 1:
            for i, p in enumerate(ddp._params):
                if p.grad is not None and ddp._reducer.view(i) is not None:
                    assert p.grad.data_ptr() == ddp._reducer.view(i).data_ptr(), i

    side = torch.cuda.Stream(device=DEV) if variant == "side_stream" else None
    ours = train_ddp(ours_wrap, stream=side, check=aliased)
    assert type(made[0]._reducer).__name__ == "NegotiatedReducer"
    assert len(made[0]._gradcomm_buckets()) > 1  # small caps: several buckets
    theirs = train_ddp(theirs_wrap)
    mine = ours.numpy().tobytes()
    assert MPI.COMM_WORLD.allreduce(int(MPI.COMM_WORLD.bcast(mine, root=0) != mine)) == 0
    loose = variant == "fp16"
    assert torch.allclose(ours, theirs, rtol=1e-3 if loose else 1e-5,
                          atol=1e-4 if loose else 1e-6), (ours - theirs).abs().max()


def test_reducer_settings_that_differ_are_refused_on_every_rank():
    if SIZE < 2:
        pytest.skip("needs ranks that differ")
    # Ranks that would plan different buckets (one rank's fusion threshold differs) or divide
    # differently (Average against Sum): refused where the optimizer is made, on every rank.
    for options in ({"fusion_threshold": 256 if RANK == 0 else 1 << 20},
                    {"op": hvd.Sum if RANK == 0 else hvd.Average}):
        model = Net().to(DEV)
        with pytest.raises(gradcomm.InvalidArgument, match="differ"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(), **options)
    hvd.barrier()  # the ranks still agree afterwards


def test_what_cuda_modules_cannot_do_is_refused():
    with pytest.raises(gradcomm.Error, match="output_device"):
        hvd.DistributedDataParallel(Net().to(DEV), output_device=DEV)
