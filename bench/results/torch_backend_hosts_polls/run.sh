#!/bin/bash
# AMD EPYC, 2026-11-28 (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv): torch's DDP on gloo against DDP on the gradcomm backend across 2 emulated hosts at
# 1 Gbit/s, launches alternating between two builds of the Python module: BEFORE (a copy of
# build/python made at the commit before the change) and AFTER (build/python).
# BEFORE=/path/to/python ROUNDS=2 bench/results/torch_backend_hosts_polls/run.sh
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \
  GLOO_SOCKET_IFNAME=eth0
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
OUT=bench/results/torch_backend_hosts_polls
scripts/hosts up 2 >/dev/null && scripts/hosts shape 1gbit
run() { scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME -- "$@"; }
for round in $(seq "${ROUNDS:-2}"); do
  for build in before after; do
    if [ $build = before ]; then export PYTHONPATH=$BEFORE; else export PYTHONPATH=build/python; fi
    echo "== round $round, $build"
    run $V bench/results/torch_backend_hosts_amd/ddp_timeline.py --steps 20 2>&1 |
      grep -v socket.cpp
    run $V bench/torch_ddp_bench.py --variants compute,torch-ddp,torch-ddp-gradcomm \
      --steps ${STEPS:-60} 2>&1 | grep -v socket.cpp
  done
done >"$OUT/run.txt"
scripts/hosts down
