#!/bin/bash
# shm's latency path against its staged path at 512 B - 32 KiB on Intel Xeon: three builds of
# the same commit that differ only in where the latency path ends (collectives/shm/segment.h):
# L16 = 16 KiB everywhere, CUR = the commit's limits (1 KiB on CPUs of their own, 8 KiB shared),
# S = 512 B and 4 KiB. Launches alternate L16, CUR, S with the same arguments; every result
# checked; MPI_Allreduce (malloc set to reuse its buffers) in every launch. Prints per launch:
# algorithm, bytes, p50 us, vs_mpi (MPI's time / this one's).
# L16=... S=... [CUR=build/bench/gradcomm-bench] [ROUNDS=3] run.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
L16=${L16:?} S=${S:?} CUR=${CUR:-build/bench/gradcomm-bench} ROUNDS=${ROUNDS:-3}
lscpu | grep "Model name"
sweep() {  # sweep NP MPIRUN-FLAGS BENCH-FLAGS...
  local np=$1 flags=$2
  shift 2
  for round in $(seq "$ROUNDS"); do
    for which in L16 CUR S; do
      bench=${!which}
      echo "=== np$np round $round $which $*"
      mpirun -np "$np" $flags "$bench" -b 512 -e 32K -f 2 -a shm -n 300 --csv "$@" 2>&1 |
        awk -F, '$1 == "shm" {printf "%s %s %s\n", $2, $11, $16} $15 != 0 && $15 != "wrong" {print "WRONG", $0}'
    done
  done
}
for mode in "" "--cycle" "--registered --inplace" "--registered --inplace --cycle"; do
  sweep 2 "--bind-to core" $mode
done
sweep 4 "--oversubscribe --bind-to none" -e 64K
sweep 4 "--oversubscribe --bind-to none" -e 64K --cycle
