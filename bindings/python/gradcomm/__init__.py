"""gradcomm: gradient all-reduce for data-parallel training, from Python.

In the style of Horovod::

    import numpy as np
    import gradcomm
    gradcomm.init()
    grads = np.ones(1000, dtype=np.float32)
    gradcomm.allreduce(grads, out=grads)          # in place, averaged over ranks
    total = gradcomm.allreduce(grads, op="sum")   # a new array

Arrays are NumPy (or anything with the buffer protocol), C-contiguous, of dtype float32,
float64, float16, int32 or int64; they are used without copies and the GIL is released while
gradcomm communicates. Errors raise gradcomm.Error (subclasses InvalidArgument, Unsupported,
CommError, MismatchError) naming the call, the rank and the problem.

MPI comes from mpi4py (imported here; it initializes MPI), so gradcomm and mpi4py share it:
``gradcomm.Communicator(MPI.COMM_WORLD.Split(...))`` wraps any mpi4py communicator.
"""

import atexit as _atexit

from mpi4py import MPI as _MPI  # initializes MPI (and loads libmpi with RTLD_GLOBAL)

from ._gradcomm import (  # noqa: F401
    CommError,
    MismatchError,
    Communicator,
    Error,
    Request,
    GradientPacker,
    InvalidArgument,
    Unsupported,
    algorithm_names,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "allreduce", "allreduce_async", "grouped_allreduce", "broadcast", "reduce_scatter", "world",
    "Communicator", "GradientPacker",
    "Request", "Error", "InvalidArgument", "Unsupported", "CommError", "MismatchError", "algorithm_names",
]

_world = None
_world_mpi = None  # the mpi4py communicator _world was made from
_communicators = []


def init(comm=None):
    """Creates the default communicator (over MPI.COMM_WORLD, or the given mpi4py one).
    Safe to call more than once. Collective."""
    global _world, _world_mpi
    if _world is None:
        _world = Communicator.world() if comm is None else Communicator(comm)
        _world_mpi = _MPI.COMM_WORLD if comm is None else comm
        _communicators.append(_world)
    return _world


def is_initialized():
    return _world is not None


def shutdown():
    """Frees gradcomm's communicators (MPI itself is finalized by mpi4py at exit)."""
    global _world, _world_mpi
    for c in _communicators:
        c.free()
    _communicators.clear()
    _world = None
    _world_mpi = None


# Runs before mpi4py's own exit handler (registered earlier): communicators go before MPI.
_atexit.register(shutdown)


def world():
    if _world is None:
        raise InvalidArgument("gradcomm: call gradcomm.init() first")
    return _world


def world_mpi():
    """The mpi4py communicator the default communicator was made from."""
    world()
    return _world_mpi


def rank():
    return world().rank()


def size():
    return world().size()


def local_rank():
    return world().local_rank()


def local_size():
    return world().local_size()


def allreduce(array, op="average", algorithm=None, out=None, comm=None):
    """Reduces `array` over all ranks with op ("sum", "average", "min", "max", "prod").
    Returns `out` (a new array when None; in place when `out is array`)."""
    return (comm or world()).allreduce(array, op, algorithm, out)


def allreduce_async(array, op="average", algorithm=None, out=None, comm=None):
    """Starts allreduce(array, ...) and returns at once with a handle: handle.wait() blocks
    (without holding the GIL) until the result is ready and returns it; handle.done() tells
    whether it is, without blocking. Both raise the call's error. The arrays must not be
    changed until the handle is done. Calls run in the order they were made, on every rank."""
    return (comm or world()).allreduce_async(array, op, algorithm, out)


def grouped_allreduce(arrays, op="average", algorithm=None, fusion_threshold=None, comm=None):
    """All-reduces every array of the list in place, fused into buckets of at most
    fusion_threshold bytes (default GRADCOMM_FUSION_THRESHOLD). Returns the list."""
    return (comm or world()).grouped_allreduce(list(arrays), op, algorithm, fusion_threshold)


def reduce_scatter(array, op="average", algorithm=None, out=None, comm=None):
    """Reduces `array` over all ranks with op and returns block rank() of the result: the
    array's elements split into size() equal blocks (MPI_Reduce_scatter_block), into `out` or a
    new 1-D array. The element count must be a multiple of size()."""
    return (comm or world()).reduce_scatter(array, op, algorithm, out)


def broadcast(array, root=0, comm=None):
    """Copies root's `array` into `array` on every rank (in place). Returns it."""
    return (comm or world()).broadcast(array, root)
