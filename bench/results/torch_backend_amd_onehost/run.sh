#!/bin/bash
# AMD EPYC, 2026-11-28 (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv): torch's DDP on one host, both torches, 2 and 4 ranks, as
# bench/results/torch_backend_09f9070/run.sh measured it on Intel Xeon; dist.all_reduce at 2
# ranks on torch 2.11. run1.txt kept only the last 5 lines of each DDP run (the ratios), run2.txt
# (RUN_TXT=run2.txt) all 8.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
  PYTHONPATH=build/python
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
out=bench/results/torch_backend_amd_onehost
VARIANTS=compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp
run() { timeout 600 mpirun --oversubscribe --bind-to none "$@" 2>&1 | grep -v Warn; }
{
  lscpu | grep "Model name"
  for np in 2 4; do
    for py in /usr/bin/python3 $V; do
      echo "=== ddp cnn np$np $py"
      run -np $np $py bench/torch_ddp_bench.py --model cnn --variants $VARIANTS --steps 30 | tail -8
      echo "=== ddp mlp np$np $py"
      run -np $np $py bench/torch_ddp_bench.py --variants $VARIANTS --steps 12 | tail -8
    done
  done
  echo "=== allreduce np2 $V"
  run -np 2 $V bench/torch_allreduce_bench.py | tail -7
} >"$out/${RUN_TXT:-run.txt}"
