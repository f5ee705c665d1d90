#!/bin/bash
# AMD EPYC, 2026-11-28 (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv): dist.all_reduce across 2 emulated hosts at 1 Gbit/s (gloo, the gradcomm backend,
# gradcomm's own call), then torch's DDP on gloo against DDP on the gradcomm backend.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python \
  OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
OUT=bench/results/torch_backend_hosts_amd
scripts/hosts up 2 >/dev/null && scripts/hosts shape 1gbit
run() { scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME -- "$@"; }
run $V bench/torch_allreduce_bench.py --sizes 1M,8M,32M --rounds 7 --iters 3 \
  >"$OUT/allreduce.txt" 2>&1
run $V bench/torch_ddp_bench.py --variants compute,torch-ddp,torch-ddp-gradcomm \
  --steps ${STEPS:-60} >"$OUT/ddp_mlp.txt" 2>&1
scripts/hosts down
