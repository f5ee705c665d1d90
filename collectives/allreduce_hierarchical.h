#pragma once

#include "collectives/allreduce_algorithm.h"

#include <cstddef>

namespace gradcomm::collectives {

// How hierarchical reduce-scatters and all-gathers inside a group (Config::hierarchical_intra).
enum class Intra { direct, ring, shm };

// The form "auto" picks for a call of `bytes` in a group of `group_size` ranks; `shm_ok` when the
// group shares one host and its segment exists, `crowded` when this machine runs more ranks than
// it has cores. shm wherever it can run, but for large calls in crowded groups of more than two:
// every one of shm's flag rounds (one per 256 KiB) needs all the group's ranks scheduled, and
// measured on 8 ranks over 2 cores (2 x 4) it fell behind direct from 8 MiB (README). direct
// otherwise; the ring form is never picked here (it lost to direct at every size measured) and
// is there for groups whose links form a ring. Same inputs on every member: same pick.
Intra hierarchical_intra_auto(std::size_t bytes, int group_size, bool shm_ok, bool crowded);

class AllreduceHierarchical : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "hierarchical"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = true, .device_buffers = true, .polls_check = false};
  }
  // Over one group hierarchical runs the ring: no candidate of its own then (nullopt).
  std::optional<double> predicted_seconds(const CostModel& model,
                                          const CostQuery& q) const override;
  // Device buffers take the GPU form (gpu_hierarchical_allreduce in allreduce_nccl.h).
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
