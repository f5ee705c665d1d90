"""What gradcomm.torch's front ends share: tensor checks, host staging of CUDA tensors, scaling
on the GPU, coalesced broadcasts, a check that every rank holds the same model, the negotiators,
and the gradient reducers that autograd hooks feed (GradientReducer, the compiled
packing::Reducer: host buckets all-reduced on the progress engine while backward runs; and
NegotiatedReducer, the same buckets on a CUDA device, reduced there).

The Horovod-style all-reduces and a CUDA model's gradient buckets reduce on the GPU (NCCL,
through the negotiator's GPU path; gpu_reduces()). Other CUDA tensors go through the same host
paths as CPU tensors, by way of pinned host copies (as Horovod's MPI operations do where the MPI cannot read GPU memory):
the copy in waits for the work queued on the tensor's device's current stream, and the result is
copied back on that stream, so that work queued after it there sees the result."""

import collections
import contextlib
import hashlib
import math
import os

import numpy as np
import torch

from . import InvalidArgument, MismatchError, Unsupported, world
from . import _gradcomm

DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}


# Devices whose tensors the front ends take.
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


def raise_on_every_rank(error, call, what, comm):
    """Re-raises `error`, this rank's refusal of its arguments, after taking part in the
    all-reduce of verify_same_across_ranks that ranks which accepted theirs make next: its
    description (the error) differs from theirs, so they raise there at once instead of waiting
    for this rank until the watchdog. Where every rank refused alike, the descriptions agree and
    each raises its own error."""
    with contextlib.suppress(InvalidArgument):
        verify_same_across_ranks(f"an error on this rank: {type(error).__name__}: {error}", call,
                                 what, comm)
    raise error


def to_sparse_rows(dense, sparse_dim):
    """`dense` as a coalesced sparse COO tensor of `sparse_dim` sparse dimensions, leaving out
    the entries that are zero. For an embedding's gradient (one sparse dimension over rows)
    a scan for the rows, five times faster than torch's to_sparse on a 100000 x 64 table."""
    if sparse_dim != 1 or dense.dim() < 2:
        return dense.to_sparse(sparse_dim)
    rows = dense.ne(0).flatten(1).any(1).nonzero().squeeze(1)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), dense.index_select(0, rows),
                                   dense.shape)._coalesced_(True)


def sparse_cost_warning(call, name, param):
    """What reducing parameter `name`'s sparse gradients in a dense bucket slot costs, and the
    faster way."""
    megabytes = param.numel() * param.element_size() / 1e6
    return (f"{call}: {name} has sparse gradients: they are reduced densely in its bucket slot "
            f"({megabytes:.3g} MB a step, with a dense copy and a scan for its rows: several "
            "times gloo's step on a 100000 x 64 table, docs/results/torch.md) and handed back "
            "sparse; "
            "gradcomm.torch.DistributedDataParallel (for a sparse Embedding or "
            "EmbeddingBag) and torch's DDP on the gradcomm backend gather only the rows a step "
            "touches")


# ---- negotiators: calls matched by name (packing/negotiator.h), one per communicator -----------
_negotiators = {}  # id(communicator) -> (communicator, its negotiator)


def mpi_threads_supported():
    """True when MPI runs at MPI_THREAD_MULTIPLE (which gradcomm's overlap needs)."""
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def next_per_communicator(counts, c):
    """The next number in `counts` (id(communicator) -> (communicator, last number)) for
    communicator c, from 1: the same on every rank of c when every rank of it counts the same
    collective objects, whatever other communicators saw."""
    entry = counts.get(id(c))
    number = entry[1] + 1 if entry is not None and entry[0] is c else 1
    counts[id(c)] = (c, number)
    return number


def negotiator(c):
    """The negotiator of communicator `c`, made on first use (collective: every rank of c makes it
    at the same point of its calls)."""
    entry = _negotiators.get(id(c))
    if entry is None or entry[0] is not c:
        if c.size() > 1 and not mpi_threads_supported():
            raise Unsupported("gradcomm.torch: its background thread needs MPI at "
                              "MPI_THREAD_MULTIPLE; MPI was initialized at a lower level "
                              "(initialize it through gradcomm or mpi4py's default, which asks "
                              "for MPI_THREAD_MULTIPLE)")
        entry = _negotiators[id(c)] = (c, c._negotiator())
    return entry[1]


