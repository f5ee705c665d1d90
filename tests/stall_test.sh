#!/usr/bin/env bash
# A rank that stops calling, under a Python front end: the job ends within GRADCOMM_TIMEOUT plus
# a few seconds, non-zero, with one watchdog report naming the rank (rank 1 of 3) and saying what
# the others wait inside.
# usage: stall_test.sh MPIEXEC PYTHON SCRIPT WAITING [MPIEXEC FLAGS...]
#   SCRIPT: run as `SCRIPT 1` on 3 ranks (rank 1 stops); WAITING: the report's line for ranks 0
#   and 2 ("ranks 0,2 wait inside ...").
# With STALL_SCRIPT_ARGS the script gets them after the 1, and GRADCOMM_TIMEOUT keeps its default
# (300 s): the script gives its own timeout of 3 s (torch.distributed's), which the report must
# name as STALL_TIMEOUT_TEXT says.
set -uo pipefail
MPIEXEC=$1
PYTHON=$2
SCRIPT=$3
WAITING=$4
shift 4
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$SECONDS
if [ -n "${STALL_SCRIPT_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # the arguments split on spaces
  env -u GRADCOMM_TIMEOUT timeout 90 "$MPIEXEC" "$@" -np 3 "$PYTHON" "$SCRIPT" 1 \
    $STALL_SCRIPT_ARGS >"$out" 2>&1
else
  GRADCOMM_TIMEOUT=3 timeout 90 "$MPIEXEC" "$@" -np 3 "$PYTHON" "$SCRIPT" 1 >"$out" 2>&1
fi
rc=$?
took=$((SECONDS - start))
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
echo "exit code $rc after $took s"
[ "$rc" -ne 0 ] || fail "exit code 0: the job was not aborted"
[ "$rc" -ne 124 ] || fail "hung until the 90 s guard"
[ "$took" -le 45 ] || fail "took $took s with a timeout of 3 s"
timeout_text=${STALL_TIMEOUT_TEXT:-GRADCOMM_TIMEOUT=3 s}
grep -qF "($timeout_text)" "$out" || fail "the report does not name the timeout: $timeout_text"
grep -q "not aborted" "$out" && fail "a rank finished normally"
grep -q "rank 1 is not in any collective" "$out" || fail "the report does not name rank 1"
grep -qF "$WAITING" "$out" || fail "the report lacks: $WAITING"
if [ "$failures" -ne 0 ]; then
  cat "$out"
  exit 1
fi
echo "$(basename "$SCRIPT"): all checks passed"
