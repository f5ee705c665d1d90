"""gradcomm for PyTorch (CPU tensors), in Horovod's shape: a script written for
``horovod.torch`` runs on gradcomm by changing its import line::

    import gradcomm.torch as hvd          # was: import horovod.torch as hvd
    hvd.init()
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in batches:                  # each rank its own shard
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # gradients all-reduced while backward runs
        optimizer.step()

and torch's DDP by changing one line: ``gradcomm.torch.DistributedDataParallel(model)``.

Tensors are reduced in place through their data pointers (no copies for contiguous CPU tensors),
of dtype float32, float64, float16, bfloat16, int32 or int64. What Horovod has and gradcomm
cannot honour (Adasum, process sets, elastic training, alltoall, reducescatter, GPU tensors)
raises NotImplementedError or InvalidArgument naming it; nothing silently does
something else. docs/coming-from-horovod.md lists the differences.
"""

import contextlib
import itertools
import math
import os
import pickle
import warnings
import weakref

import torch
from mpi4py import MPI

from . import CommError, Error, InvalidArgument, MismatchError, Unsupported, world
from . import init as _init
from . import is_initialized, local_rank, local_size, rank, shutdown, size  # noqa: F401
from . import _gradcomm
from ._torch_common import (DTYPES, GradientReducer, JoinControl, broadcast_coalesced,
                            check_tensor, neutral,
                            grad_accumulator)
from ._torch_ddp import (DistributedDataParallel, allreduce_hook, bf16_compress_hook,
                         fp16_compress_hook)
from . import _c10d

_c10d.register()  # torch.distributed.init_process_group("gradcomm")

__all__ = [
    # set-up and introspection
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    # ops and compression
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    # collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "allgather", "allgather_async",
    "synchronize", "poll", "barrier", "join", "broadcast_object", "allgather_object",
    "broadcast_parameters", "broadcast_optimizer_state",
    # training
    "DistributedOptimizer", "DistributedDataParallel", "allreduce_hook", "fp16_compress_hook",
    "bf16_compress_hook",
    # errors (gradcomm's)
    "Error", "InvalidArgument", "Unsupported", "CommError", "MismatchError",
    # refused
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "alltoall",
    "reducescatter", "SyncBatchNorm", "elastic",
]

# ---- ops -----------------------------------------------------------------------------------
# Horovod's reduction ops. gradcomm's own names ("sum", "average", ...) are accepted as well.
Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"

_OPS = {"average": "average", "avg": "average", "mean": "average", "sum": "sum", "min": "min",
        "max": "max", "product": "product", "prod": "product"}