def close_negotiators():
    """Collective: each negotiator stops once every rank has closed it."""
    for _, n in list(_negotiators.values()):
        n.close()
    _negotiators.clear()


# For tests (GRADCOMM_TORCH_NEGOTIATED_REDUCER=1): CPU models' gradients too go through the
# reducer CUDA gradients use (NegotiatedReducer, its buckets submitted to the negotiator's host
# path), so that its logic is exercised where no GPU is.
_negotiated_cpu = os.environ.get("GRADCOMM_TORCH_NEGOTIATED_REDUCER") == "1"


def gradient_reducer(params, names, call, comm=None, op="average", algorithm=None,
                     bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20, compression="none",
                     groups=None, overlap=True, divide_before_sum=False):
    """The reducer for these parameters' gradients (collective: every rank of `comm` calls it
    with the same parameters). A model on one CUDA device, where gradcomm's GPU path runs on
    every rank (gpu_reduces), gets a NegotiatedReducer (buckets on the GPU, NCCL); any other a
    GradientReducer (host buckets, CUDA gradients through pinned host copies)."""
    comm = comm or world()
    refused = None
    try:
        for p, n in zip(params, names):
            check_parameter(p, call, n)
    except Exception as error:  # where only this rank refuses, the others must not wait for it
        refused = error
    here = False
    if refused is None:
        devices = {p.device for p in params}
        one = next(iter(devices)) if len(devices) == 1 else None
        here = one is not None and (gpu_reduces(params[0], algorithm) or
                                    (one.type == "cpu" and _negotiated_cpu))
    # Every rank must pick the same kind: one int32 MIN all-reduce decides (-1: a rank refused
    # its parameters, which every rank learns here).
    flag = torch.tensor([-1 if refused is not None else 1 if here else 0], dtype=torch.int32)
    if comm.size() > 1:
        comm._allreduce_ptr(flag.data_ptr(), flag.data_ptr(), 1, "int32", "min", None)
    if refused is not None:
        raise refused
    if flag.item() < 0:
        raise InvalidArgument(f"{call}: another rank refused its parameters (its error says "
                              "which and why); this rank's were accepted")
    kind = NegotiatedReducer if flag.item() else GradientReducer
    return kind(params, names, call, comm, op, algorithm, bucket_cap_bytes, first_bucket_bytes,
                compression, groups, overlap, divide_before_sum)


class _ReducerBase:
    """What both reducers share: the parameters, the gradients marked this iteration
    (`_pending`, by index) and the check of a gradient handed to mark()."""

    def __init__(self, params, names, comm):
        self.comm = comm or world()
        self.params = params
        self.names = names
        self._dtypes = [p.dtype for p in params]
        self._counts = [p.numel() for p in params]
        self._pending = {}
        self._failed = None  # fail(): why this rank's iteration failed

    def fail(self, error):
        """This rank cannot complete this iteration (a gradient failed here: `error`): every
        bucket not yet sent is a stand-in that makes the other ranks' all-reduce of it fail,
        naming this rank, instead of reducing without this rank's gradients. finish() then raises
        on every rank and writes nothing back; the next iteration starts clean."""
        if self._failed is None:
            self._failed = f"{type(error).__name__}: {error}"
            self._fail_buckets()

    def _check_gradient(self, index, grad, device=None):
        """InvalidArgument unless `grad` fits parameter index (and lies on `device`, if given)."""
        p = self.params[index]
        if (grad.dtype != self._dtypes[index] or grad.numel() != self._counts[index] or
                grad.layout != torch.strided or not grad.is_contiguous() or
                (device is not None and grad.device != device)):
            where = f" on {grad.device}" if device is not None else ""
            built = f" on {device}" if device is not None else ""
            now = f" on {p.device}" if device is not None else ""
            raise InvalidArgument(
                f"gradient of {self.names[index]}: {grad.dtype}, {grad.numel()} elements{where}, "
                f"layout {grad.layout}{'' if grad.is_contiguous() else ', not contiguous'}; the "
                f"reducer was built for {self._dtypes[index]}, {self._counts[index]} elements"
                f"{built} (was the model converted after it was wrapped? parameter now "
                f"{p.dtype}{now})")

    def is_marked(self, index):
        return index in self._pending

    def _mark_missing_with_zeros(self):
        """Zeros for the parameters not marked this iteration (gradients backward did not
        produce)."""
        if self._failed is not None:  # (no bucket of this iteration is reduced any more)
            return
        for i, p in enumerate(self.params):
            if i not in self._pending:
                self.mark(i, torch.zeros_like(p, memory_format=torch.contiguous_format))

    @property
    def busy(self):
        """True between the first mark and finish()."""
        return bool(self._pending)


