#!/usr/bin/env bash
# gradcomm-bench --bound runs its probes in both timings and reports a positive bound for every
# row, with results checked, and each row's bound is the rule's for its buffers and timing, from
# the parts the probes printed (GRADCOMM_BENCH_BOUND_PARTS): private buffers the smaller of local
# and half the cross-core part, registered the local part back to back and the smaller of the two
# in the cycle, each part the best of the probes before, during and after the row. (No timed assert:
# whether of_bound stays under 1 is measured in docs/benchmarking.md, not asserted.)
#
#   bench_bound_test.sh MPIEXEC BENCH
set -uo pipefail
mpiexec=$1 bench=$2
# The launcher's flags for its family (tests/CMakeLists.txt); ranks inherit the environment.
read -r -a flags <<<"${GRADCOMM_TEST_MPIEXEC_FLAGS:---oversubscribe --bind-to none}"
fail() { echo "FAIL: $*"; exit 1; }
for timing in "" --cycle; do
  for buffers in "" "--registered --inplace"; do
    # shellcheck disable=SC2086
    out=$(GRADCOMM_BENCH_BOUND_PARTS=1 "$mpiexec" -n 2 "${flags[@]}" \
      "$bench" -a shm --bound $timing \
      $buffers -b 1K -e 1M -f 32 -n 3 -w 1 --csv 2>&1) || fail "gradcomm-bench $timing $buffers: $out"
    echo "$out"
    rows=$(grep -c '^shm,' <<<"$out")
    [[ $rows == 3 ]] || fail "expected 3 shm rows, got $rows"
    # Columns (header): wrong is #15, of_bound #19, bound_busbw #27.
    awk -F, '$1 == "shm" && ($15 != 0 || !($19 > 0) || !($27 > 0)) { bad = 1; print "bad row: " $0 }
             END { exit bad }' <<<"$out" || fail "a row without a bound, or with wrong results"
    # "# bound at SIZE B: local L GB/s, cross-core C GB/s" (printed with one decimal).
    private=0 cycle=0
    [[ -z $buffers ]] && private=1
    [[ -n $timing ]] && cycle=1
    awk -F, -v private=$private -v cycle=$cycle '
      /^# bound at / { split($0, w, " "); size = w[4]; l = w[7]; c = w[10]
                       if (l > local[size]) local[size] = l
                       if (c > cross[size]) cross[size] = c; next }
      $1 == "shm" { rows[$2] = $27 }
      END {
        for (size in rows) {
          if (!(size in local)) { print "no bound parts at " size; bad = 1; continue }
          want = local[size]
          if (private) { if (cross[size] / 2 < want) want = cross[size] / 2 }
          else if (cycle && cross[size] < want) want = cross[size]
          got = rows[size]
          if (got < want - 0.06 - want / 100 || got > want + 0.06 + want / 100) {
            printf "size %s: bound %s GB/s, the rule gives %s (local %s, cross-core %s)\n",
                   size, got, want, local[size], cross[size]; bad = 1
          }
        }
        exit bad
      }' <<<"$out" || fail "a bound that is not the rule's for ${buffers:-private} buffers${timing:+ in the cycle}"
  done
done
echo "OK"
