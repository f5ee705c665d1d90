"""The inputs and the serial reference of the torch backend's collective tests, on the CPU and
on CUDA tensors (tests/gpu/test_torch_cuda.py imports it too)."""

import torch
from torch.distributed import ReduceOp as R


def values(rank, dtype, n):
    """Rank `rank`'s input: small integers, exact in every dtype, products stay small."""
    base = (torch.arange(n) % 3 + rank % 2 + 1).to(torch.int64)
    if dtype == torch.bool:
        return (torch.arange(n) + rank) % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def expected(op, dtype, n, ranks):
    """What reducing the inputs of `ranks` with `op` gives, computed serially on the CPU."""
    inputs = [values(r, dtype, n) for r in ranks]
    if dtype == torch.bool:
        stacked = torch.stack(inputs) if n else torch.zeros(len(ranks), 0, dtype=torch.bool)
        return stacked.any(0) if op in (R.SUM, R.MAX) else stacked.all(0)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    stacked = torch.stack([t.to(wide) for t in inputs]) if n else torch.zeros(len(ranks), 0,
                                                                                 dtype=wide)
    integer = not (dtype.is_floating_point or dtype.is_complex)
    average = ((lambda s: torch.div(s.sum(0), len(ranks), rounding_mode="trunc")) if integer
               else (lambda s: s.sum(0) / len(ranks)))  # integers truncate, as in C
    return {R.SUM: lambda s: s.sum(0), R.AVG: average,
            R.PRODUCT: lambda s: s.prod(0), R.MIN: lambda s: s.min(0).values if n else s[0],
            R.MAX: lambda s: s.max(0).values if n else s[0]}[op](stacked)


def check(actual, want, dtype, op=None, rank=None):
    """`actual` (on any device) holds `want`: exactly, or within float rounding for AVG of
    floating and complex tensors."""
    assert actual.dtype == dtype
    actual = actual.cpu()
    if op is not None and op == R.AVG and (dtype.is_floating_point or dtype.is_complex):
        tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
        if dtype.is_complex:  # both parts (double() would drop the imaginary one)
            actual, want = torch.view_as_real(actual), torch.view_as_real(want.to(dtype))
        assert torch.allclose(actual.double(), want.double(), rtol=tol, atol=tol), (actual, want)
    else:
        assert torch.equal(actual, want.to(dtype)), f"rank {rank}: {actual} != {want}"


def registered(tensor):
    """Whether `tensor`'s data lies in gradcomm's registered memory: a /dev/shm/gradcomm-*
    mapping in /proc/self/maps."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return "/dev/shm/gradcomm-" in " ".join(fields[5:])
    return False
