#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a GPU machine from the bundle scripts/device-bundle made
# (.device/): adds Debian's Open MPI at its own paths (never replacing a file), finds NCCL, then
# runs test_gpu and test_gpu_c at 1, 2 and 4 ranks, test_gpu_host, the progress-engine bench,
# the GPU pack benchmark and gradcomm-bench --device gpu. Results go to stdout and, when $OUT is set, to $OUT/*.txt.
#
#   tests/gpu/run_on_device.sh [all|bench|tests|torch|overlap]
#     bench: only the benchmarks; tests: only the tests and the engine bench (with and without
#     its poll); torch: only the torch backend's CUDA tests (tests/gpu/test_torch_cuda.py, also
#     part of all), which build gradcomm's Python modules there against the machine's torch
#     (TORCH_PYTHON, default /opt/torch/.venv/bin/python; its Python version need not be this
#     VM's) and load the bundled GPU module; overlap: the emulated link's rate, then bench/overlap_report.sh across 2 hosts (on
#     a machine with cores to spare, unlike the 2-core VM where both hosts share the cores).
#     On the H100 machines of 2026-11-24 scripts/mpirun-hosts placed both ranks on the first
#     emulated host (link.txt: `hostname` printed gch0 twice; a 32 MiB ring took 15 ms, far
#     above 1 Gbit/s), so the overlap figures there say nothing about the link: read link.txt
#     first. The cause (that machine's Open MPI 4.1.6 mapping?) was not found.
#
# Ranks that share one GPU are time-sliced between their CUDA contexts unless CUDA MPS runs; the
# script starts the MPS daemon when the machine has it, so the ranks' kernels run side by side.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=$PWD/.device
out=${OUT:-/tmp/gradcomm-gpu}
mkdir -p "$out"
# Every results page names the CPU model: record the host's.
{ lscpu | sed -n 's/^Model name: *//p'; nproc; nvidia-smi -L 2>/dev/null; } | tee "$out/machine.txt"
# Use the machine's own Open MPI when it has one (same libmpi.so.40 ABI); else add Debian's.
own_mpi=1
if ! command -v mpirun >/dev/null; then
  cp -rn "$bundle/root/." / 2>/dev/null || true
  own_mpi=0
