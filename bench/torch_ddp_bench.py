"""Step time of gradcomm's PyTorch front ends against torch's DDP with gloo, in one run, the
variants' steps alternated so all see the same machine state:

  compute        the model alone, no communication (what exposed communication is measured from)
  gradcomm-ddp   gradcomm.torch.DistributedDataParallel
  horovod        horovod.torch.DistributedOptimizer (the real Horovod; bench/horovod/env.sh)
  horovod-scoped the same, with Horovod initialized only around its own steps (its background
                 thread otherwise takes CPU time from every other variant's steps too)
  gradcomm-ddp-bucket-view  the same with gradient_as_bucket_view=True (gradients produced in
                 the buckets' registered memory: nothing packed or unpacked)
  gradcomm-hvd   gradcomm.torch.DistributedOptimizer (Horovod's API)
  torch-ddp      torch.nn.parallel.DistributedDataParallel, gloo backend
  torch-ddp-gradcomm  torch.nn.parallel.DistributedDataParallel on the gradcomm backend
                 (torch.distributed's "gradcomm": the same DDP as torch-ddp, another backend)
  torch-ddp-nccl torch's DDP on torch's own nccl backend (--device cuda)
  torch-ddp-gradcomm-registered  the same with DDP_DISABLE_COMM_MEM=0 (torch 2.x): DDP takes its
                 buckets from the backend, which gives them gradcomm's registered memory (shm
                 reduces them in place); -bucket-view adds gradient_as_bucket_view=True

With --device cuda (torch 2.x on a GPU machine) the model and batches live on the GPU and a step
ends with torch.cuda.synchronize(); run compute,torch-ddp-nccl,torch-ddp-gradcomm there (the
gradcomm.torch front ends take CPU tensors). Ranks sharing one GPU get their own NCCL_HOSTID, so
that both backends' NCCL communicators connect them over NCCL's socket transport alike.

    PYTHONPATH=build/python mpirun -np 2 /usr/bin/python3 bench/torch_ddp_bench.py
    scripts/hosts up 2 && scripts/hosts shape 1gbit && \\
        PYTHONPATH=build/python GLOO_SOCKET_IFNAME=eth0 scripts/mpirun-hosts 2x1 -- \\
        /usr/bin/python3 bench/torch_ddp_bench.py

A step is: zero_grad, forward, backward, optimizer step (SGD with momentum), each rank on its own
batch; ranks start every step together (a barrier outside the timing). Each timed step follows
an untimed step of the same variant (the lead-in; --no-lead-in drops it), so that no variant is
timed right after another one's step, as gradcomm-bench's rounds do (docs/benchmarking.md).
Rank 0 prints the median step time and range of each variant, each front end's ratio to
torch-ddp, and the exposed communication ((step - compute) / step); --json appends one JSON
object per run to a file.
--model embedding is an EmbeddingBag (sparse gradients, which DDP reduces as sparse tensors)
under a small MLP (gradcomm.torch's front ends reduce its gradient densely: slow, they warn).
The default model is an MLP 1024-2048-2048-1024-10 (8.4 M parameters, 33.6 MB of gradients),
batch 32 per rank: with Debian's torch (generic BLAS, one thread) its backward takes about
200 ms here, and its gradients' all-reduce about 285 ms at 1 Gbit/s.
"""

import argparse
import contextlib
import fcntl
import json
import os
import socket
import statistics
import struct
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import gradcomm.torch as hvd
from torch_device import bench_device

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", choices=["mlp", "cnn", "embedding"], default="mlp",
                    help="mlp: --layers; cnn: examples/torch_digits.py's CNN on 8x8 images")
parser.add_argument("--layers", default="1024,2048,2048,1024,10", help="MLP widths")
parser.add_argument("--batch", type=int, default=32, help="per rank")
parser.add_argument("--vocabulary", type=int, default=100000,
                    help="rows of the embedding model's table (--model embedding)")
parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--variants", default="compute,gradcomm-ddp,gradcomm-hvd,torch-ddp")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--algorithm", default=None, help="gradcomm algorithm (default: auto)")
parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="bucket cap of every variant (DDP's bucket_cap_mb; the optimizer's "
                         "fusion threshold)")
parser.add_argument("--gradcomm-bucket-cap-mb", type=float, default=None,
                    help="bucket cap of the gradcomm variants alone (default: --bucket-cap-mb)")
parser.add_argument("--json", default=None, help="append the results to this file")
parser.add_argument("--save-params", default=None, metavar="DIR",
                    help="rank 0 saves each variant's final parameters to DIR/<model>_np<ranks>_"
                         "h<hosts>_<variant>.pt (to compare variants timed in separate launches)")
parser.add_argument("--no-lead-in", dest="lead_in", action="store_false",
                    help="no untimed step of a variant before its timed one (then each timed step "
                         "follows another variant's step, always the same one)")
args = parser.parse_args()
gradcomm_cap_mb = (args.bucket_cap_mb if args.gradcomm_bucket_cap_mb is None
                   else args.gradcomm_bucket_cap_mb)

torch.set_num_threads(1)  # one core per rank
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
variants = args.variants.split(",")
# gradcomm.torch's Horovod-style API starts only where a variant uses it: its negotiation thread
# then cycles through every variant's steps (idle, one small all-gather every 1-5 ms), and across
# hosts those cycles share MPI with the gradcomm backend (docs/results/torch.md, "Two threads
# that polled too often").
if any(name.startswith("gradcomm-") for name in variants):
    hvd.init()
cuda = args.device == "cuda"
device = bench_device(args.device, rank)
device_ids = [device] if cuda else None


