#!/usr/bin/env bash
# gradcomm.torch (Horovod's API), a rank that stops calling: the job ends within GRADCOMM_TIMEOUT
# plus a few seconds, non-zero, with one watchdog report naming the rank and the name the others
# wait for.
# usage: horovod_stall_test.sh MPIEXEC PYTHON [MPIEXEC FLAGS...]
set -uo pipefail
MPIEXEC=$1
PYTHON=$2
shift 2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$SECONDS
GRADCOMM_TIMEOUT=3 timeout 90 "$MPIEXEC" "$@" -np 3 "$PYTHON" "$(dirname "$0")/horovod_stall.py" \
  1 >"$out" 2>&1
rc=$?
took=$((SECONDS - start))
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
echo "exit code $rc after $took s"
[ "$rc" -ne 0 ] || fail "exit code 0: the job was not aborted"
[ "$rc" -ne 124 ] || fail "hung until the 90 s guard"
[ "$took" -le 45 ] || fail "took $took s with GRADCOMM_TIMEOUT=3"
grep -q "not aborted" "$out" && fail "a rank finished normally"
grep -q "rank 1 is not in any collective" "$out" || fail "the report does not name rank 1"
grep -q "ranks 0,2 wait inside negotiation of allreduce 'allreduce.never-on-the-stopped-rank': not submitted by rank 1" "$out" ||
  fail "the waiting ranks and the name are not listed"
if [ "$failures" -ne 0 ]; then
  cat "$out"
  exit 1
fi
echo "gradcomm.torch stall: all checks passed"