def _resolve_op(op, average, call):
    if average is not None:
        if op is not None:
            raise ValueError(f"{call}: the op parameter supersedes average; pass one of them")
        warnings.warn(f"{call}: average is deprecated in Horovod; pass op=Average or op=Sum",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    if op is None:
        return "average"
    name = op.lower() if isinstance(op, str) else None
    if name == "adasum":
        raise NotImplementedError(f"{call}: op=Adasum is not implemented by gradcomm (use "
                                  "Average or Sum)")
    if name not in _OPS:
        raise InvalidArgument(f"{call}: unknown op {op!r} (Average, Sum, Min, Max, Product)")
    return _OPS[name]


# ---- process sets: refused -----------------------------------------------------------------
class ProcessSet:
    """Horovod's process sets are not implemented by gradcomm; only the global one exists (use
    gradcomm.Communicator over an mpi4py sub-communicator and pass comm= instead)."""

    def __init__(self, ranks_or_comm=None, _global=False):
        if not _global:
            raise NotImplementedError("ProcessSet: Horovod's process sets are not implemented by "
                                      "gradcomm; pass comm=gradcomm.Communicator(mpi4py_comm) to "
                                      "the calls instead")

    def __repr__(self):
        return "ProcessSet(global)"


global_process_set = ProcessSet(_global=True)


def add_process_set(process_set):
    raise NotImplementedError("add_process_set: Horovod's process sets are not implemented by "
                              "gradcomm")


def remove_process_set(process_set):
    raise NotImplementedError("remove_process_set: Horovod's process sets are not implemented "
                              "by gradcomm")


def _check_process_set(process_set, call):
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(f"{call}: process sets are not implemented by gradcomm")


# ---- set-up and introspection --------------------------------------------------------------
def init(comm=None, process_sets=None):
    """Starts gradcomm over MPI.COMM_WORLD, an mpi4py communicator, or a list of ranks of
    COMM_WORLD (every rank of COMM_WORLD calls it then). Safe to call more than once."""
    if process_sets is not None:
        raise NotImplementedError("init: process_sets are not implemented by gradcomm")
    if isinstance(comm, (list, tuple)):
        ranks = sorted(set(int(r) for r in comm))
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = MPI.COMM_WORLD.Create(group)
        group.Free()
        if comm == MPI.COMM_NULL:
            return None  # this rank is not in the list
    return _init(comm)


def cross_rank():
    """The index of this rank's host (its node) among the hosts."""
    return world().node()


def cross_size():
    """How many hosts (nodes) the ranks are on."""
    return world().node_count()


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    c = world()
    mine = torch.tensor([local_size()], dtype=torch.int64)
    counts = torch.empty(c.size(), dtype=torch.int64)
    c._allgather_bytes_ptr(mine.data_ptr(), counts.data_ptr(), 8)
    return len(set(counts.tolist())) == 1


def mpi_built():
    return True


def mpi_enabled():
    return True


def mpi_threads_supported():
    """True when MPI runs at MPI_THREAD_MULTIPLE (which gradcomm's overlap needs)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    """False: gradcomm.torch reduces CPU tensors (gradcomm's NCCL module serves its C++ and C
    APIs, not torch tensors)."""
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    return False


def rocm_built():
    return False


def start_timeline(file_path, mark_cycles=False):
    """Writes gradcomm's timeline (a Chrome trace) of this rank to file_path with ".rank<r>"
    before its ".json" ending: every rank writes its own file (Horovod writes one, on rank 0).
    mark_cycles is accepted and has no effect (gradcomm has no cycles)."""
    _gradcomm._timeline_start(str(file_path), rank())


def stop_timeline():
    _gradcomm._timeline_stop()


# ---- compression ---------------------------------------------------------------------------
class Compressor:
    """Horovod's compressor interface: compress(tensor) -> (tensor, ctx), decompress(tensor,
    ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    wire = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16."""
    wire = "float16"
    dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.dtype:
            return tensor.to(cls.dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class BF16Compressor(FP16Compressor):
    """Floating-point tensors travel as bfloat16."""
    wire = "bfloat16"
    dtype = torch.bfloat16


class Compression:
    """Horovod's Compression.none and Compression.fp16 (and bf16)."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


# ---- join: ranks out of data stand in for the others' collectives --------------------------------
# Every collective on the world communicator first runs one JoinControl round (a small int64
# all-reduce): the ranks still training send what they are about to call, a rank inside join()
# sends zeros and then stands in for that call with neutral data (zeros for Sum and Average, as
# in Horovod, so Average still divides by every rank). Stood in for: allreduce in every form,
# grouped allreduce, barrier and DistributedOptimizer steps; any other call made while a rank
# has joined raises on every rank, the joined ones included.
#
# An async all-reduce's round is non-blocking (the ranks still training need nothing back), so
# async calls stay asynchronous; a blocking call's round blocks (cheaper than a request). After
# a grouped call's round the joined ranks are sent the list of tensors, and a
# DistributedOptimizer step that finds a rank joined holds its buckets until step() (a second
# round), so that the joined rank stands in for them at the same point.
# While a rank has joined, collectives that make no round (gradcomm's own API, mpi4py) are not
# seen by it: they wait until the watchdog ends the job.
(_KIND_ALLREDUCE, _KIND_GROUPED, _KIND_BARRIER, _KIND_STEP, _KIND_STEP_GO,
 _KIND_OTHER) = 1, 2, 3, 4, 5, 6
_DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
_OP_NAMES = ["sum", "average", "min", "max", "product"]
_control = {}  # id(world communicator) -> JoinControl
# DistributedOptimizer id -> the optimizer, for the stand-in of its steps (weak: an optimizer
# the script dropped is freed). Ids count in creation order, the same on every rank.
_optimizers = weakref.WeakValueDictionary()
_next_optimizer = itertools.count(1)


def _code(names, name):
    return 0 if name is None else names.index(name) + 1


_algorithm_list = []


def _algorithms():
    if not _algorithm_list:
        _algorithm_list.extend(["auto"] + sorted(_gradcomm.algorithm_names()))
    return _algorithm_list


def _algorithm_code(algorithm, call):
    """0 for None. An unknown name is refused here, before the round, on every rank alike."""
    if algorithm is None:
        return 0
    names = _algorithms()
    if algorithm not in names:
        raise InvalidArgument(f"{call}: unknown algorithm {algorithm!r} (one of {names})")
    return names.index(algorithm) + 1


def _algorithm_of(code):
    return _algorithms()[code - 1] if code else None


def _join_off():
    return os.environ.get("GRADCOMM_JOIN", "1") == "0"


def _join_control(c):
    """The world communicator's JoinControl, or None (another communicator, one rank, or join
    switched off with GRADCOMM_JOIN=0, which saves the round on every call)."""
    if c.size() == 1 or c is not world() or _join_off():
        return None
    control = _control.get(id(c))
    if control is None or control.comm is not c:
        control = _control[id(c)] = JoinControl(c)
    return control


def _joined_error(call, joined):
    return NotImplementedError(
        f"{call}: ranks {joined} have joined (hvd.join); while a rank stands in for the others "
        "only allreduce, grouped allreduce, barrier and DistributedOptimizer steps continue")


def _require_threads(c, call):
    """Async calls need MPI_THREAD_MULTIPLE: refused before the round, on every rank alike."""
    if c.size() > 1 and not mpi_threads_supported():
        raise Unsupported(f"{call}: non-blocking calls need MPI at MPI_THREAD_MULTIPLE; MPI was "
                          "initialized at a lower level (initialize it through gradcomm or "
                          "mpi4py's default, which asks for MPI_THREAD_MULTIPLE)")


def _checkpoint(c, call, kind, *fields, asynchronous=False):
    """Run by every collective on the world communicator before it communicates, once the call
    has passed every local check. Returns the ranks still training (None where no round runs,
    or for an async all-reduce's round, which does not wait for its answer)."""
    control = _join_control(c)
    if control is None:
        return None
    if kind == _KIND_ALLREDUCE and asynchronous:
        control.post((kind, *fields))
        return None
    active, _ = control.exchange(True, (kind, *fields))
    if len(active) < c.size() and kind == _KIND_OTHER:
        raise _joined_error(call, [r for r in range(c.size()) if r not in active])
    return active


def _share_group(c, active, counts, dtypes):
    """After a grouped call's round, when some rank has joined: the lowest rank still training
    sends the list of counts and dtypes to every rank (the joined ones need it)."""
    if active is None or len(active) == c.size():
        return
    layout = torch.tensor([v for n, d in zip(counts, dtypes) for v in (n, _code(_DTYPE_NAMES, d))],
                          dtype=torch.int64)
    c._broadcast_ptr(layout.data_ptr(), layout.numel(), "int64", min(active))


def join(device=-1):
    """Call when this rank has run out of data: until every rank has called it, this rank
    stands in for the others' allreduces (contributing zeros to Sum and Average, the neutral
    value to Min, Max and Product), grouped allreduces, barriers and DistributedOptimizer steps.
    Returns the rank of the last rank to join (the highest, when several joined last)."""
    c = world()
    if _join_off():
        raise NotImplementedError("join: switched off by GRADCOMM_JOIN=0 (the calls made no join "
                                  "round); unset it on every rank to use join")
    control = _join_control(c)
    if control is None:
        return c.rank()
    joined_at = control.rounds  # every rank counts the same rounds
    try:
        while True:
            active, d = control.exchange(False)
            if not active:
                # The last to join: the latest first round in join(), the highest rank of those.
                key = torch.tensor([joined_at * c.size() + c.rank()], dtype=torch.int64)
                c._allreduce_ptr(key.data_ptr(), key.data_ptr(), 1, "int64", "max", None)
                return int(key.item()) % c.size()
            kind = d[0]
            if kind == _KIND_ALLREDUCE:
                dtype, count = _DTYPE_NAMES[d[1] - 1], d[2]
                op, algorithm = _OP_NAMES[d[3] - 1], _algorithm_of(d[4])
                t = neutral(op, _TORCH_DTYPES[dtype], count)
                c._allreduce_ptr(t.data_ptr(), t.data_ptr(), count, dtype, op, algorithm)
            elif kind == _KIND_GROUPED:
                n, op, algorithm = d[1], _OP_NAMES[d[2] - 1], _algorithm_of(d[3])
                layout = torch.empty(2 * n, dtype=torch.int64)
                c._broadcast_ptr(layout.data_ptr(), layout.numel(), "int64", min(active))
                pairs = layout.tolist()
                dtypes = [_DTYPE_NAMES[code - 1] for code in pairs[1::2]]
                tensors = [neutral(op, _TORCH_DTYPES[dt], k) for k, dt in zip(pairs[0::2], dtypes)]
                c._grouped_allreduce_ptrs([t.data_ptr() for t in tensors], pairs[0::2], dtypes, op,
                                          algorithm, d[4] - 1 if d[4] else None)
            elif kind == _KIND_BARRIER:
                c._barrier()
            elif kind == _KIND_STEP:
                pass  # announced at the step's first gradient; stood in for at its STEP_GO
            elif kind == _KIND_STEP_GO:
                optimizer = _optimizers.get(d[1])
                if optimizer is None:
                    raise InvalidArgument(f"join: the ranks still training step "
                                          f"DistributedOptimizer #{d[1]}, which this rank does "
                                          "not hold")
                optimizer._gradcomm_stand_in()
            elif kind == _KIND_OTHER:
                raise _joined_error("join", [r for r in range(c.size()) if r not in active])
            else:
                raise RuntimeError(f"join: the ranks still training made a call hvd.join cannot "
                                   f"stand in for (round kind {kind}: DistributedDataParallel's "
                                   "forward? use its own join())")
    finally:
        for optimizer in list(_optimizers.values()):  # a part-spent accumulation starts over
            optimizer._gradcomm_delay = [optimizer._gradcomm_passes] * \
                len(optimizer._gradcomm_params)


# ---- handles ---------------------------------------------------------------------------------
_handles = {}
_next_handle = itertools.count(1)


class _Pending:
    __slots__ = ("request", "finish", "keep")

    def __init__(self, request, finish, keep):
        self.request = request
        self.finish = finish  # called once the request is done; returns the result
        self.keep = keep      # tensors whose memory the request uses


def _register(request, finish, keep):
    handle = next(_next_handle)
    _handles[handle] = _Pending(request, finish, keep)
    return handle


def _pending(handle, call):
    try:
        return _handles[handle]
    except (KeyError, TypeError):
        raise InvalidArgument(f"{call}: {handle!r} is not a handle of a call in flight "
                              "(already synchronized?)") from None


def poll(handle):
    """True once the call behind `handle` has finished (never blocks)."""
    return _pending(handle, "poll").request.done()


def synchronize(handle):
    """Waits for the call behind `handle` and returns its result (a tensor, or a list for the
    grouped calls). Raises the call's error. A handle not in flight gives None (as Horovod)."""
    if handle not in _handles:
        return None
    pending = _handles[handle]
    try:
        pending.request.wait()
    finally:
        del _handles[handle]
    return pending.finish()


def _scale_(tensor, factor):
    if factor == 1.0:
        return
    with torch.no_grad():
        if tensor.dtype.is_floating_point:
            tensor.mul_(factor)
        else:  # as Horovod: in double, truncated back toward zero
            tensor.copy_(tensor.to(torch.float64).mul_(factor))


def _comm(comm):
    return comm or world()


# ---- all-reduce --------------------------------------------------------------------------------
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                     comm=None):
    """Starts an in-place all-reduce of `tensor`; returns a handle for synchronize()/poll().
    Calls run in the order they are made, on every rank."""
    call = "allreduce_async_"
    _check_process_set(process_set, call)
    dtype = check_tensor(tensor, call, writes=True)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    _require_threads(c, call)
    _checkpoint(c, call, *_allreduce_fields(dtype, tensor.numel(), opname, algorithm, call),
                asynchronous=True)
    _scale_(tensor, prescale_factor)
    ptr = tensor.data_ptr()
    request = c._allreduce_async_ptr(ptr, ptr, tensor.numel(), dtype, opname, algorithm)

    def finish():
        _scale_(tensor, postscale_factor)
        return tensor
    return _register(request, finish, (tensor,))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                    comm=None):
    """Starts an all-reduce of `tensor` into a new tensor (synchronize() returns it)."""
    call = "allreduce_async"
    _check_process_set(process_set, call)
    dtype = check_tensor(tensor, call)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    _require_threads(c, call)
    _checkpoint(c, call, *_allreduce_fields(dtype, tensor.numel(), opname, algorithm, call),
                asynchronous=True)
    src = tensor.detach()
    if prescale_factor != 1.0:
        src = src.clone()
        _scale_(src, prescale_factor)
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    request = c._allreduce_async_ptr(src.data_ptr(), out.data_ptr(), src.numel(), dtype, opname,
                                     algorithm)

    def finish():
        _scale_(out, postscale_factor)
        return out
    return _register(request, finish, (src, out))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
               comm=None):
    """All-reduces `tensor` in place (default op Average). Returns it."""
    call = "allreduce_"
    _check_process_set(process_set, call)
    dtype = check_tensor(tensor, call, writes=True)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    _checkpoint(c, call, *_allreduce_fields(dtype, tensor.numel(), opname, algorithm, call))
    _scale_(tensor, prescale_factor)
    ptr = tensor.data_ptr()
    c._allreduce_ptr(ptr, ptr, tensor.numel(), dtype, opname, algorithm)
    _scale_(tensor, postscale_factor)
    return tensor


