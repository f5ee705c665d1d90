"""gradcomm for PyTorch (CPU and CUDA tensors), in Horovod's shape: a script written for
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
of dtype float32, float64, float16, bfloat16, int32 or int64. CUDA tensors go through pinned host
copies (as Horovod's MPI operations where the MPI cannot read GPU memory): the copy waits for
the work queued on the device's current stream, and the result comes back on that stream.
What Horovod has and gradcomm cannot honour (Adasum, process sets, elastic training,
SyncBatchNorm) raises NotImplementedError or InvalidArgument naming it; nothing silently does
something else. docs/coming-from-horovod.md lists the differences.
"""

import atexit
import contextlib
import functools
import inspect
import itertools
import math
import os
import pickle
import threading
import warnings
import weakref

import torch
from mpi4py import MPI

from . import CommError, Error, InvalidArgument, MismatchError, Unsupported, world
from . import init as _init
from . import is_initialized, local_rank, local_size, rank, size  # noqa: F401
from . import shutdown as _shutdown
from . import _gradcomm
from ._torch_common import (DEVICES, DTYPES, JoinControl, check_tensor, close_negotiators,
                            gpu_reduces, grad_accumulator, gradient_reducer, mpi_threads_supported,
                            negotiator, next_per_communicator, refuse_round, scale_on_device,
                            SparseRowsReducer, empty_sparse_like, sparse_cost_warning, staged,
                            raise_on_every_rank, to_sparse_rows, unstage,
                            verify_same_across_ranks)
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
    "alltoall", "alltoall_async", "sparse_allreduce_async", "grouped_allgather",
    "grouped_allgather_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "broadcast_parameters", "broadcast_optimizer_state",
    # training
    "DistributedOptimizer", "DistributedDataParallel", "allreduce_hook", "fp16_compress_hook",
    "bf16_compress_hook",
    # errors (gradcomm's)
    "Error", "InvalidArgument", "Unsupported", "CommError", "MismatchError",
    "HorovodInternalError",
    # refused
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "SyncBatchNorm", "elastic",
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
    c = _init(comm)
    _negotiator(c)  # collective: here, while no call is in flight on any rank
    return c


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


def gloo_built():
    return False


def gloo_enabled():
    return False


def nccl_built():
    """False: gradcomm.torch reduces CUDA tensors through host copies, not NCCL (the
    torch.distributed "gradcomm" backend is the NCCL path for CUDA tensors)."""
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """Whether CUDA tensors can be passed: this torch's CUDA build (they go through host
    copies)."""
    return torch.backends.cuda.is_built()


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


# ---- negotiation: calls matched by name, as Horovod matches them --------------------------------
# Every collective below (allreduce, grouped allreduce, broadcast, allgather, alltoall, barrier,
# join and the object calls) is submitted by name to its communicator's negotiator
# (packing/negotiator.h), where Horovod submits to its background thread: ranks may make the
# calls in different orders; each runs once every rank has submitted its name, all-reduces that
# become ready together fused. Names are Horovod's: "<kind>.<name>"; a call without one is the
# k-th unnamed call of its kind ("<kind>.noname.<k>"); barrier and join have fixed names. Signatures (kind,
# dtype, shape, op, root, scale factors) are compared across ranks: a name that means different
# things on different ranks fails on every rank, and when every rank waits for names the others
# never submit, every pending call fails, naming who submitted what.
_next_handle = itertools.count(1)
_negotiator = negotiator  # the registry (_torch_common): shared with the reducers of CUDA gradients
_close_negotiators = close_negotiators


# Runs before gradcomm's own exit handler (registered when gradcomm was imported, earlier).
atexit.register(_close_negotiators)


def shutdown():
    """Stops the negotiation (collective) and frees gradcomm's communicators; handles still
    pending are dropped and names start over, as in Horovod."""
    global _next_handle, _joins
    _close_negotiators()
    _handles.clear()
    _abandoned.clear()
    _unnamed.clear()
    _joins = 0
    _next_handle = itertools.count(1)
    _shutdown()


_unnamed = {}  # (id(communicator), kind) -> unnamed calls of that kind made so far
# join() calls so far: a joined rank makes no calls while the others go on, so unnamed calls
# count afresh after each join (every rank calls join once per round).
_joins = 0


def _op_name(prefix, name, c):
    """Horovod's "<kind>.<name>"; an unnamed call is "<kind>.noname.<k>" for the k-th unnamed
    call of its kind on the communicator (Horovod numbers it with the handle, which counts every
    call: unnamed calls then match only when every rank makes all its calls, named ones
    included, in the same order)."""
    _names_state.numbered = True  # (_in_step: this call has its name)
    if name is not None:
        return f"{prefix}.{name}"
    key = (id(c), prefix)
    _unnamed[key] = k = _unnamed.get(key, 0) + 1
    return f"{prefix}.noname.{_joins}.{k}" if _joins else f"{prefix}.noname.{k}"


_names_state = threading.local()  # the calling thread's outermost unnamed call (_in_step)


def _in_step(kind):
    """Keeps the unnamed calls of `kind` in step across ranks. The k-th unnamed call is matched
    by its name ("<kind>.noname.<k>"), so a call that fails on one rank before it takes its
    number (bad splits, a dtype gradcomm refuses) would leave that rank one number behind: its
    next call would meet the others' failed one, and with the same shape return their data as
    its result. So a call that raises before it took its name takes it then and submits it as
    failed, with why: the other ranks' calls of that name fail at once, naming this rank and the
    reason (where they would wait for it), and every rank's next unnamed call has the next
    number. Calls made inside the outermost one (allreduce inside allreduce_) name themselves."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if getattr(_names_state, "active", False):
                return fn(*args, **kwargs)
            binding = signature.bind_partial(*args, **kwargs)
            bound = binding.arguments
            if kind.startswith("grouped_") and not isinstance(bound.get("tensors"),
                                                               (list, tuple, type(None))):
                # An iterator is read once: listed here, so that a failure counts its parts.
                bound["tensors"] = list(bound["tensors"])
                args, kwargs = binding.args, binding.kwargs
            _names_state.active, _names_state.numbered = True, False
            try:
                return fn(*args, **kwargs)
            except BaseException as error:
                if not _names_state.numbered:
                    with contextlib.suppress(Exception):
                        c = _comm(bound.get("comm"))
                        names = [_op_name(kind, bound.get("name"), c)]
                        if kind.startswith("grouped_"):  # each tensor's name, as submitted
                            n = len(list(bound["tensors"]))
                            names = [f"{names[0]}_{i + 1}of{n}" for i in range(n)]
                        _submit_failed(c, names, error)
                raise
            finally:
                _names_state.active = False
        return call
    return wrap


class HorovodInternalError(Error):
    """Horovod's error for a collective that failed (a RuntimeError), raised by synchronize()
    and the blocking calls. It is also of the gradcomm class of the failure: a mismatch between
    ranks is a gradcomm.MismatchError as well."""


_internal_classes = {}


def _internal(e):
    if isinstance(e, HorovodInternalError):
        return e
    cls = type(e)
    made = _internal_classes.get(cls)
    if made is None:
        made = _internal_classes[cls] = type(cls.__name__, (HorovodInternalError, cls),
                                             {"__module__": __name__})
    return made(str(e))


# ---- join: ranks out of data stand in for the others' collectives -------------------------------
# A rank that calls join() submits the name "join.noname"; until every rank has submitted it the
# negotiator takes part for that rank in the other ranks' all-reduces (with zeros for Sum and
# Average, so Average still divides by every rank, and the neutral value for Min, Max, Product),
# allgathers (with no rows), broadcasts and barriers. join() meanwhile stands in for the steps of
# DistributedOptimizer, whose reducer runs in call order on the world communicator: each step
# makes one JoinControl round there (a small int64 all-reduce) at its first gradient, and a step
# that finds a rank joined holds its buckets until step() (a second round), where the joined
# rank stands in for them.
_KIND_STEP, _KIND_STEP_GO = 4, 5
_control = {}  # id(world communicator) -> JoinControl
# (id(communicator), DistributedOptimizer id) -> the optimizer, for the stand-in of its steps
# (weak: an optimizer the script dropped is freed). Ids count in creation order per
# communicator, the same on every rank of it.
_optimizers = weakref.WeakValueDictionary()
_optimizer_counts = {}  # DistributedOptimizers made per communicator (next_per_communicator)


def _algorithm_checked(algorithm, call):
    """The algorithm's name ("" for the default). An unknown name is refused before submission."""
    if algorithm is None:
        return ""
    names = ["auto"] + sorted(_gradcomm.algorithm_names())
    if algorithm not in names:
        raise InvalidArgument(f"{call}: unknown algorithm {algorithm!r} (one of {names})")
    return algorithm


