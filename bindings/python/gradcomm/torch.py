"""gradcomm for PyTorch (CPU tensors): in-place all-reduce, parameter broadcast and a
DistributedOptimizer that averages gradients, fused, before every step (Horovod's shape)::

    import gradcomm, gradcomm.torch as gt
    gradcomm.init()
    gt.broadcast_parameters(model.state_dict(), root=0)
    optimizer = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for x, y in batches:              # each rank its own shard
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()              # all-reduces the gradients, then steps

Tensors are used in place through their data pointers: no copies for contiguous CPU tensors.
The in-place calls refuse tensors that autograd tracks (requires_grad, outside torch.no_grad()):
writes through a data pointer bypass autograd. They cannot tell memory that is read-only to the
OS (a tensor over a read-only mmap, or over ``bytes`` via torch.frombuffer): do not pass those.
"""

import torch

from . import InvalidArgument, world

__all__ = ["allreduce_", "allreduce", "grouped_allreduce_", "broadcast_", "broadcast_parameters",
           "broadcast_optimizer_state", "DistributedOptimizer"]

_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def _check(tensor, call, what="tensor", writes=False):
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"{call}: {what} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"{call}: {what} is on {tensor.device}; gradcomm.torch takes CPU "
                              "tensors (the nccl path is separate)")
    if tensor.layout != torch.strided:
        raise InvalidArgument(f"{call}: {what} has layout {tensor.layout}; gradcomm takes dense "
                              "(strided) tensors (call .to_dense())")
    if writes and tensor.requires_grad and torch.is_grad_enabled():
        raise InvalidArgument(f"{call}: {what} requires grad, and an in-place write through its "
                              "data pointer would bypass autograd; pass tensor.detach() (or "
                              "its .grad), or call under torch.no_grad()")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{call}: {what} is not contiguous (call .contiguous())")
    if tensor.dtype not in _DTYPES:
        raise InvalidArgument(f"{call}: {what} has unsupported dtype {tensor.dtype}")
    return _DTYPES[tensor.dtype]


def allreduce_(tensor, op="average", algorithm=None, comm=None):
    """Reduces `tensor` over all ranks, in place. Returns it."""
    dtype = _check(tensor, "allreduce_", writes=True)
    ptr = tensor.data_ptr()
    (comm or world())._allreduce_ptr(ptr, ptr, tensor.numel(), dtype, op, algorithm)
    return tensor


def allreduce(tensor, op="average", algorithm=None, comm=None):
    """Returns a new tensor holding the reduction of `tensor` over all ranks."""
    dtype = _check(tensor, "allreduce")
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    (comm or world())._allreduce_ptr(tensor.data_ptr(), out.data_ptr(), tensor.numel(), dtype, op,
                                     algorithm)
    return out


def grouped_allreduce_(tensors, op="average", algorithm=None, fusion_threshold=None, comm=None):
    """All-reduces every tensor of the list in place, fused into buckets. Returns the list."""
    tensors = list(tensors)
    dtypes = [_check(t, "grouped_allreduce_", f"tensor {i}", writes=True)
              for i, t in enumerate(tensors)]
    (comm or world())._grouped_allreduce_ptrs([t.data_ptr() for t in tensors],
                                              [t.numel() for t in tensors], dtypes, op, algorithm,
                                              fusion_threshold)
    return tensors


def broadcast_(tensor, root=0, comm=None):
    """Copies root's `tensor` into `tensor` on every rank. Returns it."""
    dtype = _check(tensor, "broadcast_", writes=True)
    (comm or world())._broadcast_ptr(tensor.data_ptr(), tensor.numel(), dtype, root)
    return tensor


def broadcast_parameters(params, root=0, comm=None):
    """Broadcasts root's values of a state_dict (or named_parameters(), or a list of
    (name, tensor)) into every rank's tensors, in place, in name order."""
    items = params.items() if hasattr(params, "items") else params
    named = sorted(((n, t) for n, t in items if isinstance(t, torch.Tensor)),
                   key=lambda nt: nt[0])
    # Every tensor is checked before the first is sent: a bad one fails on every rank (they all
    # hold the same list) before any broadcast, instead of leaving the ranks out of step.
    targets = [t.data if t.requires_grad else t for _, t in named]
    for (name, _), target in zip(named, targets):
        _check(target, "broadcast_parameters", name)
    with torch.no_grad():
        for target in targets:
            broadcast_(target, root, comm)


def broadcast_optimizer_state(optimizer, root=0, comm=None):
    """Broadcasts root's optimizer state tensors (momentum buffers, Adam moments, steps) and
    hyper-parameters. Every rank must have the same state layout (e.g. after one step, or
    freshly created)."""
    state = optimizer.state_dict()
    tensors = []
    for pid in sorted(state["state"]):
        for key in sorted(state["state"][pid]):
            value = state["state"][pid][key]
            if isinstance(value, torch.Tensor):
                tensors.append((f"state.{pid}.{key}", value))
    broadcast_parameters(tensors, root, comm)
    optimizer.load_state_dict(state)


class _DistributedOptimizerMixin:
    def _gradcomm_setup(self, named_parameters, op, algorithm, fusion_threshold, comm):
        params = [p for group in self.param_groups for p in group["params"]]
        names = {}
        if named_parameters is not None:
            names = {id(p): n for n, p in named_parameters}
            missing = [i for i, p in enumerate(params) if id(p) not in names]
            if missing:
                raise InvalidArgument("DistributedOptimizer: named_parameters does not cover "
                                      f"the optimizer's parameters (indices {missing[:5]})")
        self._gradcomm_params = params
        self._gradcomm_names = names
        self._gradcomm_op = op
        self._gradcomm_algorithm = algorithm
        self._gradcomm_fusion = fusion_threshold
        self._gradcomm_comm = comm

    def synchronize(self):
        """All-reduces the gradients now (step() does it when not done since the last step)."""
        grads = []
        for p in self._gradcomm_params:
            if p.grad is None:  # every rank must send the same list: absent gradients are zero
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            grads.append(p.grad.detach())  # same memory; a create_graph grad is reduced as data
        grouped_allreduce_(grads, self._gradcomm_op, self._gradcomm_algorithm,
                           self._gradcomm_fusion, self._gradcomm_comm)

    def step(self, closure=None):
        self.synchronize()
        return self._gradcomm_base.step(self, closure)


def DistributedOptimizer(optimizer, named_parameters=None, op="average", algorithm=None,
                         fusion_threshold=None, comm=None):
    """Wraps a torch.optim optimizer so that step() first all-reduces every parameter's
    gradient (op "average" or "sum"; fused into buckets of fusion_threshold bytes, default
    GRADCOMM_FUSION_THRESHOLD). The result is an instance of the optimizer's own class
    (lr schedulers accept it) sharing its parameter groups and state."""
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"_gradcomm_base": base})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._gradcomm_setup(list(named_parameters) if named_parameters is not None else None, op,
                            algorithm, fusion_threshold, comm)
    return wrapped
