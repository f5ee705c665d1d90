#!/usr/bin/env bash
# Measures what docs/results/mpi-preload.md reports. The same unmodified MPI program
# (mpi-allreduce-bench, MPI only) runs plain and with libgradcomm_mpi.so preloaded, and
# gradcomm-bench measures auto natively; the three alternate, REPS times, at 2 and 4 ranks, 4 B to
# 64 MiB. Open MPI's baseline runs with glibc's malloc set so that MPI_Allreduce reuses its
# temporary buffers (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_ huge), and once per repetition at
# 2 ranks with glibc's defaults. gradcomm-bench runs auto alone (--no-baseline), as the preloaded
# program runs it. At 2 ranks, plain and preloaded also run a training-like cycle (--cycle). Then
# bench/mpi_preload_report.py prints the tables.
# usage: [RANKS="2 4"] [REPS=5] bench/mpi_preload_report.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail
BUILD=${1:-build}
OUT=${2:-bench/results/mpi_preload}
mkdir -p "$OUT"
rm -f "$OUT"/*.csv
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PRELOAD=$(realpath "$BUILD/bindings/mpi/libgradcomm_mpi.so")
FAIR=(-x MALLOC_MMAP_MAX_=0 -x MALLOC_TRIM_THRESHOLD_=1000000000000)
SIZES=(-b 4 -e 64M -f 4)
for rep in $(seq 1 "${REPS:-5}"); do
  for np in ${RANKS:-2 4}; do
    # Ranks that fit the cores are bound and spin (MPI too); more ranks share the cores and yield.
    if [ "$np" -le "$(nproc)" ]; then
      RUN=(mpirun -np "$np" --bind-to core)
    else
      RUN=(mpirun -np "$np" --bind-to none --oversubscribe --mca mpi_yield_when_idle 1)
    fi
    "${RUN[@]}" "${FAIR[@]}" "$BUILD/bench/mpi-allreduce-bench" "${SIZES[@]}" -n 11 -w 20 --csv \
      >"$OUT/plain_np${np}_rep${rep}.csv"
    "${RUN[@]}" "${FAIR[@]}" -x LD_PRELOAD="$PRELOAD" "$BUILD/bench/mpi-allreduce-bench" \
      "${SIZES[@]}" -n 11 -w 20 --csv >"$OUT/preload_np${np}_rep${rep}.csv"
    "${RUN[@]}" "$BUILD/bench/gradcomm-bench" -a auto --no-baseline "${SIZES[@]}" -n 11 -w 20 \
      --csv >"$OUT/native_np${np}_rep${rep}.csv"
    if [ "$np" = 2 ]; then
      "${RUN[@]}" "$BUILD/bench/mpi-allreduce-bench" -b 1M -e 64M -f 4 -n 5 -w 3 --csv \
        >"$OUT/plaindefault_np${np}_rep${rep}.csv"
      "${RUN[@]}" "${FAIR[@]}" "$BUILD/bench/mpi-allreduce-bench" -b 1M -e 64M -f 4 -n 11 -w 3 \
        --cycle --csv >"$OUT/plaincycle_np${np}_rep${rep}.csv"
      "${RUN[@]}" "${FAIR[@]}" -x LD_PRELOAD="$PRELOAD" "$BUILD/bench/mpi-allreduce-bench" \
        -b 1M -e 64M -f 4 -n 11 -w 3 --cycle --csv >"$OUT/preloadcycle_np${np}_rep${rep}.csv"
    fi
  done
done
"${GRADCOMM_PYTHON:-/usr/bin/python3}" "$(dirname "$0")/mpi_preload_report.py" "$OUT"