fi
# Only the bundled libraries the machine lacks: mixing two builds of MPI's plugins breaks both.
missing=$bundle/lib-missing
rm -rf "$missing" && mkdir -p "$missing"
for lib in "$bundle"/lib/*; do
  name=$(basename "$lib")
  # With the bundled MPI, all of its libraries: a machine's own libpmix (say) may be older.
  if ((own_mpi == 0)) || ! ldconfig -p | grep -q "^[[:space:]]*$name "; then
    ln -s "$lib" "$missing/$name"
  fi
done
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
if [[ ! -e $nccl_dir/libnccl.so.2 ]]; then
  nccl_dir=$(dirname "$(find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)")
fi
export LD_LIBRARY_PATH=$missing:$nccl_dir:${LD_LIBRARY_PATH:-}
export GRADCOMM_NCCL_MODULE=$bundle/bin/libgradcomm_nccl.so
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
{
  echo "== machine"; nvidia-smi -L; uname -r; ldd --version | head -1; echo "nccl: $nccl_dir"
  echo "mpirun: $(command -v mpirun) $(mpirun --version 2>&1 | head -1)"; echo "bundled libs used: $(ls "$missing" | tr '\n' ' ')"
  "$bundle/bin/gradcomm-bench" --list
} 2>&1 | tee "$out/machine.txt"
what=${1:-all}
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/gradcomm-mps CUDA_MPS_LOG_DIRECTORY=/tmp/gradcomm-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "== CUDA MPS daemon started" | tee -a "$out/machine.txt"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
else
  echo "== no CUDA MPS: ranks sharing the GPU are time-sliced" | tee -a "$out/machine.txt"
fi
status=0
# The torch backend on CUDA tensors: a build of the Python modules for the machine's torch (no
# CUDA needed for it: they load the bundled GPU module), then test_torch_cuda.py at 1-3 ranks.
torch_cuda_tests() {
  local py=${TORCH_PYTHON:-/opt/torch/.venv/bin/python} tb=/tmp/gradcomm-torch-build
  echo "== torch backend on CUDA tensors ($py)"
  command -v mpicxx >/dev/null && mpicxx --showme:version >/dev/null 2>&1 ||
    cp -rn "$bundle/mpidev/." / 2>/dev/null
  "$py" -c 'import pytest' 2>/dev/null || export PYTHONPATH=$bundle/pylib${PYTHONPATH:+:$PYTHONPATH}
  local pybind_dir
  pybind_dir=$("$py" -m pybind11 --cmakedir 2>/dev/null)
  if ! { cmake -S . -B "$tb" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WITH_NCCL=OFF \
           -DGRADCOMM_BUILD_TESTS=OFF -DGRADCOMM_BUILD_BENCH=OFF -DGRADCOMM_PYTHON="$py" \
           -DGRADCOMM_TORCH_PYTHONS="$py" ${pybind_dir:+-Dpybind11_DIR="$pybind_dir"} &&
         ninja -C "$tb"; } >"$out/torch_build.txt" 2>&1; then
    tail -30 "$out/torch_build.txt"
    echo "FAIL: the torch backend could not be built here (torch_build.txt)"
    status=1
    return
  fi
  grep -E "torch backend|Python module" "$out/torch_build.txt"
  for np in 1 2 3; do
    echo "== test_torch_cuda np$np"
    timeout 300 mpirun -n "$np" --bind-to none -x PYTHONPATH="$tb/python${PYTHONPATH:+:$PYTHONPATH}" \
      -x GRADCOMM_NCCL_MODULE -x LD_LIBRARY_PATH -x GRADCOMM_TIMEOUT=30 \
      "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_torch_cuda.py 2>&1 |
      tee "$out/torch_cuda_np$np.txt" | tail -15
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  done
}
if [[ $what == torch ]]; then
  torch_cuda_tests
  exit $status
fi
tests=0
[[ $what == all || $what == tests ]] && tests=1
((tests)) && torch_cuda_tests
((tests)) && for np in 1 2 4; do
  echo "== test_gpu np$np"
  timeout 150 mpirun -n "$np" --bind-to none "$bundle/bin/test_gpu" 2>&1 | tee "$out/test_gpu_np$np.txt" | tail -25
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
done
((tests)) && for np in 1 2 4; do
  echo "== test_gpu_c np$np"
  timeout 90 mpirun -n "$np" --bind-to none "$bundle/bin/test_gpu_c" 2>&1 | tee "$out/test_gpu_c_np$np.txt" | tail -8
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
done
((tests)) && echo "== test_gpu_host np2"
((tests)) && timeout 120 mpirun -n 2 --bind-to none "$bundle/bin/test_gpu_host" 2>&1 | tail -3
if [[ $what == overlap ]]; then
  command -v ip >/dev/null || export PATH=$PATH:$bundle/netroot/bin:$bundle/netroot/sbin
  export OMPI_MCA_btl=self,tcp  # the emulated hosts talk TCP, never shared memory
  # The link first: host names, shaping, and what a 32 MiB all-reduce gets across it.
  scripts/hosts up 2 && scripts/hosts shape 1gbit && scripts/hosts status 2>&1 | tee "$out/link.txt"
  scripts/mpirun-hosts 2x1 -- hostname 2>&1 | tee -a "$out/link.txt"
  timeout 120 scripts/mpirun-hosts 2x1 -- "$bundle/bin/gradcomm-bench" -a ring -b 32M -e 32M \
    -n 3 -w 1 --no-baseline 2>&1 | grep -v '^#' | tee -a "$out/link.txt"
  build=$(mktemp -d) && mkdir -p "$build/trainer" && ln -s "$bundle/bin/gradcomm-train" "$build/trainer/"
  PAIRS=${PAIRS:-3} SETTINGS=${SETTINGS:-"hosts:halving_doubling:4194304"} \
    timeout 400 bench/overlap_report.sh "$build" 2>&1 | tee "$out/overlap.txt"
  exit "${PIPESTATUS[0]}"
fi
if [[ $what == tests ]]; then  # and the engine on spare cores, which is quick
  for np in 2 4; do
    echo "== gradcomm-nonblocking-bench np$np"
    timeout 120 mpirun -n "$np" --bind-to core "$bundle/bin/gradcomm-nonblocking-bench" 2>&1 |
      tee "$out/nonblocking_np$np.txt"
  done
  for poll in 50 0; do  # the engine's wake, with and without its poll
    echo "== gradcomm-nonblocking-bench np2, GRADCOMM_ENGINE_POLL_US=$poll"
    GRADCOMM_ENGINE_POLL_US=$poll timeout 120 mpirun -n 2 --bind-to core \
      -x GRADCOMM_ENGINE_POLL_US "$bundle/bin/gradcomm-nonblocking-bench" 2>&1 |
      tee "$out/nonblocking_np2_poll$poll.txt"
  done
  exit $status
fi
echo "== pack bench"
(cd "$bundle" && timeout 120 bin/gradcomm-gpu-pack-bench workloads/resnet50.json \
   workloads/bert_base.json workloads/mobilenet_v2.json workloads/vgg16.json) 2>&1 | tee "$out/pack_bench.txt"
# Ranks share the one GPU: a distinct NCCL_HOSTID per rank makes NCCL connect them over its
# socket transport (it refuses two ranks on one device of one host).
bench() {  # bench NP NAME [env ...]
  local np=$1 name=$2; shift 2
  echo "== gradcomm-bench --device gpu np$np $*"
  timeout 240 env "$@" mpirun -n "$np" --bind-to none bash -c \
    'NCCL_HOSTID=gradcomm-bench-$OMPI_COMM_WORLD_RANK exec "$0" "$@"' \
    "$bundle/bin/gradcomm-bench" --device gpu -b 8 -e 256M -f 8 -n 10 -w 3 2>&1 |
    tee "$out/bench_gpu_$name.txt"
}
bench 1 np1
bench 2 np2
bench 4 np4_rpn2_nccl GRADCOMM_RANKS_PER_NODE=2 GRADCOMM_GPU_INTER_NODE=nccl
bench 4 np4_rpn2_mpi GRADCOMM_RANKS_PER_NODE=2 GRADCOMM_GPU_INTER_NODE=mpi
exit $status
