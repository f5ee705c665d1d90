#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

class AllreduceRing : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "ring"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