def _allreduce_fields(dtype, count, opname, algorithm, call):
    return (_KIND_ALLREDUCE, _code(_DTYPE_NAMES, dtype), count, _code(_OP_NAMES, opname),
            _algorithm_code(algorithm, call))


def _allreduce_new(tensor, opname, prescale, postscale, algorithm, c, call):
    dtype = check_tensor(tensor, call)
    _checkpoint(c, call, *_allreduce_fields(dtype, tensor.numel(), opname, algorithm, call))
    src = tensor.detach()
    if prescale != 1.0:
        src = src.clone()
        _scale_(src, prescale)
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    c._allreduce_ptr(src.data_ptr(), out.data_ptr(), src.numel(), dtype, opname, algorithm)
    _scale_(out, postscale)
    return out


class _AllreduceGrad(torch.autograd.Function):
    """Sum and Average are linear: the gradient of the result is all-reduced the same way."""

    @staticmethod
    def forward(ctx, tensor, opname, prescale, postscale, algorithm, c):
        ctx.args = (opname, prescale, postscale, algorithm, c)
        return _allreduce_new(tensor, opname, prescale, postscale, algorithm, c, "allreduce")

    @staticmethod
    def backward(ctx, grad):
        opname, prescale, postscale, algorithm, c = ctx.args
        return (_allreduce_new(grad.contiguous(), opname, prescale, postscale, algorithm, c,
                               "allreduce (backward)"), None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
              algorithm=None, comm=None):
    """Returns a new tensor holding the all-reduce of `tensor` (default op Average). With Sum
    or Average the result has a gradient (the all-reduce of the result's gradient), as in
    Horovod; Min, Max and Product results are not differentiable."""
    call = "allreduce"
    _check_process_set(process_set, call)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    check_tensor(tensor, call)
    compressed, ctx = compression.compress(tensor)
    if (compressed.requires_grad and torch.is_grad_enabled() and
            opname in ("sum", "average")):
        out = _AllreduceGrad.apply(compressed, opname, prescale_factor, postscale_factor,
                                   algorithm, c)
    else:
        out = _allreduce_new(compressed, opname, prescale_factor, postscale_factor, algorithm, c,
                             call)
    return compression.decompress(out, ctx)


