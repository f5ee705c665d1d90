"""torch.distributed on the gradcomm backend across emulated hosts (tests/multihost_test.sh
torch_2x1), where no host resolves another's name: init_process_group("gradcomm") with none of
torch's rendezvous variables set (they come from MPI: rank 0's name, or an address of rank 0
where the name does not resolve), a gloo group made through the same rendezvous, and one
all_reduce on each group, every rank checking the exact sum."""

import faulthandler
import os
import socket

# A hang prints every thread's stack and fails: after the stall watchdog's 300 s (whose report
# names a stalled gradcomm call), before the harness's 400 s (which kills without a word).
faulthandler.dump_traceback_later(float(os.environ.get("TEST_HANG_DUMP_SECONDS", "350")),
                                  exit=True)

for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(name, None)
# TEST_PREFER_LOOPBACK=1: GLOO_SOCKET_IFNAME puts lo first while the rendezvous is filled (at
# import), as where a user set it for one host: rank 1 must still take rank 0's eth0 address, not
# its own loopback (before, it waited in torch's store for the whole of its 30 minutes).
prefer_loopback = os.environ.get("TEST_PREFER_LOOPBACK") == "1"
if prefer_loopback:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
else:
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # gloo finds no address by name either (and lo,
    # were it set outside, would not cross the hosts)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gradcomm.torch  # noqa: E402,F401  (registers the backend)

if prefer_loopback:
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # for gloo's own connections, made below
    if os.environ["RANK"] != "0":  # fail here rather than wait in torch's store
        assert not os.environ["MASTER_ADDR"].startswith("127."), os.environ["MASTER_ADDR"]

dist.init_process_group("gradcomm")
rank, size = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
base = torch.arange(1009, dtype=torch.float32)
for label, group in (("gradcomm", None), ("gloo", gloo)):
    t = base * (rank + 1)
    dist.all_reduce(t, group=group)
    expected = base * (size * (size + 1) // 2)
    assert torch.equal(t, expected), f"rank {rank}: {label} all_reduce gave a wrong sum"
print(f"rank {rank} on {socket.gethostname()}: MASTER_ADDR={os.environ['MASTER_ADDR']}, "
      f"gradcomm and gloo sums exact", flush=True)
dist.destroy_process_group()
