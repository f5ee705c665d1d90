#!/usr/bin/env bash
# On a machine without a usable GPU (CI, this project's build machines), a build with the GPU
# path must still start and work: the library and tools never link CUDA or NCCL (only the
# dlopen'ed module does), `gradcomm-bench --list` names nccl with the reason it cannot run, and
# asking for nccl fails with that reason instead of crashing. Skips (exit 77) where a GPU works.
#
#   no_gpu_test.sh MPIEXEC BENCH LIBGRADCOMM [MODULE]
set -uo pipefail
mpiexec=$1 bench=$2 lib=$3 module=${4:-}
# The launcher's flags for its family (tests/CMakeLists.txt).
read -r -a flags <<<"${GRADCOMM_TEST_MPIEXEC_FLAGS:---oversubscribe --bind-to none}"
fail() { echo "FAIL: $*"; exit 1; }

for binary in "$bench" "$lib"; do
  if ldd "$binary" | grep -Ei 'libcuda|libcudart|libnccl'; then
    fail "$binary links CUDA or NCCL at load time"
  fi
done
if [[ -n $module ]]; then
  ldd "$module" | grep -q libnccl || fail "$module does not link NCCL"
fi

list=$("$bench" --list) || fail "gradcomm-bench --list failed"
echo "$list"
nccl_line=$(grep '^nccl ' <<<"$list") || fail "--list does not show nccl"
if ! grep -q 'unavailable: ' <<<"$nccl_line"; then
  echo "SKIP: nccl is available here (a GPU is present): run tests/gpu instead"
  exit 77
fi

out=$("$mpiexec" -n 2 "${flags[@]}" "$bench" -a nccl -b 1K -e 1K -n 1 -w 0 2>&1)
rc=$?
echo "$out" | head -5
[[ $rc != 0 ]] || fail "gradcomm-bench -a nccl succeeded without a GPU"
grep -q 'allreduce(nccl): rank 0: nccl is unavailable: ' <<<"$out" ||
  fail "no clear error for nccl without a GPU"
out=$("$mpiexec" -n 2 "${flags[@]}" "$bench" --device gpu 2>&1)
[[ $? != 0 ]] || fail "gradcomm-bench --device gpu succeeded without a GPU"
grep -q 'gradcomm-bench --device gpu: ' <<<"$out" || fail "no clear error for --device gpu"
# Host algorithms are untouched.
"$mpiexec" -n 2 "${flags[@]}" "$bench" -a ring,auto -b 8 -e 64K -f 64 -n 2 -w 1 ||
  fail "host algorithms failed in a GPU build"
echo "PASS"
