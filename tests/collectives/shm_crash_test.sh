#!/usr/bin/env bash
# A rank killed (SIGKILL) in the middle of shm all-reduces on registered and private buffers: the
# job ends non-zero within the time limit (no hang), and no shared-memory file is left in
# /dev/shm (segments are unlinked as soon as every rank has mapped them).
# usage: shm_crash_test.sh MPIEXEC HELPER
set -uo pipefail
MPIEXEC=$1
HELPER=$2
RUN=("$MPIEXEC" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
segments() { ls /dev/shm 2>/dev/null | grep '^gradcomm-' | sort; }
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

before=$(segments)
for np in 2 4; do
  start=$(date +%s)
  timeout 120 "${RUN[@]}" -np $np "$HELPER" >/tmp/shm_crash.$$ 2>&1
  rc=$?
  elapsed=$(($(date +%s) - start))
  [ $rc -eq 0 ] && fail "np=$np: the job exited 0 although a rank was killed"
  [ $rc -eq 124 ] && fail "np=$np: the job hung (killed by timeout after 120 s)"
  grep -q "no rank was killed" /tmp/shm_crash.$$ && fail "np=$np: a rank finished the loop"
  echo "np=$np: exit code $rc after ${elapsed} s"
  after=$(segments)
  [ "$before" = "$after" ] || fail "np=$np: /dev/shm changed: before [$before] after [$after]"
done
rm -f /tmp/shm_crash.$$
[ $failures -eq 0 ] && echo "PASS" || exit 1
