#!/usr/bin/env bash
# small_shm.py on 2 ranks in a mount namespace of its own whose /dev/shm is a 1 MiB tmpfs (Open
# MPI's shared-memory transport keeps its files in /tmp there). Needs root (unshare -m): without
# it the test reports itself skipped (exit 77).
# usage: small_shm.sh MPIEXEC PYTHON [MPIEXEC FLAGS...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mpiexec=$1
python=$2
shift 2
if ! unshare -m true 2>/dev/null; then
  echo "SKIPPED: unshare -m needs root"
  exit 77
fi
export OMPI_MCA_btl_vader_backing_directory=/tmp
# shellcheck disable=SC2016  # expanded by the inner shell
exec unshare -m bash -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"' _ \
  "$mpiexec" -x OMPI_MCA_btl_vader_backing_directory "$@" -np 2 "$python" "$here/small_shm.py"
