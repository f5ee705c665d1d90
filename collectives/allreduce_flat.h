#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

class AllreduceFlat : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "flat"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
