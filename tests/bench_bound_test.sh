#!/usr/bin/env bash
# gradcomm-bench --bound runs its probes in both timings and reports a positive bound for every
# row, with results checked. (No timed assert: whether of_bound stays under 1 is measured in
# docs/benchmarking.md, not asserted.)
#
#   bench_bound_test.sh MPIEXEC BENCH
set -uo pipefail
mpiexec=$1 bench=$2
fail() { echo "FAIL: $*"; exit 1; }
for timing in "" --cycle; do
  for buffers in "" "--registered --inplace"; do
    # shellcheck disable=SC2086
    out=$("$mpiexec" -n 2 --oversubscribe --bind-to none "$bench" -a shm --bound $timing \
      $buffers -b 1K -e 1M -f 32 -n 3 -w 1 --csv 2>&1) || fail "gradcomm-bench $timing $buffers: $out"
    echo "$out"
    rows=$(grep -c '^shm,' <<<"$out")
    [[ $rows == 3 ]] || fail "expected 3 shm rows, got $rows"
    # Columns (header): wrong is #15, of_bound #19, bound_busbw #27.
    awk -F, '$1 == "shm" && ($15 != 0 || !($19 > 0) || !($27 > 0)) { bad = 1; print "bad row: " $0 }
             END { exit bad }' <<<"$out" || fail "a row without a bound, or with wrong results"
  done
done
echo "OK"
