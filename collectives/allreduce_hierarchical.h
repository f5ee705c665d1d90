#pragma once

#include "collectives/allreduce_algorithm.h"

#include <cstddef>

namespace gradcomm::collectives {

// The cross-group phase all-reduces each shard with halving_doubling below this size, with the
// ring from it (the crossover measured on 2 and 4 ranks).
inline constexpr std::size_t kHierarchicalRingFromBytes = std::size_t{4} << 20;

// How hierarchical reduce-scatters and all-gathers inside a group (Config::hierarchical_intra).
enum class Intra { direct, ring, shm };

// The form "auto" picks for a call of `bytes` in a group of `group_size` ranks; `shm_ok` when the
// group shares one host and its segment exists. Deterministic: every member picks the same.
Intra hierarchical_intra_auto(std::size_t bytes, int group_size, bool shm_ok);

// Drops the communicator's hierarchy (sub-communicators and their shm segments). Called on every
// rank together after a mismatch ended a call, possibly inside a phase: the next call builds
// fresh ones, so no message or counter of the abandoned call is seen again.
void forget_hierarchy(Communicator& comm);

class AllreduceHierarchical : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "hierarchical"; }
  // Device buffers take the GPU form (gpu_hierarchical_allreduce in allreduce_nccl.h).
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
