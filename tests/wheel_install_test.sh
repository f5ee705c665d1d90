#!/usr/bin/env bash
# pip install . into a fresh virtual environment over Debian's Python (its torch, NumPy and
# mpi4py), built without isolation so the torch backend finds torch: then, without PYTHONPATH,
# gradcomm imports from the environment, the wheel holds libgradcomm.so, and torch's DDP trains
# on init_process_group("gradcomm") at 2 ranks.
# usage: wheel_install_test.sh SOURCE_DIR MPIEXEC PYTHON [MPIEXEC FLAGS...]
set -euo pipefail
SOURCE=$1
MPIEXEC=$2
PYTHON=$3
shift 3
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check --no-input \
  scikit-build-core==1.1.2
(cd "$WORK" && "$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check --no-input \
  --no-build-isolation --config-settings "build-dir=$WORK/build" "$SOURCE")
unset PYTHONPATH
where=$(cd "$WORK" && "$WORK/venv/bin/python" -c "import gradcomm, os; print(os.path.dirname(gradcomm.__file__))")
case $where in "$WORK"/venv/*) ;; *) echo "FAIL: gradcomm imported from $where"; exit 1 ;; esac
ls "$where"/lib/libgradcomm.so* >/dev/null
ls "$where"/_c10d_torch*.so >/dev/null
cat >"$WORK/ddp.py" <<'PY'
import torch
import torch.distributed as dist
import gradcomm.torch  # noqa: F401
dist.init_process_group("gradcomm")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 3))
x = torch.full((4, 8), float(dist.get_rank() + 1))
model(x).sum().backward()
# The gradient of the bias is the batch size on every rank, averaged: 4.
assert torch.allclose(model.module.bias.grad, torch.full((3,), 4.0)), model.module.bias.grad
w = model.module.weight.grad  # mean over ranks of 4 * (rank + 1) in every entry
assert torch.allclose(w, torch.full_like(w, 4.0 * (dist.get_world_size() + 1) / 2)), w
print(f"rank {dist.get_rank()}: wheel ok", flush=True)
PY
(cd "$WORK" && "$MPIEXEC" "$@" -np 2 "$WORK/venv/bin/python" "$WORK/ddp.py")
echo "wheel install: all checks passed"
