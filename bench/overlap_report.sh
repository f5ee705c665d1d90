#!/usr/bin/env bash
# Measures what docs/results/overlap.md reports: gradcomm-train's step time with the gradient
# all-reduce overlapped with backward (--overlap on) against the same buckets reduced after
# backward (--overlap off), runs alternating, on 2 emulated hosts at 1 Gbit/s (1 rank each) and
# on one host (2 ranks); prints each run and the medians, ranges and ratio per setting.
# The model: an MLP of 8.4 M parameters (1024-2048-2048-1024-10), batch 512, whose 33.6 MB of
# gradients take about as long to all-reduce over the emulated link as backward takes.
# BATCH (default 512) sets the global batch: pick it so that backward and the all-reduce take
# about as long (a timeline shows both), since the link's speed sets the all-reduce's time.
# usage: [PAIRS=4] [BATCH=512] [SETTINGS="hosts:ring:4194304 ..."] bench/overlap_report.sh [BUILD_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$ROOT/build}
PAIRS=${PAIRS:-4}
SETTINGS=${SETTINGS:-"hosts:halving_doubling:4194304 hosts:ring:4194304 hosts:auto:26214400 local:auto:26214400"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Each run: 9 steps, a line each; the first (connections made, caches cold) is left out and the
# run's figure is the median of the other 8 steps.
MODEL=(--model mlp --hidden 2048,2048,1024 --features 1024 --samples 4096 --batch "${BATCH:-512}" --steps 9
       --log-every 1)

hosts_ready=0
for setting in $SETTINGS; do
  IFS=: read -r where algorithm bucket <<<"$setting"
  if [ "$where" = hosts ] && [ $hosts_ready = 0 ]; then
    "$ROOT/scripts/hosts" up 2 >/dev/null
    "$ROOT/scripts/hosts" shape 1gbit >/dev/null
    hosts_ready=1
  fi
  on=() off=()
  for ((i = 0; i < PAIRS; ++i)); do
    for mode in on off; do
      args=("${MODEL[@]}" --algorithm "$algorithm" --fusion-threshold "$bucket" --overlap "$mode")
      if [ "$where" = hosts ]; then
        lines=$("$ROOT/scripts/mpirun-hosts" 2x1 -- "$BUILD/trainer/gradcomm-train" "${args[@]}" |
          grep '^step' | tail -n +2)
      else
        lines=$(mpirun -np 2 --bind-to none "$BUILD/trainer/gradcomm-train" "${args[@]}" |
          grep '^step' | tail -n +2)
      fi
      read -r ms exposed < <(sed -E 's/.*exposed comm +([0-9.]+)%.*\(([0-9.]+) ms\/step\).*/\2 \1/' \
        <<<"$lines" | python3 -c '
import statistics, sys
rows = [tuple(map(float, l.split())) for l in sys.stdin if l.strip()]
print("%.2f %.1f" % (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)))')
      echo "$where $algorithm bucket $bucket overlap $mode: $ms ms/step, exposed comm $exposed%"
      if [ $mode = on ]; then on+=("$ms $exposed"); else off+=("$ms $exposed"); fi
    done
  done
  python3 - "$where" "$algorithm" "$bucket" "${on[@]}" -- "${off[@]}" <<'PY'
import statistics, sys
where, algorithm, bucket = sys.argv[1:4]
rest = sys.argv[4:]
split = rest.index("--")
on = [tuple(map(float, x.split())) for x in rest[:split]]
off = [tuple(map(float, x.split())) for x in rest[split + 1:]]
def summary(runs):
    ms = [r[0] for r in runs]
    return statistics.median(ms), min(ms), max(ms), statistics.median(r[1] for r in runs)
a, b = summary(on), summary(off)
print("== %s %s bucket %s: overlap on %.0f ms (%.0f-%.0f, exposed %.1f%%), off %.0f ms "
      "(%.0f-%.0f, exposed %.1f%%), on/off %.2f" % (where, algorithm, bucket, *a, *b, a[0] / b[0]))
PY
done
if [ $hosts_ready = 1 ]; then "$ROOT/scripts/hosts" down >/dev/null; fi
