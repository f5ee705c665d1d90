#!/bin/bash
# AMD EPYC, 2026-11-29 (from the repository root, after scripts/test built build/ and the torch
# 2.11 venv): torch's DDP on the gradcomm backend with its buckets in torch's memory
# (torch-ddp-gradcomm) and in gradcomm's registered memory (DDP_DISABLE_COMM_MEM=0 for the
# -registered variants only: bench/torch_ddp_bench.py sets it around their steps), steps
# alternating in each launch, three launches per row; then dist.all_reduce on a tensor of
# torch's and on one the backend allocated, rounds alternating.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
  PYTHONPATH=build/python OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
out=bench/results/torch_ddp_registered
VARIANTS=compute,torch-ddp,torch-ddp-gradcomm,torch-ddp-gradcomm-registered,torch-ddp-gradcomm-registered-bucket-view,gradcomm-ddp
run() { timeout 600 mpirun --oversubscribe --bind-to none "$@" 2>&1 | grep -v Warn; }
{
  lscpu | grep "Model name"
  $V -c 'import torch; print("torch", torch.__version__)'
  for launch in 1 2 3; do
    for np in 2 4; do
      echo "=== ddp mlp np$np launch $launch"
      run -np $np $V bench/torch_ddp_bench.py --variants $VARIANTS --steps 20 \
        --json $out/ddp.jsonl | grep -v "parameters of"
      echo "=== ddp cnn np$np launch $launch"
      run -np $np $V bench/torch_ddp_bench.py --model cnn --variants $VARIANTS --steps 30 \
        --json $out/ddp.jsonl | grep -v "parameters of"
    done
  done
  for np in 2 4; do
    echo "=== allreduce np$np"
    run -np $np $V bench/torch_allreduce_bench.py --variants gradcomm,gradcomm-registered,gloo \
      --sizes 16K,256K,1M,4M,16M,64M --json $out/allreduce.jsonl
  done
} >"$out/${RUN_TXT:-run.txt}"