def _join_off():
    return os.environ.get("GRADCOMM_JOIN", "1") == "0"


def _join_control(c):
    """The world communicator's JoinControl, or None (another communicator, one rank, or join
    switched off with GRADCOMM_JOIN=0, which saves the round of every optimizer step)."""
    if c.size() == 1 or c is not world() or _join_off():
        return None
    control = _control.get(id(c))
    if control is None or control.comm is not c:
        control = _control[id(c)] = JoinControl(c)
    return control


def _step_round(c, call, kind, optimizer_id, negotiated):
    """A DistributedOptimizer step's round; returns the ranks still training (None: no round).
    At STEP_GO, a joined rank that said it cannot stand in for this optimizer's buckets (it does
    not hold the optimizer) fails the step on every training rank, before any bucket starts."""
    control = _join_control(c)
    if control is None:
        return None
    active, _ = control.exchange(True, (kind, optimizer_id, int(negotiated)))
    if kind == _KIND_STEP_GO:
        refusing = control.refusals.pop(optimizer_id, None)
        if refusing and not negotiated:  # (the negotiator stands in for negotiated buckets)
            raise InvalidArgument(
                f"{call}: joined rank{'s' if len(refusing) > 1 else ''} "
                f"{', '.join(map(str, refusing))} (hvd.join) cannot stand in for this step: "
                f"{'they do' if len(refusing) > 1 else 'it does'} not hold DistributedOptimizer "
                f"#{optimizer_id} (dropped before join()?); nothing was reduced")
    return active


def join(device=-1):
    """Call when this rank has run out of data: until every rank has called it, this rank
    stands in (GPU all-reduces on `device`, default the device of its DistributedOptimizers'
    CUDA models) for the others' allreduces (contributing zeros to Sum and Average, the neutral
    value to Min, Max and Product), grouped allreduces, allgathers (no rows), broadcasts,
    barriers and DistributedOptimizer steps. Returns the rank that joined last (of several that
    joined in the same cycle, the highest), as Horovod."""
    c = world()
    if _join_off():
        raise NotImplementedError("join: switched off by GRADCOMM_JOIN=0 (optimizer steps made no "
                                  "join round); unset it on every rank to use join")
    handle = next(_next_handle)
    if device < 0:  # the device of this rank's optimizers' GPU buckets, where it has them
        device = next((o._gradcomm_reducer.gpu_device for o in list(_optimizers.values())
                       if o._gradcomm_reducer.gpu_device >= 0), -1)
    # With a device, the negotiator stands in for GPU all-reduces there, even before this rank
    # made one (Horovod's join(device)).
    state = _negotiator(c).submit("join.noname", "join", "join", gpu=int(device))
    pending = _register(handle, [state], state.last_joined, ())
    control = _join_control(c)
    # A step of an optimizer this rank does not hold: refused in the next round (the training
    # ranks fail that step at its STEP_GO, before any bucket), and raised here once every rank
    # has joined, as this rank stays joined until then (the others' join() needs its rounds).
    refused, refusing = [], None
    try:
        while control is not None:
            active, d = control.exchange(False, refusing=refusing)
            refusing = None
            if not active:
                break
            kind = d[0]
            if kind in (_KIND_STEP, _KIND_STEP_GO):
                optimizer = _optimizers.get((id(c), d[1]))
                if optimizer is not None:
                    if kind == _KIND_STEP_GO:
                        optimizer._gradcomm_stand_in()
                elif kind == _KIND_STEP and not d[2]:  # (the negotiator stands in for its own)
                    refusing = d[1]
                    error = InvalidArgument(
                        f"join: the ranks still training step DistributedOptimizer #{d[1]}, "
                        "which this rank does not hold (dropped before join()?)")
                    if not refused:
                        warnings.warn(f"{error}: their step fails; join() raises this once "
                                      "every rank has joined", stacklevel=2)
                    refused.append(error)
            else:
                refuse_round(c, RuntimeError(
                    f"join: the ranks still training made a call hvd.join cannot stand in for "
                    f"(round kind {kind}: DistributedDataParallel's forward? use its own "
                    "join())"), "join (refused on this rank)")
    finally:
        if control is not None:  # every rank has joined: no step is left to refuse
            control.refusals.clear()
        for optimizer in list(_optimizers.values()):  # a part-spent accumulation starts over
            optimizer._gradcomm_delay = [optimizer._gradcomm_passes] * \
                len(optimizer._gradcomm_params)
    last = synchronize(pending)
    global _joins
    _joins += 1
    for key in [k for k in _unnamed if k[0] == id(c)]:
        del _unnamed[key]
    if refused:
        raise refused[0]
    return last


# ---- handles ---------------------------------------------------------------------------------
_handles = {}


class _Pending:
    __slots__ = ("states", "finish", "keep")

    def __init__(self, states, finish, keep):
        self.states = states  # the negotiated operations behind the handle
        self.finish = finish  # called once they are done; returns the result
        self.keep = keep      # tensors whose memory they use


def _register(handle, states, finish, keep):
    _reap_abandoned()
    _handles[handle] = _Pending(states, finish, keep)
    return handle


# Operations submitted by a call that then failed (a grouped call whose k-th submission
# raised): they run anyway, since their peers may wait for them, and their memory must outlive
# them; nobody holds a handle to them. Dropped once finished, at the next registration.
_abandoned = []


def _abandon(states, keep):
    if states:
        _abandoned.append(_Pending(states, None, keep))
    _reap_abandoned()


def _finished(state):
    try:
        return state.done()
    except Error:
        return True  # finished with an error nobody will read


def _reap_abandoned():
    if _abandoned:
        _abandoned[:] = [p for p in _abandoned if not all(_finished(s) for s in p.states)]


def _pending(handle, call):
    try:
        return _handles[handle]
    except (KeyError, TypeError):
        raise InvalidArgument(f"{call}: {handle!r} is not a handle of a call in flight "
                              "(already synchronized?)") from None


def poll(handle):
    """True once the call behind `handle` has finished, with or without an error (never
    blocks). A handle not in flight is a ValueError, as in Horovod. A grouped call has
    finished once every part has: a part that failed does not make the others finished
    (synchronize() raises its error after waiting for them all)."""
    return all(_finished(s) for s in _pending(handle, "poll").states)


def synchronize(handle):
    """Waits for the call behind `handle` and returns its result (a tensor; a list for the
    grouped calls; (output, received_splits) for alltoall). A failed call raises
    HorovodInternalError. A handle not in flight gives None (as Horovod)."""
    if handle not in _handles:
        return None
    pending = _handles.pop(handle)
    error = None
    for s in pending.states:  # every one, even after an error: they use pending.keep's memory
        try:
            s.wait()
        except Error as e:
            error = error or e
    if error is not None:
        raise _internal(error) from error
    return pending.finish()


def _comm(comm):
    return comm or world()


# ---- all-reduce --------------------------------------------------------------------------------
_WIRE_OPS = {"sum": "sum", "average": "sum", "min": "min", "max": "max", "product": "prod"}


def _submit_allreduce(c, tensor, name, opname, prescale, postscale, algorithm, fusion_threshold,
                      ready_event=None):
    """Submits an in-place all-reduce of `tensor` (checked, contiguous; a host tensor, or with
    `ready_event` a CUDA tensor the GPU reduces, already prescaled on its stream, and
    postscaled by the caller after). As Horovod: Average is a Sum whose postscale factor is
    divided by the rank count; the factors apply on the negotiation thread, in Horovod's
    arithmetic."""
    dtype = DTYPES[tensor.dtype]
    post = _average_factor(c, opname, postscale)
    signature = (f"allreduce {dtype} {list(tensor.shape)} {opname}, factors "
                 f"({float(prescale)!r}, {float(postscale)!r})" +
                 (f", algorithm {algorithm}" if algorithm else ""))
    threshold = 0 if fusion_threshold is None else max(1, int(fusion_threshold))
    device = ready_event is not None
    return _negotiator(c).submit(name, "allreduce", signature, tensor.data_ptr(), tensor.numel(),
                                 dtype, _WIRE_OPS[opname],
                                 prescale=1.0 if device else float(prescale),
                                 postscale=1.0 if device else float(post), algorithm=algorithm,
                                 fusion_threshold=threshold, device=device,
                                 ready_event=ready_event.cuda_event if device else 0,
                                 gpu=tensor.device.index if device else -1)


