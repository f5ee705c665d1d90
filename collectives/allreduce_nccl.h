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

// ncclAllGather and ncclReduceScatter on device buffers, for front ends that hold GPU tensors
// (the torch backend's all-gathers and reduce-scatters, which FSDP issues). Each is one gradcomm
// call: its arguments are checked (both buffers on one GPU), it is compared across ranks like
// every call (kind, count, dtype, op) before NCCL is enqueued on `stream` (a cudaStream_t), and it
// returns once the result is ready, or with `asynchronous` once it is enqueued. `count` is the
// elements each rank contributes (all-gather) or receives (reduce-scatter); recv (all-gather) and
// send (reduce-scatter) hold comm.size() times as many. InvalidArgument for host memory or
// buffers on two devices; the reduce-scatter Unsupported in reproducible mode, as allreduce (an
// all-gather only copies).
void nccl_allgather(Communicator& comm, const void* send, void* recv, std::size_t count,
                    DataType dtype, void* stream, bool asynchronous);
void nccl_reduce_scatter(Communicator& comm, const void* send, void* recv, std::size_t count,
                         DataType dtype, ReduceOp op, void* stream, bool asynchronous);

// Why the GPU path cannot run in this process; empty when it can.
std::string nccl_unavailable_reason();

// NCCL communicators this process created, destroyed and aborted (tests check the cache).
struct NcclCommCounts {
  long created = 0, destroyed = 0, aborted = 0;
};
NcclCommCounts nccl_comm_counts();

}  // namespace gradcomm::collectives
