#!/bin/bash
# shm in two builds, OLD and NEW (a change to the call's path: README.md here says which),
# launches alternating with the same arguments, 2 ranks bound to a core
# each, private and registered, back to back and in the cycle; every result checked, MPI_Allreduce
# (malloc set to reuse its buffers) in every launch. Prints per launch: bytes, shm's p50 us,
# vs_mpi (MPI's time / shm's).
# OLD=... [NEW=build/bench/gradcomm-bench] [ROUNDS=3] [SIZES="-b 512 -e 16M -f 4"] run.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OLD=${OLD:?} NEW=${NEW:-build/bench/gradcomm-bench} ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-"-b 512 -e 16M -f 4"}
lscpu | grep "Model name"
for mode in "" "--cycle" "--registered --inplace" "--registered --inplace --cycle"; do
  for round in $(seq "$ROUNDS"); do
    for which in OLD NEW; do
      echo "=== np2 round $round $which ${mode:-private}"
      # shellcheck disable=SC2086
      mpirun -np 2 --bind-to core "${!which}" $SIZES -a shm -n 51 --csv $mode 2>&1 |
        awk -F, '$1 == "shm" {printf "%s %s %s\n", $2, $11, $16}
                 $15 != 0 && $15 != "wrong" {print "WRONG", $0}'
    done
  done
done