def interface_address(name):
    """The IPv4 address of network interface `name` (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])


def init_gloo():
    ifname = os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    address, port = None, None
    if rank == 0:
        address = interface_address(ifname)
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
    address, port = world.bcast((address, port), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=size)


widths = [int(w) for w in args.layers.split(",")]


def make_model():
    torch.manual_seed(1)
    if args.model == "embedding":  # sparse gradients: DDP reduces the embedding's as sparse
        return torch.nn.Sequential(
            torch.nn.EmbeddingBag(args.vocabulary, 64, mode="mean", sparse=True),
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    if args.model == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 10))
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def sgd(params):  # (no momentum for sparse gradients)
    return torch.optim.SGD(params, lr=1e-3, momentum=0 if args.model == "embedding" else 0.9)


@contextlib.contextmanager
def bucket_memory(name):
    """DDP asks the backend for its bucket memory where DDP_DISABLE_COMM_MEM=0, when it makes
    its buckets (at construction, and again at its second step): set for the -registered
    variants while they build and step, unset for the others."""
    saved = os.environ.get("DDP_DISABLE_COMM_MEM")
    os.environ["DDP_DISABLE_COMM_MEM"] = "0" if "-registered" in name else "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DDP_DISABLE_COMM_MEM")
        else:
            os.environ["DDP_DISABLE_COMM_MEM"] = saved


runs = {}
for name in variants:
    model = make_model().to(device)
    if name == "compute":
        runs[name] = (model, sgd(model.parameters()))
    elif name == "gradcomm-ddp":
        ddp = hvd.DistributedDataParallel(model, algorithm=args.algorithm,
                                          bucket_cap_mb=gradcomm_cap_mb)
        runs[name] = (ddp, sgd(ddp.parameters()))
    elif name in ("gradcomm-ddp-bucket-view", "gradcomm-ddp-bucket-view-no-overlap"):
        # Gradients produced in bucket memory: nothing copied.
        ddp = hvd.DistributedDataParallel(model, algorithm=args.algorithm,
                                          bucket_cap_mb=gradcomm_cap_mb,
                                          gradient_as_bucket_view=True,
                                          overlap=not name.endswith("-no-overlap"))
        runs[name] = (ddp, sgd(ddp.parameters()))
    elif name == "gradcomm-ddp-no-overlap":
        ddp = hvd.DistributedDataParallel(model, algorithm=args.algorithm, overlap=False,
                                          bucket_cap_mb=gradcomm_cap_mb)
        runs[name] = (ddp, sgd(ddp.parameters()))
    elif name in ("gradcomm-hvd", "gradcomm-hvd-no-negotiator"):
        # -no-negotiator: the same optimizer, with gradcomm.torch's negotiator closed before
        # its lead-in step; its first call makes a new one. So it compares a fresh negotiator
        # with one that cycled through the other variants' steps (not a step without one).
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       algorithm=args.algorithm,
                                       fusion_threshold=int(gradcomm_cap_mb * (1 << 20)))
        runs[name] = (model, opt)
    elif name == "horovod-scoped":
        # The same, with Horovod running only around its own steps: hvd.init() before its
        # lead-in step, hvd.shutdown() after its timed one. Once initialized, Horovod's
        # background thread runs its negotiation cycle until shutdown, taking CPU time from
        # whatever else the process does; scoped, the other variants' steps do not pay for it,
        # and Horovod's own steps still do.
        import horovod.torch as real_hvd
        real_hvd.init()
        real_hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = real_hvd.DistributedOptimizer(sgd(model.parameters()),
                                            named_parameters=model.named_parameters())
        real_hvd.shutdown()
        runs[name] = (model, opt)
    elif name == "horovod":  # the real Horovod (bench/horovod/env.sh builds it), its defaults
        import horovod.torch as real_hvd
        real_hvd.init()
        real_hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = real_hvd.DistributedOptimizer(sgd(model.parameters()),
                                            named_parameters=model.named_parameters())
        runs[name] = (model, opt)
    elif name == "torch-ddp":
        if not dist.is_initialized():
            init_gloo()
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        runs[name] = (ddp, sgd(ddp.parameters()))
    elif name in ("torch-ddp-gradcomm", "torch-ddp-nccl", "torch-ddp-gradcomm-registered",
                  "torch-ddp-gradcomm-registered-bucket-view"):
        if not dist.is_initialized():
            init_gloo()
        group = dist.new_group(backend=name.split("-")[2])
        with bucket_memory(name):
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=args.bucket_cap_mb, process_group=group,
                device_ids=device_ids, gradient_as_bucket_view=name.endswith("-bucket-view"))
        runs[name] = (ddp, sgd(ddp.parameters()))
    else:
        raise SystemExit(f"unknown variant {name}")

g = torch.Generator().manual_seed(rank)
shape = (args.batch, 1, 8, 8) if args.model == "cnn" else (args.batch, widths[0])
if args.model == "embedding":  # a bag of 20 indices per sample
    x = torch.randint(0, args.vocabulary, (args.batch, 20), generator=g).to(device)
else:
    x = torch.randn(*shape, generator=g).to(device)
y = torch.randint(0, widths[-1] if args.model == "mlp" else 10, (args.batch,), generator=g)
y = y.to(device)
loss_fn = torch.nn.CrossEntropyLoss()
times = {name: [] for name in runs}


def train_step(model, opt):
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize()


for step in range(args.warmup + args.steps):
    for name, (model, opt) in runs.items():
        if name.endswith("-no-negotiator"):
            hvd._close_negotiators()
        if name == "horovod-scoped":
            real_hvd.init()
        if args.lead_in:  # untimed: the timed step follows a step of its own variant
            world.Barrier()
            with bucket_memory(name):
                train_step(model, opt)
        world.Barrier()
        with bucket_memory(name):
            t0 = time.perf_counter()
            train_step(model, opt)
            elapsed = time.perf_counter() - t0
        if name.endswith("-no-negotiator"):
            hvd._negotiator(hvd.world())
        if name == "horovod-scoped":
            real_hvd.shutdown()
        if step >= args.warmup:
            times[name].append(elapsed)

hosts = len(set(world.allgather(socket.gethostname())))
# A step is as slow as its slowest rank.
slowest = {name: [max(v) for v in zip(*world.allgather(t))] for name, t in times.items()}
if rank == 0:
    params = sum(p.numel() for p in make_model().parameters())
    what = {"cnn": "CNN (digits)", "mlp": f"MLP {args.layers}",
            "embedding": f"EmbeddingBag {args.vocabulary}x64 (sparse) + MLP 64-256-10"}[args.model]
    print(f"{size} ranks ({hosts} hosts), {what} ({params / 1e6:.2f} M "
          f"parameters, {4 * params / 1e6:.1f} MB of gradients), batch {args.batch} per rank, "
          f"{args.steps} steps per variant, alternated"
          f"{', each after an untimed one of its own' if args.lead_in else ', no lead-in'}; "
          f"buckets {args.bucket_cap_mb:g} MiB "
          f"(gradcomm's {gradcomm_cap_mb:g}); gradcomm "
          f"algorithm {args.algorithm or os.environ.get('GRADCOMM_ALGORITHM', 'auto')}")
    med = {name: statistics.median(t) for name, t in slowest.items()}
    result = {"ranks": size, "hosts": hosts, "model": what,
              "batch": args.batch, "steps": args.steps, "bucket_cap_mb": args.bucket_cap_mb,
              "gradcomm_bucket_cap_mb": gradcomm_cap_mb,
              "algorithm": args.algorithm or os.environ.get("GRADCOMM_ALGORITHM", "auto"),
              "lead_in": args.lead_in, "variants": {}}
    for name, t in slowest.items():
        line = (f"  {name:24s} median {1e3 * med[name]:8.1f} ms  range {1e3 * min(t):7.1f}-"
                f"{1e3 * max(t):7.1f}")
        entry = {"median_ms": 1e3 * med[name], "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)}
        if "compute" in med and name != "compute":
            exposed = max(0.0, (med[name] - med["compute"]) / med[name])
            line += f"  exposed comm {100 * exposed:5.1f}%"
            entry["exposed"] = exposed
        if "torch-ddp-nccl" in med and name.startswith("torch-ddp-gradcomm"):
            line += f"  / torch-ddp-nccl {med[name] / med['torch-ddp-nccl']:.2f}"
            entry["vs_torch_ddp_nccl"] = med[name] / med["torch-ddp-nccl"]
        if "torch-ddp" in med and (name.startswith("gradcomm") or
                                  name.startswith("torch-ddp-gradcomm")):
            line += f"  / torch-ddp {med[name] / med['torch-ddp']:.2f}"
            entry["vs_torch_ddp"] = med[name] / med["torch-ddp"]
        reference = "horovod" if "horovod" in med else "horovod-scoped"
        if reference in med and name.startswith("gradcomm"):
            line += f"  / {reference} {med[name] / med[reference]:.2f}"
            entry["vs_horovod"] = med[name] / med[reference]
        result["variants"][name] = entry
        print(line)
    # Every variant took the same steps from the same start on the same data: they end with
    # the same parameters, up to float rounding (the reduction orders differ).
    finals = {name: torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()])
              for name, (m, _) in runs.items() if name != "compute"}
    if args.save_params:
        os.makedirs(args.save_params, exist_ok=True)
        for name, v in finals.items():
            torch.save(v, os.path.join(args.save_params,
                                       f"{args.model}_np{size}_h{hosts}_{name}.pt"))
    if finals:
        ref_name, ref = next(iter(finals.items()))
        for name, v in finals.items():
            diff = (v - ref).abs().max().item()
            print(f"  parameters of {name} vs {ref_name}: max difference {diff:.2e}")
            result["variants"][name]["max_param_diff"] = diff
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
