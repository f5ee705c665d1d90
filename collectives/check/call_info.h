#pragma once

// The fingerprint of one collective call: what every rank should agree on. The call check
// (consistency.h) compares it across ranks; the stall watchdog's flight recorder keeps it for its
// report (to_record / describe).

#include <cstdint>
#include <string>
#include <string_view>

#include "core/watchdog.h"

namespace gradcomm::collectives {

enum class CallKind : std::uint8_t {
  allreduce = 1,
  broadcast = 2,
  allgatherv = 3,
  grouped_allreduce = 4,
  gather = 5,
  allgather = 6,
  scatter = 7,
  alltoall = 8,
  barrier = 9,
  reduce_scatter = 10,
};
std::string_view to_string(CallKind kind);

struct CallInfo {
  std::uint64_t sequence = 0;
  CallKind kind = CallKind::allreduce;
  std::uint64_t count = 0;               // elements (grouped: all tensors; allgatherv: all ranks)
  int dtype = -1;                        // DataType, -1 when mixed or not applicable
  int op = -1;                           // ReduceOp, -1 when not applicable
  int root = -1;                         // broadcast only
  int algorithm = -1;                    // index into algorithm_names(), -1 when none
  const char* algorithm_name = nullptr;  // the same name, in static storage
  std::uint64_t detail = 0;  // hash of the tensor list (grouped) or of the counts (allgatherv)
  bool device = false;       // GPU buffers: the NCCL path bounds its own waits first
};

// "allreduce #41: 1000 x float32 sum, algorithm ring".
std::string describe(const CallInfo& call);

// The flight recorder's record of `call` (GPU calls get 5 s of grace: the NCCL path times out
// first and says more).
watchdog::Record to_record(const CallInfo& call);

}  // namespace gradcomm::collectives
