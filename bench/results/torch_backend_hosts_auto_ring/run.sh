#!/bin/bash
# The rows of README.md (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv); GRADCOMM_ALGORITHM=ring for the ring rows, --steps 40 for the long auto row.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python \
  OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
scripts/hosts up 2 >/dev/null && scripts/hosts shape 1gbit
scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME \
  ${GRADCOMM_ALGORITHM:+-x GRADCOMM_ALGORITHM} -- $V bench/torch_ddp_bench.py \
  --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp --steps ${STEPS:-10}
scripts/hosts down