class GradientReducer(_ReducerBase):
    """The compiled Reducer over a list of parameters' gradients. mark(i, grad) hands it
    parameter i's gradient tensor (kept alive until finish()); finish() waits for every bucket
    and writes the averaged gradients back into those tensors. A parameter not marked before
    finish() counts as zeros (the front ends mark the ones backward did not reach themselves). A CUDA
    gradient is reduced from a pinned host copy of it, made once per parameter and reused."""

    def __init__(self, params, names, call, comm=None, op="average", algorithm=None,
                 bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20, compression="none",
                 groups=None, overlap=True, divide_before_sum=False):
        super().__init__(params, names, comm)
        # Placeholders only: every tensor is marked with explicit memory before finish().
        self._reducer = _gradcomm._Reducer(
            self.comm, [p.data_ptr() for p in params], [p.numel() for p in params],
            [DTYPES[p.dtype] for p in params], op, algorithm, int(bucket_cap_bytes),
            int(first_bucket_bytes), compression, [], [list(g) for g in (groups or [])],
            True, overlap, divide_before_sum)
        # self._pending: index -> (gradient, the memory marked for it: itself or its copy)
        self._hosts = {}    # index -> the host copy of a CUDA gradient (made once)
        self._flat = None
        self._views = {}

    def mark(self, index, grad):
        """Hands the reducer `grad` (contiguous, parameter index's shape and dtype)."""
        self._check_gradient(index, grad)
        host = grad
        if needs_host_copy(grad):
            host = self._hosts.get(index)
            if host is None:
                host = self._hosts[index] = staged(grad, read=False)
            host.copy_(grad)  # waits for the gradient's stream
        self._reducer.mark_ready(index, host.data_ptr())
        # Alive until finish(): the reducer writes the result there.
        self._pending[index] = (grad, host)

    def _fail_buckets(self):
        self._reducer.fail_iteration(self._failed)

    def finish(self):
        error = None
        try:
            self._mark_missing_with_zeros()
        except Exception as e:  # noqa: BLE001 - this rank's step fails; the others learn of it
            error = e
            self.fail(e)
        try:
            self._reducer.finish()
            copied = [(g, h) for g, h in self._pending.values() if h is not g]
        except Exception:
            if error is None:
                raise
        finally:
            self._pending.clear()
            self._failed = None
        if error is not None:
            raise error
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

    @property
    def negotiated(self):
        """False: a joined rank stands in for its buckets by marking zeros."""
        return False

    @property
    def gpu_device(self):
        """-1: its buckets are host memory."""
        return -1

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


_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
# NegotiatedReducers made per communicator (next_per_communicator): their buckets' names.
_negotiated_reducers = {}


