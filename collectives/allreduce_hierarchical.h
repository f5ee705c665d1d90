#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

class AllreduceHierarchical : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "hierarchical"; }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
