#!/usr/bin/env bash
# The stall watchdog (GRADCOMM_TIMEOUT): a rank that never arrives, or ranks that disagree on the
# order of calls with the consistency check off, end the job within the timeout plus a few
# seconds, with a non-zero exit code and one report on rank 0 naming the missing rank.
# usage: watchdog_test.sh MPIEXEC WATCHDOG_HELPER
set -uo pipefail
MPIEXEC=$1
HELPER=$2
RUN=("$MPIEXEC" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# run NAME NP ARGS...: runs the helper with GRADCOMM_TIMEOUT=3 under a 60 s guard.
run() {
  local name=$1 np=$2
  shift 2
  local start=$SECONDS
  GRADCOMM_TIMEOUT=3 timeout 60 "${RUN[@]}" -np "$np" "$HELPER" "$@" >"$WORK/$name" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  echo "$name: exit code $rc after ${took} s"
  [ "$rc" -ne 0 ] || fail "$name: exit code 0 (the job was not aborted)"
  [ "$rc" -ne 124 ] || fail "$name: hung until the 60 s guard"
  [ "$took" -le 30 ] || fail "$name: took ${took} s (timeout 3 s)"
  grep -q "not aborted" "$WORK/$name" && fail "$name: a rank finished normally"
  [ "$(grep -c 'watchdog report' "$WORK/$name")" -eq 1 ] || fail "$name: not exactly one report"
}

run missing2 3 missing 2
grep -q "rank 2 is not in any collective (newest call: #2) - it never arrived at call #3" \
  "$WORK/missing2" || fail "missing2: the missing rank is not named: $(cat "$WORK/missing2")"
grep -q "ranks 0,1 wait inside allreduce #3: 1000 x float32 max, algorithm ring" "$WORK/missing2" || fail "missing2: waiting ranks not listed"

# Rank 0 itself is the one missing: rank 1 times out and asks rank 0's watchdog for the report.
run missing0 4 missing 0
grep -q "rank 0 is not in any collective (newest call: #2) - it never arrived at call #3" \
  "$WORK/missing0" || fail "missing0: rank 0 not named: $(cat "$WORK/missing0")"

# The same for a request: the ranks that submitted it wait in it on their progress engines.
run unsubmitted1 3 unsubmitted 1
grep -q "rank 1 is not in any collective (newest call: #2) - it never arrived at call #3" \
  "$WORK/unsubmitted1" || fail "unsubmitted1: the missing rank is not named: $(cat "$WORK/unsubmitted1")"
grep -q "ranks 0,2 wait inside allreduce #3: 1000 x float32 max, algorithm ring" \
  "$WORK/unsubmitted1" || fail "unsubmitted1: waiting ranks not listed"

GRADCOMM_CHECK=off run order 3 order
grep -q "different calls" "$WORK/order" || fail "order: no verdict on the call order: $(cat "$WORK/order")"
grep -q "rank 1 waits inside broadcast #3" "$WORK/order" || fail "order: rank 1's call not named"
grep -q "running   broadcast #3" "$WORK/order" || fail "order: rank 1's broadcast not shown"
grep -q "running   allreduce #3" "$WORK/order" || fail "order: the others' allreduce not shown"

# The first calls on two communicators: rank 0 on one, ranks 1 and 2 on the other. Each
# communicator's first call builds its state collectively; the watchdog sees the call from
# before that: the report names what the ranks missing on one communicator wait in on the other.
run communicators 3 communicators
other="it waits inside allreduce #0: 1000 x float32 sum, algorithm auto on another communicator"
grep -q "rank 1 is in no collective of this communicator (newest call: none): $other" \
  "$WORK/communicators" || fail "communicators: rank 1's other call not named"
grep -q "disagree on which communicator" "$WORK/communicators" ||
  fail "communicators: no verdict on the communicators"

if [ "$failures" -ne 0 ]; then
  for f in "$WORK"/*; do echo "== $(basename "$f")"; cat "$f"; done
  echo "$failures failure(s)"
  exit 1
fi
echo "watchdog: all checks passed"
