"""gradcomm.torch.DistributedDataParallel: torch's DDP, with gradcomm underneath.

    model = gradcomm.torch.DistributedDataParallel(model)   # was torch.nn.parallel.DDP(model)

Autograd hooks on every parameter's gradient accumulator hand each gradient to gradcomm's
reducer as backward produces it; buckets (25 MiB, the first 1 MiB, planned again after the
first iteration from the order the gradients arrived on rank 0) are all-reduced on the
communicator's progress engine while backward still runs, and backward() returns with every
gradient averaged over the ranks, bit-identical on every rank."""

import contextlib
import functools
import warnings

import torch
from torch.autograd import Variable

from . import InvalidArgument, MismatchError, world
from ._torch_common import (JoinControl, SparseRowsReducer, broadcast_coalesced,
                            empty_sparse_like, grad_accumulator, gradient_reducer, refuse_round,
                            raise_on_every_rank, sparse_cost_warning, to_sparse_rows,
                            verify_same_across_ranks)

__all__ = ["DistributedDataParallel", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook"]

_CALL = "DistributedDataParallel"
# What the constructor's check across ranks compares (a rank that refused its arguments takes
# part in it with its error).
_LAYOUT_DIFFERS = "the module's parameters or buffers, or DDP's arguments (one refused them)"


class _BuiltinHook:
    """A communication hook gradcomm runs itself, inside its reducer: pass it to
    DistributedDataParallel.register_comm_hook (torch's own default_hooks functions of the same
    names are accepted too)."""

    def __init__(self, name, compression):
        self.__name__ = name
        self.compression = compression

    def __call__(self, state, bucket):
        raise NotImplementedError(f"gradcomm.torch.{self.__name__} runs inside gradcomm's "
                                  "reducer; pass it to register_comm_hook instead of calling it")

    def __repr__(self):
        return f"gradcomm.torch.{self.__name__}"


allreduce_hook = _BuiltinHook("allreduce_hook", "none")
fp16_compress_hook = _BuiltinHook("fp16_compress_hook", "float16")
bf16_compress_hook = _BuiltinHook("bf16_compress_hook", "bfloat16")


def _torch_builtin_hooks():
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    except ImportError:  # torch built without distributed
        return {}
    return {default_hooks.allreduce_hook: "none", default_hooks.fp16_compress_hook: "float16",
            default_hooks.bf16_compress_hook: "bfloat16"}


def _as_device(d):
    """A device from an index (a CUDA device, as torch's DDP takes it) or a device or string;
    "cuda" alone is the current CUDA device."""
    d = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _moved(obj, device):
    """`obj` with every tensor in it (through tuples, lists and dicts) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_moved(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


class DistributedDataParallel(torch.nn.Module):
    """torch.nn.parallel.DistributedDataParallel's call shape and behaviour over gradcomm
    (CPU modules; CUDA modules on one device reduced on the GPU, through NCCL, where gradcomm's
    GPU path runs, else through pinned host copies). Supported:
    device_ids (the module's one device; inputs are moved there), bucket_cap_mb,
    broadcast_buffers, find_unused_parameters, gradient_as_bucket_view, no_sync(),
    register_comm_hook with the built-in allreduce, fp16 and bf16 compression hooks, join() for
    uneven inputs. Not supported, with an error that says so: a module across several devices,
    process_group (pass comm=), static_graph, custom comm hooks. gradcomm's own keywords: comm
    (a gradcomm.Communicator; default the world), algorithm, first_bucket_mb (1), overlap
    (False: the same buckets reduced after backward, the baseline overlap is measured
    against)."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False, *,
                 comm=None, algorithm=None, first_bucket_mb=1.0, overlap=True):
        super().__init__()
        try:  # the arguments: where only this rank refuses its own, the others must not wait
            # As torch's DDP for a module on one device: device_ids names that device (inputs are
            # moved there), or is left unset (inputs stay where they are).
            devices = {p.device for p in module.parameters()}
            self.device = None
            if device_ids:
                if len(device_ids) != 1 or len(devices) != 1:
                    raise InvalidArgument(f"{_CALL}: device_ids must name the one device of a "
                                          f"module on one device (got {device_ids}, parameters "
                                          f"on {sorted(map(str, devices))})")
                self.device = _as_device(device_ids[0])
                if self.device not in devices:
                    raise InvalidArgument(f"{_CALL}: device_ids {device_ids} is not the device of "
                                          f"the module's parameters ({next(iter(devices))})")
            if output_device is not None and (self.device is None or
                                              _as_device(output_device) != self.device):
                raise InvalidArgument(f"{_CALL}: output_device must be the module's device "
                                      "(device_ids[0]); gradcomm does not split a module's output "
                                      "across devices")
            if process_group is not None:
                raise NotImplementedError(f"{_CALL}: process_group is torch.distributed's; pass "
                                          "comm=gradcomm.Communicator(mpi4py_comm) instead")
            if static_graph:
                raise NotImplementedError(f"{_CALL}: static_graph=True is not supported by "
                                          "gradcomm (its reducer expects each gradient once per "
                                          "backward)")
            if bucket_cap_mb <= 0 or first_bucket_mb <= 0:
                raise InvalidArgument(f"{_CALL}: bucket_cap_mb and first_bucket_mb must be "
                                      "positive")
        except Exception as error:
            raise_on_every_rank(error, _CALL, _LAYOUT_DIFFERS, comm or world())
        self.module = module
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._comm = comm or world()
        self._algorithm = algorithm
        self._bucket_cap = int(bucket_cap_mb * (1 << 20))
        self._first_bucket = int(first_bucket_mb * (1 << 20))
        self._overlap = overlap

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._buffers_list = [b for b in module.buffers()]
        # The parameters whose gradients are sparse (index -> sparse dimensions), as torch's DDP
        # finds them: those of sparse embeddings. The same on every rank (the same module). They
        # have no bucket slot: the reducer gathers their rows after the buckets, as torch's DDP
        # on gloo does (SparseRowsReducer), and every rank gets them back sparse, whichever
        # rank's backward reached them.
        sparse_modules = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        expect_sparse = {id(m.weight) for m in module.modules()
                         if isinstance(m, sparse_modules) and m.sparse}
        self._sparse_rows = {i: 1 for i, p in enumerate(self._params) if id(p) in expect_sparse}
        # Others that backward makes sparse on this rank: reduced densely in their bucket slot,
        # handed back sparse (and a warning: slow on large tables).
        self._sparse = {}
        self._sparse_warned = False
        layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
                          for n, p in module.named_parameters())
        layout += "|" + ";".join(f"{tuple(b.shape)}:{b.dtype}" for b in self._buffers_list)
        verify_same_across_ranks(layout, _CALL, _LAYOUT_DIFFERS, self._comm)
        # Every rank starts from rank 0's parameters and buffers (torch's DDP does the same).
        broadcast_coalesced(list(module.parameters()) + self._buffers_list, 0, self._comm)

        self._compression = "none"
        self._reducer = self._make_reducer()  # collective
        if gradient_as_bucket_view and any(d.type != "cpu" for d in devices) and \
                not self._reducer.negotiated:  # decided by every rank alike
            raise InvalidArgument(f"{_CALL}: gradient_as_bucket_view needs the buckets on the "
                                  "parameters' device; this model's gradients go through host "
                                  "buckets (its parameters are on several devices, or gradcomm's "
                                  "GPU path cannot run on some rank; leave it False)")
        self._require_sync = True   # outside no_sync()
        self._sync_pending = False  # the last forward asked its backward to all-reduce
        self._sync_buffers_next = True  # torch: after a grad-enabled forward outside no_sync
        self._in_backward = False
        self._hook_error = None     # raised by the end-of-backward callback, once ranks agree
        self._unused = []           # parameters the last forward did not reach
        self._used_unsynced = set()  # parameters given gradients inside no_sync since last sync
        self._fired = set()          # parameters whose hook ran in this backward
        self._scratch = {}
        self._join = None            # inside join(): its _Join
        self._last_used = None       # this rank's used flags in its last backward (join)
        self._grad_scale = 1.0       # join(divide_by_initial_world_size=False) rescales
        self._hooks = []
        self._accumulators = []
        for i, p in enumerate(self._params):
            acc = grad_accumulator(p)
            self._hooks.append(acc.register_hook(functools.partial(self._on_gradient, i)))
            self._accumulators.append(acc)  # the node must outlive the hook

    # ---- torch.nn.Module -------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self._in_backward:
            # The last backward stopped part way (an error in autograd): its end-of-backward
            # callback never ran. Complete its all-reduce with stand-ins, as the other ranks
            # complete theirs, so the ranks stay in step.
            warnings.warn(f"{_CALL}: the previous backward did not complete; finishing its "
                          "all-reduce before this forward", RuntimeWarning, stacklevel=2)
            try:
                self._finish_backward()
            except Exception:  # noqa: BLE001 - that backward's error was raised already
                pass
        # As torch: only a grad-enabled forward outside no_sync prepares an all-reducing backward
        # (a no_grad forward in between leaves a pending backward as it was).
        syncing = torch.is_grad_enabled() and self._require_sync
        sync_buffers = (self.broadcast_buffers and self._sync_buffers_next and
                        bool(self._buffers_list) and self._comm.size() > 1)
        buffer_root = 0
        if self._join is not None:  # one join round: tells joined ranks what to stand in for
            buffer_root = self._join.forward_round(syncing, sync_buffers)
        if sync_buffers:
            broadcast_coalesced(self._buffers_list, buffer_root, self._comm)
        if self.device is not None:
            inputs, kwargs = _moved(inputs, self.device), _moved(kwargs, self.device)
        output = self.module(*inputs, **kwargs)
        self._sync_buffers_next = syncing
        if syncing:
            self._sync_pending = True
            self._unused = self._unreached(output) if self.find_unused_parameters else []
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this context accumulate gradients locally;
        the first backward after it all-reduces the sum."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def register_comm_hook(self, state, hook):
        """Built-in hooks only: gradcomm.torch.allreduce_hook, fp16_compress_hook,
        bf16_compress_hook (or torch's default_hooks functions of those names): float32
        gradients travel as float16 / bfloat16. Call once, before the first backward."""
        compression = hook.compression if isinstance(hook, _BuiltinHook) else \
            _torch_builtin_hooks().get(hook)
        if compression is None:
            raise NotImplementedError(
                f"{_CALL}.register_comm_hook: {getattr(hook, '__name__', hook)!r} is not one of "
                "gradcomm's built-in hooks (allreduce_hook, fp16_compress_hook, "
                "bf16_compress_hook); gradcomm does not run custom Python comm hooks")
        if self._reducer.iterations() > 0 or self._reducer.busy:
            raise RuntimeError(f"{_CALL}.register_comm_hook must be called before the first "
                               "backward")
        if compression != "none" and self.gradient_as_bucket_view:
            raise NotImplementedError(f"{_CALL}: gradient_as_bucket_view with a compression hook "
                                      "is not supported (the buckets hold the compressed dtype)")
        self._compression = compression
        self._reducer = self._make_reducer()  # collective, as register_comm_hook is

    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """torch's DDP.join: a context manager for uneven inputs. Inside it, each forward runs one
        small all-reduce that tells the ranks which ones are still training; a rank that has left
        its loop stands in for the others' steps at the context's exit (zeros for its gradients,
        in the same buckets; the buffers broadcast from a rank still training) until every rank
        has left, and then every rank takes the model of the last rank to leave.
        divide_by_initial_world_size=False averages over the ranks still training instead.
        throw_on_early_termination=True raises on every rank as soon as one has left."""
        return _Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    # ---- internals ---------------------------------------------------------------------------
    def _make_reducer(self):
        # As torch's fp16 / bf16 hooks: each gradient is divided by the rank count once
        # compressed, then summed.
        def make(params, indices):
            return gradient_reducer(params, [self._names[i] for i in indices], _CALL,
                                    self._comm, "average", self._algorithm, self._bucket_cap,
                                    self._first_bucket, self._compression, overlap=self._overlap,
                                    divide_before_sum=True)
        if self._sparse_rows:
            return SparseRowsReducer(make, self._params, self._sparse_rows, self._comm)
        return make(self._params, list(range(len(self._params))))

    def _unreached(self, output):
        """Indices of parameters the autograd graph of `output` does not reach."""
        reached, seen = set(), set()
        stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None:
                reached.add(id(variable))
            stack.extend(f for f, _ in fn.next_functions if f is not None)
        return [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _scratch_for(self, i):
        """Memory that stands in for parameter i's gradient where backward gave it none this
        iteration: its current gradient (accumulated in no_sync) or zeros."""
        p = self._params[i]
        if i in self._sparse_rows:  # no dense memory: its rows, or none
            if p.grad is not None and i in self._used_unsynced:
                return p.grad
            return empty_sparse_like(p, self._sparse_rows[i])
        s = self._scratch.get(i)
        if s is None:
            s = self._scratch[i] = torch.empty_like(p, memory_format=torch.contiguous_format)
        if p.grad is not None and i in self._used_unsynced:
            s.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        else:
            s.zero_()
        return s

    def _on_gradient(self, i, *_):
        if not self._sync_pending:
            self._used_unsynced.add(i)
            return
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._finish_backward)
            for j in self._unused:
                self._reducer.mark(j, self._scratch_for(j))
        # An error fails this rank's iteration in the reducer (its buckets become stand-ins that
        # make the other ranks' all-reduce fail, naming this rank), and is kept for the
        # end-of-backward callback, which completes the step's calls, so the ranks stay in step,
        # and then raises it.
        self._fired.add(i)
        if self._hook_error is not None:
            return
        try:
            if self._reducer.is_marked(i):
                raise RuntimeError(
                    f"{_CALL}: parameter {self._names[i]} got a gradient twice in one backward, "
                    "or after its forward found it unused (is it used outside the module's "
                    "forward, or with reentrant checkpointing?); gradcomm's DDP expects one "
                    "gradient per parameter per backward")
            p = self._params[i]
            grad = p.grad
            if grad is None:  # a Function returned None for it: it counts as zeros
                return        # (marked with a stand-in at the end of backward)
            if i in self._sparse_rows:  # gathered by rows at finish(), sparse or not
                self._reducer.mark(i, grad)
                return
            if grad.layout == torch.sparse_coo:
                # A sparse embedding's gradient: reduced densely in its bucket slot (which the
                # reducer all-reduces every step anyway), made sparse again at the end of
                # backward, as torch's DDP hands optimizers a sparse one (SparseAdam needs it).
                self._sparse.setdefault(i, grad.sparse_dim())
                if not self._sparse_warned:
                    self._sparse_warned = True
                    warnings.warn(sparse_cost_warning(_CALL, self._names[i], p), stacklevel=2)
                grad = p.grad = grad.to_dense()
            elif grad.layout != torch.strided:
                raise RuntimeError(f"{_CALL}: parameter {self._names[i]} has a {grad.layout} "
                                   "gradient; gradcomm reduces dense and sparse COO gradients")
            if not grad.is_contiguous():
                grad = p.grad = grad.contiguous()
            if self.gradient_as_bucket_view:
                view = self._reducer.view(i)
                if view is not None and grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    grad = p.grad = view
            self._reducer.mark(i, grad)
        except Exception as e:  # noqa: BLE001 - re-raised by _finish_backward
            self._hook_error = e
            self._reducer.fail(e)

    def _stand_in(self, sync_gradients, sync_buffers, buffer_root):
        """A joined rank's part in one step of the ranks still training."""
        if sync_buffers:
            broadcast_coalesced(self._buffers_list, buffer_root, self._comm)
        # As the training ranks' forward set it: whether the next forward broadcasts buffers.
        self._sync_buffers_next = sync_gradients
        if not sync_gradients:
            return
        zeros = self._scratch.get("join")
        if zeros is None:
            zeros = self._scratch["join"] = [
                empty_sparse_like(p, self._sparse_rows[i]) if i in self._sparse_rows else
                torch.zeros_like(p, memory_format=torch.contiguous_format)
                for i, p in enumerate(self._params)]
        for i in reversed(range(len(zeros))):  # backward's order, should the buckets be replanned
            if i not in self._sparse_rows:  # (no rows to offer)
                zeros[i].zero_()
            self._reducer.mark(i, zeros[i])
        try:
            if self.find_unused_parameters:
                # The used-flag all-reduce. As torch's joined ranks do, this rank offers the flags
                # of its own last backward (a parameter it used then counts as used, and the
                # training ranks' gradient for it becomes zeros rather than staying None).
                flags = self._last_used.clone() if self._last_used is not None else torch.zeros(
                    len(self._params), dtype=torch.int32)
                self._comm._allreduce_ptr(flags.data_ptr(), flags.data_ptr(), flags.numel(),
                                          "int32", "max", None)
        finally:
            try:
                self._reducer.finish()
            except MismatchError:
                pass  # the step failed on a training rank (each raises): this rank stands in on

    def _finish_backward(self):
        # Stand-ins for the parameters not marked: found unused by forward, reached with a None
        # gradient (zeros, as in torch), or not reached at all (`missing`: an error unless
        # find_unused_parameters, which fails this rank's iteration as a hook's error does).
        missing, standing_in, error = [], list(self._unused), None
        try:
            for i in range(len(self._params)):
                if not self._reducer.is_marked(i):
                    if i not in self._fired:
                        missing.append(i)
                    standing_in.append(i)
            if missing and not self.find_unused_parameters and self._hook_error is None:
                names = ", ".join(self._names[i] for i in missing[:8])
                self._hook_error = RuntimeError(
                    f"{_CALL}: on rank {self._comm.rank()} these parameters got no gradient in "
                    f"this backward: {names}{' ...' if len(missing) > 8 else ''}. Pass "
                    "find_unused_parameters=True when forward does not use every parameter, or "
                    "set requires_grad=False on those that never train.")
                self._reducer.fail(self._hook_error)
            if self._hook_error is None:
                for i in standing_in:
                    if i not in self._unused:  # (those were marked at backward's start)
                        self._reducer.mark(i, self._scratch_for(i))
            used = None
            if self.find_unused_parameters:
                # Which parameters got a gradient on some rank (this backward, or in no_sync
                # since the last all-reduce): the others keep theirs untouched, as in torch.
                flags = torch.ones(len(self._params), dtype=torch.int32)
                for i in standing_in:
                    if i not in self._used_unsynced and i not in self._fired:
                        flags[i] = 0
                self._last_used = flags.clone()
                self._comm._allreduce_ptr(flags.data_ptr(), flags.data_ptr(), flags.numel(),
                                          "int32", "max", None)
                used = flags.tolist()
        except Exception as e:  # noqa: BLE001 - still finish below, so the ranks stay in step
            error = e
            self._reducer.fail(e)
        try:
            try:
                self._reducer.finish()
            except Exception:
                if error is None and self._hook_error is None:
                    raise
                # this rank's own error is raised below (the reducer's says only that it failed)
            if error is None and self._hook_error is None:
                with torch.no_grad():
                    for i in standing_in:
                        if used is not None and not used[i]:
                            continue
                        if i in self._sparse_rows:
                            continue  # (below)
                        p, s = self._params[i], self._scratch[i]
                        if p.grad is None or p.grad.is_sparse:
                            p.grad = s.clone()  # (made sparse again below, if it was)
                        else:
                            p.grad.copy_(s)
                    for i in self._sparse_rows:  # their gathered rows, where torch writes
                        reduced = self._reducer.result(i)
                        if used is not None and not used[i]:
                            continue
                        self._params[i].grad = reduced
                    if self._grad_scale != 1.0:  # join: the mean over the ranks still training
                        for i, p in enumerate(self._params):
                            if p.grad is not None and (used is None or used[i]):
                                p.grad.mul_(self._grad_scale)
        finally:
            # Sparse gradients are handed back sparse, on every path (the rows whose reduced
            # gradient is zero are left out, as Horovod's sparse_as_dense leaves them).
            for i, sparse_dim in self._sparse.items():
                p = self._params[i]
                if p.grad is not None and not p.grad.is_sparse:
                    p.grad = to_sparse_rows(p.grad, sparse_dim)
            hook_error, self._hook_error = self._hook_error, None
            self._in_backward = False
            self._sync_pending = False
            self._unused = []
            self._fired.clear()
            self._used_unsynced.clear()
        if error is not None:
            raise error
        if hook_error is not None:
            raise hook_error

    def _gradcomm_buckets(self):
        """The reducer's buckets: (dtype, wire dtype, parameter indices, elements)."""
        return self._reducer.buckets()


