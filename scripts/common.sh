# Shared by scripts/run and scripts/test (sourced, not executed): installs what is missing from
# Debian's packages, configures and builds, and sets the environment every mpirun here needs.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${GRADCOMM_BUILD_DIR:-$ROOT/build}

# Everything the build and the tests need, by Debian package name.
PACKAGES=(cmake ninja-build g++ pkg-config nlohmann-json3-dev
          openmpi-bin libopenmpi-dev libhwloc-dev hwloc
          libgtest-dev libgmock-dev libbenchmark-dev
          pybind11-dev python3-dev python3-numpy python3-mpi4py python3-torch python3-sklearn
          python3-pytest python3-matplotlib valgrind iproute2 python3-venv libtorch-dev
          mpich libmpich-dev)

install_missing() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  echo "== installing: ${missing[*]}"
  "${sudo[@]}" apt-get update
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y "${missing[@]}"
}

# torch 2.x beside Debian's torch 1.13: a virtual environment over Debian's Python (NumPy,
# mpi4py and pytest show through), made once and reused by every checkout on this machine, with
# the versions pinned in scripts/requirements-torch2.txt. The first run downloads about 3 GB
# (4.6 GB installed: torch's CUDA libraries come with it from PyPI). GRADCOMM_TORCH2=0 skips it.
TORCH2_VENV=${GRADCOMM_TORCH2_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11}
torch2_venv() {
  [ "${GRADCOMM_TORCH2:-1}" = 0 ] && return 0
  local requirements=$ROOT/scripts/requirements-torch2.txt stamp=$TORCH2_VENV/.requirements
  if [ -x "$TORCH2_VENV/bin/python" ] && cmp -s "$requirements" "$stamp"; then return 0; fi
  echo "== creating the torch 2.x environment in $TORCH2_VENV (first time: ~3 GB download)"
  local started=$SECONDS
  /usr/bin/python3 -m venv --system-site-packages "$TORCH2_VENV"
  "$TORCH2_VENV/bin/python" -m pip install --no-input --disable-pip-version-check -q \
    -r "$requirements"
  cp "$requirements" "$stamp"
  echo "== torch 2.x environment ready in $((SECONDS - started)) s"
}

# The interpreters whose torch the torch.distributed backend is built for (and tested with).
torch_pythons() {
  local pythons=/usr/bin/python3
  [ "${GRADCOMM_TORCH2:-1}" != 0 ] && pythons+=";$TORCH2_VENV/bin/python"
  echo "$pythons"
}

# The real Horovod 0.28.1, built from PyPI's source against Debian's torch and Open MPI
# (bench/horovod/env.sh: about 2 minutes the first time, reused after), for the tests that compare
# gradcomm.torch with it. GRADCOMM_HOROVOD=0 skips it.
HOROVOD_PYTHON=
horovod_venv() {
  [ "${GRADCOMM_HOROVOD:-1}" = 0 ] && return 0
  HOROVOD_PYTHON=$("$ROOT/bench/horovod/env.sh") || {
    echo "== horovod could not be built (above): the tests against it do not run"
    HOROVOD_PYTHON=
  }
}

build() {
  echo "== configuring and building in $BUILD_DIR"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WERROR=ON \
    "-DGRADCOMM_TORCH_PYTHONS=$(torch_pythons)" "-DGRADCOMM_HOROVOD_PYTHON=$HOROVOD_PYTHON" "$@"
  cmake --build "$BUILD_DIR" -j "$(nproc)"
}

# The MPICH leg: the library built against Debian's MPICH (Open MPI stays the default MPI), for
# the tests whose behaviour can differ between MPI libraries. No Python, benchmarks or GPU module.
MPICH_BUILD_DIR=${GRADCOMM_MPICH_BUILD_DIR:-$ROOT/build-mpich}
MPICH_TARGETS=(test_consistency test_grouped_allreduce test_lifecycle test_bad_input
               test_nonblocking test_shm test_scatter_gather test_preload gradcomm_mpi
               gradcomm_shared)
# build_mpi_family DIR MPICC MPICXX MPIEXEC: those targets against another MPI.
build_mpi_family() {
  echo "== configuring and building against $2 in $1"
  cmake -S "$ROOT" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WERROR=ON \
    "-DMPI_C_COMPILER=$2" "-DMPI_CXX_COMPILER=$3" "-DMPIEXEC_EXECUTABLE=$4" \
    -DGRADCOMM_WITH_PYTHON=OFF -DGRADCOMM_BUILD_BENCH=OFF -DGRADCOMM_WITH_NCCL=OFF \
    "-DGRADCOMM_TEST_RANKS=2;3"
  cmake --build "$1" -j "$(nproc)" --target "${MPICH_TARGETS[@]}"
}
build_mpich() {
  build_mpi_family "$MPICH_BUILD_DIR" mpicc.mpich mpicxx.mpich /usr/bin/mpiexec.mpich
}

# Intel MPI (MPICH's ABI) from PyPI, for the same tests on request (GRADCOMM_TEST_IMPI=1; about
# 200 MB installed): a virtual environment of its own, pinned. 2021.16.1 is the newest whose
# wheels bring their libfabric (2021.19 wants libfabric>=2.6, which PyPI does not have).
IMPI_VENV=${GRADCOMM_IMPI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-impi-2021.16.1}
IMPI_BUILD_DIR=${GRADCOMM_IMPI_BUILD_DIR:-$ROOT/build-impi}
build_impi() {
  if [ ! -x "$IMPI_VENV/bin/mpicc" ]; then
    /usr/bin/python3 -m venv "$IMPI_VENV"
    "$IMPI_VENV/bin/python" -m pip install --no-input --disable-pip-version-check -q \
      impi-rt==2021.16.1 impi-devel==2021.16.1
  fi
  export I_MPI_ROOT=$IMPI_VENV I_MPI_FABRICS=shm
  export LD_LIBRARY_PATH=$IMPI_VENV/lib:$IMPI_VENV/lib/libfabric${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  build_mpi_family "$IMPI_BUILD_DIR" "$IMPI_VENV/bin/mpicc" "$IMPI_VENV/bin/mpicxx" \
    "$IMPI_VENV/bin/mpiexec"
}

# The tests the MPI-family legs run, and at which rank counts. c_abi_install: the C ABI and the
# preload from an installed tree, compiled with the family's wrapper and found by find_package
# (under MPICH a Fortran handle naming no communicator passed the null checks Open MPI needs).
# At 3 ranks (a count no power of two, one rank past the cores) the tests whose paths split
# the buffer by rank count, and the consistency and non-blocking tests (one rank against two:
# 22 and 9 s there under MPICH's spinning waits, paid for by the main suite's faster checks).
MPI_FAMILY_TESTS='(test_consistency|test_grouped_allreduce|test_lifecycle\.[a-z]+|test_bad_input|test_nonblocking|test_shm|test_scatter_gather|mpi_preload[a-z_]*)\.np2$|(test_lifecycle\.[a-z]+|test_shm|test_grouped_allreduce|test_scatter_gather|test_consistency|test_nonblocking)\.np3$|^c_abi_install$'
run_mpi_family_tests() {
  (cd "$1" && GTEST_FILTER='-*GroupedWorkload*:*GroupedCompression*' \
    ctest --output-on-failure -R "$MPI_FAMILY_TESTS")
}

# Open MPI as root, with more ranks than cores: allowed, and waiting ranks yield the CPU.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1
MPIRUN=(mpirun --oversubscribe --bind-to none)
