#!/bin/bash
# AMD EPYC, 2026-11-28 (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv): torch_ddp_bench.py across 2 emulated hosts at 1 Gbit/s once it starts
# gradcomm.torch only for variants that use it, so the backend runs as a user of
# init_process_group("gradcomm") alone has it. LAUNCHES launches of 60 steps per variant.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python \
  OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
OUT=bench/results/torch_backend_hosts_polls
scripts/hosts up 2 >/dev/null && scripts/hosts shape 1gbit
for launch in $(seq "${LAUNCHES:-2}"); do
  echo "== launch $launch"
  scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME -- \
    $V bench/torch_ddp_bench.py --variants compute,torch-ddp,torch-ddp-gradcomm \
    --steps ${STEPS:-60} 2>&1 | grep -v socket.cpp
done >"$OUT/backend_alone.txt"
scripts/hosts down
