#!/usr/bin/env bash
# Multi-host tests on emulated hosts (scripts/hosts: network namespaces, real TCP between them),
# launched by scripts/mpirun-hosts with no emulation variable: the layout is discovered.
#   multihost_test.sh BUILD_DIR SOURCE_DIR CASE
# CASE: topology      nodes discovered for 2x2, 3x2 and 3+1 match the host names and the layout
#       allreduce_2x2 the whole all-reduce suite (every algorithm, dtype, op, count) on 2 hosts
#       allreduce_3p1 the same on an uneven 3+1 (the 16 Mi-element runs left out: time)
#       traffic_3x2   hierarchical and ring on 3 hosts x 2: byte and message counters equal the
#                     analytic values on the real layout, results exact
#       nonblocking_2x1  the non-blocking suite on 2 hosts (shm left out): its waits on the
#                     progress thread against transfers over TCP and the comparison of calls
#                     over MPI (not the shared board of one host), a mismatch among them
#       torch_2x1     torch.distributed on the gradcomm backend and gloo, rendezvous from MPI,
#                     on hosts that cannot resolve each other's names (PYTHON: the interpreter)
# Exits 77 (CTest: skipped) with the reason when this machine cannot create namespaces.
set -uo pipefail
BUILD=$1
SOURCE=$2
CASE=$3
HOSTS=$SOURCE/scripts/hosts
LAUNCH=$SOURCE/scripts/mpirun-hosts

# A private set of hosts per test run, so runs never share or remove each other's.
export GRADCOMM_HOSTS_PREFIX=gct$$
"$HOSTS" check || exit 77
trap '"$HOSTS" down' EXIT
# The layout must be discovered, never emulated.
unset GRADCOMM_RANKS_PER_NODE GRADCOMM_TOPOLOGY

failures=0
run() {  # run LAYOUT EXPECTED_NODES PROGRAM [ARGS...]
  local layout=$1 expected=$2
  shift 2
  echo "== $layout: $*"
  if ! GRADCOMM_TEST_EXPECTED_LAYOUT=$expected timeout -k 10 400 "$LAUNCH" "$layout" "$@"; then
    echo "FAIL: $layout: $*"
    failures=$((failures + 1))
  fi
}

case "$CASE" in
  topology)
    "$HOSTS" up 3 || exit 1
    run 2x2 2,2 "$BUILD/tests/test_topology"
    run 3x2 2,2,2 "$BUILD/tests/test_topology"
    run 3,1 3,1 "$BUILD/tests/test_topology"
    # gradcomm-topo names the hosts.
    out=$(timeout -k 10 120 "$LAUNCH" 3,1 "$BUILD/topology/gradcomm-topo" --json)
    echo "$out"
    echo "$out" | grep -q "\"nodes\": \[\[0, 1, 2\], \[3\]\]" ||
      { echo "FAIL: gradcomm-topo --json nodes"; failures=$((failures + 1)); }
    echo "$out" | grep -q "\"hosts\": \[\"${GRADCOMM_HOSTS_PREFIX}h0\", \"${GRADCOMM_HOSTS_PREFIX}h0\", \"${GRADCOMM_HOSTS_PREFIX}h0\", \"${GRADCOMM_HOSTS_PREFIX}h1\"\]" ||
      { echo "FAIL: gradcomm-topo --json hosts"; failures=$((failures + 1)); }
    ;;
  allreduce_2x2)
    "$HOSTS" up 2 || exit 1
    run 2x2 2,2 "$BUILD/tests/test_allreduce"
    ;;
  allreduce_3p1)
    "$HOSTS" up 2 || exit 1
    run 3,1 3,1 "$BUILD/tests/test_allreduce" --gtest_filter=-*SixteenMiElements*
    ;;
  traffic_3x2)
    "$HOSTS" up 3 || exit 1
    run 3x2 2,2,2 "$BUILD/tests/test_allreduce" \
      "--gtest_filter=*HierarchicalLayouts*discovered*:*Exact*/hierarchical_*:*Exact*/ring_*"
    ;;
  nonblocking_2x1)
    "$HOSTS" up 2 || exit 1
    run 2x1 1,1 "$BUILD/tests/test_nonblocking" --gtest_filter=-*/shm  # shm: one host only
    ;;
  torch_2x1)
    # torch.distributed's rendezvous from MPI across hosts whose names do not resolve (python:
    # the interpreter with torch, as the python tests).
    "$HOSTS" up 2 || exit 1
    run 2x1 1,1 "${PYTHON:-/usr/bin/python3}" "$SOURCE/tests/python/torch_hosts_rendezvous.py"
    run 2x1 1,1 -x TEST_PREFER_LOOPBACK=1 "${PYTHON:-/usr/bin/python3}" \
      "$SOURCE/tests/python/torch_hosts_rendezvous.py"
    ;;
  *)
    echo "unknown case '$CASE'"
    exit 2
    ;;
esac
((failures == 0)) || {
  echo "$failures failure(s)"
  exit 1
}
echo "all passed"
