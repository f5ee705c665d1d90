"""What gradcomm.torch's front ends share: tensor checks, host staging of CUDA tensors, scaling
on the GPU, coalesced broadcasts, a check that every rank holds the same model, and the gradient
reducer that autograd hooks feed (the compiled packing::Reducer: buckets all-reduced on the
progress engine while backward runs).

The Horovod-style all-reduces reduce CUDA tensors on the GPU (NCCL, through the negotiator's
GPU path; gpu_reduces()). Other CUDA tensors go through the same host paths as CPU tensors, by
way of pinned host copies (as Horovod's MPI operations do where the MPI cannot read GPU memory):
the copy in waits for the work queued on the tensor's device's current stream, and the result is
copied back on that stream, so that work queued after it there sees the result."""

import collections
import hashlib
import os

import numpy as np
import torch

from . import InvalidArgument, MismatchError, world
from . import _gradcomm

DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}


# Devices whose tensors the front ends take (CUDA through host copies, above).
DEVICES = ("cpu", "cuda")

# For tests (GRADCOMM_TORCH_STAGE_ALL=1): every tensor, CPU ones too, then goes through a host
# copy as CUDA tensors do, so that the staging is exercised where no GPU is.
_stage_every_tensor = os.environ.get("GRADCOMM_TORCH_STAGE_ALL") == "1"


_gpu_unavailable = None


# Algorithms with a GPU form; under any other (named, or GRADCOMM_ALGORITHM) CUDA tensors are
# staged through the host as before, as they are in reproducible mode, which has no GPU form.
_GPU_ALGORITHMS = (None, "", "auto", "nccl", "hierarchical")


def gpu_reduces(tensor, algorithm=None):
    """Whether the Horovod-style all-reduces reduce `tensor` on the GPU with `algorithm`: a CUDA
    tensor, where gradcomm's GPU module runs, with an algorithm that has a GPU form, outside
    reproducible mode (GRADCOMM_DETERMINISTIC=1) and GRADCOMM_TORCH_STAGE_ALL."""
    global _gpu_unavailable
    if not tensor.is_cuda or _stage_every_tensor:
        return False
    if algorithm not in _GPU_ALGORITHMS or os.environ.get("GRADCOMM_DETERMINISTIC") == "1":
        return False
    if algorithm in (None, "", "auto") and os.environ.get("GRADCOMM_ALGORITHM") not in \
            _GPU_ALGORITHMS:
        return False
    if _gpu_unavailable is None:
        _gpu_unavailable = _gradcomm._gpu_unavailable_reason()
    return not _gpu_unavailable


def scale_on_device(tensor, factor):
    """Multiplies `tensor` in place by `factor` on its device's current stream, in Horovod's
    arithmetic (packing/negotiator.h): float32, float16 and bfloat16 in float32 with the factor
    rounded to float, float64 in double, integers in double truncated toward zero and saturated."""
    if factor == 1.0 or tensor.numel() == 0:
        return
    with torch.no_grad():
        if tensor.dtype == torch.float64:
            tensor.mul_(float(factor))
        elif tensor.dtype == torch.float32:
            tensor.mul_(float(np.float32(factor)))
        elif tensor.is_floating_point():  # in float32 (some torch kernels round the factor to
            tensor.copy_(tensor.float().mul_(float(np.float32(factor))))  # the tensor's dtype)
        else:
            info = torch.iinfo(tensor.dtype)
            wide = tensor.double().mul_(float(factor))
            high, low = wide >= float(info.max), wide <= float(info.min)
            exact = wide.trunc().masked_fill_(high | low, 0).to(tensor.dtype)
            tensor.copy_(exact.masked_fill_(high, info.max).masked_fill_(low, info.min))


def needs_host_copy(tensor):
    """Whether gradcomm's host path reads and writes `tensor` through a host copy of it."""
    return tensor.device.type != "cpu" or _stage_every_tensor