def _average_factor(c, opname, postscale):
    return postscale / c.size() if opname == "average" else postscale


def _ready_after_prescale(tensors, prescale):
    """Prescales the CUDA tensors the GPU reduces, on their device's current stream, and returns
    an event recorded there after that (what the negotiator waits for before reading them)."""
    for t in tensors:
        scale_on_device(t, prescale)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensors[0].device))
    return ready


@_in_step("allreduce")
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                     comm=None):
    """Starts an in-place all-reduce of `tensor`; returns a handle for synchronize()/poll()."""
    call = "allreduce_async_"
    _check_process_set(process_set, call)
    check_tensor(tensor, call, writes=True)
    opname = _resolve_op(op, average, call)
    algorithm = _algorithm_checked(algorithm, call)
    c = _comm(comm)
    handle = next(_next_handle)
    if gpu_reduces(tensor, algorithm):  # NCCL on the GPU; scaled on the caller's stream
        ready = _ready_after_prescale([tensor], prescale_factor)
        state = _submit_allreduce(c, tensor, _op_name("allreduce", name, c), opname,
                                  prescale_factor, postscale_factor, algorithm, None, ready)
        post = _average_factor(c, opname, postscale_factor)
        return _register(handle, [state], lambda: _postscaled(tensor, post), (tensor, ready))
    host = staged(tensor)
    state = _submit_allreduce(c, host, _op_name("allreduce", name, c), opname,
                              prescale_factor, postscale_factor, algorithm, None)
    return _register(handle, [state], lambda: unstage(tensor, host), (tensor, host))


def _postscaled(tensor, factor):
    scale_on_device(tensor, factor)
    return tensor


@_in_step("allreduce")
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                    comm=None):
    """Starts an all-reduce of `tensor` into a new tensor (synchronize() returns it)."""
    call = "allreduce_async"
    _check_process_set(process_set, call)
    check_tensor(tensor, call)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(out, average, name, op, prescale_factor, postscale_factor,
                            algorithm=algorithm, comm=comm)


@_in_step("allreduce")
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
               comm=None):
    """All-reduces `tensor` in place (default op Average). Returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set, algorithm=algorithm,
                                        comm=comm))


def _allreduce_new(tensor, opname, prescale, postscale, algorithm, c, call, name=None):
    check_tensor(tensor, call)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_(out, None, name, opname, prescale, postscale, algorithm=algorithm, comm=c)


class _AllreduceGrad(torch.autograd.Function):
    """Sum and Average are linear: the gradient of the result is all-reduced the same way."""

    @staticmethod
    def forward(ctx, tensor, opname, prescale, postscale, algorithm, c, name):
        ctx.args = (opname, prescale, postscale, algorithm, c)
        return _allreduce_new(tensor, opname, prescale, postscale, algorithm, c, "allreduce",
                              name)

    @staticmethod
    def backward(ctx, grad):
        opname, prescale, postscale, algorithm, c = ctx.args
        return (_allreduce_new(grad.contiguous(), opname, prescale, postscale, algorithm, c,
                               "allreduce (backward)"), None, None, None, None, None, None)


@_in_step("allreduce")
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
                                   algorithm, c, name)
    else:
        out = _allreduce_new(compressed, opname, prescale_factor, postscale_factor, algorithm, c,
                             call, name)
    return compression.decompress(out, ctx)


# ---- grouped all-reduce -------------------------------------------------------------------------
@_in_step("grouped_allreduce")
def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, *,
                             algorithm=None, fusion_threshold=None, comm=None):
    """Starts an in-place all-reduce of every tensor of the list, fused; returns a handle
    (synchronize() returns the list). Each tensor is negotiated under "<name>_<i>of<n>", as in
    Horovod."""
    call = "grouped_allreduce_async_"
    _check_process_set(process_set, call)
    tensors = list(tensors)
    dtypes = [check_tensor(t, call, f"tensor {i}", writes=True) for i, t in enumerate(tensors)]
    c = _comm(comm)
    # In-place results written into one another's memory would be garbage: refused before
    # anything is submitted, by the check grouped_allreduce makes in C++ (CUDA tensors' ranges
    # are compared as the addresses they are; nothing is read there).
    _check_disjoint(tensors, dtypes, call, c)
    opname = _resolve_op(op, average, call)
    algorithm = _algorithm_checked(algorithm, call)
    handle = next(_next_handle)
    base, n = _op_name("grouped_allreduce", name, c), len(tensors)
    states, keep = [], tensors
    try:  # from the name on: a part that fails on this rank only is submitted as failed
        on_gpu = [gpu_reduces(t, algorithm) for t in tensors]
        if len({t.device for t, g in zip(tensors, on_gpu) if g}) > 1:
            on_gpu = [False] * n  # one event covers one device's stream: staged, as before
        ready = (_ready_after_prescale([t for t, g in zip(tensors, on_gpu) if g],
                                       prescale_factor) if any(on_gpu) else None)
        hosts = [t if g else staged(t) for t, g in zip(tensors, on_gpu)]
        keep = tensors + hosts + [ready]
        post = _average_factor(c, opname, postscale_factor)
        for i, h in enumerate(hosts):
            states.append(_submit_allreduce(c, h, f"{base}_{i + 1}of{n}", opname,
                                            prescale_factor, postscale_factor, algorithm,
                                            fusion_threshold, ready if on_gpu[i] else None))
    except Exception as error:
        # The ones submitted run anyway (their peers may wait for them): their memory and
        # event stay alive until they finish. The rest are submitted as failed.
        _abandon(states, keep)
        _submit_failed(c, [f"{base}_{i + 1}of{n}" for i in range(len(states), n)], error)
        raise

    def finish():
        return [_postscaled(t, post) if g else unstage(t, h)
                for t, h, g in zip(tensors, hosts, on_gpu)]
    return _register(handle, states, finish, keep)


def _check_disjoint(tensors, dtypes, call, c):
    """InvalidArgument unless the tensors' memory ranges are disjoint (grouped in-place calls)."""
    on_cpu = [(t.data_ptr(), t.numel(), d) for t, d in zip(tensors, dtypes)
              if t.device.type == "cpu"]
    _gradcomm._validate_tensors(on_cpu, call, c.rank())
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i, t.device)
                    for i, t in enumerate(tensors) if t.device.type != "cpu" and t.numel() > 0)
    for (_, end, i, d), (start, _, j, e) in zip(ranges, ranges[1:]):
        if d == e and start < end:
            raise InvalidArgument(f"{call}: tensors {min(i, j)} and {max(i, j)} overlap in "
                                  f"memory on {d}; in-place results would overwrite each other")


@_in_step("grouped_allreduce")
def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, *,
                            algorithm=None, fusion_threshold=None, comm=None):
    """Starts a fused all-reduce of the list into new tensors (synchronize() returns them)."""
    call = "grouped_allreduce_async"
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_tensor(t, call, f"tensor {i}")
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor,
                                    process_set, algorithm=algorithm,
                                    fusion_threshold=fusion_threshold, comm=comm)


