#pragma once

#include "collectives/allreduce_algorithm.h"

#include <cstddef>

namespace gradcomm::collectives {

// How hierarchical reduce-scatters and all-gathers inside a group (Config::hierarchical_intra).
enum class Intra { direct, ring, shm };

// The form "auto" picks; `shm_ok` when the group shares one host, its segment exists and a round
// carries one element of every column. shm wherever it can run, direct otherwise. (Until the
// shm phases read and wrote registered buffers in place and staged through 4-deep slots, crowded
// groups of more than two ran direct above 4 MiB; measured since, on 8 ranks over 2 cores as
// 2 x 4, shm wins 1.1-1.9x with private buffers and 2.0-5.1x with registered ones at 4-64 MiB:
// docs/results/hierarchical.md.) The ring form is never picked here (it lost to direct at every
// size measured) and is there for groups whose links form a ring. Same inputs on every member:
// same pick.
Intra hierarchical_intra_auto(bool shm_ok);

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
