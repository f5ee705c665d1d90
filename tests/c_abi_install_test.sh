#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then, against that prefix only:
#  1. compiles tests/c_abi/example.c with plain gcc and pkg-config (no MPI flags: gradcomm.h
#     needs no MPI types) and runs it under mpirun at 1, 2 and 3 ranks;
#  2. compiles it again with the MPI compiler wrapper (the MPI gradcomm was built with) to wrap
#     a user communicator via its Fortran handle;
#  3. configures a CMake project that finds the package (find_package(gradcomm)) and builds the
#     C example and a C++ program against gradcomm::gradcomm, and runs both.
#  4. runs tests/mpi_preload/test_preload.c (an MPI-only program) with the installed
#     libgradcomm_mpi.so preloaded (gradcomm-mpi.pc's `preload`), linked before libmpi, and linked
#     to gradcomm::gradcomm_mpi by find_package;
#  5. with a Python interpreter given, imports the installed Python package and all-reduces.
# usage: c_abi_install_test.sh BUILD_DIR MPIEXEC [PYTHON]
set -euo pipefail
BUILD=$1
MPIEXEC=$2
PYTHON=${3:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The launcher's flags for its family and the compiler wrapper of the MPI gradcomm was built
# with (tests/CMakeLists.txt).
read -r -a FLAGS <<<"${GRADCOMM_TEST_MPIEXEC_FLAGS:---oversubscribe --bind-to none}"
RUN=("$MPIEXEC" "${FLAGS[@]}")
MPICC=${GRADCOMM_TEST_MPICC:-mpicc}
# MPICH's MPI_STATUSES_IGNORE is the address 1, which GCC reads as an empty array it writes.
NO_STRINGOP=-Wno-stringop-overflow

cmake --install "$BUILD" --prefix "$WORK/prefix" >/dev/null
export PKG_CONFIG_PATH="$WORK/prefix/lib/pkgconfig"
LIBDIR=$(pkg-config --variable=libdir gradcomm)
echo "== gcc against $(pkg-config --modversion gradcomm) in $WORK/prefix"
gcc -std=c11 -Wall -Wextra -Werror "$HERE/c_abi/example.c" -o "$WORK/example" \
  $(pkg-config --cflags --libs gradcomm) -Wl,-rpath,"$LIBDIR"
for np in 1 2 3; do "${RUN[@]}" -np "$np" "$WORK/example"; done
"$MPICC" -std=c11 -Wall -Wextra -Werror -DGRADCOMM_TEST_MPI "$HERE/c_abi/example.c" \
  -o "$WORK/example_mpi" $(pkg-config --cflags --libs gradcomm) -Wl,-rpath,"$LIBDIR"
"${RUN[@]}" -np 2 "$WORK/example_mpi"

echo "== libgradcomm_mpi.so from the installed tree: preloaded, and linked before libmpi"
PRELOAD=$(pkg-config --variable=preload gradcomm-mpi)
[ -f "$PRELOAD" ] || { echo "gradcomm-mpi.pc names $PRELOAD, which is missing"; exit 1; }
"$MPICC" -std=c11 -Wall -Wextra -Werror $NO_STRINGOP "$HERE/mpi_preload/test_preload.c" \
  -o "$WORK/test_preload" $(pkg-config --cflags gradcomm-mpi) -lpthread -ldl
"${RUN[@]}" -np 2 env LD_PRELOAD="$PRELOAD" "$WORK/test_preload" --quick | tail -1
# The wrapper puts MPI's libraries after the program's own: libgradcomm_mpi comes first.
"$MPICC" -std=c11 -Wall -Wextra -Werror $NO_STRINGOP "$HERE/mpi_preload/test_preload.c" \
  -o "$WORK/test_linked" $(pkg-config --cflags gradcomm-mpi) -Wl,--no-as-needed \
  $(pkg-config --libs gradcomm-mpi) -lpthread -ldl -Wl,-rpath,"$LIBDIR"
"${RUN[@]}" -np 2 "$WORK/test_linked" --quick | tail -1

echo "== find_package(gradcomm)"
cmake -S "$HERE/c_abi/consumer" -B "$WORK/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/consumer" >/dev/null
"${RUN[@]}" -np 2 "$WORK/consumer/consumer_c"
"${RUN[@]}" -np 2 "$WORK/consumer/consumer_cxx"
"${RUN[@]}" -np 2 "$WORK/consumer/consumer_preload" --quick | tail -1
if [ -n "$PYTHON" ]; then
  echo "== the installed Python package"
  site=$(find "$WORK/prefix" -type d -name gradcomm -path "*-packages/*" | head -1)
  [ -n "$site" ] || { echo "no Python package under $WORK/prefix"; exit 1; }
  PYTHONPATH=$(dirname "$site") "${RUN[@]}" -np 2 "$PYTHON" -c '
import numpy as np, gradcomm
gradcomm.init()
x = gradcomm.allreduce(np.ones(3, dtype=np.float32), op="sum")
assert x.tolist() == [gradcomm.size()] * 3, x
if gradcomm.rank() == 0: print("python package: ok from", gradcomm.__file__)'
fi
echo "installed-tree checks passed"