@_in_step("grouped_allreduce")
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, *, algorithm=None,
                       fusion_threshold=None, comm=None):
    """All-reduces every tensor of the list in place, fused into buckets. Returns the list."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set,
                                                algorithm=algorithm,
                                                fusion_threshold=fusion_threshold, comm=comm))


class _GroupedAllreduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, opname, prescale, postscale, algorithm, c, name, *tensors):
        ctx.args = (opname, prescale, postscale, algorithm, c)
        copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        return tuple(grouped_allreduce_(copies, None, name, opname, prescale, postscale,
                                        algorithm=algorithm, comm=c))

    @staticmethod
    def backward(ctx, *grads):
        opname, prescale, postscale, algorithm, c = ctx.args
        copies = [g.detach().clone(memory_format=torch.contiguous_format) for g in grads]
        grouped_allreduce_(copies, op=opname, prescale_factor=prescale,
                           postscale_factor=postscale, algorithm=algorithm, comm=c)
        return (None, None, None, None, None, None, *copies)


@_in_step("grouped_allreduce")
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      *, algorithm=None, fusion_threshold=None, comm=None):
    """Returns new tensors holding the all-reduce of every tensor of the list, fused.
    Differentiable for Sum and Average."""
    call = "grouped_allreduce"
    _check_process_set(process_set, call)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        check_tensor(t, call, f"tensor {i}")
    opname = _resolve_op(op, average, call)
    c = _comm(comm)
    compressed = [compression.compress(t) for t in tensors]
    inputs = [t for t, _ in compressed]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in inputs) and
            opname in ("sum", "average")):
        outs = list(_GroupedAllreduceGrad.apply(opname, prescale_factor, postscale_factor,
                                                algorithm, c, name, *inputs))
    else:
        outs = [t.detach().clone(memory_format=torch.contiguous_format) for t in inputs]
        grouped_allreduce_(outs, None, name, opname, prescale_factor, postscale_factor,
                           algorithm=algorithm, fusion_threshold=fusion_threshold, comm=c)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


# ---- broadcast, allgather, alltoall: bytes of any dtype ------------------------------------------
_BYTE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                torch.complex128]


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _check_bytes_tensor(tensor, call, writes=False, rows=False):
    """Checks a tensor that travels as bytes; returns its dtype's name."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"{call}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in DEVICES or tensor.layout != torch.strided:
        raise InvalidArgument(f"{call}: expected a dense CPU or CUDA tensor, got one on "
                              f"{tensor.device} with layout {tensor.layout}")
    if tensor.dtype not in _BYTE_DTYPES:
        raise InvalidArgument(f"{call}: unsupported dtype {tensor.dtype} (supported: "
                              f"{', '.join(_dtype_name(d) for d in _BYTE_DTYPES)})")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{call}: the tensor is not contiguous (call .contiguous())")
    if writes and tensor.requires_grad and torch.is_grad_enabled():
        raise InvalidArgument(f"{call}: the tensor requires grad, and an in-place write through "
                              "its data pointer would bypass autograd; pass tensor.detach()")
    if rows:
        if tensor.dim() == 0:
            raise InvalidArgument(f"{call}: the tensor has no dimensions (0-d); the call "
                                  "concatenates along the first")
        if tensor.numel() == 0 and math.prod(tensor.shape[1:]) == 0:
            raise InvalidArgument(f"{call}: tensors with a zero-sized dimension after the first "
                                  "are not supported")
    return _dtype_name(tensor.dtype)


def _rows_signature(call, dtype_name, tensor):
    return f"{call} {dtype_name} [*{''.join(', ' + str(d) for d in tensor.shape[1:])}]"


def _result_tensor(state, dtype, trailing):
    """The negotiated result's bytes as a tensor of `dtype` with rows of shape `trailing`
    (no copy: the tensor holds the result's memory)."""
    if state.nbytes() == 0:
        return torch.empty((0, *trailing), dtype=dtype)
    return torch.frombuffer(state, dtype=torch.uint8).view(dtype).reshape(-1, *trailing)


@_in_step("broadcast")
def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set, *,
                     comm=None):
    """Starts copying root_rank's `tensor` into every rank's, in place; returns a handle."""
    call = "broadcast_async_"
    _check_process_set(process_set, call)
    dtype = _check_bytes_tensor(tensor, call, writes=True)
    c = _comm(comm)
    handle = next(_next_handle)
    signature = f"broadcast {dtype} {list(tensor.shape)}, root {int(root_rank)}"
    is_root = c.rank() == int(root_rank)
    host = staged(tensor, read=is_root)
    state = _negotiator(c).submit(_op_name("broadcast", name, c), "broadcast", signature,
                                  host.data_ptr(), tensor.numel() * tensor.element_size(),
                                  root=int(root_rank))
    return _register(handle, [state], lambda: tensor if is_root else unstage(tensor, host),
                     (tensor, host))


@_in_step("broadcast")
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Starts a broadcast into a new tensor (synchronize() returns it)."""
    _check_bytes_tensor(tensor, "broadcast_async")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(out, root_rank, name, process_set, comm=comm)


@_in_step("broadcast")
def broadcast_(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Copies root_rank's `tensor` into `tensor` on every rank. Returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, comm=comm))


class _BroadcastGrad(torch.autograd.Function):
    """As Horovod: the gradient is the average of the result's gradients, on the root only."""

    @staticmethod
    def forward(ctx, tensor, root_rank, c, name):
        ctx.root_rank, ctx.c = root_rank, c
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        return broadcast_(out, root_rank, name, comm=c)

    @staticmethod
    def backward(ctx, grad):
        reduced = _allreduce_new(grad.contiguous(), "average", 1.0, 1.0, None, ctx.c,
                                 "broadcast (backward)")
        if ctx.c.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


@_in_step("broadcast")
def broadcast(tensor, root_rank, name=None, process_set=global_process_set, *, comm=None):
    """Returns a new tensor holding root_rank's `tensor` (differentiable, as in Horovod)."""
    call = "broadcast"
    _check_process_set(process_set, call)
    _check_bytes_tensor(tensor, call)
    c = _comm(comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastGrad.apply(tensor, int(root_rank), c, name)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_(out, root_rank, name, comm=c)


def _allgather_submit(tensor, full_name, c):
    """Submits an allgather of `tensor` (checked by the caller, before it took its name) under
    `full_name`; returns (state, finish, host copy)."""
    dtype = _dtype_name(tensor.dtype)
    src = staged(tensor.detach())
    state = _negotiator(c).submit(full_name, "allgather", _rows_signature("allgather", dtype, src),
                                  src.data_ptr(), src.numel() * src.element_size())
    trailing = tuple(src.shape[1:])
    return state, lambda: _on_device(_result_tensor(state, src.dtype, trailing), tensor), src


def _allgather_start(tensor, name, c, call):
    """Submits an allgather; returns (handle, state)."""
    _check_bytes_tensor(tensor, call, rows=True)
    state, finish, src = _allgather_submit(tensor, _op_name("allgather", name, c), c)
    return _register(next(_next_handle), [state], finish, (src,)), state


def _on_device(result, like):
    """`result` (host memory) on `like`'s device: itself on the CPU, a copy on a GPU."""
    if like.device.type == "cpu":
        return result
    return result.to(like.device)


def _rows_of(state, tensor):
    row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
    return [b // row_bytes for b in state.counts()]


class _AllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, c, name):
        handle, state = _allgather_start(tensor, name, c, "allgather")
        out = synchronize(handle)
        ctx.rows, ctx.rank, ctx.comm = _rows_of(state, tensor), c.rank(), c
        return out

    @staticmethod
    def backward(ctx, grad):  # as Horovod: average the gradients, keep this rank's rows
        reduced = _allreduce_new(grad.contiguous(), "average", 1.0, 1.0, None, ctx.comm,
                                 "allgather (backward)")
        offset = sum(ctx.rows[:ctx.rank])
        return reduced.narrow(0, offset, ctx.rows[ctx.rank]), None, None


@_in_step("allgather")
def allgather(tensor, name=None, process_set=global_process_set, *, comm=None):
    """Concatenates every rank's tensor along dimension 0 (first dimensions may differ; the
    others and the dtype must agree: otherwise every rank raises)."""
    call = "allgather"
    _check_process_set(process_set, call)
    _check_bytes_tensor(tensor, call, rows=True)
    c = _comm(comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, c, name)
    return synchronize(_allgather_start(tensor, name, c, call)[0])


@_in_step("allgather")
def allgather_async(tensor, name=None, process_set=global_process_set, *, comm=None):
    """Starts an allgather; returns a handle (synchronize() returns the gathered tensor)."""
    _check_process_set(process_set, "allgather_async")
    return _allgather_start(tensor, name, _comm(comm), "allgather_async")[0]


def _submit_failed(c, names, error, wait=False):
    """Submits each of `names` (a call, or a grouped call's parts, that failed here before it was
    submitted) as failed, with why: the other ranks' calls of those names fail at once, naming
    this rank, instead of waiting for it until the watchdog. With `wait`, returns once they have
    (names fixed by the caller: a retry here then makes calls of its own)."""
    states = []
    for full in names:
        with contextlib.suppress(Exception):
            states.append(_negotiator(c).submit(full, "failed", f"{type(error).__name__}: {error}"))
    for state in states if wait else ():
        with contextlib.suppress(Exception):
            state.wait()


def _submit_each(c, tensors, base, submit):
    """Submits `submit(tensor, "<base>_<i>of<n>")` for each tensor, as Horovod names a grouped
    call's tensors; returns a handle whose synchronize() gives the list of results. Where a
    submission fails, those made run anyway (their peers may wait for them), abandoned, and the
    rest are submitted as failed."""
    n = len(tensors)
    states, finishes, keep = [], [], list(tensors)
    try:
        for i, t in enumerate(tensors):
            state, finish, host = submit(t, f"{base}_{i + 1}of{n}")
            states.append(state)
            finishes.append(finish)
            keep.append(host)
    except Exception as error:
        _abandon(states, keep)
        _submit_failed(c, [f"{base}_{i + 1}of{n}" for i in range(len(states), n)], error)
        raise
    return _register(next(_next_handle), states, lambda: [f() for f in finishes], keep)


@_in_step("grouped_allgather")
def grouped_allgather_async(tensors, name=None, process_set=global_process_set, *, comm=None):
    """Starts an allgather of every tensor of the list (each negotiated under
    "<name>_<i>of<n>", as Horovod's); synchronize() returns the list of gathered tensors."""
    call = "grouped_allgather_async"
    _check_process_set(process_set, call)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_bytes_tensor(t, f"{call} (tensor {i})", rows=True)
    c = _comm(comm)
    return _submit_each(c, tensors, _op_name("grouped_allgather", name, c),
                        lambda t, full: _allgather_submit(t, full, c))


class _GroupedAllgatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, name, *tensors):
        handle = grouped_allgather_async(tensors, name, comm=c)
        states = _handles[handle].states
        outs = synchronize(handle)
        ctx.rows = [_rows_of(s, t) for s, t in zip(states, tensors)]
        ctx.rank, ctx.comm = c.rank(), c
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # as Horovod: average the gradients, keep this rank's rows
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, comm=ctx.comm)
        return (None, None, *[r.narrow(0, sum(rows[:ctx.rank]), rows[ctx.rank])
                              for r, rows in zip(reduced, ctx.rows)])


