#!/bin/bash
# shm's latency path up to 2 KiB on CPUs of their own (8 KiB where ranks share them; commit
# ccddb13) against 16 KiB before (the commit before it, 1489a54), from the repository root:
# OLD=path/to/gradcomm-bench of a build of 1489a54. Launches alternate old, new, old, new with
# the same arguments; every result checked; MPI_Allreduce (malloc set to reuse its buffers) in
# every launch as the baseline.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OLD=${OLD:?gradcomm-bench of a build of 1489a54} NEW=${NEW:-build/bench/gradcomm-bench}
lscpu | grep "Model name"
sweep() {  # sweep NP MPIRUN-FLAGS -- BENCH-FLAGS
  local np=$1 flags=$2
  shift 2
  for round in 1 2; do
    for which in old new; do
      bench=$OLD
      [ $which = new ] && bench=$NEW
      echo "=== np$np round $round $which $*"
      mpirun -np "$np" $flags "$bench" -b 1K -e 32K -f 2 -a shm,auto -n 200 "$@" 2>&1 |
        grep -v "^#" | awk '{printf "%s %s %s x_mpi %s\n", $1, $5, $6, $14}'
    done
  done
}
for mode in "" "--cycle" "--registered --inplace" "--registered --inplace --cycle"; do
  sweep 2 "--bind-to core" $mode
done
sweep 4 "--oversubscribe --bind-to none" -e 64K
sweep 4 "--oversubscribe --bind-to none" -e 64K --cycle