class NegotiatedReducer(_ReducerBase):
    """GradientReducer's interface for a model on one CUDA device, reduced on the GPU: each
    bucket (the compiled reducer's first plan: packing::plan_reducer_buckets in reverse parameter
    order; not planned again from an observed order, which would take a collective outside the
    negotiation that a rank inside hvd.join could not match) is a flat tensor on the device; mark()
    copies a gradient into its slot on the current stream, and a complete bucket (but the last,
    which finish() submits) is submitted to the communicator's negotiator under a name of its
    own, after an event recorded there (the negotiator's GPU path: NCCL on a stream of its own,
    once that event has run). finish() waits for every bucket and copies the results back on
    the current stream; work queued there after it sees them, and the next iteration's copies in
    wait for that. Names make the buckets' order free (ranks may complete them in different
    orders), a rank inside hvd.join stands in for them, and mismatched buckets fail on every
    rank, as every negotiated call."""

    def __init__(self, params, names, call, comm=None, op="average", algorithm=None,
                 bucket_cap_bytes=25 << 20, first_bucket_bytes=1 << 20, compression="none",
                 groups=None, overlap=True, divide_before_sum=False):
        super().__init__(params, names, comm)
        if op not in ("average", "sum"):
            raise InvalidArgument(f"{call}: the reducer of CUDA gradients takes op average or "
                                  f"sum, not {op!r}")
        self._call = call
        self._average = op == "average"
        self._algorithm = algorithm or ""
        self._caps = (int(bucket_cap_bytes), int(first_bucket_bytes))
        self._compression = compression
        self._groups = [list(g) for g in (groups or [])]
        self._overlap = overlap
        self._divide_before_sum = divide_before_sum
        self._device = params[0].device if params else torch.device("cpu")
        self._gpu = self._device.type == "cuda"
        self._name = f"{call}.reducer{next_per_communicator(_negotiated_reducers, self.comm)}"
        self._negotiator = negotiator(self.comm)  # collective: made here, before any bucket
        self._iterations = 0
        self._reusable = None  # the event after the last copy back (the buckets' memory free)
        what = "the reducer's settings (op, compression, bucket sizes or groups)"
        try:  # the buckets' memory on the device may fail on one rank only (out of memory)
            self._plan()
        except Exception as error:
            raise_on_every_rank(error, call, what, self.comm)
        # What the buckets' signatures do not say (the op, where it divides), and the plan: ranks
        # that differ would reduce different buckets, or scale them differently, under one name.
        verify_same_across_ranks(
            f"op {op}, divide_before_sum {divide_before_sum}, compression {compression}, "
            f"algorithm {self._algorithm!r}, buckets {self.buckets()}", call, what, self.comm)

    def _plan(self):
        self._buckets = _gradcomm._plan_reducer_buckets(
            self._counts, [DTYPES[d] for d in self._dtypes], self._caps[0], self._caps[1],
            self._compression, [], self._groups, self._call, self.comm.rank())
        self._flats, self._slots = [], {}
        self._bucket_of = {}
        for b, (_, wire, indices, offsets, count) in enumerate(self._buckets):
            flat = torch.empty(count, dtype=_TORCH_DTYPES[wire], device=self._device)
            self._flats.append(flat)
            for i, offset in zip(indices, offsets):
                self._slots[i] = flat[offset:offset + self._counts[i]]
                self._bucket_of[i] = b
        self._views = {}
        # The last bucket that holds elements is sent by finish() (as the compiled reducer's
        # last bucket): complete only when backward is, it has nothing to overlap with, and a
        # rank whose iteration fails always has it left to stand in for.
        self._last = max((b for b, bucket in enumerate(self._buckets) if bucket[4] > 0),
                         default=-1)
        self._start_iteration()

    def _start_iteration(self):
        self._pending = {}  # index -> gradient (alive until finish(): the result goes there)
        self._failed = None
        self._waiting = [len(b[2]) for b in self._buckets]
        self._states = {}   # bucket -> negotiated state
        self._events = {}   # bucket -> the event its submission waits for (alive until done)
        self._waited = set()  # the streams that waited for _reusable in this iteration

    def _divides_first(self, b):
        dtype, wire = self._buckets[b][0], self._buckets[b][1]
        return self._divide_before_sum and self._average and wire != dtype

    def _stream(self):
        return torch.cuda.current_stream(self._device) if self._gpu else None

    def mark(self, index, grad):
        """Hands the reducer `grad` (contiguous, parameter index's shape and dtype, on the
        model's device)."""
        self._check_gradient(index, grad, self._device)
        if index in self._pending:
            raise InvalidArgument(f"{self._call}: {self.names[index]} was marked twice in one "
                                  "iteration")
        if self._reusable is not None:  # every stream that writes a slot: after the copies back
            stream = self._stream()
            if stream not in self._waited:
                stream.wait_event(self._reusable)
                self._waited.add(stream)
        slot = self._slots[index]
        b = self._bucket_of[index]
        with torch.no_grad():
            if grad.data_ptr() != slot.data_ptr():
                slot.copy_(grad.reshape(-1))
            if self._divides_first(b):
                slot.div_(self.comm.size())
        self._pending[index] = grad
        self._waiting[b] -= 1
        if (self._overlap and self._waiting[b] == 0 and self._failed is None and
                b != self._last):
            self._submit(b)

    def _fail_buckets(self):
        for b in range(len(self._buckets)):
            if b not in self._states:
                self._submit(b)

    def _submit(self, b):
        dtype, wire, _, _, count = self._buckets[b]
        flat = self._flats[b]
        if count == 0:  # parameters without elements: nothing to reduce, on any rank
            self._states[b] = None
            return
        if self._failed is not None:  # the other ranks' bucket of this name fails, naming this one
            self._states[b] = self._negotiator.submit(
                f"{self._name}.bucket{b}", "failed",
                f"this rank's iteration failed: {self._failed}")
            return
        event = 0
        if self._gpu:
            ready = self._events[b] = torch.cuda.Event()
            ready.record(self._stream())
            event = ready.cuda_event
        signature = (f"reducer bucket {b} of {len(self._buckets)}: {dtype} as {wire}, {count} "
                     f"elements, sum" + (f", algorithm {self._algorithm}" if self._algorithm
                                         else ""))
        # fusion_threshold 1: the buckets are planned already, never fused further.
        self._states[b] = self._negotiator.submit(
            f"{self._name}.bucket{b}", "allreduce", signature, flat.data_ptr(), count, wire,
            "sum", algorithm=self._algorithm, fusion_threshold=1, device=self._gpu,
            ready_event=event, gpu=self._device.index if self._gpu else -1)

    def finish(self):
        error = None
        try:
            self._mark_missing_with_zeros()
            for b in range(len(self._buckets)):
                if b not in self._states:
                    self._submit(b)
        except Exception as e:  # noqa: BLE001 - raised once the buckets submitted are done
            error = e
        for state in self._states.values():  # every one: they use the buckets' memory
            try:
                if state is not None:
                    state.wait()
            except Exception as e:  # noqa: BLE001 - the first error is raised
                error = error or e
        if self._failed is not None:  # (its stand-ins' MismatchError is the other ranks' error)
            error = InvalidArgument(f"{self._call}: this rank's iteration failed ({self._failed});"
                                    " its buckets were not reduced on any rank and no gradient "
                                    "was written back")
        if error is not None:
            # The next iteration starts clean; the gradients stay as they were (a gradient that
            # is its bucket's slot, gradient_as_bucket_view, may hold a partial sum).
            self._start_iteration()
            raise error
        n = self.comm.size()
        with torch.no_grad():
            for b, (_, _, indices, _, _) in enumerate(self._buckets):
                if self._average and not self._divides_first(b):
                    self._flats[b].div_(n)
                for i in indices:
                    grad, slot = self._pending[i], self._slots[i]
                    if grad.data_ptr() != slot.data_ptr():
                        grad.view(-1).copy_(slot)
        if self._gpu:
            self._reusable = torch.cuda.Event()
            self._reusable.record(self._stream())
        self._iterations += 1
        self._start_iteration()

    def iterations(self):
        return self._iterations

    def __del__(self):
        # Buckets still in flight (a front end dropped mid-iteration after an error): NCCL may
        # still write their memory, which goes with this object.
        for state in getattr(self, "_states", {}).values():
            try:
                if state is not None:
                    state.wait()
            except Exception:  # noqa: BLE001 - reported to whoever waited first, or nobody
                pass

    def buckets(self):
        return [(dtype, wire, list(indices), count)
                for dtype, wire, indices, _, count in self._buckets]

    def view(self, index):
        """Parameter index's slot in its bucket, as a tensor of its shape on the model's device,
        from the second iteration on as GradientReducer's (None before, and where the bucket
        holds another dtype than the parameter's: compression)."""
        if self._iterations < 1:
            return None
        v = self._views.get(index)
        if v is None:
            slot = self._slots[index]
            if slot.dtype != self._dtypes[index]:
                return None
            v = self._views[index] = slot.view(self.params[index].shape)
        return v

    @property
    def negotiated(self):
        """True: a rank inside hvd.join stands in for its buckets by itself."""
        return True

    @property
    def gpu_device(self):
        """The CUDA device its buckets are on (-1: host buckets)."""
        return self._device.index if self._gpu else -1


