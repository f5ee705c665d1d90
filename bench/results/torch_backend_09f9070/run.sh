#!/bin/bash
# How run.txt, ddp.jsonl and ar.jsonl were made (from the repository root, after scripts/test
# built build/ and the torch 2.11 venv): each torch in turn, 2 and 4 ranks.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 PYTHONPATH=build/python
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
out=bench/results/torch_backend_09f9070
lscpu | grep "Model name"
for np in 2 4; do
  for py in /usr/bin/python3 $V; do
    echo "=== ddp cnn np$np $py"; timeout 600 mpirun --oversubscribe --bind-to none -np $np $py bench/torch_ddp_bench.py --model cnn --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp --steps 30 --json $out/ddp.jsonl 2>&1 | grep -v Warn | tail -5
    echo "=== ddp mlp np$np $py"; timeout 600 mpirun --oversubscribe --bind-to none -np $np $py bench/torch_ddp_bench.py --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp --steps 12 --json $out/ddp.jsonl 2>&1 | grep -v Warn | tail -5
    echo "=== allreduce np$np $py"; timeout 900 mpirun --oversubscribe --bind-to none -np $np $py bench/torch_allreduce_bench.py --json $out/ar.jsonl 2>&1 | grep -v Warn | tail -7
  done
done
