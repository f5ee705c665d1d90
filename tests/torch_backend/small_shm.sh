#!/usr/bin/env bash
# small_shm.py on 2 ranks in a mount namespace of its own whose /dev/shm is a 4 MiB tmpfs (Open
# MPI's shared-memory transport keeps its files in /tmp there): passes when the script ends
# well, torch printed the backend's warning for the bucket that did not fit, and the script its
# last line. Needs root (unshare -m): without it the test reports itself skipped (exit 77).
# usage: small_shm.sh MPIEXEC PYTHON [MPIEXEC FLAGS...]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mpiexec=$1
python=$2
shift 2
if ! unshare -m true 2>/dev/null; then
  echo "SKIPPED: unshare -m needs root"
  exit 77
fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT
export OMPI_MCA_btl_vader_backing_directory=/tmp
# shellcheck disable=SC2016  # expanded by the inner shell
timeout 120 unshare -m bash -c 'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$@"' _ \
  "$mpiexec" -x OMPI_MCA_btl_vader_backing_directory "$@" -np 2 "$python" "$here/small_shm.py" \
  >"$out" 2>&1
rc=$?
cat "$out"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
((rc == 0)) || fail "exit status $rc"
grep -q "is in torch's memory, not gradcomm's registered memory" "$out" ||
  fail "no warning for the bucket that did not fit"
grep -q "small /dev/shm: buckets in torch's memory where they do not fit" "$out" ||
  fail "the script did not finish"
((failures == 0)) && echo "small /dev/shm: passed"
exit $((failures > 0))
