#!/usr/bin/env bash
# timeline_copies.sh MPIEXEC PYTHON [MPIEXEC FLAGS...]: both copies of gradcomm in one process
# write whole timelines of their own (timeline_copies.py), at 2 ranks.
set -euo pipefail
mpiexec=$1 python=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
GRADCOMM_TIMELINE=$work/trace.json "$mpiexec" -n 2 "$@" "$python" "$here/timeline_copies.py"
"$python" "$here/timeline_copies.py" --check "$work"