# ---- grouped all-reduce -------------------------------------------------------------------------
def _grouped_args(tensors, call, writes):
    tensors = list(tensors)
    dtypes = [check_tensor(t, call, f"tensor {i}", writes=writes) for i, t in enumerate(tensors)]
    return tensors, dtypes


def _grouped_prologue(tensors, average, op, prescale_factor, process_set, comm, call, algorithm,
                      fusion_threshold):
    """What the in-place grouped all-reduces do before communicating: checks, the op, the
    communicator, the prescale. Returns (communicator, tensors, dtypes, op name)."""
    _check_process_set(process_set, call)
    tensors, dtypes = _grouped_args(tensors, call, True)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    counts = [t.numel() for t in tensors]
    if call.endswith("async_"):
        _require_threads(c, call)
    active = _checkpoint(c, call, _KIND_GROUPED, len(tensors), _code(_OP_NAMES, opname),
                         _algorithm_code(algorithm, call),
                         0 if fusion_threshold is None else int(fusion_threshold) + 1)
    _share_group(c, active, counts, dtypes)
    for t in tensors:
        _scale_(t, prescale_factor)
    return c, tensors, dtypes, opname


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, *,
                             algorithm=None, fusion_threshold=None, comm=None):
    """Starts an in-place all-reduce of every tensor of the list, fused; returns a handle
    (synchronize() returns the list)."""
    c, tensors, dtypes, opname = _grouped_prologue(tensors, average, op, prescale_factor,
                                                   process_set, comm, "grouped_allreduce_async_",
                                                   algorithm, fusion_threshold)
    request = c._grouped_allreduce_async_ptrs([t.data_ptr() for t in tensors],
                                              [t.numel() for t in tensors], dtypes, opname,
                                              algorithm, fusion_threshold)

    def finish():
        for t in tensors:
            _scale_(t, postscale_factor)
        return tensors
    return _register(request, finish, tensors)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, *,
                            algorithm=None, fusion_threshold=None, comm=None):
    """Starts a fused all-reduce of the list into new tensors (synchronize() returns them)."""
    call = "grouped_allreduce_async"
    tensors, _ = _grouped_args(tensors, call, False)
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, None, name, _resolve_op(op, average, call),
                                    prescale_factor, postscale_factor, process_set,
                                    algorithm=algorithm, fusion_threshold=fusion_threshold,
                                    comm=comm)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                       fusion_threshold=None, comm=None):
    """All-reduces every tensor of the list in place, fused into buckets. Returns the list."""
    c, tensors, dtypes, opname = _grouped_prologue(tensors, average, op, prescale_factor,
                                                   process_set, comm, "grouped_allreduce_",
                                                   algorithm, fusion_threshold)
    c._grouped_allreduce_ptrs([t.data_ptr() for t in tensors], [t.numel() for t in tensors],
                              dtypes, opname, algorithm, fusion_threshold)
    for t in tensors:
        _scale_(t, postscale_factor)
    return tensors


