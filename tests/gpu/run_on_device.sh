#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a GPU machine from the bundle scripts/device-bundle made
# (.device/): adds Debian's Open MPI at its own paths (never replacing a file), finds NCCL, then
# runs test_gpu and test_gpu_c at 1, 2 and 4 ranks, test_gpu_host, the progress-engine bench,
# the GPU pack benchmark and gradcomm-bench --device gpu. Results go to stdout and, when $OUT is set, to $OUT/*.txt.
#
#   tests/gpu/run_on_device.sh [MODE...]     (default: all; several modes run in the order given)
#     all: the tests and the benchmarks; bench: only the benchmarks; tests: only the tests and
#     the engine bench (with and without its poll); torch: only the torch backend's CUDA tests
#     (tests/gpu/test_torch_cuda.py, also part of all), which build gradcomm's Python modules
#     there against the machine's torch (TORCH_PYTHON, default /opt/torch/.venv/bin/python; its
#     Python version need not be this VM's) and load the bundled GPU module; torch-bench:
#     dist.all_reduce and torch's DDP step on CUDA tensors, gradcomm's backend against torch's
#     nccl, alternated (bench/torch_allreduce_bench.py, bench/torch_ddp_bench.py --device cuda);
#     cpu-ranks: gradcomm-bench on host memory at 8 and 16 ranks, one core each, against the
#     machine's MPI_Allreduce; hosts: how mpirun places ranks on the emulated hosts (the
#     allocation and map Open MPI reports, its launcher's log); overlap: the emulated link's
#     rate, then bench/overlap_report.sh across 2 hosts (on a machine with cores to spare,
#     unlike the 2-core VM where both hosts share the cores).
#     On the H100 machines of 2026-11-24 scripts/mpirun-hosts placed both ranks on the first
#     emulated host (link.txt: `hostname` printed gch0 twice; a 32 MiB ring took 15 ms, far
#     above 1 Gbit/s), so the overlap figures there say nothing about the link: read link.txt
#     first. The cause: that machine sets OMPI_MCA_plm=isolated, which starts every rank on
#     mpirun's own host; scripts/mpirun-hosts now names the rsh launcher itself.
#     hosts-torch: torch's DDP (CPU tensors) across 2 emulated hosts at 1 Gbit/s, gloo against
#     gradcomm (bench/torch_ddp_bench.py).
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
if command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/gradcomm-mps CUDA_MPS_LOG_DIRECTORY=/tmp/gradcomm-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "== CUDA MPS daemon started" | tee -a "$out/machine.txt"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
else
  echo "== no CUDA MPS: ranks sharing the GPU are time-sliced" | tee -a "$out/machine.txt"
