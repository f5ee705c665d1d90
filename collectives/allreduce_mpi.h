#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// MPI_Allreduce of the MPI library, the baseline. float16/bfloat16 and avg, which MPI lacks, use
// user-defined MPI operations built on gradcomm's kernels (created once per communicator); avg
// is a sum followed by a local division. MPI's standard recommends, but does not guarantee, that
// every rank gets the same bits; Open MPI 4.1's algorithms do, and the test suite checks it.
class AllreduceMpi : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "mpi"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