class _GroupedAllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, opname, prescale, postscale, algorithm, c, *tensors):
        ctx.args = (opname, prescale, postscale, algorithm, c)
        copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        return tuple(grouped_allreduce_(copies, op=opname, prescale_factor=prescale,
                                        postscale_factor=postscale, algorithm=algorithm,
                                        comm=c))

    @staticmethod
    def backward(ctx, *grads):
        opname, prescale, postscale, algorithm, c = ctx.args
        copies = [g.detach().clone(memory_format=torch.contiguous_format) for g in grads]
        grouped_allreduce_(copies, op=opname, prescale_factor=prescale,
                           postscale_factor=postscale, algorithm=algorithm, comm=c)
        return (None, None, None, None, None, *copies)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      *, algorithm=None, fusion_threshold=None, comm=None):
    """Returns new tensors holding the all-reduce of every tensor of the list, fused.
    Differentiable for Sum and Average."""
    call = "grouped_allreduce"
    _check_process_set(process_set, call)
    tensors, _ = _grouped_args(tensors, call, False)
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    compressed = [compression.compress(t) for t in tensors]
    inputs = [t for t, _ in compressed]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in inputs) and
            opname in ("sum", "average")):
        outs = list(_GroupedAllreduceGrad.apply(opname, prescale_factor, postscale_factor,
                                                algorithm, c, *inputs))
    else:
        outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in inputs]
        grouped_allreduce_(outs, op=opname, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, algorithm=algorithm,
                           fusion_threshold=fusion_threshold, comm=c)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# ---- broadcast -----------------------------------------------------------------------------------
def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set, *,
                     comm=None):
    """Starts copying root_rank's `tensor` into every rank's, in place; returns a handle."""
    call = "broadcast_async_"
    _check_process_set(process_set, call)
    dtype = check_tensor(tensor, call, writes=True)
    _require_threads(_comm(comm), call)
    _checkpoint(_comm(comm), call, _KIND_OTHER)
    request = _comm(comm)._broadcast_async_ptr(tensor.data_ptr(), tensor.numel(), dtype,
                                               int(root_rank))
    return _register(request, lambda: tensor, (tensor,))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Starts a broadcast into a new tensor (synchronize() returns it)."""
    check_tensor(tensor, "broadcast_async")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name, process_set, comm=comm)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Copies root_rank's `tensor` into `tensor` on every rank. Returns it."""
    call = "broadcast_"
    _check_process_set(process_set, call)
    dtype = check_tensor(tensor, call, writes=True)
    _checkpoint(_comm(comm), call, _KIND_OTHER)
    _comm(comm)._broadcast_ptr(tensor.data_ptr(), tensor.numel(), dtype, int(root_rank))
    return tensor


class _BroadcastGrad(torch.autograd.Function):
    """As Horovod: the gradient is the average of the result's gradients, on the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, c):
        ctx.root_rank, ctx.c = root_rank, c
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        return broadcast_(out, root_rank, comm=c)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_new(grad.contiguous(), "average", 1.0, 1.0, None, ctx.c,
                                 "broadcast (backward)")
        if ctx.c.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Returns a new tensor holding root_rank's `tensor` (differentiable, as in Horovod)."""
    call = "broadcast"
    _check_process_set(process_set, call)
    check_tensor(tensor, call)
    c = _comm(comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastGrad.apply(tensor, int(root_rank), c)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_(out, root_rank, comm=c)


# ---- allgather, barrier and objects: gradcomm's checked byte exchanges ------------------------
# Like every gradcomm call they are compared across ranks before data moves (ranks that make
# different calls get MismatchError on every rank, not a hang) and seen by the stall watchdog.
_GATHER_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.complex64, torch.complex128]
_MAX_DIMS = 8