fi
status=0
torch_py=${TORCH_PYTHON:-/opt/torch/.venv/bin/python}
torch_build=/tmp/gradcomm-torch-build
# gradcomm's Python modules for the machine's torch (no CUDA needed for them: they load the
# bundled GPU module), once per run.
build_torch_modules() {
  [[ -e $torch_build/.built ]] && return 0
  command -v mpicxx >/dev/null && mpicxx --showme:version >/dev/null 2>&1 ||
    cp -rn "$bundle/mpidev/." / 2>/dev/null
  "$torch_py" -c 'import pytest' 2>/dev/null || export PYTHONPATH=$bundle/pylib${PYTHONPATH:+:$PYTHONPATH}
  local pybind_dir
  pybind_dir=$("$torch_py" -m pybind11 --cmakedir 2>/dev/null)
  if ! timeout -k 5 "${TORCH_BUILD_LIMIT:-240}" bash -c "$(declare -p torch_build torch_py pybind_dir); "'
       cmake -S . -B "$torch_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMM_WITH_NCCL=OFF \
           -DGRADCOMM_BUILD_TESTS=OFF -DGRADCOMM_BUILD_BENCH=OFF -DGRADCOMM_PYTHON="$torch_py" \
           -DGRADCOMM_TORCH_PYTHONS="$torch_py" ${pybind_dir:+-Dpybind11_DIR="$pybind_dir"} &&
         ninja -C "$torch_build"' >"$out/torch_build.txt" 2>&1; then
    tail -30 "$out/torch_build.txt"
    echo "FAIL: the torch backend could not be built here (torch_build.txt)"
    status=1
    return 1
  fi
  grep -E "torch backend|Python module" "$out/torch_build.txt"
  touch "$torch_build/.built"
}
torch_mpirun() {  # torch_mpirun NP TIMEOUT ARGS...: the machine's torch under mpirun
  local np=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" mpirun -n "$np" --bind-to none \
    -x PYTHONPATH="$torch_build/python${PYTHONPATH:+:$PYTHONPATH}" -x GRADCOMM_NCCL_MODULE \
    -x LD_LIBRARY_PATH -x GRADCOMM_TIMEOUT=30 -x PYTHONUNBUFFERED=1 "$torch_py" "$@"
}
# The torch backend and gradcomm.torch's front ends on CUDA tensors (test_torch_cuda.py,
# test_torch_cuda_frontends.py) at 1-3 ranks.
torch_cuda_tests() {
  echo "== torch backend on CUDA tensors ($torch_py) $(date +%T)"
  build_torch_modules || return
  echo "== built $(date +%T)"
  for np in ${TORCH_TEST_RANKS:-1 2 3}; do
    echo "== test_torch_cuda np$np $(date +%T)"
    # A test stuck past 40 s prints every thread's Python stack.
    torch_mpirun "$np" "${TORCH_TEST_LIMIT:-150}" -m pytest -q -p no:cacheprovider \
      -o faulthandler_timeout=40 ${PYTEST_ARGS:-} tests/gpu/test_torch_cuda.py \
      tests/gpu/test_torch_cuda_frontends.py 2>&1 |
      tee "$out/torch_cuda_np$np.txt" | tail -15
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  done
}
# gradcomm's backend against torch's nccl on CUDA tensors, alternated within each launch.
torch_cuda_bench() {
  build_torch_modules || return
  local np model
  for np in 1 2; do
    echo "== dist.all_reduce on CUDA tensors, nccl against gradcomm, np$np"
    torch_mpirun "$np" "${TORCH_BENCH_LIMIT:-150}" bench/torch_allreduce_bench.py --device cuda \
      --variants "${TORCH_BENCH_VARIANTS:-nccl,gradcomm}" --sizes 4K,64K,1M,16M,64M --rounds 7 \
      --iters 7 --json "$out/torch_cuda_bench.json" 2>&1 |
      tee "$out/torch_cuda_allreduce_np$np.txt"
  done
  for model in mlp cnn; do
    echo "== torch's DDP step on CUDA, $model, np2"
    torch_mpirun 2 "${TORCH_BENCH_LIMIT:-150}" bench/torch_ddp_bench.py --device cuda --model "$model" --steps 10 \
      --variants compute,torch-ddp-nccl,torch-ddp-gradcomm --json "$out/torch_cuda_bench.json" 2>&1 |
      tee "$out/torch_cuda_ddp_$model.txt"
  done
}
# Host memory at 8 and 16 ranks (16 also in registered memory), a core each, against the machine's MPI_Allreduce with Open MPI's
# defaults (vader with the single-copy mechanism it picks).
cpu_ranks_bench() {
  (
    unset OMPI_MCA_btl OMPI_MCA_pml OMPI_MCA_btl_vader_single_copy_mechanism
    unset OMPI_MCA_rmaps_base_oversubscribe
    local np reg
    for np_reg in 8: 16: 16:--registered; do
      np=${np_reg%%:*} reg=${np_reg#*:}
      echo "== gradcomm-bench np$np, one core each ${reg:-(private buffers)}"
      timeout -k 10 150 mpirun -n "$np" --bind-to core --map-by core "$bundle/bin/gradcomm-bench" \
        -a auto,shm -b 8 -e 64M -f 4 -n 10 -w 3 --explore 1 $reg --csv 2>&1 |
        tee "$out/cpu_np${np}${reg:+_registered}.csv" | grep -v '^#' | cut -c1-160
    done
  )
}
# How mpirun places ranks on the emulated hosts: its allocation and map, and its launcher's log.
hosts_diagnosis() {
  command -v ip >/dev/null || export PATH=$PATH:$bundle/netroot/bin:$bundle/netroot/sbin
  {
    echo "== emulated hosts: placement"
    grep -v '^#' /etc/openmpi/openmpi-mca-params.conf 2>/dev/null | grep .
    env | grep -E '^(OMPI|PMIX|ORTE|PRTE|SLURM|HYDRA)' | sort
    scripts/hosts up 2 && scripts/hosts status
    # Are the hosts' namespaces distinct here? Each host's net and UTS namespace, its addresses.
    echo "outside: net $(readlink /proc/self/ns/net) uts $(readlink /proc/self/ns/uts); ip: $(command -v ip)"
    ip -V; systemd-detect-virt 2>/dev/null; ls -la /run/netns /var/run/netns 2>&1 | head
    for i in 0 1; do
      scripts/hosts exec "$i" sh -c 'echo "host: $(hostname) net $(readlink /proc/self/ns/net) uts $(readlink /proc/self/ns/uts)"; ip -4 -o addr'
    done
    scripts/hosts exec 0 sh -c 'getent hosts 10.213.7.2 gch1; ping -c1 -W1 10.213.7.2 | tail -2'
    scripts/hosts exec 0 /bin/sh -c "exec $PWD/scripts/hosts agent 10.213.7.2 hostname"
    timeout -k 10 60 scripts/mpirun-hosts 2x1 --display-allocation --display-map \
      --mca plm_base_verbose 5 --mca ras_base_verbose 5 --mca rmaps_base_verbose 5 -- \
      sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"'
    timeout -k 10 60 scripts/mpirun-hosts 2x1 --mca orte_keep_fqdn_hostnames 1 -- hostname
    scripts/hosts down
  } >"$out/hosts.txt" 2>&1
  grep -E "rank [0-9] on|^gc|ERROR|rror" "$out/hosts.txt" | head -20
}
# torch's DDP on CPU tensors across 2 emulated hosts at 1 Gbit/s: gloo against gradcomm's
# backend and gradcomm.torch's DDP wrapper, alternated (bench/torch_ddp_bench.py).
hosts_torch() {
  build_torch_modules || return
  command -v ip >/dev/null || export PATH=$PATH:$bundle/netroot/bin:$bundle/netroot/sbin
  (
    export OMPI_MCA_btl=self,tcp
    scripts/hosts up 2 && scripts/hosts shape 1gbit || exit 1
    for model in mlp cnn; do
      echo "== torch's DDP across 2 emulated hosts at 1 Gbit/s, $model"
      PYTHONPATH=$torch_build/python GLOO_SOCKET_IFNAME=eth0 GRADCOMM_TIMEOUT=60 \
        timeout -k 10 "${TORCH_BENCH_LIMIT:-150}" scripts/mpirun-hosts 2x1 -- "$torch_py" \
        bench/torch_ddp_bench.py --model "$model" --steps "${HOSTS_TORCH_STEPS:-8}" \
        --variants compute,torch-ddp,torch-ddp-gradcomm,gradcomm-ddp \
        --json "$out/hosts_torch.json" 2>&1 | tee "$out/hosts_torch_$model.txt"
    done
    scripts/hosts down
  ) || status=1
}
gpu_tests() {
  local spec test limit lines np
  # name, time limit, lines of output shown
  for spec in "test_gpu 150 25" "test_gpu_c 90 8"; do
    read -r test limit lines <<<"$spec"
    for np in 1 2 4; do
      echo "== $test np$np"
      timeout -k 10 "$limit" mpirun -n "$np" --bind-to none "$bundle/bin/$test" 2>&1 |
        tee "$out/${test}_np$np.txt" | tail -"$lines"
      [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
  done
  echo "== test_gpu_host np2"
  timeout -k 10 120 mpirun -n 2 --bind-to none "$bundle/bin/test_gpu_host" 2>&1 | tail -3
}
overlap() {
  command -v ip >/dev/null || export PATH=$PATH:$bundle/netroot/bin:$bundle/netroot/sbin
  (
    export OMPI_MCA_btl=self,tcp  # the emulated hosts talk TCP, never shared memory
    # The link first: host names, shaping, and what a 32 MiB all-reduce gets across it.
    scripts/hosts up 2 && scripts/hosts shape 1gbit && scripts/hosts status 2>&1 | tee "$out/link.txt"
    scripts/mpirun-hosts 2x1 -- hostname 2>&1 | tee -a "$out/link.txt"
    timeout -k 10 120 scripts/mpirun-hosts 2x1 -- "$bundle/bin/gradcomm-bench" -a ring -b 32M -e 32M \
      -n 3 -w 1 --no-baseline 2>&1 | grep -v '^#' | tee -a "$out/link.txt"
    build=$(mktemp -d) && mkdir -p "$build/trainer" && ln -s "$bundle/bin/gradcomm-train" "$build/trainer/"
    PAIRS=${PAIRS:-3} SETTINGS=${SETTINGS:-"hosts:halving_doubling:4194304"} \
      timeout -k 10 400 bench/overlap_report.sh "$build" 2>&1 | tee "$out/overlap.txt"
    exit "${PIPESTATUS[0]}"
  ) || status=1
}
engine_bench() {  # the engine on spare cores, which is quick
  local np poll
  for np in 2 4; do
    echo "== gradcomm-nonblocking-bench np$np"
    timeout -k 10 120 mpirun -n "$np" --bind-to core "$bundle/bin/gradcomm-nonblocking-bench" 2>&1 |
      tee "$out/nonblocking_np$np.txt"
  done
  for poll in 50 0; do  # the engine's wake, with and without its poll
    echo "== gradcomm-nonblocking-bench np2, GRADCOMM_ENGINE_POLL_US=$poll"
    GRADCOMM_ENGINE_POLL_US=$poll timeout -k 10 120 mpirun -n 2 --bind-to core \
      -x GRADCOMM_ENGINE_POLL_US "$bundle/bin/gradcomm-nonblocking-bench" 2>&1 |
      tee "$out/nonblocking_np2_poll$poll.txt"
  done
}
# Ranks share the one GPU: a distinct NCCL_HOSTID per rank makes NCCL connect them over its
# socket transport (it refuses two ranks on one device of one host).
bench() {  # bench NP NAME [env ...]
  local np=$1 name=$2
  shift 2
  echo "== gradcomm-bench --device gpu np$np $*"
  timeout -k 10 240 env "$@" mpirun -n "$np" --bind-to none bash -c \
    'NCCL_HOSTID=gradcomm-bench-$OMPI_COMM_WORLD_RANK exec "$0" "$@"' \
    "$bundle/bin/gradcomm-bench" --device gpu -b 8 -e 256M -f 8 -n 10 -w 3 2>&1 |
    tee "$out/bench_gpu_$name.txt"
}
benches() {
  echo "== pack bench"
  (cd "$bundle" && timeout -k 10 120 bin/gradcomm-gpu-pack-bench workloads/resnet50.json \
     workloads/bert_base.json workloads/mobilenet_v2.json workloads/vgg16.json) 2>&1 |
    tee "$out/pack_bench.txt"
  bench 1 np1
  bench 2 np2
  bench 4 np4_rpn2_nccl GRADCOMM_RANKS_PER_NODE=2 GRADCOMM_GPU_INTER_NODE=nccl
  bench 4 np4_rpn2_mpi GRADCOMM_RANKS_PER_NODE=2 GRADCOMM_GPU_INTER_NODE=mpi
}
for what in "${@:-all}"; do
  case $what in
    all) torch_cuda_tests; gpu_tests; benches ;;
    tests) torch_cuda_tests; gpu_tests; engine_bench ;;
    bench) benches ;;
    torch) torch_cuda_tests ;;
    torch-bench) torch_cuda_bench ;;
    cpu-ranks) cpu_ranks_bench ;;
    hosts) hosts_diagnosis ;;
    hosts-torch) hosts_torch ;;
    overlap) overlap ;;
    *) echo "run_on_device.sh: unknown mode '$what'" >&2; exit 2 ;;
  esac
done
exit $status
