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
  reduce = 11,    // an all-reduce whose result one rank keeps (a front end's, CallAnnotation)
  allocate = 12,  // the check before a front end's collective allocation (CallAnnotation)
  failed = 13,    // a call that failed on its rank before it could run (compare_failed_call);
                  // `detail` holds the kind of call it was
};
std::string_view to_string(CallKind kind);

struct CallInfo {
  std::uint64_t sequence = 0;
  CallKind kind = CallKind::allreduce;
  std::int16_t element = -1;             // the front end's element type (CallAnnotation), or -1
  std::uint64_t count = 0;               // elements (grouped: all tensors; allgatherv: all ranks)
  int dtype = -1;                        // DataType, -1 when mixed or not applicable
  int op = -1;                           // ReduceOp, -1 when not applicable
  int root = -1;                         // broadcast, gather, scatter, reduce
  int algorithm = -1;                    // index into algorithm_names(), -1 when none
  const char* algorithm_name = nullptr;  // the same name, in static storage
  std::uint64_t detail = 0;  // hash of the tensor list (grouped) or of the counts (allgatherv)
  bool device = false;       // GPU buffers: the NCCL path bounds its own waits first
};

// What a front end knows of its calls beyond what it passes gradcomm, compared across ranks with
// the rest of each call (so that ranks that differ in it get a MismatchError, not a result):
// - `element`, the front end's own element type (torch's dtype: an int8 tensor is reduced as
//   int64, a complex64 one as float32 pairs, and gathers, scatters and broadcasts move bytes, so
//   gradcomm's own fields cannot tell such a tensor from another dtype's), -1 for none;
// - `root`, for a reduce that runs as an all-reduce of which only the root keeps the result
//   (the call is then described and compared as a reduce), -1 for none;
// - `as`, for an all-reduce that runs another collective whose result each rank takes part of
//   (torch's reduce_scatter on host tensors: CallKind::reduce_scatter), so that it disagrees
//   with a plain all-reduce of the same size on another rank; CallKind::allocate for the
//   all-reduce that checks a front end's collective allocation (torch's DDP buckets), so that
//   a rank whose next call is another collective gets a MismatchError, not a hang;
//   CallKind::allreduce for none;
// - `list`, for a call that is one of a front end's coalesced list of calls (torch's
//   all_gather_coalesced), a hash of the whole list, 0 for none: ranks whose lists differ in
//   length or shapes then disagree at the list's first call. Without it the rank with the
//   shorter list would complete its list and meet the difference only at its next call, if any.
// Lives on the thread that makes the calls, for every call it begins meanwhile (not for the
// calls gradcomm makes inside them).
class CallAnnotation {
 public:
  explicit CallAnnotation(int element, int root = -1, CallKind as = CallKind::allreduce,
                          std::uint64_t list = 0);
  ~CallAnnotation();
  CallAnnotation(const CallAnnotation&) = delete;
  CallAnnotation& operator=(const CallAnnotation&) = delete;

  // The innermost annotation of this thread, or nullptr.
  static const CallAnnotation* current();

  const int element, root;
  const CallKind as;
  const std::uint64_t list;

 private:
  const CallAnnotation* const outer_;
};

// Applies the current annotation, if any, to `call`.
void annotate(CallInfo& call);

// Names a front end's element types in descriptions ("torch.int8"); set once by the front end.
// Without it, "element type N".
void set_element_namer(std::string (*namer)(int element));

// "allreduce #41: 1000 x float32 sum, algorithm ring".
std::string describe(const CallInfo& call);

// The flight recorder's record of `call` (GPU calls get 5 s of grace: the NCCL path times out
// first and says more).
watchdog::Record to_record(const CallInfo& call);

}  // namespace gradcomm::collectives