def grad_accumulator(p):
    """The AccumulateGrad node of leaf `p` (its post hooks run once p.grad holds the new
    gradient)."""
    with torch.enable_grad():
        return p.expand_as(p).grad_fn.next_functions[0][0]


def empty_sparse_like(param, sparse_dim):
    """A sparse COO tensor of param's shape and dtype with no entries (a stand-in)."""
    return torch.sparse_coo_tensor(
        torch.empty(sparse_dim, 0, dtype=torch.int64, device=param.device),
        torch.empty((0,) + tuple(param.shape[sparse_dim:]), dtype=param.dtype,
                    device=param.device), param.shape)


class SparseRowsReducer:
    """A reducer for parameters some of whose gradients are sparse (sparse embeddings, known
    before the first backward): the dense ones go to the reducer `make_inner(params, indices)`
    builds over them alone; each sparse one has no bucket slot and is gathered by rows after
    the inner finish() (an allgather of every rank's entry count, allgathervs of the indices and
    the values, all checked calls on `comm`), summed where rows coincide and (`average`) divided
    by the rank count, as torch's DDP reduces them on gloo. Indices are the caller's (every
    parameter); mark a sparse one with its sparse gradient (or empty_sparse_like), and after
    finish() take its result with result(index)."""

    def __init__(self, make_inner, params, sparse_dims, comm, average=True):
        self.comm = comm
        self._average = average
        self._params = params
        self._sparse_dims = dict(sparse_dims)  # index -> sparse dimensions
        self._dense = [i for i in range(len(params)) if i not in self._sparse_dims]
        self._slot = {g: k for k, g in enumerate(self._dense)}
        self._inner = make_inner([params[i] for i in self._dense], self._dense) \
            if self._dense else None
        self._pending = {}   # sparse index -> its gradient this iteration
        self._results = {}   # sparse index -> the reduced gradient, until result()
        self._failed = None  # fail()

    def fail(self, error):
        """GradientReducer.fail: here also no rows are gathered in this iteration, on any
        rank."""
        if self._failed is None:
            self._failed = error
        if self._inner is not None:
            self._inner.fail(error)

    def mark(self, index, grad):
        if index in self._slot:
            self._inner.mark(self._slot[index], grad)
        else:
            self._pending[index] = grad

    def is_marked(self, index):
        if index in self._slot:
            return self._inner.is_marked(self._slot[index])
        return index in self._pending

    def view(self, index):
        return self._inner.view(self._slot[index]) if index in self._slot else None

    def finish(self):
        pending, self._pending = self._pending, {}
        error, self._failed = self._failed, None
        inner_error = None
        if self._inner is not None:
            try:
                self._inner.finish()
            except Exception as e:  # noqa: BLE001 - raised once every gather is done
                if error is None and not isinstance(e, MismatchError):
                    raise
                inner_error = e  # this rank's failure, or another rank's (every rank has one)
        # Every rank, every sparse parameter, in index order (a rank whose gradient is missing
        # offers no rows). From a gradient this rank cannot offer on (or once the step failed),
        # it offers none (count -1): every rank skips those gathers, the others raising
        # MismatchError, so the ranks stay in step and none reduces without this rank's rows.
        failed_on = None
        for i in sorted(self._sparse_dims):
            rows = None
            if error is None and inner_error is None:
                try:
                    rows = self._rows_of(i, pending.get(i))
                except Exception as e:  # noqa: BLE001 - raised once every gather is done
                    error = e
            reduced, failed = self._gather_rows(i, rows)
            if reduced is not None:
                self._results[i] = reduced
            failed_on = failed_on or failed
        if error is not None:
            self._results.clear()
            raise error
        if inner_error is not None:
            self._results.clear()
            raise inner_error
        if failed_on:
            self._results.clear()
            raise MismatchError(
                f"gradcomm.torch: the sparse gradients failed on rank"
                f"{'s' if len(failed_on) > 1 else ''} {', '.join(map(str, failed_on))} in this "
                "iteration; no sparse gradient was reduced, on any rank")

    def result(self, index):
        return self._results.pop(index, None)

    def _rows_of(self, index, grad):
        """This rank's (indices, values) of parameter index's gradient (None: no rows), on the
        host; InvalidArgument for one that does not fit the parameter."""
        param, sparse_dim = self._params[index], self._sparse_dims[index]
        if grad is None:
            grad = empty_sparse_like(param, sparse_dim)
        if (grad.dtype != param.dtype or grad.shape != param.shape or
                grad.layout not in (torch.strided, torch.sparse_coo)):
            raise InvalidArgument(f"the gradient of a sparse parameter ({tuple(param.shape)}, "
                                  f"{param.dtype}) is {tuple(grad.shape)}, {grad.dtype}, "
                                  f"{grad.layout}")
        if grad.is_sparse and grad.sparse_dim() != sparse_dim:
            # (torch 1.13's zero_grad leaves a sparse gradient with every dimension sparse)
            grad = empty_sparse_like(param, sparse_dim) if grad._nnz() == 0 else grad.to_dense()
        if not grad.is_sparse:
            grad = to_sparse_rows(grad, sparse_dim)
        grad = grad.coalesce()
        return grad._indices().contiguous().cpu(), grad._values().contiguous().cpu()

    def _gather_rows(self, index, rows):
        """(parameter index's gradient summed over the ranks' rows, []); (None, the ranks that
        offered none: `rows` None) where any did."""
        param, sparse_dim = self._params[index], self._sparse_dims[index]
        n = self.comm.size()
        counts = torch.zeros(n, dtype=torch.int64)
        mine = torch.tensor([-1 if rows is None else rows[0].shape[1]], dtype=torch.int64)
        self.comm._allgather_bytes_ptr(mine.data_ptr(), counts.data_ptr(), 8)
        counts = counts.tolist()
        failed = [r for r, c in enumerate(counts) if c < 0]
        if failed:
            return None, failed
        indices, values = rows
        total = sum(counts)
        row_bytes = values.element_size() * math.prod(param.shape[sparse_dim:])
        every_index = torch.empty(sparse_dim * total, dtype=torch.int64)
        every_value = torch.empty((total,) + tuple(param.shape[sparse_dim:]), dtype=param.dtype)
        self.comm._allgatherv_bytes_ptr(indices.data_ptr(), every_index.data_ptr(),
                                        [c * sparse_dim * 8 for c in counts])
        self.comm._allgatherv_bytes_ptr(values.data_ptr(), every_value.data_ptr(),
                                        [c * row_bytes for c in counts])
        blocks, at = [], 0
        for c in counts:  # each rank's [sparse_dim, count] block
            blocks.append(every_index[at * sparse_dim:(at + c) * sparse_dim].view(sparse_dim, c))
            at += c
        summed = torch.sparse_coo_tensor(torch.cat(blocks, 1), every_value,
                                         param.shape).coalesce()
        if self._average:
            summed._values().div_(n)
        return summed.to(param.device), []

    # What the front ends ask of a reducer besides, from the inner one (indices mapped back).
    def iterations(self):
        return self._inner.iterations() if self._inner is not None else 0

    @property
    def busy(self):
        return bool(self._pending) or (self._inner is not None and self._inner.busy)

    @property
    def negotiated(self):
        return self._inner.negotiated if self._inner is not None else False

    @property
    def gpu_device(self):
        return self._inner.gpu_device if self._inner is not None else -1

    def buckets(self):
        if self._inner is None:
            return []
        return [(dtype, wire, [self._dense[k] for k in indices], count)
                for dtype, wire, indices, count in self._inner.buckets()]


