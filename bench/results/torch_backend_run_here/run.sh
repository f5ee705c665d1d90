#!/bin/bash
# The waiter runs its call itself (commit a1b10ef) against the commit before it (1489a54), from
# the repository root: OLD=path/to/a/build/of/1489a54/python (a git worktree built with
# scripts/common.sh's build), NEW=build/python. Launches alternate old, new, old, new, ... with
# the same bench scripts; each build's gradcomm in its own launch.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
V=${XDG_CACHE_HOME:-$HOME/.cache}/gradcomm/venv-torch2.11/bin/python
OLD=${OLD:?the python folder of a build of 1489a54} NEW=${NEW:-build/python}
here=bench/results/torch_backend_run_here
ROUNDS=${ROUNDS:-3}
launch() { timeout 600 mpirun -np 2 -x PYTHONPATH -x OMP_NUM_THREADS "$@" 2>&1 | grep -v Warn; }
lscpu | grep "Model name"
for round in $(seq "$ROUNDS"); do
  for which in old new; do
    if [ $which = old ]; then export PYTHONPATH=$OLD; else export PYTHONPATH=$NEW; fi
    for py in /usr/bin/python3 $V; do
      echo "=== round $round $which layers $py"
      launch --bind-to core $py $here/layers.py
      echo "=== round $round $which ddp cnn np2 $py, 300 steps, backend alone"
      launch --oversubscribe --bind-to none $py bench/torch_ddp_bench.py --model cnn \
        --variants compute,torch-ddp,torch-ddp-gradcomm --steps 300 | tail -4 | head -3
    done
  done
done
