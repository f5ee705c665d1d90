#!/usr/bin/env bash
# Training throughput of gradcomm-train at 1, 2 and 4 ranks: an MLP of 5.3 M parameters
# (512-2048-2048-10, 21 MB of float32 gradients per step), global batch 240, with gradcomm's
# default algorithm (auto) and with MPI_Allreduce (--algorithm mpi), alternated so that both see
# the same machine state. Prints one markdown row per run: samples/s and the share of step time
# spent in all-reduce (rank 0's wall time).
# usage: bench/train_scaling.sh [BUILD_DIR] [STEPS]
set -euo pipefail
BUILD_DIR=${1:-build}
STEPS=${2:-20}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
echo "| ranks | algorithm | samples/s | all-reduce share | compute share | ms/step |"
echo "| ---: | --- | ---: | ---: | ---: | ---: |"
for np in 1 2 4; do
  for algorithm in auto mpi; do
    [ "$np" = 1 ] && [ "$algorithm" = mpi ] && continue
    json=$(mktemp)
    mpirun --bind-to none -np "$np" "$BUILD_DIR/trainer/gradcomm-train" --features 512 \
      --hidden 2048,2048 --samples 4096 --validation 0 --batch 240 --steps "$STEPS" \
      --algorithm "$algorithm" --json "$json" >/dev/null
    python3 - "$json" "$np" "$algorithm" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
ms = 1e3 * s["seconds"] / s["steps_run"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {s['samples_per_second']:.0f} | "
      f"{100 * s['allreduce_share']:.1f}% | {100 * s['compute_share']:.1f}% | {ms:.0f} |")
PY
    rm -f "$json"
  done
done