def _allgather_impl(tensor, call, c):
    _checkpoint(c, call, _KIND_OTHER)
    if tensor.dim() > _MAX_DIMS or tensor.dim() == 0 or tensor.dtype not in _GATHER_DTYPES:
        raise InvalidArgument(f"{call}: takes tensors of 1 to {_MAX_DIMS} dimensions of dtype "
                              f"{', '.join(str(d) for d in _GATHER_DTYPES)}; got "
                              f"{tensor.dtype} of shape {list(tensor.shape)}")
    # Every rank sees every rank's shape and dtype, so a mismatch raises on every rank.
    n, me = c.size(), c.rank()
    mine = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    mine[0], mine[1] = tensor.dim(), _GATHER_DTYPES.index(tensor.dtype)
    mine[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    everyone = torch.empty(n, 2 + _MAX_DIMS, dtype=torch.int64)
    c._allgather_bytes_ptr(mine.data_ptr(), everyone.data_ptr(), mine.numel() * 8)
    meta = [(tuple(row[2:2 + row[0]]), _GATHER_DTYPES[row[1]]) for row in everyone.tolist()]
    for r, (shape, dtype) in enumerate(meta):
        if dtype != tensor.dtype or len(shape) != tensor.dim() or tuple(shape[1:]) != \
                tuple(tensor.shape[1:]):
            raise InvalidArgument(
                f"{call}: rank {r} passed a {dtype} tensor of shape {list(shape)}, rank {me} a "
                f"{tensor.dtype} tensor of shape {list(tensor.shape)}; tensors must agree in "
                "dtype and in every dimension but the first (and have at least one)")
    src = tensor.detach().contiguous()
    row_bytes = src.element_size() * math.prod(src.shape[1:])
    counts = [shape[0] * row_bytes for shape, _ in meta]
    out = torch.empty((sum(s[0] for s, _ in meta), *src.shape[1:]), dtype=src.dtype)
    c._allgatherv_bytes_ptr(src.data_ptr(), out.data_ptr(), counts)
    return out, [s[0] for s, _ in meta]


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, c):
        out, rows = _allgather_impl(tensor, "allgather", c)
        ctx.rows, ctx.rank, ctx.comm = rows, c.rank(), c
        return out

    @staticmethod
    def backward(ctx, grad):  # as Horovod: average the gradients, keep this rank's rows
        reduced = _allreduce_new(grad.contiguous(), "average", 1.0, 1.0, None, ctx.comm,
                                 "allgather (backward)")
        offset = sum(ctx.rows[:ctx.rank])
        return reduced.narrow(0, offset, ctx.rows[ctx.rank]), None


def allgather(tensor, name=None, process_set=global_process_set, *, comm=None):
    """Concatenates every rank's tensor along dimension 0 (first dimensions may differ)."""
    call = "allgather"
    _check_process_set(process_set, call)
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise InvalidArgument(f"{call}: expected a CPU torch.Tensor")
    c = _comm(comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, c)
    return _allgather_impl(tensor, call, c)[0]


class _Done:
    def done(self):
        return True

    def wait(self):
        return None


def allgather_async(tensor, name=None, process_set=global_process_set, *, comm=None):
    """allgather, returning a handle (the gather runs at once; synchronize() returns it)."""
    out = allgather(tensor, name, process_set, comm=comm)
    return _register(_Done(), lambda: out, ())


def barrier(process_set=global_process_set):
    _check_process_set(process_set, "barrier")
    _checkpoint(world(), "barrier", _KIND_BARRIER)
    world()._barrier()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns root_rank's `obj` (pickled) on every rank."""
    _check_process_set(process_set, "broadcast_object")
    c = world()
    _checkpoint(c, "broadcast_object", _KIND_OTHER)
    return _broadcast_pickled(c, obj, root_rank)


def _broadcast_pickled(c, obj, root_rank):
    """root_rank's `obj`, pickled, on every rank (two checked broadcasts: size, then bytes)."""
    payload = pickle.dumps(obj) if c.rank() == root_rank else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    c._broadcast_bytes_ptr(size.data_ptr(), 8, root_rank)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    c._broadcast_bytes_ptr(data.data_ptr(), data.numel(), root_rank)
    return obj if c.rank() == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's `obj` (pickled), in rank order."""
    _check_process_set(process_set, "allgather_object")
    c = world()
    _checkpoint(c, "allgather_object", _KIND_OTHER)
    payload = pickle.dumps(obj)
    sizes = torch.empty(c.size(), dtype=torch.int64)
    mine = torch.tensor([len(payload)], dtype=torch.int64)
    c._allgather_bytes_ptr(mine.data_ptr(), sizes.data_ptr(), 8)
    counts = sizes.tolist()
    out = torch.empty(sum(counts), dtype=torch.uint8)
    send = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    c._allgatherv_bytes_ptr(send.data_ptr(), out.data_ptr(), counts)
    data, objects, at = out.numpy().tobytes(), [], 0
    for n in counts:
        objects.append(pickle.loads(data[at:at + n]))
        at += n
    return objects


def _refused(name, why):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name}: {why}")
    refuse.__name__ = name
    return refuse


alltoall = _refused("alltoall", "not implemented by gradcomm")
alltoall_async = _refused("alltoall_async", "not implemented by gradcomm")
reducescatter = _refused("reducescatter", "not implemented by gradcomm")
reducescatter_async = _refused("reducescatter_async", "not implemented by gradcomm")
sparse_allreduce_async = _refused("sparse_allreduce_async", "gradcomm reduces dense tensors")
SyncBatchNorm = _refused("SyncBatchNorm", "not implemented by gradcomm")


class _Elastic:
    def __getattr__(self, attr):
        raise NotImplementedError(f"elastic.{attr}: Horovod's elastic training is not "
                                  "implemented by gradcomm")


elastic = _Elastic()


