#!/bin/bash
# gradcomm (auto) against Intel MPI's MPI_Allreduce at 512 B - 8 KiB, 2 ranks, in the same
# launches (gradcomm-bench built against Intel MPI by bench/peers/run.sh impi, its settings:
# I_MPI_FABRICS=shm, I_MPI_PIN=0, no binding), LAUNCHES launches per timing, back to back and
# cycle alternating. Prints per launch: bytes, auto's p50 us, MPI's p50 us, auto's pick.
V=${V:-$HOME/.cache/gradcomm/peers/impi} LAUNCHES=${LAUNCHES:-8}
lscpu | grep "Model name"
for launch in $(seq "$LAUNCHES"); do
  for timing in "" --cycle; do
    echo "=== launch $launch ${timing:-b2b}"
    # shellcheck disable=SC2086
    I_MPI_ROOT=$V I_MPI_FABRICS=shm I_MPI_PIN=0 "$V/bin/mpiexec" -np 2 \
      build-peers/impi/bench/gradcomm-bench -a auto -b 512 -e 8K -f 2 -n 200 --csv $timing 2>&1 |
      awk -F, '$1 == "auto" {a[$2] = $11; p[$2] = $21} $1 == "mpi" {m[$2] = $11}
               $15 != 0 && $15 != "wrong" {print "WRONG", $0}
               END {for (s in a) print s, a[s], m[s], p[s]}' | sort -n
  done
done
