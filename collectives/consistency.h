#pragma once

// Consistency checks (GRADCOMM_CHECK) and the flight-recorder hook of every collective call.
//
// Each top-level call opens a CallScope with its fingerprint (sequence number, kind, count, dtype,
// op, algorithm, root, a hash of tensor lists or counts). The scope records the call for the stall
// watchdog and makes sure every rank made the same call:
// - default: ring, halving_doubling, flat and shm post the comparison and start at once; their
//   waits poll it, so a mismatch that would leave them waiting ends in MismatchError on every
//   rank. On a communicator whose ranks share one host the fingerprints go through a shared-
//   memory board (each rank writes its own and reads the others', no message); across hosts
//   through one MPI_Iallreduce of the fields' minima and maxima. Message tags carry a hash of the
//   fingerprint, so mismatched calls never exchange data; shm also compares the fingerprints in
//   its shared call descriptors. After a mismatch every rank re-duplicates its MPI communicator
//   and drops its shm segment (the next call maps a fresh one). Everything else (mpi,
//   hierarchical, broadcast, allgatherv, grouped_allreduce, calls with count 0, an algorithm's
//   first use on a communicator) completes the comparison before it starts.
// - full: every call compares before it starts, and an all-reduce then compares a hash of every
//   rank's output, so a silent divergence is an error too.
// - off: no comparison (the recorder and the tags stay).
// Calls that gradcomm makes inside a call (sub-communicators of hierarchical, auto's
// calibration, grouped_allreduce's buckets) belong to the outer call: their scopes do nothing.

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/communicator.h"
#include "core/watchdog.h"

namespace gradcomm::collectives {

class CheckState;  // per-communicator comparison state (consistency.cc)

class CallScope {
 public:
  // `call` names the operation in errors ("allreduce(ring)"). Records the call's start.
  CallScope(Communicator& comm, const watchdog::CallInfo& info, std::string_view call);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  // Compares now (blocking) unless already compared: before anything that could hang or mix
  // messages with a mismatched peer (blocking MPI collectives, set-up on first use).
  void check_now();
  // Compares now when `what` (an algorithm, or "auto" for the selection) has not run on this
  // communicator yet: first uses may build state with collectives of their own.
  void before_first_use(std::string_view what);
  // Chooses how to compare a call that runs `algorithm` (see above) and starts the comparison.
  void start(std::string_view algorithm);
  // The call is done: completes the comparison (MismatchError on every rank when the ranks
  // disagree) and, in full mode, compares the output's hash when `output` is given.
  void finish(const void* output = nullptr, std::size_t bytes = 0);

  bool outermost() const { return outermost_; }

  // When every rank makes this kind of call but the details differ (a grouped_allreduce's
  // tensor lists), `reporter` runs on every rank instead of the generic message: it may use
  // collectives to explain the difference, and must throw.
  void on_detail_mismatch(std::function<void()> reporter) { reporter_ = std::move(reporter); }
  const std::function<void()>& detail_reporter() const { return reporter_; }

 private:
  void post_fingerprint(CheckState& state);

  Communicator& comm_;
  CheckState* state_ = nullptr;  // comm_'s (outermost scopes only)
  watchdog::CallInfo info_;
  std::string_view call_;
  bool outermost_ = false;
  std::function<void()> reporter_;
  bool compared_ = false;  // the comparison was posted (and maybe completed)
  bool finished_ = false;
};

// For wait loops: true while the current call's comparison is in flight.
bool check_pending();
// Tests the current call's comparison; throws MismatchError on every rank when it found one.
void poll_check();
// Completes the current call's comparison now (an algorithm about to block in an MPI
// collective calls this).
void require_check();
// The message tag for `base` (< 256) inside the current call: salted with the fingerprint's
// hash, so calls that disagree never match each other's messages.
int call_tag(int base);
// The fingerprint of the current outermost call (null outside any call), for shm's descriptors.
const watchdog::CallInfo* current_call();
// "ranks disagree on ...: ranks 0,1 call allreduce #4: ...; rank 2 calls ..." from the
// fingerprints of every rank (index = rank).
std::string describe_mismatch(const std::vector<watchdog::CallInfo>& calls);

}  // namespace gradcomm::collectives
