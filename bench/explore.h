#pragma once

// auto's exploring of one size, untimed, before a benchmark times it: gradcomm-bench --explore
// and the peers' harnesses (bench/peers/ccl_bench.cc) alike. A training loop repeats its sizes
// thousands of times, so the timed calls should see auto's steady state, not its exploring.

#include <mpi.h>

#include "collectives/select/auto_select.h"
#include "gradcomm/gradcomm.h"

namespace gradcomm::bench {

struct Exploration {
  int calls = 0;
  double seconds = 0;
  bool settled = true;
};

// Calls `call` (an auto call of `args`' count, dtype and op) 8 at a time until auto has settled
// there (gradcomm::collectives::auto_settled: the same on every rank), for at most max_seconds
// (the slowest rank's clock decides, so every rank stops at the same call).
template <class Call>
Exploration explore_auto(Communicator& comm, const collectives::AllreduceArgs& args,
                         double max_seconds, Call call) {
  const MPI_Comm mpi = comm.mpi_comm();
  Exploration e;
  MPI_Barrier(mpi);
  const double t0 = MPI_Wtime();
  while (!collectives::auto_settled(args, comm)) {
    for (int i = 0; i < 8; ++i, ++e.calls)
      call();
    double elapsed = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, mpi);
    e.seconds = elapsed;
    if (elapsed > max_seconds) {
      e.settled = collectives::auto_settled(args, comm);
      break;
    }
  }
  return e;
}

}  // namespace gradcomm::bench
