#!/usr/bin/env bash
# Valgrind (memcheck) on small runs of the optimised build: no invalid read or write, no use of
# uninitialised memory, no definite leak in gradcomm's code (Open MPI's own allocations at
# init/finalize are suppressed by tests/sanitizer/valgrind.supp and Open MPI's file).
#  - no MPI: the trainer's unit tests and the fuzz corpora through the parsers;
#  - under mpirun at 2 and 3 ranks: every host algorithm over sizes 8 B - 256 KiB with results
#    checked (gradcomm-bench), and data-parallel training with checkpoints (gradcomm-train).
# usage: valgrind_test.sh BUILD_DIR SOURCE_DIR MPIEXEC
set -uo pipefail
BUILD=$1
SRC=$2
MPIEXEC=$3
RUN=("$MPIEXEC" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
VG=(valgrind -q --error-exitcode=97 --leak-check=full --show-leak-kinds=definite
    --errors-for-leak-kinds=definite --num-callers=40
    --suppressions=/usr/share/openmpi/openmpi-valgrind.supp
    --suppressions="$SRC/tests/sanitizer/valgrind.supp")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failures=0
run() {
  local name=$1
  shift
  local started=$SECONDS
  if "$@" >"$WORK/$name.log" 2>&1; then
    echo "ok   $name ($((SECONDS - started)) s)"
  else
    echo "FAIL $name (exit $?):"
    grep -E "==[0-9]+==" "$WORK/$name.log" | head -60
    tail -5 "$WORK/$name.log"
    failures=$((failures + 1))
  fi
}
run trainer_unit "${VG[@]}" "$BUILD/tests/test_trainer_unit"
for t in checkpoint tuning_table workload; do
  run "fuzz_corpus_$t" "${VG[@]}" "$BUILD/fuzz/fuzz_$t" "$SRC/fuzz/corpus/$t"
done
ALGORITHMS=ring,halving_doubling,flat,hierarchical,shm,auto
for np in 2 3; do
  run "bench_np$np" "${RUN[@]}" -np "$np" "${VG[@]}" "$BUILD/bench/gradcomm-bench" \
    -b 8 -e 256K -f 32 -n 2 -w 1 -c 1 --explore 0.2 -a "$ALGORITHMS"
done
run train_np2 "${RUN[@]}" -np 2 "${VG[@]}" "$BUILD/trainer/gradcomm-train" --steps 30 \
  --hidden 16 --samples 512 --batch 32 --optimizer adam --checkpoint-dir "$WORK/ckpt" \
  --checkpoint-every 10 --verify-every 10 --log-every 10
if [ "$failures" -ne 0 ]; then
  echo "$failures run(s) with valgrind errors"
  exit 1
fi
echo "valgrind: no errors"
