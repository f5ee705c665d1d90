#!/usr/bin/env bash
# How the files here were made (2 ranks, each bound to a core; launches alternating):
#   old_new.txt         gradcomm.torch before (old build's python dir) and after
#   against_horovod.txt Horovod 0.28.1 alone, then gradcomm.torch old and new, each in its own launch
#   steps_np2.txt, steps_np4.txt  bench/torch_ddp_bench.py (digits CNN; compute, gradcomm-hvd,
#                       gradcomm-ddp), old and new alternating (np4 oversubscribes the 2 cores)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
OLD=${OLD:?the python dir of a build before the change}
NEW=${NEW:-$ROOT/build/python}
HP=$("$ROOT/bench/horovod/env.sh")
for i in 1 2 3; do
  for b in old new; do
    P=$OLD; [ $b = new ] && P=$NEW
    PYTHONPATH=$P mpirun -np 2 --bind-to core python3 "$ROOT/bench/horovod/latency.py" \
      --libs gradcomm --label "$b launch$i " | grep ranks
  done
done
for i in 1 2 3; do
  mpirun -np 2 --bind-to core "$HP" "$ROOT/bench/horovod/latency.py" --libs horovod \
    --label "horovod launch$i " | grep ranks
  for b in old new; do
    P=$OLD; [ $b = new ] && P=$NEW
    PYTHONPATH=$P mpirun -np 2 --bind-to core "$HP" "$ROOT/bench/horovod/latency.py" \
      --libs gradcomm --label "gradcomm-$b launch$i " | grep ranks
  done
done
