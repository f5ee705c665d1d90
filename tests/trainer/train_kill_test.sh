#!/usr/bin/env bash
# Trainer faults: a rank SIGKILLed mid-training (checkpointing every step, so the kill often lands
# inside a checkpoint write) ends the whole job with a non-zero exit within 30 s; the checkpoint
# left behind is never corrupt, and --resume from it ends with the model hash of an
# uninterrupted run.
# usage: train_kill_test.sh MPIEXEC GRADCOMM_TRAIN
set -uo pipefail
MPIEXEC=$1
TRAIN=$2
source "$(dirname "${BASH_SOURCE[0]}")/train_test_common.sh"

STEPS=3000
COMMON=(--steps "$STEPS" --batch 120 --optimizer adam --hidden 64 --samples 4000 --log-every 100)
timeout 300 "${RUN[@]}" -np 3 "$TRAIN" "${COMMON[@]}" >"$WORK/straight" 2>&1 ||
  fail "uninterrupted run failed: $(tail -3 "$WORK/straight")"

for round in 1 2; do
  CKPT="$WORK/ckpt$round"
  mkdir -p "$CKPT"
  timeout 300 "${RUN[@]}" -np 3 "$TRAIN" "${COMMON[@]}" --checkpoint-dir "$CKPT" \
    --checkpoint-every 1 >"$WORK/killed$round" 2>&1 &
  job=$!
  # Wait for some progress, then kill one rank (the last one on round 1, rank 0 on round 2).
  for _ in $(seq 1 300); do
    [ -f "$CKPT/checkpoint.bin" ] && break
    sleep 0.1
  done
  sleep 0.$((RANDOM % 3))$((RANDOM % 10))
  mapfile -t pids < <(pgrep -f -- "^$TRAIN .*--checkpoint-dir $CKPT" | sort -n)
  victim=${pids[$((round == 1 ? ${#pids[@]} - 1 : 0))]:-}
  if [ -z "$victim" ]; then
    fail "round $round: no rank to kill (did the job finish already?)"
    wait "$job"
    continue
  fi
  killed_at=$SECONDS
  kill -9 "$victim"
  wait "$job"
  rc=$?
  took=$((SECONDS - killed_at))
  echo "round $round: killed pid $victim; job exit code $rc after ${took} s"
  [ "$rc" -ne 0 ] || fail "round $round: the job exited 0 after a rank was killed"
  [ "$rc" -ne 124 ] || fail "round $round: the job hung"
  [ "$took" -le 30 ] || fail "round $round: the job took ${took} s to end"
  grep -q "model hash" "$WORK/killed$round" && fail "round $round: the job finished training"

  timeout 300 "${RUN[@]}" -np 3 "$TRAIN" "${COMMON[@]}" --checkpoint-dir "$CKPT" \
    --checkpoint-every 1 --resume >"$WORK/resumed$round" 2>&1 ||
    fail "round $round: resume failed: $(tail -3 "$WORK/resumed$round")"
  step=$(sed -n 's/.*resumed from .* at step \([0-9]*\).*/\1/p' "$WORK/resumed$round")
  echo "round $round: resumed at step ${step:-?}"
  [ -n "$step" ] && [ "$step" -gt 0 ] || fail "round $round: did not resume from a checkpoint"
  [ "$(hash_of "$WORK/resumed$round")" = "$(hash_of "$WORK/straight")" ] ||
    fail "round $round: resumed model $(hash_of "$WORK/resumed$round") differs from $(hash_of "$WORK/straight")"
  ls "$CKPT" | grep -v '^checkpoint.bin$' | grep -q . && fail "round $round: leftovers: $(ls "$CKPT")"
done

if [ "$failures" -ne 0 ]; then
  for f in "$WORK"/killed* "$WORK"/resumed*; do echo "== $f"; tail -15 "$f"; done
  echo "$failures failure(s)"
  exit 1
fi
echo "train kill: all checks passed (model hash $(hash_of "$WORK/straight"))"