@_in_step("grouped_allgather")
def grouped_allgather(tensors, name=None, process_set=global_process_set, *, comm=None):
    """Horovod's grouped_allgather: the allgather of every tensor of the list (first dimensions
    may differ between ranks; the rest and the dtype must agree). Differentiable."""
    call = "grouped_allgather"
    _check_process_set(process_set, call)
    tensors = list(tensors)
    c = _comm(comm)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_GroupedAllgatherGrad.apply(c, name, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, comm=c))


@_in_step("alltoall")
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, *,
                   comm=None):
    """Starts an alltoall: rank r sends splits[j] rows of `tensor` (along the first dimension,
    in rank order) to each rank j; without splits the rows divide equally. synchronize()
    returns (output, received_splits)."""
    call = "alltoall_async"
    _check_process_set(process_set, call)
    dtype = _check_bytes_tensor(tensor, call, rows=True)
    c = _comm(comm)
    n, rows = c.size(), tensor.shape[0]
    if splits is None:
        if rows % n:
            raise InvalidArgument(f"{call}: the first dimension ({rows}) does not divide by the "
                                  f"{n} ranks; pass splits")
        split_list = [rows // n] * n
    else:
        split_list = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor)
                                       else splits)]
        if len(split_list) != n or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise InvalidArgument(f"{call}: splits {split_list} must be {n} non-negative row "
                                  f"counts summing to the first dimension ({rows})")
    src = staged(tensor.detach())
    row_bytes = src.element_size() * math.prod(src.shape[1:])
    handle = next(_next_handle)
    state = _negotiator(c).submit(_op_name("alltoall", name, c), "alltoall",
                                  _rows_signature("alltoall", dtype, src), src.data_ptr(),
                                  src.numel() * src.element_size(),
                                  splits=[s * row_bytes for s in split_list])
    trailing = tuple(src.shape[1:])
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def finish():
        received = torch.tensor([b // row_bytes for b in state.counts()], dtype=split_dtype)
        return _on_device(_result_tensor(state, src.dtype, trailing), tensor), received
    return _register(handle, [state], finish, (src,))


class _AlltoallGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, c):
        out, received = synchronize(alltoall_async(tensor, splits, name, comm=c))
        ctx.received, ctx.comm = received, c
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):  # the rows go back where they came from
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, comm=ctx.comm))
        return out, None, None, None


@_in_step("alltoall")
def alltoall(tensor, splits=None, name=None, process_set=global_process_set, *, comm=None):
    """Returns the rows every rank sent this rank, in rank order (and, when splits were given,
    the row counts received from each rank), as Horovod. Differentiable."""
    call = "alltoall"
    _check_process_set(process_set, call)
    _check_bytes_tensor(tensor, call, rows=True)
    c = _comm(comm)
    if tensor.requires_grad and torch.is_grad_enabled():
        out, received = _AlltoallGrad.apply(tensor, splits, name, c)
    else:
        out, received = synchronize(alltoall_async(tensor, splits, name, comm=c))
    return out if splits is None else (out, received)


def barrier(process_set=global_process_set):
    """Returns once every rank has called it (negotiated under Horovod's "barrier.noname")."""
    _check_process_set(process_set, "barrier")
    handle = next(_next_handle)
    state = _negotiator(world()).submit("barrier.noname", "barrier", "barrier")
    synchronize(_register(handle, [state], lambda: None, ()))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns root_rank's `obj` (pickled) on every rank. Without a name it is negotiated as
    "broadcast_object.noname" (Horovod names it after the object's type, which differs when
    the other ranks pass None)."""
    _check_process_set(process_set, "broadcast_object")
    return _broadcast_pickled(world(), obj, root_rank, name)


def _pickled(c, full_name, obj):
    """`obj` pickled for the object collective `full_name`. Where pickling fails (on one rank,
    say), the name is submitted as failed, with why, before the error is raised: the other ranks'
    calls of that name fail at once, naming this rank, instead of waiting for it until the
    watchdog. Its names are fixed (no number), so this rank waits for that failure to end as the
    others' calls do: a retry here then makes a call of its own."""
    try:
        return pickle.dumps(obj)
    except Exception as error:  # not KeyboardInterrupt or SystemExit: those leave at once
        _submit_failed(c, [full_name], error, wait=True)
        raise


def _broadcast_pickled(c, obj, root_rank, name=None):
    """root_rank's `obj`, pickled, on every rank: one negotiated broadcast sized by the root."""
    root_rank = int(root_rank)
    full_name = f"broadcast_object.{name}" if name is not None else "broadcast_object.noname"
    payload = _pickled(c, full_name, obj) if c.rank() == root_rank else b""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
        torch.empty(0, dtype=torch.uint8)
    handle = next(_next_handle)
    state = _negotiator(c).submit(
        full_name, "broadcast", f"broadcast_object, root {root_rank}", data.data_ptr(),
        data.numel(), root=root_rank, sized_by_root=True)
    synchronize(_register(handle, [state], lambda: None, (data,)))
    return obj if c.rank() == root_rank else pickle.loads(memoryview(state))


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's `obj` (pickled), in rank order."""
    _check_process_set(process_set, "allgather_object")
    c = world()
    full_name = f"allgather_object.{name}" if name is not None else "allgather_object.noname"
    payload = torch.frombuffer(bytearray(_pickled(c, full_name, obj)), dtype=torch.uint8)
    handle = next(_next_handle)
    state = _negotiator(c).submit(
        full_name, "allgather", "allgather_object", payload.data_ptr(), payload.numel())
    synchronize(_register(handle, [state], lambda: None, (payload,)))
    data, objects, at = memoryview(state), [], 0
    for n in state.counts():
        objects.append(pickle.loads(data[at:at + n]))
        at += n
    return objects


def _refused(name, why):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name}: {why}")
    refuse.__name__ = name
    return refuse


# ---- reducescatter: Horovod's, Sum and Average ---------------------------------------------------
def _reducescatter_op(op, call):
    opname = _resolve_op(op, None, call)
    if opname not in ("sum", "average"):
        raise _internal(InvalidArgument(f"{call}: op {op!r} is not supported; reducescatter "
                                        "takes Average and Sum, as Horovod's does"))
    return opname


def _reducescatter_rows(rows, ranks):
    """Each rank's rows of a first dimension of `rows`, as Horovod splits it: the first
    rows % ranks ranks get one more."""
    per, extra = divmod(rows, ranks)
    return [per + (r < extra) for r in range(ranks)]


