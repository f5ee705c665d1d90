#!/usr/bin/env bash
# A/B/C: GRADCOMM_TMP_PFW=0/1/2, launches alternating.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
B=${BUILD:-build}/bench/gradcomm-bench  # run from the repository root
OUT=${OUT:-bench/results/shm_amd_prefetchw_probe/csv}; mkdir -p $OUT
for r in $(seq 1 ${ROUNDS:-5}); do
  for mode in reg_cycle priv_cycle priv_inplace_cycle reg_b2b; do
    case $mode in
      reg_cycle) flags="--registered --inplace --cycle";;
      priv_cycle) flags="--cycle";;
      priv_inplace_cycle) flags="--inplace --cycle";;
      reg_b2b) flags="--registered --inplace";;
    esac
    for v in 0 1 2; do
      GRADCOMM_TMP_PFW=$v mpirun -np 2 --bind-to core -x GRADCOMM_TMP_PFW $B -a shm $flags \
        -b 1M -e 64M -f 4 -n 15 -w 3 --csv > $OUT/${mode}_v${v}_r$r.csv 2>/dev/null
    done
  done
done