# ---- parameters and optimizer state ----------------------------------------------------------
def broadcast_parameters(params, root_rank=0, *, comm=None, root=None):
    """Broadcasts root_rank's values of a state_dict (or named_parameters(), or a list of
    (name, tensor)) into every rank's tensors, in place, in name order, packed into few
    broadcasts."""
    if root is not None:  # gradcomm's earlier keyword
        root_rank = root
    items = params.items() if hasattr(params, "items") else params
    named = sorted(((n, t) for n, t in items if isinstance(t, torch.Tensor)), key=lambda x: x[0])
    # Every tensor is checked before the first is sent: a bad one fails on every rank (they all
    # hold the same list) before any broadcast.
    for n, t in named:
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise InvalidArgument(f"broadcast_parameters: {n} is not a dense CPU tensor")
    c = _comm(comm)
    if not 0 <= int(root_rank) < c.size():
        raise InvalidArgument(f"broadcast_parameters: root {root_rank} is outside the "
                              f"communicator's {c.size()} ranks")
    _checkpoint(c, "broadcast_parameters", _KIND_OTHER)
    broadcast_coalesced([t for _, t in named], int(root_rank), c)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, *, root=None):
    """Gives every rank root_rank's optimizer state and hyper-parameters (state_dict() pickled
    from the root, then load_state_dict), whatever state the other ranks hold."""
    if root is not None:
        root_rank = root
    _checkpoint(world(), "broadcast_optimizer_state", _KIND_OTHER)
    state = _broadcast_pickled(world(), optimizer.state_dict() if rank() == root_rank else None,
                               root_rank)
    optimizer.load_state_dict(state)