def _check_reducescatter_tensor(tensor, call, what="the tensor"):
    dtype = check_tensor(tensor, call, what)
    if tensor.dim() == 0:
        raise InvalidArgument(f"{call}: {what} is a scalar (0-d); reducescatter splits its first "
                              "dimension between the ranks")
    if math.prod(tensor.shape[1:]) == 0:
        raise InvalidArgument(f"{call}: {what} has a zero-sized dimension after the first "
                              f"({list(tensor.shape)}); its rows would hold nothing")
    return dtype


def _reducescatter_submit(tensor, full_name, opname, prescale, postscale, c):
    """Submits the reducescatter of `tensor` (checked by the caller, before it took its name;
    never written) under `full_name`; returns (state, finish, host copy)."""
    dtype = DTYPES[tensor.dtype]
    src = staged(tensor.detach())
    rows = _reducescatter_rows(src.shape[0], c.size())
    row = math.prod(src.shape[1:])
    signature = (f"reducescatter {dtype} {list(src.shape)} {opname}, factors "
                 f"({float(prescale)!r}, {float(postscale)!r})")
    state = _negotiator(c).submit(full_name, "reducescatter", signature, src.data_ptr(),
                                  src.numel(), dtype, _WIRE_OPS[opname],
                                  splits=[r * row for r in rows], prescale=float(prescale),
                                  postscale=float(_average_factor(c, opname, postscale)))
    trailing = tuple(src.shape[1:])
    return state, lambda: _on_device(_result_tensor(state, src.dtype, trailing), tensor), src


@_in_step("reducescatter")
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, *, comm=None):
    """Starts Horovod's reducescatter: every rank's `tensor` (same shape and dtype everywhere;
    not modified) reduced with Sum or Average, this rank keeping its rows of the first
    dimension (split as Horovod splits it: the first rows % size ranks get one more).
    synchronize() returns them."""
    call = "reducescatter_async"
    _check_process_set(process_set, call)
    opname = _reducescatter_op(op, call)
    c = _comm(comm)
    _check_reducescatter_tensor(tensor, call)
    state, finish, src = _reducescatter_submit(tensor, _op_name("reducescatter", name, c), opname,
                                               prescale_factor, postscale_factor, c)
    return _register(next(_next_handle), [state], finish, (src,))


def _reducescatter_grads(grads, opname, prescale, postscale, c):
    """Horovod's gradient of a reducescatter: each rank's output gradient (times the rank
    count for Sum, and the scale factors), gathered."""
    factor = (c.size() if opname == "sum" else 1) * prescale * postscale
    scaled = [g.contiguous() * factor if factor != 1 else g.contiguous() for g in grads]
    return synchronize(grouped_allgather_async(scaled, comm=c))


class _ReducescatterGrad(torch.autograd.Function):
    """Horovod's gradient: the allgather of each output's gradient (times the rank count for
    Sum, and the scale factors)."""

    @staticmethod
    def forward(ctx, c, name, opname, prescale, postscale, *tensors):
        ctx.args = (opname, prescale, postscale, c)
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, opname, prescale_factor=prescale, postscale_factor=postscale,
            comm=c)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *_reducescatter_grads(grads, *ctx.args))


@_in_step("reducescatter")
def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, *,
                  comm=None):
    """Horovod's reducescatter (reducescatter_async, waited for). Differentiable as Horovod's:
    the gradient is the allgather of the output's gradient (times the rank count for Sum)."""
    call = "reducescatter"
    _check_process_set(process_set, call)
    opname = _reducescatter_op(op, call)
    c = _comm(comm)
    _check_reducescatter_tensor(tensor, call)
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        # One tensor, under the name the call would have alone.
        out = _ReducescatterOneGrad.apply(c, name, opname, prescale_factor, postscale_factor,
                                          compressed)
    else:
        out = synchronize(reducescatter_async(compressed, name, opname, prescale_factor=
                                              prescale_factor, postscale_factor=postscale_factor,
                                              comm=c))
    return compression.decompress(out, ctx)


class _ReducescatterOneGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c, name, opname, prescale, postscale, tensor):
        ctx.args = (opname, prescale, postscale, c)
        return synchronize(reducescatter_async(tensor.detach(), name, opname,
                                               prescale_factor=prescale,
                                               postscale_factor=postscale, comm=c))

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, None, *_reducescatter_grads([grad], *ctx.args))


def _grouped_reducescatter_args(tensors, op, process_set, comm, call):
    """The checked arguments of a grouped reducescatter: (op name, list of tensors, comm)."""
    _check_process_set(process_set, call)
    opname = _reducescatter_op(op, call)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        _check_reducescatter_tensor(t, call, f"tensor {i}")
    return opname, tensors, _comm(comm)


@_in_step("grouped_reducescatter")
def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0, *, comm=None):
    """Starts the reducescatter of every tensor of the list (each negotiated under
    "<name>_<i>of<n>", as Horovod's); synchronize() returns the list of this rank's parts."""
    call = "grouped_reducescatter_async"
    opname, tensors, c = _grouped_reducescatter_args(tensors, op, process_set, comm, call)
    return _submit_each(c, tensors, _op_name("grouped_reducescatter", name, c),
                        lambda t, full: _reducescatter_submit(t, full, opname, prescale_factor,
                                                              postscale_factor, c))


@_in_step("grouped_reducescatter")
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, *, comm=None):
    """Horovod's grouped_reducescatter: reducescatter of every tensor of the list, returned as a
    list. Differentiable as reducescatter."""
    call = "grouped_reducescatter"
    opname, tensors, c = _grouped_reducescatter_args(tensors, op, process_set, comm, call)
    compressed = [compression.compress(t) for t in tensors]
    inputs = [t for t, _ in compressed]
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        outs = list(_ReducescatterGrad.apply(c, name, opname, prescale_factor, postscale_factor,
                                             *inputs))
    else:
        outs = synchronize(grouped_reducescatter_async(inputs, name, opname,
                                                       prescale_factor=prescale_factor,
                                                       postscale_factor=postscale_factor,
                                                       comm=c))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set, *, comm=None):
    """Horovod's: starts the reduction of a sparse COO tensor as allgathers of every rank's
    indices and values (and sizes, which must agree); returns a function that waits for them
    and gives the sparse sum of every rank's entries (uncoalesced; Average divides the values
    by the rank count), as Horovod's does."""
    call = "sparse_allreduce_async"
    _check_process_set(process_set, call)
    c = _comm(comm)
    names = [f"{name}.{part}" if name else None for part in ("values", "indices", "sizes")]
    try:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            raise InvalidArgument(f"{call}: takes a sparse COO tensor, got "
                                  f"{getattr(tensor, 'layout', type(tensor).__name__)}")
        opname = _resolve_op(op, None, call)
        if opname not in ("average", "sum"):
            raise InvalidArgument(f"{call}: op must be Average or Sum")
    except Exception as error:
        # Maybe here only: the others start their three allgathers, which fail at once under
        # the names theirs take (and unnamed ones stay numbered alike).
        _submit_failed(c, [_op_name("allgather", n, c) for n in names], error,
                       wait=name is not None)
        raise
    # The values first: they alone can be refused (their dtype), before anything is submitted.
    values = allgather_async(tensor._values().contiguous(), name=names[0], comm=c)
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name=names[1],
                              comm=c)
    sizes = allgather_async(torch.tensor([list(tensor.shape)], dtype=torch.int64),
                            name=names[2], comm=c)
    shape, n = tensor.shape, c.size()

    def handle():
        results, error = [], None
        for h in (sizes, indices, values):  # every one, so that none stays in flight
            try:
                results.append(synchronize(h))
            except Exception as e:  # noqa: BLE001 - raised once all are done
                error = error or e
        if error is not None:
            raise error
        every, gathered_indices, gathered_values = results
        if not bool((every == every[0]).all()):
            raise InvalidArgument(f"{call}: the ranks' tensors differ in size: "
                                  f"{[list(map(int, r)) for r in every]} (rank order)")
        if opname == "average":
            gathered_values = gathered_values / n
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, shape)

    return handle


SyncBatchNorm = _refused("SyncBatchNorm", "not implemented by gradcomm")


class _Elastic:
    def __getattr__(self, attr):
        raise NotImplementedError(f"elastic.{attr}: Horovod's elastic training is not "
                                  "implemented by gradcomm")


elastic = _Elastic()


