#!/usr/bin/env bash
# The real Horovod, for measuring and testing gradcomm.torch beside it: horovod 0.28.1 from PyPI,
# built from source against Open MPI (no TensorFlow, MXNet or Gloo), in a virtual environment
# made once and reused. Prints the environment's python.
#   bench/horovod/env.sh          against Debian's torch 1.13 (a venv over /usr/bin/python3)
#   bench/horovod/env.sh torch2   against the pinned torch 2.x of scripts/common.sh's venv (a
#                                 venv over /usr/bin/python3 whose path puts that torch first)
# The first run downloads the 4 MB source and compiles for about 2 minutes on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm
flavour=${1:-torch1}
case $flavour in
  torch1) VENV=${GRADCOMM_HOROVOD_VENV:-$CACHE/venv-horovod-0.28.1} ;;
  torch2)
    source "$ROOT/scripts/common.sh"
    torch2_venv >&2
    VENV=$CACHE/venv-horovod-0.28.1-torch2
    ;;
  *) echo "usage: $0 [torch1|torch2]" >&2; exit 2 ;;
esac
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
  started=$SECONDS
  echo "== building horovod 0.28.1 in $VENV (first time: about 2 minutes)" >&2
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
  if [ "$flavour" = torch2 ]; then
    # torch 2.x ahead of Debian's 1.13 on the path: .pth lines come before the system's packages
    "$TORCH2_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])' \
      >"$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/torch2.pth"
  fi
  "$VENV/bin/python" -m pip install --no-input --disable-pip-version-check -q \
    "cmake==3.31.6" "packaging" "wheel" "setuptools<70" >&2
  source=horovod==0.28.1
  if [ "$flavour" = torch2 ]; then
    # 0.28.1 compiles its torch extension as C++14, which torch 2.x's headers no longer accept:
    # PyPI's source with the standard raised to C++17, nothing else changed.
    work=$(mktemp -d)
    "$VENV/bin/python" -m pip download --no-input --disable-pip-version-check -q --no-deps \
      --no-binary :all: -d "$work" horovod==0.28.1 >&2
    tar -xzf "$work"/horovod-0.28.1.tar.gz -C "$work"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$work"/horovod-0.28.1/CMakeLists.txt "$work"/horovod-0.28.1/horovod/torch/CMakeLists.txt
    source=$work/horovod-0.28.1
  fi
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
    MAKEFLAGS="-j$(getconf _NPROCESSORS_ONLN)" PATH="$VENV/bin:$PATH" \
    "$VENV/bin/python" -m pip install --no-input --disable-pip-version-check -v \
    --no-build-isolation --no-cache-dir "$source" >&2
  echo "== horovod ready in $((SECONDS - started)) s" >&2
fi
echo "$VENV/bin/python"
