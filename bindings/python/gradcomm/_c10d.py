"""gradcomm as a torch.distributed backend. ``import gradcomm.torch`` registers it::

    import gradcomm.torch                                  # registers "gradcomm"
    torch.distributed.init_process_group("gradcomm")       # was: "gloo" / "nccl" / "mpi"
    model = torch.nn.parallel.DistributedDataParallel(model)

Launch with ``mpirun -np N python train.py``: the ranks come from MPI. torch's rendezvous still
wants ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; where the launcher set none
of them, registering sets them from MPI (rank 0's host name and a free port of its, broadcast to
every rank), as DeepSpeed's MPI discovery does. A rank that cannot resolve that name takes one of
rank 0's IPv4 addresses instead (the interface GLOO_SOCKET_IFNAME names first, loopback last); a
rank on another host never takes a loopback address, or a name that resolves only to one.
Variables already set are left alone, and the backend checks that what torch was given agrees
with MPI.

A timeout given to ``init_process_group`` or ``new_group`` is the group's: a call that runs
longer ends the job with the watchdog's report (as ``GRADCOMM_TIMEOUT`` does, which it replaces
for that group). Where none is given (torch's default of 30 minutes), ``GRADCOMM_TIMEOUT``
holds.

The compiled backend comes in one module per torch version it was built for
(``_c10d_torch<major>_<minor>``); the one matching the running torch is loaded.
"""

import atexit
import importlib
import inspect
import ipaddress
import os
import socket

import torch
import torch.distributed as dist
from mpi4py import MPI

NAME = "gradcomm"
_module = None


def _torch_tag():
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{int(major)}_{int(minor)}"


def compiled():
    """The compiled backend for the running torch; ImportError naming the versions built."""
    global _module
    if _module is None:
        tag = _torch_tag()
        try:
            _module = importlib.import_module(f"gradcomm._c10d_torch{tag}")
        except ImportError as error:
            here = os.path.dirname(__file__)
            built = sorted(f[len("_c10d_torch"):].split(".")[0].replace("_", ".")
                           for f in os.listdir(here) if f.startswith("_c10d_torch"))
            raise ImportError(
                f"gradcomm: no torch.distributed backend for torch {torch.__version__} "
                f"(built for: {', '.join(built) or 'none'}); rebuild gradcomm with this torch "
                f"(GRADCOMM_TORCH_PYTHONS, or pip install . in this environment): {error}"
            ) from error
    return _module


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ipv4_addresses():
    """This host's IPv4 addresses as (interface, address): GLOO_SOCKET_IFNAME's interfaces
    first, then the others, loopback last."""
    import fcntl
    import struct

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            found.append((name, socket.inet_ntoa(packed[20:24])))
    preferred = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    return sorted(found, key=lambda a: (a[0] not in preferred, a[1].startswith("127.")))


def _is_loopback(address):
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _reachable_name(host, addresses, beside_rank0):
    """The name or address this rank reaches rank 0's store at: `host` where it resolves here,
    else the first of rank 0's `addresses` (interface, address). A rank on another host than
    rank 0's takes neither a name that resolves only to loopback here (a host name mapped to
    127.0.1.1, or the same name on every host) nor a loopback address: it would wait on its own
    machine for a store that is not there. None where nothing is left."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        resolved = set()
    if resolved and (beside_rank0 or not all(_is_loopback(a) for a in resolved)):
        return host
    usable = [a for _, a in addresses if beside_rank0 or not _is_loopback(a)]
    return usable[0] if usable else None


def _fill_rendezvous_from_mpi():
    """Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from MPI
    where none of torch's rendezvous variables is set. Collective over MPI_COMM_WORLD then: a rank
    that finds no way to rank 0 makes every rank raise (the others would wait for it in torch's
    store for the whole of its timeout)."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    world = MPI.COMM_WORLD
    # Decided alike on every rank: a rank that returned here while the others went on would
    # leave them waiting in the broadcast below, before any watchdog runs.
    given = world.allgather(any(n in os.environ for n in names))
    if all(given):
        return
    if any(given):
        raise RuntimeError(
            f"gradcomm.torch: torch's rendezvous variables ({', '.join(names)}) are set on "
            f"rank(s) {', '.join(str(r) for r, g in enumerate(given) if g)} only: set them on "
            "every rank, or on none to take them from MPI")
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        address = None
        if world.Get_rank() == 0:
            try:  # an error here is every rank's, not rank 0's alone
                address = (socket.gethostname(), _free_port(), _ipv4_addresses())
            except Exception as error:
                address = f"{type(error).__name__}: {error}"
        address = world.bcast(address, root=0)
        if isinstance(address, str):
            raise RuntimeError(f"gradcomm.torch: rank 0 could not find its address for torch's "
                               f"rendezvous ({address}); set MASTER_ADDR and MASTER_PORT (with "
                               "RANK and WORLD_SIZE)")
        host, port, addresses = address
        beside_rank0 = local.allreduce(world.Get_rank() == 0, op=MPI.LOR)
        reachable = _reachable_name(host, addresses, beside_rank0)
        lost = [r for r, ok in enumerate(world.allgather(reachable is not None)) if not ok]
        if lost:
            raise RuntimeError(
                f"gradcomm.torch: rank(s) {', '.join(map(str, lost))} cannot reach rank 0's host "
                f"'{host}': the name does not resolve there, or only to loopback, and rank 0 has "
                f"no other IPv4 address ({', '.join(a for _, a in addresses) or 'none'}); set "
                "MASTER_ADDR and MASTER_PORT (with RANK and WORLD_SIZE) for torch's rendezvous")
        os.environ.setdefault("RANK", str(world.Get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(world.Get_size()))
        os.environ.setdefault("LOCAL_RANK", str(local.Get_rank()))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(local.Get_size()))
        os.environ.setdefault("MASTER_ADDR", reachable)
        os.environ.setdefault("MASTER_PORT", str(port))
    finally:
        local.Free()


def _drain_at_exit():
    if _module is not None:
        _module.drain()


def _given_timeout(options):
    """The timeout the caller gave init_process_group or new_group, in seconds; None where torch
    passes its default (30 minutes), which leaves GRADCOMM_TIMEOUT (default 300 s) in force."""
    from torch.distributed.constants import default_pg_timeout

    timeout = getattr(options, "timeout", None)
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def _create(options, _backend_options=None):
    """torch's creator (extended API): options has group_rank, group_size,
    global_ranks_in_group (empty for the default group), timeout and group_id (torch's group
    name)."""
    ranks = list(getattr(options, "global_ranks_in_group", []) or [])
    return compiled().create(options.group_rank, options.group_size, ranks,
                             _given_timeout(options), str(getattr(options, "group_id", "") or ""))


def register():
    """Registers the backend with torch.distributed (once) and fills the rendezvous variables
    from MPI where the launcher left them unset. Where gradcomm was not built for the running
    torch, init_process_group("gradcomm") raises the ImportError that says so."""
    if NAME.upper() in dist.Backend._plugins:
        return
    _fill_rendezvous_from_mpi()
    # Calls still running at exit finish before Python finalizes (after it, a progress thread
    # that releases a tensor's Python object would be ended mid-call), and before mpi4py's exit
    # handler, registered earlier, finalizes MPI.
    atexit.register(_drain_at_exit)
    kwargs = {"extended_api": True}
    if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
        # CUDA tensors reach the backend, which names what it takes instead of torch's
        # "no backend for cuda".
        kwargs["devices"] = ["cpu", "cuda"]
    dist.Backend.register_backend(NAME, _create, **kwargs)