# ---- parameters and optimizer state ----------------------------------------------------------
def broadcast_parameters(params, root_rank=0, *, comm=None, root=None):
    """Broadcasts root_rank's values of a state_dict (or named_parameters(), or a list of
    (name, tensor) or of tensors) into every rank's tensors, in place: one negotiated broadcast
    per tensor, named "broadcast.<name>" as in Horovod, all in flight at once."""
    if root is not None:  # gradcomm's earlier keyword
        root_rank = root
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda x: x[0])
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise InvalidArgument(f"broadcast_parameters: invalid params of type {type(params)}")
    named = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    # Every tensor is checked before the first is submitted: a bad one fails on every rank (they
    # all hold the same list) before any broadcast.
    for n, t in named:
        if t.device.type not in DEVICES or t.layout != torch.strided:
            raise InvalidArgument(f"broadcast_parameters: {n} is not a dense CPU or CUDA tensor")
        _check_bytes_tensor(t.detach(), f"broadcast_parameters ({n})")
    c = _comm(comm)
    if not 0 <= int(root_rank) < c.size():
        raise InvalidArgument(f"broadcast_parameters: root {root_rank} is outside the "
                              f"communicator's {c.size()} ranks")
    handles = [broadcast_async_(t.detach(), int(root_rank), n, comm=c) for n, t in named]
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, *, root=None):
    """Gives every rank root_rank's optimizer state and hyper-parameters (state_dict() pickled
    from the root, then load_state_dict). As Horovod, an optimizer without any state first
    makes it: every trainable parameter gets a zero gradient and the optimizer steps once
    (without all-reducing), on every rank alike."""
    if root is not None:
        root_rank = root
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgument("broadcast_optimizer_state: cannot broadcast torch.optim.LBFGS "
                              "state")
    full_name = "broadcast_object.optimizer_state"  # _broadcast_pickled's name for it
    if not optimizer.state_dict()["state"]:
        try:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            base = getattr(optimizer, "_gradcomm_base", None)
            if base is not None:
                base.step(optimizer)
            else:
                optimizer.step()
        except Exception as error:
            # Maybe here only (a root that loaded its state skips this step): the broadcast is
            # submitted as failed, so the root's fails at once, naming this rank.
            _submit_failed(world(), [full_name], error, wait=True)
            raise
        if not optimizer.state_dict()["state"]:
            return  # an optimizer that keeps no state
    state = _broadcast_pickled(world(), optimizer.state_dict() if rank() == root_rank else None,
                               root_rank, "optimizer_state")
    optimizer.load_state_dict(state)


# ---- DistributedOptimizer ------------------------------------------------------------------
def _scale_(tensor, factor):
    if factor == 1.0:
        return
    with torch.no_grad():
        tensor.mul_(factor)



def _alias(name):
    """A read-write attribute that is another attribute under another name."""
    return property(lambda self: getattr(self, name), lambda self, v: setattr(self, name, v))