# The kind of a DDP join round, apart from the Horovod API's (gradcomm.torch), which also runs
# rounds on the world communicator: each side refuses the other's instead of misreading it.
_DDP_ROUND = 101


class _Join:
    """DistributedDataParallel.join()'s context (see there)."""

    def __init__(self, ddp, divide_by_initial_world_size, enable, throw_on_early_termination):
        self.ddp = ddp
        self.divide_by_initial = divide_by_initial_world_size
        self.enable = enable and ddp._comm.size() > 1
        self.throw = throw_on_early_termination
        if ddp._comm.size() > 1:
            # Ranks that differ here would scale their gradients differently once a rank has
            # joined (a wrong average without a word), or raise alone, or make JoinControl alone.
            verify_same_across_ranks(
                f"enable {bool(enable)}, divide_by_initial_world_size "
                f"{bool(self.divide_by_initial)}, throw_on_early_termination {bool(self.throw)}",
                f"{_CALL}.join", "join()'s arguments", ddp._comm)
        self.control = JoinControl(ddp._comm) if self.enable else None

    def __enter__(self):
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError(f"{_CALL}.join: already inside join()")
            self.ddp._join = self
        return self

    def _early_termination(self):
        return RuntimeError(f"{_CALL}.join(throw_on_early_termination=True): a rank ran out of "
                            "inputs; raising on every rank")

    def forward_round(self, sync_gradients, sync_buffers):
        """A training rank's round at each forward; returns the rank buffers come from."""
        ddp = self.ddp
        active, _ = self.control.exchange(True, (_DDP_ROUND, int(sync_gradients),
                                                 int(sync_buffers)))
        n = ddp._comm.size()
        if len(active) < n and self.throw:
            raise self._early_termination()
        ddp._grad_scale = 1.0 if self.divide_by_initial else n / len(active)
        return max(active)  # as torch: the buffers of the highest rank still training

    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        ddp = self.ddp
        try:
            if exc_type is not None:
                return False  # the other ranks' calls are not stood in for: the error ends it
            while True:
                active, d = self.control.exchange(False)
                if not active:
                    break
                if self.throw:
                    raise self._early_termination()
                if d[0] != _DDP_ROUND:
                    refuse_round(ddp._comm, RuntimeError(
                        f"{_CALL}.join: the ranks still training made a call a joined rank "
                        "cannot stand in for (a Horovod-API call on the same communicator?); "
                        "inside join() only the model's forward and backward are stood in for"),
                        f"{_CALL}.join (refused on this rank)")
                ddp._stand_in(bool(d[1]), bool(d[2]), max(active))
            # Every rank takes the model (and buffers) of the last rank to leave its loop.
            source = max(self.control.last_active)
            broadcast_coalesced(list(ddp.module.parameters()) + ddp._buffers_list, source,
                                ddp._comm)
        finally:
            ddp._join = None
            ddp._grad_scale = 1.0
        return False
