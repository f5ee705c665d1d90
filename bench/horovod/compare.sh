#!/usr/bin/env bash
# The real Horovod beside gradcomm.torch: horovod.torch.DistributedOptimizer against
# gradcomm.torch's DistributedOptimizer and DistributedDataParallel in the same launch, steps
# alternating (bench/torch_ddp_bench.py), on the digits CNN and the 8.4 M-parameter MLP, at 2 and
# 4 ranks on this host; with --hosts, across 2 emulated hosts at 1 Gbit/s (scripts/mpirun-hosts).
# Every variant ends with the same parameters (printed). Horovod runs with its defaults (MPI CPU
# operations, 1 ms cycle, 128 MiB fusion), as its documentation recommends for a start.
# Horovod runs as `horovod-scoped`: initialized before its own steps and shut down after them
# (see --separate for why: its background thread otherwise slows every variant in the process).
# gradcomm-hvd-no-negotiator closes gradcomm.torch's negotiator before its steps (its first call
# makes a new one): a fresh negotiator against one that cycled through the other variants' steps.
# gradcomm-ddp-bucket-view is gradcomm's DDP with gradient_as_bucket_view=True (torch DDP's option; the gradients are produced in the
# buckets' registered memory, and nothing is packed or unpacked).
# usage: bench/horovod/compare.sh [--torch2] [--hosts] [--steps N] [--json FILE] [--separate N]
#   --torch2: torch 2.x (scripts/common.sh's pin) instead of Debian's torch 1.13
#   --separate N: Horovod and gradcomm in separate launches instead of one, alternated N times
#     each (launch H: compute,horovod; launch G: compute and the gradcomm variants), with a
#     summary by bench/horovod/summary.py. Once initialized, Horovod's background thread runs its
#     negotiation cycle (every 1 ms, MPI collectives that spin while they wait) for the whole
#     process, so in a shared launch every variant pays for it, the compute alone included: on
#     these 2 cores the MLP's compute took 1.5x longer with Horovod initialized. A gradcomm user
#     does not pay that; a Horovod user does, and launch H measures it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
hosts=0 steps=30 json= flavour=torch1 separate=0
while (($#)); do
  case $1 in
    --torch2) flavour=torch2 ;;
    --hosts) hosts=1 ;;
    --steps) steps=$2; shift ;;
    --json) json=$2; shift ;;
    --separate) separate=$2; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
PY=$("$ROOT/bench/horovod/env.sh" "$flavour")
export PYTHONPATH=$ROOT/build/python OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
variants=compute,horovod-scoped,gradcomm-hvd,gradcomm-hvd-no-negotiator,gradcomm-ddp,gradcomm-ddp-bucket-view
if ((hosts)); then  # two emulated hosts, links shaped to 1 Gbit/s
  "$ROOT/scripts/hosts" up 2 >/dev/null
  "$ROOT/scripts/hosts" shape 1gbit
fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores; horovod 0.28.1, torch $("$PY" -c 'import torch; print(torch.__version__)')"
launch() {  # launch NP VARIANTS MODEL JSON [save-params dir]
  local np=$1 which=$2 model=$3 out=$4 params=${5:-}
  local bench=("$ROOT/bench/torch_ddp_bench.py" --model "$model" --variants "$which"
               --steps "$steps" --json "$out" ${params:+--save-params "$params"})
  if ((hosts)); then
    "$ROOT/scripts/mpirun-hosts" 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -- "$PY" "${bench[@]}"
  else
    mpirun -np "$np" --oversubscribe --bind-to none -x PYTHONPATH -x OMP_NUM_THREADS "$PY" \
      "${bench[@]}"
  fi
}
if ((separate)); then
  dir=${json:-$(mktemp -d)}
  [[ -n $json ]] && mkdir -p "$dir"
  nps="2 4"
  ((hosts)) && nps=2
  for model in cnn mlp; do
    for np in $nps; do
      for ((rep = 1; rep <= separate; rep++)); do
        echo "== $model np$np, launch pair $rep of $separate"
        launch "$np" compute,horovod "$model" "$dir/horovod.jsonl" "$dir/params"
        launch "$np" compute,gradcomm-hvd,gradcomm-ddp,gradcomm-ddp-bucket-view "$model" \
          "$dir/gradcomm.jsonl" "$dir/params"
      done
    done
  done
  "$PY" "$ROOT/bench/horovod/summary.py" "$dir"
  exit
fi
for model in cnn mlp; do
  if ((hosts)); then
    "$ROOT/scripts/mpirun-hosts" 2x1 -x PYTHONPATH -x OMP_NUM_THREADS -- "$PY" "$ROOT/bench/torch_ddp_bench.py" \
      --model "$model" --variants "$variants" --steps "$steps" ${json:+--json "$json"}
  else
    for np in 2 4; do
      mpirun -np "$np" --oversubscribe --bind-to none -x PYTHONPATH -x OMP_NUM_THREADS "$PY" \
        "$ROOT/bench/torch_ddp_bench.py" --model "$model" --variants "$variants" \
        --steps "$steps" ${json:+--json "$json"}
    done
  fi
done
