#!/bin/bash
# How run.txt and ddp.jsonl were made (from the repository root, after scripts/test built build/
# and the torch 2.11 venv): torch's DDP on gloo against the same DDP on the gradcomm backend,
# 2 emulated hosts (network namespaces, links shaped to 1 Gbit/s), 1 rank each, both torches.
set -u
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python \
  OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
out=bench/results/torch_backend_hosts
scripts/hosts up 2 >/dev/null && scripts/hosts shape 1gbit
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores; commit $(git rev-parse --short HEAD)"
for run in 1 2; do
  for py in $V /usr/bin/python3; do
    echo "=== run $run ddp cnn $py"
    timeout 900 scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME -- \
      $py bench/torch_ddp_bench.py --model cnn --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp \
      --steps 30 --json $out/ddp.jsonl 2>&1 | grep -v Warn | tail -6
    echo "=== run $run ddp mlp $py"
    timeout 900 scripts/mpirun-hosts 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -x GLOO_SOCKET_IFNAME -- \
      $py bench/torch_ddp_bench.py --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp \
      --steps 10 --json $out/ddp.jsonl 2>&1 | grep -v Warn | tail -6
  done
done
