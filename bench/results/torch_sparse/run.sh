#!/usr/bin/env bash
# torch's DDP on a model with sparse gradients (EmbeddingBag 100000x64, sparse): gloo against
# the gradcomm backend, steps alternating; two launches per row. From the repository root, after
# a build (scripts/test or the build step of scripts/run).
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python
export OMP_NUM_THREADS=1
torch2=${TORCH2_PYTHON:-$HOME/.cache/gradcomm/venv-torch2.11/bin/python}
lscpu | grep "Model name"
git log --oneline -1
for py in /usr/bin/python3 "$torch2"; do
  "$py" -c "import torch; print('torch', torch.__version__)"
  for np in 2 4; do
    bind=(--bind-to core)
    [ "$np" -gt 2 ] && bind=(--oversubscribe --bind-to none)
    for launch in 1 2; do
      mpirun -np "$np" "${bind[@]}" "$py" bench/torch_ddp_bench.py --model embedding \
        --variants compute,torch-ddp,torch-ddp-gradcomm --steps 40 2>&1 | grep -v Warning
    done
  done
done
