#pragma once

#include "collectives/allreduce_algorithm.h"

#include <cstddef>

namespace gradcomm::collectives {

class AllreduceHalvingDoubling : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "halving_doubling"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = true, .device_buffers = false, .polls_check = true};
  }
  std::optional<double> predicted_seconds(const CostModel& model,
                                          const CostQuery& q) const override;
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
