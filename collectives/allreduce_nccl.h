#pragma once

#include <string>

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// `nccl`: ncclAllReduce on device buffers through the GPU module (core/gpu_runtime.h). One NCCL
// communicator per gradcomm communicator, on the device of the first call's buffers, created on
// first use (the ncclUniqueId made on rank 0 and broadcast with MPI) and destroyed with the
// communicator. Waits poll the stream and NCCL's asynchronous error state; after
// Config::timeout_seconds the NCCL communicator is aborted and the call throws CommError.
class AllreduceNccl : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "nccl"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = false, .device_buffers = true, .polls_check = false};
  }
  bool supports(const AllreduceArgs& args, const Communicator&) const override {
    return args.device;
  }
  void run(const AllreduceArgs& args, Communicator& comm) override;
};

// The GPU hierarchical all-reduce (Horovod's shape), run by `hierarchical` for device buffers:
// ncclReduceScatter inside each group, an all-reduce of each shard across groups (NCCL, or with
// Config::gpu_inter_node == "mpi" gradcomm's host algorithms on shards staged through pinned
// memory), ncclAllGather inside each group. One group, uneven groups and integer avg (which two
// truncating divisions would get wrong) run the flat `nccl` instead.
void gpu_hierarchical_allreduce(const AllreduceArgs& args, Communicator& comm);

// Why the GPU path cannot run in this process; empty when it can.
std::string nccl_unavailable_reason();

// NCCL communicators this process created, destroyed and aborted (tests check the cache).
struct NcclCommCounts {
  long created = 0, destroyed = 0, aborted = 0;
};
NcclCommCounts nccl_comm_counts();

}  // namespace gradcomm::collectives
