#!/usr/bin/env bash
# Measures what docs/results/shm.md reports: shm against MPI_Allreduce (interleaved in the same
# run, malloc set so MPI reuses its temporary buffers) at 2 and 4 ranks, 1-64 MiB, private
# buffers out of place and in place (as torch's DDP and Horovod hand their buckets over) and
# registered buffers in place, back to back and in a training-like cycle
# (--cycle), each row against the bound measured right before it (--bound); then 8 B latency of
# shm, auto and halving_doubling.
# usage: [RANKS="2 4"] bench/shm_report.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail
BUILD=${1:-build}
OUT=${2:-bench/results}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for np in ${RANKS:-2 4}; do
  # Ranks that fit the cores are bound and spin (MPI too); more ranks share the cores and yield.
  if [ "$np" -le "$(nproc)" ]; then
    bind=core RUN=(mpirun)
  else
    bind=none RUN=(mpirun --oversubscribe --mca mpi_yield_when_idle 1)
  fi
  for timing in b2b cycle; do
    flag=$([ $timing = cycle ] && echo --cycle || true)
    "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" -a shm --bound $flag \
      -b 1M -e 64M -f 4 -n 15 -w 3 --csv >"$OUT/shm_np${np}_private_$timing.csv"
    "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" -a shm --bound $flag \
      -b 1M -e 64M -f 4 -n 15 -w 3 --inplace --csv >"$OUT/shm_np${np}_private_inplace_$timing.csv"
    "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" -a shm --bound $flag \
      -b 1M -e 64M -f 4 -n 15 -w 3 --registered --inplace --csv \
      >"$OUT/shm_np${np}_registered_$timing.csv"
  done
  "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" \
    -a shm,halving_doubling,auto -b 8 -e 8 -n 40 --csv >"$OUT/shm_np${np}_8B.csv"
done
