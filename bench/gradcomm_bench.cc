// gradcomm-bench: all-reduce timings in the style of nccl-tests' all_reduce_perf, with
// MPI_Allreduce measured in the same run as the baseline.
//
//   mpirun -np 4 gradcomm-bench -b 8 -e 256M -f 4 -a ring,halving_doubling -n 20 -w 5 -c 1
//
// Method: for each size, every algorithm is warmed up, then timed in rounds that alternate the
// algorithms (this machine's speed drifts, so only interleaved measurements are compared). A
// round is, for each algorithm, a barrier followed by a batch of back-to-back calls, the same
// count for every algorithm at a size, sized so the fastest one's batch lasts at least ~200 us
// (small messages would otherwise measure the timer and the barrier); each round runs them in
// a fresh random order (the same on every rank), since what ran just before changes the caches
// and the scheduler's state: rotating one order would leave every algorithm after the same one
// (on 4 ranks sharing 2 cores, that alone moved one algorithm against another by up to 18%).
// The time of a round is the slowest rank's per-call average; statistics are over rounds. vs_mpi is
// MPI_Allreduce's median time divided by the algorithm's median time (> 1: faster than
// MPI_Allreduce). vs_best pairs the rounds: the median over rounds of (the best fixed algorithm's
// time in that round / this algorithm's time in that round), the best fixed one being the gradcomm
// algorithm other than auto with the lowest median (1: as fast; below 1: slower). Pairing cancels
// the drift between rounds, which a ratio of two medians keeps; both are reported for auto after
// the sweep.

// The engine (options, rounds, check, output) is bench.h; each mode has its own file.

#include <malloc.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>

#include "bench/bench.h"
#include "core/error.h"

namespace {

int run(int argc, char** argv) {
  int rank = 0;
  gradcomm::check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "gradcomm-bench: MPI_Comm_rank");
  const std::optional<gradcomm::bench::Options> parsed = gradcomm::bench::parse(argc, argv, rank);
  if (!parsed) return 0;
  gradcomm::Communicator comm(MPI_COMM_WORLD);
  if (!parsed->workload.empty()) return gradcomm::bench::run_workload(comm, *parsed);
  return gradcomm::bench::run_sweep(comm, *parsed);
}

}  // namespace

int main(int argc, char** argv) {
  // A fair baseline: Open MPI's MPI_Allreduce allocates a temporary buffer per call, and from
  // ~32 MiB glibc would map it fresh each time (here ~3.4 ms per MiB touched). Off before MPI
  // starts, unless --default-malloc (docs/benchmarking.md).
  bool default_malloc = false;
  for (int i = 1; i < argc; ++i)
    default_malloc = default_malloc || std::strcmp(argv[i], "--default-malloc") == 0;
  if (!default_malloc) {
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  }
  gradcomm::init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
    rc = 2;
  }
  gradcomm::finalize();
  return rc;
}
