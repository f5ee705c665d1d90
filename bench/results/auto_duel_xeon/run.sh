#!/bin/bash
# auto against the best fixed algorithm, before (45d5218: a duel's challenger ran only its timed
# calls) and after (9bb764e and on: the untimed calls before each too), launches alternating old,
# new, ROUNDS times at 2 ranks and at 4 ranks (sharing the 2 cores), not bound, as
# docs/results/auto.md measures it. OLD=gradcomm-bench of 45d5218 [NEW=build/bench/gradcomm-bench]
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OLD=${OLD:?} NEW=${NEW:-build/bench/gradcomm-bench} ROUNDS=${ROUNDS:-4}
lscpu | grep "Model name"
for np in 2 4; do
  for round in $(seq "$ROUNDS"); do
    for which in OLD NEW; do
      echo "=== np$np round $round $which"
      mpirun --oversubscribe --bind-to none -np "$np" "${!which}" \
        -a auto,ring,halving_doubling,flat,shm -b 8 -e 64M -f 4 -n 21 --csv 2>&1 |
        awk -F, '$1 == "auto" {print $2, $22, $21} $15 != 0 && $15 != "wrong" {print "WRONG", $0}'
    done
  done
done
