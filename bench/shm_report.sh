#!/usr/bin/env bash
# Measures what the README reports for shm: busbw against size for shm, ring and MPI_Allreduce
# (interleaved in the same run) at 2 and 4 ranks, with STREAM measured in the same run for the
# memory-traffic bound, plus registered in-place buffers; then plots busbw vs size.
# usage: bench/shm_report.sh [BUILD_DIR] [OUT_DIR]   (plot needs /usr/bin/python3 + matplotlib)
set -euo pipefail
BUILD=${1:-build}
OUT=${2:-bench/results}
mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RUN=(mpirun --oversubscribe --mca mpi_yield_when_idle 1)
for np in 2 4; do
  bind=$([ "$np" -le "$(nproc)" ] && echo core || echo none)
  "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" -a shm,ring --stream \
    -b 4 -e 64M -f 4 -n 15 -w 3 --csv >"$OUT/shm_np$np.csv"
  "${RUN[@]}" -np $np --bind-to $bind "$BUILD/bench/gradcomm-bench" -a shm,ring --stream \
    -b 4 -e 64M -f 8 -n 15 -w 3 --registered --inplace --csv >"$OUT/shm_np${np}_registered.csv"
done
/usr/bin/python3 "$(dirname "$0")/plot_busbw.py" "$OUT" || echo "(no plot: $?)"