# ---- DistributedOptimizer ------------------------------------------------------------------
class _DistributedOptimizerMixin:
    def _gradcomm_setup(self, named_parameters, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, num_groups, groups, algorithm,
                        fusion_threshold, comm, overlap, sparse_as_dense=False):
        call = "DistributedOptimizer"
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and all(p is not q for q in params):
                    params.append(p)
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(nt, tuple) or len(nt) != 2 for nt in named):
                raise InvalidArgument(f"{call}: named_parameters must be (name, parameter) "
                                      "pairs, as model.named_parameters() gives")
            names_of = {id(p): n for n, p in named}
            if len(set(n for n, _ in named)) != len(named):
                raise InvalidArgument(f"{call}: named_parameters has duplicate names")
            missing = [i for i, p in enumerate(params) if id(p) not in names_of]
            if missing:
                raise InvalidArgument(f"{call}: named_parameters does not cover the optimizer's "
                                      f"parameters (indices {missing[:5]})")
            names = [names_of[id(p)] for p in params]
        else:
            names = [f"allreduce.noname.{i}" for i in range(len(params))]
        if backward_passes_per_step < 1:
            raise InvalidArgument(f"{call}: backward_passes_per_step must be at least 1")
        if gradient_predivide_factor <= 0:
            raise InvalidArgument(f"{call}: gradient_predivide_factor must be positive")
        opname = _resolve_op(op, None, call)
        if opname not in ("average", "sum"):
            raise InvalidArgument(f"{call}: op must be Average or Sum")
        if gradient_predivide_factor != 1.0 and opname != "average":
            raise InvalidArgument(f"{call}: gradient_predivide_factor needs op=Average")
        if compression not in (Compression.none, Compression.fp16, Compression.bf16):
            raise NotImplementedError(f"{call}: compression {compression!r}: gradcomm runs "
                                      "Compression.none, .fp16 and .bf16 inside its reducer; "
                                      "custom compressors are not supported")
        index_of = {id(p): i for i, p in enumerate(params)}
        group_lists = None
        if isinstance(groups, int):  # Horovod: an int is a number of groups
            num_groups, groups = groups, None
        if groups is not None:
            if num_groups:
                warnings.warn(f"{call}: groups given; num_groups is ignored", stacklevel=3)
            if not isinstance(groups, (list, tuple)):
                raise InvalidArgument(f"{call}: groups must be a list of lists of parameters")
            group_lists = []
            for g in groups:
                indices = []
                for p in g:
                    if id(p) not in index_of:
                        raise InvalidArgument(f"{call}: groups holds a tensor that is not one of "
                                              "the optimizer's trainable parameters")
                    indices.append(index_of[id(p)])
                group_lists.append(indices)
        elif num_groups:
            if num_groups < 0:
                raise InvalidArgument(f"{call}: num_groups must not be negative")
            # As Horovod: the parameters in order, split into num_groups nearly equal runs.
            k, extra = divmod(len(params), num_groups)
            group_lists, start = [], 0
            for g in range(num_groups):
                end = start + k + (1 if g < extra else 0)
                if end > start:
                    group_lists.append(list(range(start, end)))
                start = end
        cap = fusion_threshold if fusion_threshold is not None else 25 << 20
        self._gradcomm_call = call
        self._gradcomm_sparse_as_dense = sparse_as_dense
        self._gradcomm_params = params
        self._gradcomm_names = names
        self._gradcomm_passes = backward_passes_per_step
        self._gradcomm_delay = [backward_passes_per_step] * len(params)
        self._gradcomm_prediv = gradient_predivide_factor
        self._gradcomm_should_sync = True
        self._gradcomm_synchronized = False
        self._gradcomm_reducer = GradientReducer(
            params, names, call, comm, opname, algorithm, cap, min(cap, 1 << 20),
            compression.wire, group_lists, overlap)
        self._gradcomm_comm = self._gradcomm_reducer.comm
        self._gradcomm_id = next(_next_optimizer)  # the same on every rank: made in one order
        _optimizers[self._gradcomm_id] = self
        self._gradcomm_zeros = None
        self._gradcomm_announced = False  # this step's join round made
        self._gradcomm_holding = False    # a rank has joined: buckets wait for step()
        self._gradcomm_held = {}          # index -> gradient, while holding
        self._gradcomm_hooks = []
        self._gradcomm_accumulators = []
        for i, p in enumerate(params):
            acc = grad_accumulator(p)
            self._gradcomm_hooks.append(acc.register_hook(self._gradcomm_hook(i)))
            self._gradcomm_accumulators.append(acc)

    def _gradcomm_hook(self, i):
        def hook(*_):
            self._gradcomm_on_gradient(i)
        return hook

    def _gradcomm_on_gradient(self, i):
        if self._gradcomm_is_marked(i) or self._gradcomm_delay[i] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._gradcomm_delay[i] -= 1
        if self._gradcomm_delay[i] == 0:
            self._gradcomm_mark(i)

    def _gradcomm_is_marked(self, i):
        return self._gradcomm_reducer.is_marked(i) or i in self._gradcomm_held

    def _gradcomm_mark(self, i):
        if not self._gradcomm_announced:  # the step's first gradient: one join round first
            active = _checkpoint(self._gradcomm_comm, self._gradcomm_call, _KIND_STEP,
                                 self._gradcomm_id)
            self._gradcomm_announced = True
            # A rank has joined: hold the buckets until step(), where the joined rank stands
            # in for them (a world call in between would otherwise meet it mid-step).
            self._gradcomm_holding = active is not None and len(active) < self._gradcomm_comm.size()
        p = self._gradcomm_params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif p.grad.layout != torch.strided:
            if not self._gradcomm_sparse_as_dense:
                raise InvalidArgument(f"{self._gradcomm_call}: {self._gradcomm_names[i]} has a "
                                      f"{p.grad.layout} gradient; pass sparse_as_dense=True")
            p.grad = p.grad.to_dense()
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        grad = p.grad.detach()  # same memory; a create_graph gradient is reduced as data
        if self._gradcomm_prediv != 1.0:
            _scale_(grad, 1.0 / self._gradcomm_prediv)
        if self._gradcomm_holding:
            self._gradcomm_held[i] = grad
        else:
            self._gradcomm_reducer.mark(i, grad)

    def synchronize(self):
        """Waits for the gradients' all-reduce (starting it for gradients backward has not
        produced: they count as zeros). step() calls it unless done since the last step."""
        reducer = self._gradcomm_reducer
        for i in range(len(self._gradcomm_params)):
            if not self._gradcomm_is_marked(i):
                self._gradcomm_mark(i)
        try:
            if self._gradcomm_holding:  # a rank has joined: it stands in from this round on
                _checkpoint(self._gradcomm_comm, self._gradcomm_call, _KIND_STEP_GO,
                            self._gradcomm_id)
                for i, grad in self._gradcomm_held.items():
                    reducer.mark(i, grad)
            reducer.finish()
        finally:
            self._gradcomm_delay = [self._gradcomm_passes] * len(self._gradcomm_params)
            self._gradcomm_announced = self._gradcomm_holding = False
            self._gradcomm_held = {}
        if self._gradcomm_prediv != 1.0:
            for p in self._gradcomm_params:
                _scale_(p.grad.detach(), self._gradcomm_prediv)
        self._gradcomm_synchronized = True

    def _gradcomm_stand_in(self):
        """A joined rank's part in a step of the ranks still training: zeros for every
        gradient, in the same buckets (hvd.join)."""
        if self._gradcomm_zeros is None:
            self._gradcomm_zeros = [torch.zeros_like(p, memory_format=torch.contiguous_format)
                                    for p in self._gradcomm_params]
        for i in reversed(range(len(self._gradcomm_zeros))):  # backward's order
            z = self._gradcomm_zeros[i]
            z.zero_()
            self._gradcomm_reducer.mark(i, z)
        self._gradcomm_reducer.finish()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this context does not synchronize (call synchronize() yourself
        first, e.g. to clip the averaged gradients)."""
        self._gradcomm_should_sync = False
        try:
            yield
        finally:
            self._gradcomm_should_sync = True

    def step(self, closure=None):
        if self._gradcomm_should_sync:
            if self._gradcomm_synchronized:
                warnings.warn("optimizer.step() called without skip_synchronize() after "
                              "optimizer.synchronize(); the gradients are all-reduced again",
                              stacklevel=2)
            self.synchronize()
        self._gradcomm_synchronized = False
        return self._gradcomm_base.step(self, closure)

    def zero_grad(self, *args, **kwargs):
        if self._gradcomm_reducer.busy or self._gradcomm_held:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        return self._gradcomm_base.zero_grad(self, *args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, algorithm=None,
                         fusion_threshold=None, comm=None, overlap=True):
    """Wraps a torch.optim optimizer so that each gradient is all-reduced as backward produces
    it (fused into buckets: fusion_threshold bytes, default 25 MiB, the first 1 MiB; or
    Horovod's num_groups / groups, one bucket per group), and step() waits for them first.
    Compression.fp16 / .bf16 send float32 gradients as float16 / bfloat16. With
    backward_passes_per_step=k, gradients accumulate locally for k backward passes before they
    are all-reduced. The result is an instance of the optimizer's own class (lr schedulers accept
    it) sharing its parameter groups and state."""
    _check_process_set(process_set, "DistributedOptimizer")
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"_gradcomm_base": base})
    wrapped = cls.__new__(cls)
    # Not instance-level step/zero_grad (an lr scheduler made before wrapping puts a counting
    # wrapper of the old step there): they would hide the all-reducing ones.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in ("step", "zero_grad")})
    wrapped._gradcomm_setup(named_parameters, compression, backward_passes_per_step, op,
                            gradient_predivide_factor, num_groups, groups, algorithm,
                            fusion_threshold, comm, overlap, sparse_as_dense)
    return wrapped

