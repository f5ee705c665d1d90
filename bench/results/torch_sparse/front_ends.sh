#!/usr/bin/env bash
# The sparse-gradient model on every PyTorch front end: torch's DDP over gloo and over the
# gradcomm backend, and gradcomm.torch's DDP wrapper and DistributedOptimizer (which reduce the
# table's gradient densely in their buckets). 2 ranks bound to a core each, both torches.
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=build/python
export OMP_NUM_THREADS=1
torch2=${TORCH2_PYTHON:-$HOME/.cache/gradcomm/venv-torch2.11/bin/python}
lscpu | grep "Model name"
git log --oneline -1
for py in /usr/bin/python3 "$torch2"; do
  "$py" -c "import torch; print('torch', torch.__version__)"
  mpirun -np 2 --bind-to core "$py" -W ignore::UserWarning bench/torch_ddp_bench.py \
    --model embedding --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp,gradcomm-hvd \
    --steps 30 2>&1
done