def staged(tensor, read=True):
    """The memory gradcomm's host path uses for `tensor`: the tensor itself on the CPU, else a
    host copy (pinned), filled from it when `read` (the copy waits for the work queued on the
    device's current stream)."""
    if not needs_host_copy(tensor):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    if read:
        host.copy_(tensor)
    return host


def unstage(tensor, host):
    """Copies `host` (what staged() gave) back into `tensor`, on the device's current stream
    (the host does not wait; work queued after it there sees the result). Returns `tensor`."""
    if host is not tensor:
        with torch.no_grad():
            tensor.copy_(host, non_blocking=True)
    return tensor


def check_tensor(tensor, call, what="tensor", writes=False):
    """The gradcomm dtype name of a tensor gradcomm can reduce in place; InvalidArgument
    naming the call and the problem otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"{call}: {what} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.device.type not in DEVICES:
        raise InvalidArgument(f"{call}: {what} is on {tensor.device}; gradcomm.torch takes CPU "
                              "and CUDA tensors")
    if tensor.layout != torch.strided:
        raise InvalidArgument(f"{call}: {what} has layout {tensor.layout}; gradcomm takes dense "
                              "(strided) tensors (call .to_dense())")
    if writes and tensor.requires_grad and torch.is_grad_enabled():
        raise InvalidArgument(f"{call}: {what} requires grad, and an in-place write through its "
                              "data pointer would bypass autograd; pass tensor.detach() (or "
                              "its .grad), or call under torch.no_grad()")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{call}: {what} is not contiguous (call .contiguous())")
    if tensor.dtype not in DTYPES:
        raise InvalidArgument(f"{call}: {what} has unsupported dtype {tensor.dtype} (supported: "
                              "float32, float64, float16, bfloat16, int32, int64)")
    return DTYPES[tensor.dtype]


def check_parameter(p, call, name):
    """Parameters a reducer takes: dense CPU or CUDA tensors of a gradcomm dtype."""
    if p.device.type not in DEVICES:
        raise InvalidArgument(f"{call}: parameter {name} is on {p.device}; gradcomm.torch trains "
                              "CPU and CUDA models")
    if p.layout != torch.strided:
        raise InvalidArgument(f"{call}: parameter {name} has layout {p.layout}; only dense "
                              "parameters are supported")
    if p.dtype not in DTYPES:
        raise InvalidArgument(f"{call}: parameter {name} has unsupported dtype {p.dtype}")


def _byte_view(t):
    return t.reshape(-1).view(torch.uint8)


def broadcast_coalesced(tensors, root, comm, chunk_bytes=64 << 20):
    """Copies root's values of `tensors` (any dtypes, the same shapes on every rank) into every
    rank's, in place, packed into few broadcasts of at most chunk_bytes."""
    tensors = [t.detach() for t in tensors if t.numel() > 0]
    rank = comm.rank()
    align = 16  # every tensor starts 16-byte aligned in the packed buffer (views by dtype)
    start = 0
    while start < len(tensors):
        end, nbytes = start, 0
        while end < len(tensors) and (end == start or nbytes + tensors[end].numel() *
                                      tensors[end].element_size() <= chunk_bytes):
            nbytes += (tensors[end].numel() * tensors[end].element_size() + align - 1) // align * align
            end += 1
        group = tensors[start:end]
        flat = torch.empty(nbytes, dtype=torch.uint8)
        offsets, offset = [], 0
        for t in group:
            offsets.append(offset)
            offset += (t.numel() * t.element_size() + align - 1) // align * align
        if rank == root:
            for t, o in zip(group, offsets):
                b = t.numel() * t.element_size()
                flat[o:o + b].copy_(_byte_view(t.contiguous()))
        comm._broadcast_ptr(flat.data_ptr(), nbytes // 8, "int64", root)
        if rank != root:
            with torch.no_grad():
                for t, o in zip(group, offsets):
                    b = t.numel() * t.element_size()
                    t.copy_(flat[o:o + b].view(t.dtype).view(t.shape))
        start = end


def verify_same_across_ranks(description, call, what, comm):
    """Raises InvalidArgument on every rank (one small all-reduce, no hang) unless every rank
    passed the same `description` string."""
    digest = int.from_bytes(hashlib.sha256(description.encode()).digest()[:7], "little")
    t = torch.tensor([digest, -digest], dtype=torch.int64)
    comm._allreduce_ptr(t.data_ptr(), t.data_ptr(), 2, "int64", "min", None)
    if t[0].item() != -t[1].item():
        raise InvalidArgument(f"{call}: the ranks differ in {what} (rank {comm.rank()} has "
                              f"{description[:200]}{'...' if len(description) > 200 else ''})")


class GradientReducer:
    """The compiled Reducer over a list of parameters' gradients. mark(i, grad) hands it
    parameter i's gradient tensor (kept alive until finish()); finish() waits for every bucket
    and writes the averaged gradients back into those tensors. Every parameter must be marked
    before finish() (the front ends mark the ones backward did not reach themselves). A CUDA
    gradient is reduced from a pinned host copy of it, made once per parameter and reused."""

    def __init__(self, params, names, call, comm=None, op="average", algorithm=None,
                 bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20, compression="none",
                 groups=None, overlap=True, divide_before_sum=False):
        self.comm = comm or world()
        for p, n in zip(params, names):
            check_parameter(p, call, n)
        self.params = params
        self.names = names
        self._dtypes = [p.dtype for p in params]
        self._counts = [p.numel() for p in params]
        # Placeholders only: every tensor is marked with explicit memory before finish().
        self._reducer = _gradcomm._Reducer(
            self.comm, [p.data_ptr() for p in params], [p.numel() for p in params],
            [DTYPES[p.dtype] for p in params], op, algorithm, int(bucket_cap_bytes),
            int(first_bucket_bytes), compression, [], [list(g) for g in (groups or [])],
            True, overlap, divide_before_sum)
        self._pending = {}  # index -> (gradient, the memory marked for it: itself or its copy)
        self._hosts = {}    # index -> the host copy of a CUDA gradient (made once)
        self._flat = None
        self._views = {}

    def mark(self, index, grad):
        """Hands the reducer `grad` (contiguous, parameter index's shape and dtype)."""
        p = self.params[index]
        if (grad.dtype != self._dtypes[index] or grad.numel() != self._counts[index] or
                grad.layout != torch.strided or not grad.is_contiguous()):
            raise InvalidArgument(
                f"gradient of {self.names[index]}: {grad.dtype}, {grad.numel()} elements, "
                f"layout {grad.layout}{'' if grad.is_contiguous() else ', not contiguous'}; the "
                f"reducer was built for {self._dtypes[index]}, {self._counts[index]} elements "
                f"(was the model converted after it was wrapped? parameter now {p.dtype})")
        host = grad
        if needs_host_copy(grad):
            host = self._hosts.get(index)
            if host is None:
                host = self._hosts[index] = staged(grad, read=False)
            host.copy_(grad)  # waits for the gradient's stream
        self._reducer.mark_ready(index, host.data_ptr())
        # Alive until finish(): the reducer writes the result there.
        self._pending[index] = (grad, host)

    def is_marked(self, index):
        return index in self._pending

    @property
    def busy(self):
        """True between the first mark and finish()."""
        return bool(self._pending)

    def finish(self):
        try:
            self._reducer.finish()
            copied = [(g, h) for g, h in self._pending.values() if h is not g]
        finally:
            self._pending.clear()
        devices = set()
        for grad, host in copied:
            unstage(grad, host)
            if grad.is_cuda:
                devices.add(grad.device)
        # Before a host copy is filled again (next backward, perhaps from another thread's
        # stream), its copy back must have run.
        for d in devices:
            torch.cuda.current_stream(d).synchronize()

    def iterations(self):
        return self._reducer.iterations()

    def buckets(self):
        return self._reducer.buckets()

    def view(self, index):
        """Parameter index's slot in its bucket, as a tensor of its shape (None before the first
        iteration has finished: the buckets may still be planned again then)."""
        if self._reducer.iterations() < 1:
            return None
        v = self._views.get(index)
        if v is None:
            if self._flat is None:
                self._flat = torch.frombuffer(self._reducer, dtype=torch.uint8)
            p = self.params[index]
            offset = self._reducer.view_offset(index)
            nbytes = p.numel() * p.element_size()
            v = self._flat[offset:offset + nbytes].view(p.dtype).view(p.shape)
            self._views[index] = v
        return v


def grad_accumulator(p):
    """The AccumulateGrad node of leaf `p` (its post hooks run once p.grad holds the new
    gradient)."""
    with torch.enable_grad():
        return p.expand_as(p).grad_fn.next_functions[0][0]


class JoinControl:
    """The exchange that lets ranks which ran out of data (join) stand in for the collectives
    of the ranks still training. Each round is one int64 SUM all-reduce of size + FIELDS
    elements: a rank still training sets its own slot and the descriptor of the call it is about
    to make; a joined rank sends zeros. Every rank then knows which ranks are still training and,
    from their (agreeing) descriptors, what a joined rank must stand in for."""

    FIELDS = 8

    def __init__(self, comm):
        self.comm = comm
        self._n = comm.size()
        self._rank = comm.rank()
        # NumPy, not torch: a round costs a few microseconds, most of it the all-reduce.
        self._v = np.zeros(self._n + self.FIELDS, dtype=np.int64)
        self._ptr = self._v.ctypes.data
        # The ranks training in the newest round this rank saw that had any.
        self.last_active = list(range(self._n))
        self.rounds = 0       # rounds made so far: the same count on every rank
        self._posted = collections.deque()  # (buffer, request) of non-blocking rounds

    def post(self, fields):
        """A training rank's round whose answer it does not need (before an all-reduce):
        non-blocking, so an async call stays asynchronous; its buffer lives until it is done."""
        a = np.zeros(self._n + self.FIELDS, dtype=np.int64)
        a[self._rank] = 1
        a[self._n:self._n + len(fields)] = fields
        request = self.comm._allreduce_async_ptr(a.ctypes.data, a.ctypes.data, a.size, "int64",
                                                 "sum", None)
        self.rounds += 1
        self._posted.append((a, request))
        while self._posted and self._posted[0][1].done():
            self._posted.popleft()

    def exchange(self, active, fields=()):
        """One round; returns (the ranks still training, their descriptor)."""
        self.rounds += 1
        n, v = self._n, self._v
        v[:] = 0
        if active:
            v[self._rank] = 1
            v[n:n + len(fields)] = fields
        self.comm._allreduce_ptr(self._ptr, self._ptr, n + self.FIELDS, "int64", "sum", None)
        values = v.tolist()
        if sum(values[:n]) == n:  # nobody has joined: the common case
            return range(n), values[n:]
        active_ranks = [r for r in range(n) if values[r]]
        if not active_ranks:
            return active_ranks, [0] * self.FIELDS
        self.last_active = active_ranks
        k = len(active_ranks)
        # A sum that does not divide proves the training ranks disagree. One that divides may
        # still hide a disagreement; the call itself then fails its fingerprint check on every
        # rank, the joined ones included (unless GRADCOMM_CHECK=0).
        if any(x % k for x in values[n:]):
            raise MismatchError(f"join: the {k} ranks still training are making different calls "
                                f"(descriptor sums {values[n:]} over ranks {active_ranks})")
        return active_ranks, [x // k for x in values[n:]]


def neutral(op, dtype, count):
    """A tensor of `count` elements that leaves `op` unchanged: what a joined rank contributes
    in place of data (zeros for sum and average, as Horovod and torch's DDP join do)."""
    if op in ("sum", "average"):
        return torch.zeros(count, dtype=dtype)
    if op == "product":
        return torch.ones(count, dtype=dtype)
    if dtype.is_floating_point:
        return torch.full((count,), float("inf") if op == "min" else float("-inf"), dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.full((count,), info.max if op == "min" else info.min, dtype=dtype)
