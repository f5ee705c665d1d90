#!/usr/bin/env bash
# What the emulated network's own CPU work costs compute on this machine, with no MPI library
# involved: gradcomm-train on one rank per emulated host (no communication), alone and while
# plain TCP traffic runs between the two hosts in both directions at once at the shaped rate,
# the two alternating. Prints each run's median step (first step left out) and, per condition,
# the median and range; docs/results/overlap.md reports it.
# usage: [PAIRS=3] [BATCH=192] [RATE=1gbit] bench/network_tax.sh [BUILD_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$ROOT/build}
PAIRS=${PAIRS:-3}
PY=/usr/bin/python3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MODEL=(--model mlp --hidden 2048,2048,1024 --features 1024 --samples 4096 --batch "${BATCH:-192}"
       --steps 9 --log-every 1 --overlap off)

TMP=$(mktemp -d)
client="" server=""
cleanup() {
  [ -n "$client$server" ] && kill -TERM $client $server 2>/dev/null || true
  "$ROOT/scripts/hosts" down >/dev/null 2>&1 || true
  rm -rf "$TMP"
}
trap cleanup EXIT
"$ROOT/scripts/hosts" up 2 >/dev/null
"$ROOT/scripts/hosts" shape "${RATE:-1gbit}" >/dev/null

# One compute run per host at once; prints the slower host's median ms per step.
compute() {
  local pids=() i
  for i in 0 1; do
    "$ROOT/scripts/hosts" exec "$i" mpirun -n 1 --bind-to none "$BUILD/trainer/gradcomm-train" \
      "${MODEL[@]}" >"$TMP/compute.$i" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}" || { echo "network_tax.sh: the run on host $i failed:" >&2;
                            cat "$TMP/compute.$i" >&2; return 1; }
  done
  for i in 0 1; do
    grep '^step' "$TMP/compute.$i" | tail -n +2 | sed -E 's/.*\(([0-9.]+) ms\/step\).*/\1/' |
      "$PY" -c 'import statistics, sys; print("%.2f" % statistics.median(float(l) for l in sys.stdin))'
  done | sort -n | tail -1
}

quiet=() loaded=()
for ((p = 0; p < PAIRS; ++p)); do
  ms=$(compute)
  echo "quiet:  $ms ms/step"
  quiet+=("$ms")
  "$ROOT/scripts/hosts" exec 1 "$PY" "$ROOT/bench/network_tax.py" serve 5999 120 >"$TMP/server" &
  server=$!
  "$ROOT/scripts/hosts" exec 0 "$PY" "$ROOT/bench/network_tax.py" send \
    "$("$ROOT/scripts/hosts" address 1)" 5999 120 >"$TMP/client" &
  client=$!
  sleep 1
  ms=$(compute)
  kill -TERM "$client" "$server" 2>/dev/null || true
  wait "$client" "$server" 2>/dev/null || true
  client="" server=""
  echo "loaded: $ms ms/step (traffic: $(cat "$TMP/server" "$TMP/client" | tr '\n' ' '))"
  loaded+=("$ms")
done
"$PY" - "${quiet[@]}" -- "${loaded[@]}" <<'PY'
import statistics, sys
args = sys.argv[1:]
cut = args.index("--")
q = [float(x) for x in args[:cut]]
l = [float(x) for x in args[cut + 1:]]
print("== compute alone %.0f ms (%.0f-%.0f), beside the traffic %.0f ms (%.0f-%.0f): %.2fx" %
      (statistics.median(q), min(q), max(q), statistics.median(l), min(l), max(l),
       statistics.median(l) / statistics.median(q)))
PY
