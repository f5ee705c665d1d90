#!/usr/bin/env bash
# End-to-end test of gradcomm-train under mpirun: help and usage errors, a run stopped after a
# checkpoint and resumed ends with the same model hash as an uninterrupted run, the --json
# history has one entry per step, and a corrupt checkpoint stops --resume with a clear message
# and a non-zero exit (no hang, no crash).
# usage: train_cli_test.sh MPIEXEC GRADCOMM_TRAIN
set -uo pipefail
MPIEXEC=$1
TRAIN=$2
source "$(dirname "${BASH_SOURCE[0]}")/train_test_common.sh"

"${RUN[@]}" -np 1 "$TRAIN" --help >"$WORK/help" 2>&1 || fail "--help exited non-zero"
grep -q -- "--batch B" "$WORK/help" || fail "--help does not list --batch"

"${RUN[@]}" -np 2 "$TRAIN" --optimizer rmsprop >"$WORK/bad" 2>&1 && fail "unknown optimizer accepted"
grep -q "unknown optimizer 'rmsprop' (sgd, momentum, adam)" "$WORK/bad" || fail "no clear message for a bad optimizer: $(head -3 "$WORK/bad")"

"${RUN[@]}" -np 3 "$TRAIN" --batch 100 --steps 2 >"$WORK/indivisible" 2>&1 && fail "indivisible batch accepted"
grep -q "global batch 100 does not divide by 3 ranks" "$WORK/indivisible" || fail "no clear message for an indivisible batch: $(head -3 "$WORK/indivisible")"

COMMON=(--steps 40 --batch 120 --optimizer adam --hidden 32 --samples 4000 --log-every 10)
"${RUN[@]}" -np 2 "$TRAIN" "${COMMON[@]}" --json "$WORK/history.json" >"$WORK/straight" 2>&1 || fail "uninterrupted run failed: $(tail -3 "$WORK/straight")"
"${RUN[@]}" -np 2 "$TRAIN" "${COMMON[@]}" --steps 25 --checkpoint-dir "$WORK/ckpt" --checkpoint-every 10 >"$WORK/first" 2>&1 || fail "first half failed: $(tail -3 "$WORK/first")"
"${RUN[@]}" -np 2 "$TRAIN" "${COMMON[@]}" --checkpoint-dir "$WORK/ckpt" --resume >"$WORK/resumed" 2>&1 || fail "resumed run failed: $(tail -3 "$WORK/resumed")"
grep -q "resumed from .* at step 20" "$WORK/resumed" || fail "resume did not start at step 20: $(head -3 "$WORK/resumed")"
straight=$(hash_of "$WORK/straight")
resumed=$(hash_of "$WORK/resumed")
[ -n "$straight" ] && [ "$straight" = "$resumed" ] || fail "resumed model $resumed differs from uninterrupted $straight"

python3 - "$WORK/history.json" <<'PY' || fail "--json history is wrong"
import json, sys
h = json.load(open(sys.argv[1]))
steps = [e["step"] for e in h["history"]]
assert steps == list(range(1, 41)), steps
assert all("loss" in e and "accuracy" in e and "allreduce_seconds" in e for e in h["history"])
assert h["summary"]["ranks"] == 2 and h["summary"]["steps"] == 40
assert h["history"][-1]["loss"] < h["history"][0]["loss"]
PY

printf 'garbage' >"$WORK/ckpt/checkpoint.bin"
timeout 120 "${RUN[@]}" -np 2 "$TRAIN" "${COMMON[@]}" --checkpoint-dir "$WORK/ckpt" --resume >"$WORK/corrupt" 2>&1
rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "corrupt checkpoint: exit code $rc"
grep -q "truncated" "$WORK/corrupt" || fail "corrupt checkpoint: no clear message: $(head -3 "$WORK/corrupt")"

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "gradcomm-train CLI: all checks passed (model hash $straight)"
