#!/bin/bash
# The latency path to 2 KiB on Intel (commit 3554dcc) against 1 KiB before (9bb764e), from the
# repository root: OLD=gradcomm-bench of a build of 9bb764e. 2 ranks bound to a core each,
# launches alternating old, new with the same arguments, every result checked, MPI_Allreduce in
# every launch. Prints per launch: bytes, shm's p50 us, vs_mpi.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OLD=${OLD:?} NEW=${NEW:-build/bench/gradcomm-bench} ROUNDS=${ROUNDS:-6}
lscpu | grep "Model name"
for mode in "" "--cycle" "--registered --inplace" "--registered --inplace --cycle"; do
  for round in $(seq "$ROUNDS"); do
    for which in OLD NEW; do
      echo "=== np2 round $round $which $mode"
      # shellcheck disable=SC2086
      mpirun -np 2 --bind-to core "${!which}" -b 1K -e 4K -f 2 -a shm -n 400 --csv $mode 2>&1 |
        awk -F, '$1 == "shm" {printf "%s %s %s\n", $2, $11, $16} $15 != 0 && $15 != "wrong" {print "WRONG", $0}'
    done
  done
done