class JoinControl:
    """The exchange that lets ranks which ran out of data (join) stand in for the collectives
    of the ranks still training. Each round is one int64 SUM all-reduce of size + FIELDS
    elements: a rank still training sets its own slot and the descriptor of the call it is about
    to make; a joined rank sends zeros. Every rank then knows which ranks are still training and,
    from their (agreeing) descriptors, what a joined rank must stand in for. A joined rank that
    cannot stand in for a call it learnt of in an earlier round (an optimizer it does not hold)
    sends -(1 + the call's id) in its slot instead, and the training ranks collect that in
    `refusals` (id -> ranks) to fail the call on every one of them before it starts."""

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
        self.refusals = {}    # call id -> the joined ranks that cannot stand in for it
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

    def exchange(self, active, fields=(), refusing=None):
        """One round; returns (the ranks still training, their descriptor). `refusing`: on a
        joined rank, the id of a call it cannot stand in for (see the class)."""
        self.rounds += 1
        n, v = self._n, self._v
        v[:] = 0
        if active:
            v[self._rank] = 1
            v[n:n + len(fields)] = fields
        elif refusing is not None:
            v[self._rank] = -1 - refusing
        self.comm._allreduce_ptr(self._ptr, self._ptr, n + self.FIELDS, "int64", "sum", None)
        values = v.tolist()
        if sum(values[:n]) == n:  # nobody has joined: the common case
            return range(n), values[n:]
        for r in range(n):
            if values[r] < 0:
                self.refusals.setdefault(-1 - values[r], []).append(r)
        active_ranks = [r for r in range(n) if values[r] > 0]
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


def refuse_round(comm, error, call):
    """A joined rank's answer to a round of a kind it cannot stand in for: it fails the call
    the ranks still training make next on `comm` in its place (`call` names it in their
    report), so they raise a MismatchError naming this rank at once where they would wait for
    it until the watchdog, then raises `error` here."""
    try:
        comm._fail_next_call(call)
    except Exception:  # noqa: BLE001 - this rank's own error is the one to raise
        pass
    raise error


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
