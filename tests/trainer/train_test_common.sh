# Shared by train_cli_test.sh and train_kill_test.sh (sourced after MPIEXEC and TRAIN are set):
# the mpirun command, a work directory removed (with any rank left running in it) at exit,
# failure counting and the model hash of a gradcomm-train log.
RUN=("$MPIEXEC" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
# Every run uses algorithm auto, whose choice depends on a timing calibration that may differ
# between the uninterrupted and the resumed run on a loaded machine (seen under the sanitizers);
# in the reproducible mode every algorithm gives the same bits, so the hashes must agree.
export GRADCOMM_DETERMINISTIC=1
WORK=$(mktemp -d)
trap 'pkill -9 -f "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
hash_of() { sed -n 's/.*model hash \([0-9a-f]*\).*/\1/p' "$1"; }
