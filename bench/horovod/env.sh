#!/usr/bin/env bash
# The real Horovod, for measuring gradcomm.torch beside it (bench/horovod/compare.sh): horovod
# 0.28.1 from PyPI, built from source against Debian's torch 1.13 and Open MPI (no TensorFlow,
# MXNet or Gloo), in a virtual environment made once and reused. Prints the environment's python.
# The first run downloads the 4 MB source and compiles for 10-20 minutes on 2 cores.
set -euo pipefail
VENV=${GRADCOMM_HOROVOD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-horovod-0.28.1}
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
  started=$SECONDS
  echo "== building horovod 0.28.1 in $VENV (first time: 10-20 minutes)" >&2
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install --no-input --disable-pip-version-check -q \
    "cmake==3.31.6" "packaging" "wheel" "setuptools<70" >&2
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
    MAKEFLAGS="-j$(nproc)" PATH="$VENV/bin:$PATH" \
    "$VENV/bin/python" -m pip install --no-input --disable-pip-version-check -v \
    --no-build-isolation --no-cache-dir "horovod[pytorch]==0.28.1" >&2
  echo "== horovod ready in $((SECONDS - started)) s" >&2
fi
echo "$VENV/bin/python"
