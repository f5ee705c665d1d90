#!/usr/bin/env bash
# Measures what the README reports for several hosts: busbw against size for hierarchical, ring,
# halving_doubling, auto and MPI_Allreduce (interleaved in the same run) on emulated hosts
# (scripts/hosts) whose links are shaped to RATE, at each LAYOUT; then plots busbw against size
# with auto's cost model, and prints a markdown table.
# usage: bench/multihost.sh [BUILD_DIR] [OUT_DIR] [RATE] [LAYOUT...]
#   defaults: build, bench/results/multihost, 1gbit, layouts 2x2 4x2 2x4
# Needs root (network namespaces); the plot needs /usr/bin/python3 with matplotlib.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-build}
OUT=${2:-bench/results/multihost}
RATE=${3:-1gbit}
shift $(($# < 3 ? $# : 3))
LAYOUTS=("$@")
((${#LAYOUTS[@]})) || LAYOUTS=(2x2 4x2 2x4)
mkdir -p "$OUT"
"$ROOT/scripts/hosts" check
trap '"$ROOT/scripts/hosts" down' EXIT
for layout in "${LAYOUTS[@]}"; do
  hosts=${layout%x*}
  "$ROOT/scripts/hosts" up "$hosts"
  "$ROOT/scripts/hosts" shape "$RATE"
  echo "== $layout, links shaped to $RATE"
  "$ROOT/scripts/mpirun-hosts" "$layout" "$BUILD/bench/gradcomm-bench" \
    -a hierarchical,ring,halving_doubling,auto -b 4K -e 64M -f 4 -n 7 -w 1 --csv \
    >"$OUT/${layout}_$RATE.csv"
  "$ROOT/scripts/hosts" status
done
/usr/bin/python3 "$ROOT/bench/plot_multihost.py" "$OUT" "$RATE" "${LAYOUTS[@]}" ||
  echo "(no plot: $?)"
