"""gradcomm.torch under mpirun (2 and 4 ranks from CTest): in-place all-reduce of CPU tensors
without copies, parameter broadcast, and DistributedOptimizer against two references trained
on the same data from the same seed: torch.nn.parallel.DistributedDataParallel with the gloo
backend, and one process with the full batch."""

import pytest
import torch
from mpi4py import MPI

import gradcomm
import gradcomm.torch as gt

gradcomm.init()
RANK = gradcomm.rank()
SIZE = gradcomm.size()
torch.set_num_threads(1)  # ranks share the cores


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64])
def test_allreduce_in_place_without_copies(dtype):
    t = (torch.arange(1000) % 7 + RANK).to(dtype)
    ptr = t.data_ptr()
    gt.allreduce_(t, op="sum")
    expected = ((torch.arange(1000) % 7) * SIZE + SIZE * (SIZE - 1) // 2).to(dtype)
    assert t.data_ptr() == ptr
    assert torch.equal(t, expected)
    out = gt.allreduce((torch.ones(3, dtype=dtype) * 2), op="average")
    assert torch.equal(out, torch.full((3,), 2, dtype=dtype))


def test_errors():
    with pytest.raises(gradcomm.Error, match="not contiguous"):
        gt.allreduce_(torch.ones(4, 4).t())
    with pytest.raises(gradcomm.Error, match="unsupported dtype"):
        gt.allreduce_(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(gradcomm.Error, match="not a torch.Tensor"):
        gt.allreduce_([1.0])
    with pytest.raises(gradcomm.Error, match="unknown op"):
        gt.allreduce_(torch.ones(4), op="median")
    with pytest.raises(gradcomm.Error, match="is on meta"):
        gt.allreduce_(torch.ones(4, device="meta"))
    with pytest.raises(gradcomm.Error, match="layout"):
        gt.allreduce_(torch.ones(4).to_sparse())
    # In-place writes autograd cannot see: refused unless under no_grad (or on .detach()).
    leaf = torch.ones(4, requires_grad=True)
    with pytest.raises(gradcomm.Error, match="requires grad"):
        gt.allreduce_(leaf)
    with pytest.raises(gradcomm.Error, match="requires grad"):
        gt.broadcast_(leaf, 0)
    with torch.no_grad():
        gt.allreduce_(leaf, op="sum")
    assert torch.equal(leaf.detach(), torch.full((4,), float(SIZE)))
    with pytest.raises(gradcomm.Error, match=r"root -1 is outside"):
        gt.broadcast_(torch.ones(4), root_rank=-1)
    with pytest.raises(gradcomm.Error, match=rf"root {SIZE} is outside"):
        gt.broadcast_(torch.ones(4), root_rank=SIZE)
    t = torch.ones(8)
    with pytest.raises(gradcomm.Error, match="overlaps"):
        gt.grouped_allreduce_([t, t])
    # A state_dict with a tensor that is not dense fails before anything is broadcast.
    model = make_model(100 + RANK)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(model.state_dict())
    state["zz.sparse"] = torch.ones(3).to_sparse()
    with pytest.raises(gradcomm.Error, match="zz.sparse is not a dense CPU or CUDA tensor"):
        gt.broadcast_parameters(state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradcomm.Error, match="were not named"):  # Horovod's words
        gt.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:1])
    ones = torch.ones(4)
    gt.allreduce_(ones, op="sum")  # still usable
    assert torch.equal(ones, torch.full((4,), float(SIZE)))


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def test_broadcast_parameters_makes_replicas_equal():
    model = make_model(100 + RANK)  # different on every rank
    gt.broadcast_parameters(model.state_dict(), root=0)
    reference = make_model(100)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                reference.state_dict().values()))
    assert MPI.COMM_WORLD.allreduce(int(not same)) == 0


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# DistributedOptimizer, DDP and one process differ only in the order float32 gradient
# contributions are added (per-rank shard sums, then the all-reduce; DDP's gloo ring; one
# process: the whole batch): relative differences of ~1e-7 per step, which 20 steps of SGD with
# momentum at a stable learning rate keep well below 1e-5.
TOLERANCE = 1e-5


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_distributed_optimizer_matches_ddp_and_one_process(gloo, optimizer_name):
    torch.manual_seed(7)
    global_batch = 120  # divides by 1, 2, 3, 4, 5 and 8 ranks
    x = torch.randn(20 * global_batch, 20)
    y = torch.randint(0, 5, (20 * global_batch,))

    def optimizer_for(model):
        if optimizer_name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=1e-3)

    ours = make_model(3)
    ddp_model = make_model(3)
    single = make_model(3)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    opt_ours = gt.DistributedOptimizer(optimizer_for(ours), named_parameters=ours.named_parameters())
    assert isinstance(opt_ours, torch.optim.Optimizer)
    opt_ddp = optimizer_for(ddp_model)
    opt_single = optimizer_for(single)
    loss_fn = torch.nn.CrossEntropyLoss()
    shard = global_batch // SIZE
    for step in range(20):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        mine = slice(step * global_batch + RANK * shard, step * global_batch + (RANK + 1) * shard)
        for model, opt in [(ours, opt_ours), (ddp, opt_ddp)]:
            opt.zero_grad()
            loss_fn(model(x[mine]), y[mine]).backward()
            opt.step()
        opt_single.zero_grad()
        loss_fn(single(x[rows]), y[rows]).backward()
        opt_single.step()
    a, b, c = flat(ours), flat(ddp_model), flat(single)
    vs_ddp = ((a - b).norm() / b.norm()).item()
    vs_single = ((a - c).norm() / c.norm()).item()
    print(f"\n{optimizer_name}: relative distance to DDP {vs_ddp:.2e}, to one process "
          f"{vs_single:.2e}")
    assert vs_ddp <= TOLERANCE
    assert vs_single <= TOLERANCE
    # Replicas identical across ranks.
    digest = float(a.double().sum())
    assert MPI.COMM_WORLD.allreduce(digest, op=MPI.MAX) == MPI.COMM_WORLD.allreduce(digest,
                                                                                   op=MPI.MIN)
