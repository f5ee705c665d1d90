#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

class AllreduceFlat : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "flat"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = true, .device_buffers = false, .polls_check = true};
  }
  std::optional<double> predicted_seconds(const CostModel& model,
                                          const CostQuery& q) const override;
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

}  // namespace gradcomm::collectives
