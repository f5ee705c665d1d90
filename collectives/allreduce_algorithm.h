#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "collectives/check/call_context.h"
#include "collectives/select/cost_model.h"
#include "core/communicator.h"
#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm::collectives {

// A plain, type-erased description of one all-reduce call.
struct AllreduceArgs {
  const void* send;  // == recv means in-place
  void* recv;
  std::size_t count;
  DataType dtype;
  ReduceOp op;
  std::uint64_t sequence = 0;  // the communicator's call number, equal on all ranks
  // GPU calls (the front door sets these after classifying the pointers): the buffers are CUDA
  // memory of device `gpu`, work is enqueued on `stream` (a cudaStream_t), and an asynchronous
  // call returns once enqueued. Host algorithms never see device == true.
  bool device = false;
  int gpu = -1;
  void* stream = nullptr;
  bool asynchronous = false;
  // The call this is part of (the front door's; an algorithm running another on a sub-
  // communicator hands it on): its message tags and the comparison its waits poll.
  CallContext call = {};

  bool in_place() const { return send == recv; }
  std::size_t element_bytes() const { return element_size(dtype); }
};

// What an algorithm can take and how it runs, for the front door, auto and the call check.
struct AllreduceCapabilities {
  bool host_buffers = true;     // reads and writes host memory on the CPU
  bool device_buffers = false;  // takes GPU buffers (the front door classifies pointers)
  // Its waits poll the call's comparison of fingerprints (AllreduceArgs::call), so the check can
  // run in the background; otherwise the check completes before the algorithm starts.
  bool polls_check = false;
};

// One all-reduce algorithm. Adding one: collectives/allreduce_<name>.{h,cc} and one line in
// collectives/registry.cc; the front door, auto, the checks and the benchmark ask the registry
// and this interface, never the name. The front door (gradcomm::allreduce) validates arguments
// and handles count == 0 and size == 1, so run() may assume size > 1 and count > 0; it must
// still handle count < size and counts not divisible by size. Every rank must end with
// bit-identical output, and op == avg must come back divided by the rank count.
class AllreduceAlgorithm {
 public:
  virtual ~AllreduceAlgorithm() = default;
  virtual std::string_view name() const = 0;
  virtual AllreduceCapabilities capabilities() const { return {}; }
  virtual bool supports(const AllreduceArgs&, const Communicator&) const { return true; }
  virtual void run(const AllreduceArgs& args, Communicator& comm) = 0;
  // True when run(args) begins with an exchange that carries CallContext::fingerprint() to every
  // peer and calls CallContext::call_proven once all agree (or require_check when they do not):
  // the consistency check then posts on its board only if that exchange waits long. It runs
  // before the check of the algorithm's first use, so it must not communicate (nor make state
  // whose making does).
  virtual bool proves_call(const AllreduceArgs&, Communicator&) const { return false; }
  // The cost model's seconds for one call of `bytes` (collectives/select/cost_model.h); nullopt
  // when the algorithm has no model here, and is then no candidate of auto's.
  virtual std::optional<double> predicted_seconds(const CostModel&, const CostQuery&) const {
    return std::nullopt;
  }
};

}  // namespace gradcomm::collectives