class _DistributedOptimizerMixin:
    def _gradcomm_arguments(self, call, named_parameters, compression,
                            backward_passes_per_step, op, gradient_predivide_factor, num_groups,
                            groups):
        """The trainable parameters, their names, the op and the groups (lists of indices into
        the parameters), or InvalidArgument / NotImplementedError for a bad argument."""
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and all(p is not q for q in params):
                    params.append(p)
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(nt, tuple) or len(nt) != 2 for nt in named):
                raise InvalidArgument(f"{call}: named_parameters should be a sequence of tuples "
                                      "(name, parameter), usually produced by "
                                      "model.named_parameters().")
            names_of = {id(p): n for n, p in named}
            seen, dups = set(), set()
            for n, _ in named:
                (dups if n in seen else seen).add(n)
            if dups:
                raise InvalidArgument(f"{call}: Parameter names in named_parameters must be "
                                      f"unique. Found duplicates: {', '.join(sorted(dups))}")
            missing = [p for p in params if id(p) not in names_of]
            if missing:
                raise InvalidArgument(f"{call}: named_parameters was specified, but one or more "
                                      "model parameters were not named. Python object ids: "
                                      f"{', '.join(str(id(p)) for p in missing)}")
            names = [names_of[id(p)] for p in params]
        else:  # Horovod's names: parameter group, then index in it
            where = {}
            for i, group in enumerate(self.param_groups):
                for j, p in enumerate(group["params"]):
                    where.setdefault(id(p), f"allreduce.noname.{i}.{j}")
            names = [where[id(p)] for p in params]
        if backward_passes_per_step < 1:
            raise InvalidArgument(f"{call}: backward_passes_per_step must be > 0")
        if gradient_predivide_factor <= 0:
            raise InvalidArgument(f"{call}: gradient_predivide_factor must be positive")
        opname = _resolve_op(op, None, call)
        if opname not in ("average", "sum"):
            raise InvalidArgument(f"{call}: op must be Average or Sum")
        if gradient_predivide_factor != 1.0 and opname != "average":
            raise InvalidArgument(f"{call}: gradient_predivide_factor not supported with "
                                  "op != Average")
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
                warnings.warn(f"{call}: groups given; num_groups is ignored", stacklevel=4)
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
        return params, names, opname, group_lists

    def _gradcomm_setup(self, named_parameters, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, num_groups, groups, algorithm,
                        fusion_threshold, comm, overlap, sparse_as_dense=False):
        call = "DistributedOptimizer"
        try:
            params, names, opname, group_lists = self._gradcomm_arguments(
                call, named_parameters, compression, backward_passes_per_step, op,
                gradient_predivide_factor, num_groups, groups)
        except Exception as error:  # this rank only, maybe: the others must not wait for it
            raise_on_every_rank(
                error, call,
                "the optimizer's parameters (names, shapes, dtypes, order) or gradient settings",
                comm or world())
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
        def make_reducer(subset, indices):
            position = {g: k for k, g in enumerate(indices)}
            groups = None if group_lists is None else [
                g for g in ([position[i] for i in grp if i in position] for grp in group_lists)
                if g]
            return gradient_reducer(subset, [names[i] for i in indices], call, comm, opname,
                                    algorithm, cap, min(cap, 1 << 20), compression.wire, groups,
                                    overlap)
        self._gradcomm_make_reducer = make_reducer
        self._gradcomm_average = opname == "average"
        # What the reducer's buckets do not say: which parameter each slot holds (ranks that list
        # the same parameters in another order, or name them otherwise, would sum different
        # parameters' gradients), and how each rank scales (a gradient_predivide_factor that
        # differs gives every rank other gradients). One all-reduce: an error on every rank.
        verify_same_across_ranks(
            f"parameters {[(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]}, "
            f"groups {group_lists}, gradient_predivide_factor {float(gradient_predivide_factor)!r}"
            f", backward_passes_per_step {backward_passes_per_step}, op {opname}, sparse_as_dense "
            f"{bool(sparse_as_dense)}", call,
            "the optimizer's parameters (names, shapes, dtypes, order) or gradient settings",
            comm or world())
        self._gradcomm_reducer = make_reducer(params, list(range(len(params))))
        self._gradcomm_comm = self._gradcomm_reducer.comm
        self._gradcomm_id = next_per_communicator(_optimizer_counts, self._gradcomm_comm)
        _optimizers[(id(self._gradcomm_comm), self._gradcomm_id)] = self
        self._gradcomm_zeros = None
        self._gradcomm_announced = False  # this step's join round made
        self._gradcomm_holding = False    # a rank has joined: buckets wait for step()
        self._gradcomm_held = {}          # index -> gradient, while holding
        self._gradcomm_divided = []       # gradients divided by gradient_predivide_factor
        # index -> sparse_dim: the parameters whose gradients came sparse on this rank, handed
        # back sparse from then on (a rank learns it from its first sparse gradient)
        self._gradcomm_sparse = {}
        # After the first step, the ranks agree on which parameters any of them saw sparse
        # (one flag all-reduce); from then on those are gathered by rows (SparseRowsReducer),
        # with no bucket slot. index -> sparse_dim.
        self._gradcomm_agreed = False
        self._gradcomm_rows = {}
        self._gradcomm_hooks = []
        self._gradcomm_accumulators = []
        for i, p in enumerate(params):
            acc = grad_accumulator(p)
            self._gradcomm_hooks.append(acc.register_hook(self._gradcomm_hook(i)))
            self._gradcomm_accumulators.append(acc)
        # The attributes Horovod's optimizer has, for code that reads them.
        self._parameter_names = {p: n for p, n in zip(params, names)}
        self._grad_accs = self._gradcomm_accumulators
        self._requires_update = set(params)
        self._handles = {}  # Horovod's per-parameter handles: gradcomm's reducer holds its own
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = {"average": Average, "sum": Sum}[opname]
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = global_process_set

    # Horovod's names for state gradcomm keeps under its own.
    _synchronized = _alias("_gradcomm_synchronized")
    _should_synchronize = _alias("_gradcomm_should_sync")

    @property
    def _allreduce_delay(self):
        return {p: d for p, d in zip(self._gradcomm_params, self._gradcomm_delay)}

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
            active = _step_round(self._gradcomm_comm, self._gradcomm_call, _KIND_STEP,
                                 self._gradcomm_id, self._gradcomm_reducer.negotiated)
            self._gradcomm_announced = True
            # A rank has joined: hold the buckets until step(), where the joined rank stands
            # in for them (a world call in between would otherwise meet it mid-step).
            self._gradcomm_holding = active is not None and len(active) < self._gradcomm_comm.size()
        p = self._gradcomm_params[i]
        if i in self._gradcomm_rows:  # gathered by rows at finish(): its rows, or none
            grad = p.grad.detach() if p.grad is not None else empty_sparse_like(
                p, self._gradcomm_rows[i])
            if self._gradcomm_holding:
                self._gradcomm_held[i] = grad
            else:
                self._gradcomm_reducer.mark(i, grad)
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif p.grad.layout != torch.strided:
            # A sparse gradient (a sparse embedding's) before the ranks agreed on the sparse
            # parameters (the first step): reduced densely in its bucket slot and made sparse
            # again after (synchronize), so that optimizers that take sparse gradients only
            # (SparseAdam) keep working; from the next step it is gathered by rows.
            if p.grad.layout != torch.sparse_coo:
                raise InvalidArgument(f"{self._gradcomm_call}: {self._gradcomm_names[i]} has a "
                                      f"{p.grad.layout} gradient: dense and sparse COO "
                                      "gradients are reduced")
            if self._gradcomm_agreed and i not in self._gradcomm_sparse:
                # Sparse only after the ranks agreed on the sparse parameters: dense for good.
                warnings.warn(sparse_cost_warning(self._gradcomm_call, self._gradcomm_names[i],
                                                  p), stacklevel=2)
            self._gradcomm_sparse.setdefault(i, p.grad.sparse_dim())
            p.grad = p.grad.to_dense()
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        grad = p.grad.detach()  # same memory; a create_graph gradient is reduced as data
        if self._gradcomm_prediv != 1.0:
            _scale_(grad, 1.0 / self._gradcomm_prediv)
            self._gradcomm_divided.append(grad)
        if self._gradcomm_holding:
            self._gradcomm_held[i] = grad
        else:
            self._gradcomm_reducer.mark(i, grad)

    def synchronize(self):
        """Waits for the gradients' all-reduce (starting it for gradients backward has not
        produced: they count as zeros). step() calls it unless done since the last step."""
        reducer = self._gradcomm_reducer
        # Raised once the step's calls are complete, so the ranks stay in step. A gradient that
        # cannot be marked fails this rank's step in the reducer (after the join round, which
        # the other ranks make before their buckets): the other ranks' all-reduce of its
        # buckets fails, naming this rank, instead of reducing without its gradients.
        error = None
        for i in range(len(self._gradcomm_params)):
            if not self._gradcomm_is_marked(i):
                try:
                    self._gradcomm_mark(i)
                except Exception as e:  # noqa: BLE001 - raised below
                    error = error or e
        finished = False  # (a failed step fails on every rank: none goes on to agree below)
        try:
            if self._gradcomm_holding:  # a rank has joined: it stands in from this round on
                _step_round(self._gradcomm_comm, self._gradcomm_call, _KIND_STEP_GO,
                            self._gradcomm_id, self._gradcomm_reducer.negotiated)
                for i, grad in self._gradcomm_held.items():
                    reducer.mark(i, grad)
            if error is not None:
                reducer.fail(error)
            try:
                reducer.finish()
                finished = error is None
            except Exception:
                if error is None:
                    raise
                # (this rank's own error is raised below: the reducer's says only that it failed)
        finally:
            self._gradcomm_delay = [self._gradcomm_passes] * len(self._gradcomm_params)
            self._gradcomm_announced = self._gradcomm_holding = False
            self._gradcomm_held = {}
            divided, self._gradcomm_divided = self._gradcomm_divided, []
            if not finished:
                for grad in divided:  # as backward left them
                    _scale_(grad, self._gradcomm_prediv)
                self._gradcomm_sparse_again()
        if error is not None:
            raise error
        for i in self._gradcomm_rows:  # their gathered rows (the mean, or the sum)
            reduced = self._gradcomm_reducer.result(i)
            if reduced is not None:
                self._gradcomm_params[i].grad = reduced
        if self._gradcomm_prediv != 1.0:
            for i, p in enumerate(self._gradcomm_params):
                if i not in self._gradcomm_rows:
                    _scale_(p.grad.detach(), self._gradcomm_prediv)
        self._gradcomm_sparse_again()
        self._gradcomm_agree_on_sparse()
        self._gradcomm_synchronized = True

    def _gradcomm_sparse_again(self):
        """Sparse gradients sparse again, as they came (also where this rank's backward gave
        none: zeros stood in). Rows whose reduced gradient is zero are left out, as Horovod's
        sparse_as_dense leaves them."""
        for i, sparse_dim in self._gradcomm_sparse.items():
            p = self._gradcomm_params[i]
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = to_sparse_rows(p.grad, sparse_dim)

    def _gradcomm_agree_on_sparse(self):
        """Once, at the end of the first step (every rank: synchronize(), or a joined rank's
        stand-in): which parameters any rank saw sparse. Those are gathered by rows from the
        next step on, in a reducer rebuilt without their slots (collective). Not with a
        negotiated reducer (CUDA gradients), whose kind every rank shares."""
        if self._gradcomm_agreed or self._gradcomm_reducer.negotiated:
            return
        self._gradcomm_agreed = True
        comm = self._gradcomm_comm
        flags = torch.zeros(len(self._gradcomm_params), dtype=torch.int32)
        # Not with sparse_as_dense (Horovod's way to keep a table on the dense all-reduce), nor
        # where a parameter lies on a GPU (the rebuilt reducer over the others could be of
        # another kind than the one every joined rank's stand-in expects).
        if not self._gradcomm_sparse_as_dense and all(
                p.device.type == "cpu" for p in self._gradcomm_params):
            for i, sparse_dim in self._gradcomm_sparse.items():
                flags[i] = sparse_dim
        if comm.size() > 1:
            comm._allreduce_ptr(flags.data_ptr(), flags.data_ptr(), flags.numel(), "int32",
                                "max", None)
        rows = {i: int(f) for i, f in enumerate(flags.tolist()) if f > 0}
        if rows:
            self._gradcomm_rows = rows
            self._gradcomm_sparse = {i: d for i, d in self._gradcomm_sparse.items()
                                     if i not in rows}
            self._gradcomm_reducer = SparseRowsReducer(
                self._gradcomm_make_reducer, self._gradcomm_params, rows, comm,
                self._gradcomm_average)

    def _gradcomm_stand_in(self):
        """A joined rank's part in a step of the ranks still training: zeros for every
        gradient, in the same buckets (hvd.join). A negotiated reducer's buckets (CUDA
        gradients) need nothing: the negotiator stands in for them while this rank is joined."""
        if self._gradcomm_reducer.negotiated:
            return
        if self._gradcomm_zeros is None:  # (none for the parameters gathered by rows)
            self._gradcomm_zeros = [
                None if i in self._gradcomm_rows else
                torch.zeros_like(p, memory_format=torch.contiguous_format)
                for i, p in enumerate(self._gradcomm_params)]
        for i in reversed(range(len(self._gradcomm_zeros))):  # backward's order
            if i in self._gradcomm_rows:  # no rows to offer
                self._gradcomm_reducer.mark(i, empty_sparse_like(
                    self._gradcomm_params[i], self._gradcomm_rows[i]))
                continue
            z = self._gradcomm_zeros[i]
            z.zero_()
            self._gradcomm_reducer.mark(i, z)
        try:
            self._gradcomm_reducer.finish()
        except MismatchError:
            # The step failed on a training rank: each of them raises, none agrees below; this
            # rank stands in on for their next steps.
            return
        self._gradcomm_agree_on_sparse()

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
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You "
                              "may want to consider using optimizer.skip_synchronize() context "
                              "if you use optimizer.synchronize() in your code.", stacklevel=2)
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

