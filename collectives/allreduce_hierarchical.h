#pragma once

#include "collectives/allreduce_algorithm.h"

#include <cstddef>

namespace gradcomm::collectives {

// The cross-group phase all-reduces each shard with halving_doubling below this size, with the
// ring from it (the crossover measured on 2 and 4 ranks).
inline constexpr std::size_t kHierarchicalRingFromBytes = std::size_t{4} << 20;

class AllreduceHierarchical : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "hierarchical"; }
  // Device buffers take the GPU form (gpu_hierarchical_allreduce in allreduce_nccl.h).
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
