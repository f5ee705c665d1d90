#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

class AllreduceHalvingDoubling : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "halving_doubling"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
