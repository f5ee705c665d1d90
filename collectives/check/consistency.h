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
//   its shared call descriptors. shm carries a hash of the whole fingerprint in the one line each
//   rank writes in a call's first round anyway (its packet, on every path): on the board its
//   fingerprint is posted only when a wait grows long (a peer in another call may be polling for
//   it), and a call whose lines all agree reads no peer's post (CallContext::call_proven). After
//   a mismatch every rank re-duplicates its MPI communicator and drops its shm segment (the next
//   call maps a fresh one).
//   Everything else (mpi, hierarchical, broadcast, allgatherv, grouped_allreduce, calls with count
//   0, an algorithm's first use on a communicator) completes the comparison before it starts.
// - full: every call compares before it starts, and an all-reduce then compares a hash of every
//   rank's output, so a silent divergence is an error too.
// - off: no comparison (the recorder and the tags stay).
// Calls that gradcomm makes inside a call (sub-communicators of hierarchical, auto's
// calibration, grouped_allreduce's buckets) belong to the outer call: their scopes are built with
// the outer call's context, do no comparison of their own and hand the outer context on.
// After a mismatch, every rank renews its MPI communicator and drops the per-communicator state
// that cannot outlive an abandoned call (Attachment::survives_mismatch: shm's segment,
// hierarchical's sub-communicators); the next call builds it afresh.

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/check/call_context.h"
#include "collectives/check/call_info.h"
#include "core/communicator.h"
#include "core/request.h"

namespace gradcomm::collectives {

class CheckState;  // per-communicator comparison state (consistency.cc)

class CallScope {
 public:
  // `call` names the operation in errors ("allreduce(ring)"). Records the call's start. With
  // `outer`, the call is part of that call (see above).
  CallScope(Communicator& comm, const CallInfo& info, std::string_view call,
            const CallContext* outer = nullptr);
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;

  // Compares now (blocking) unless already compared: before anything that could hang or mix
  // messages with a mismatched peer (blocking MPI collectives, set-up on first use).
  void check_now();
  // Compares now when `what` (an algorithm, or "auto" for the selection) has not run on this
  // communicator yet: first uses may build state with collectives of their own.
  void before_first_use(std::string_view what);
  // Starts the comparison of a call that runs `algorithm`: in the background when the algorithm
  // polls it in its waits (`polls_check`, AllreduceCapabilities), else completed first.
  // `proves_call`: the algorithm's first exchange carries CallContext::fingerprint() to every
  // peer (shm's latency path), so on the board the fingerprint is posted only once its waits poll
  // (a peer in another call needs it there) or it cannot prove the call, and a proven call
  // (CallContext::call_proven) reads no peer's post: one cross-core line less per call.
  void start(std::string_view algorithm, bool polls_check, bool proves_call = false);
  // The call is done: completes the comparison (MismatchError on every rank when the ranks
  // disagree) and, in full mode, compares the output's hash when `output` is given.
  void finish(const void* output = nullptr, std::size_t bytes = 0);

  bool outermost() const { return outermost_; }
  // What the call's algorithms are given (AllreduceArgs::call).
  const CallContext& context() const { return context_; }

  // When every rank makes this kind of call but the details differ (a grouped_allreduce's
  // tensor lists), `reporter` runs on every rank instead of the generic message: it may use
  // collectives to explain the difference, and must throw.
  void on_detail_mismatch(std::function<void()> reporter) { reporter_ = std::move(reporter); }
  const std::function<void()>& detail_reporter() const { return reporter_; }

 private:
  friend class CallContext;
  void post_fingerprint(CheckState& state);
  void post_deferred();
  void prove();
  bool pending() const;
  void poll();

  Communicator& comm_;
  CheckState* state_ = nullptr;  // comm_'s (outermost scopes only)
  CallInfo info_;
  CallContext context_;
  std::string_view call_;
  bool outermost_ = false;
  std::function<void()> reporter_;
  bool compared_ = false;  // the comparison was posted (and maybe completed), or deferred
  bool proves_ = false;    // start()'s proves_call, on the board
  bool deferred_ = false;  // the board post is left to the algorithm's waits or to finish()
  bool finished_ = false;
};

// A call that failed on this rank before it could run (a front end refused its arguments here),
// where the other ranks may be making it: takes the call's place in the comparison as a call of
// kind `failed` (`attempted` names what it was), so that the ranks which made the call get a
// MismatchError naming this rank instead of waiting for it, or meeting this rank's next call of
// the same shape in its place, and every rank's calls stay in step. Returns when every rank's
// call failed alike; otherwise throws MismatchError here too (the caller reports its own error
// instead). With GRADCOMM_CHECK=off it only takes the call's sequence number.
void compare_failed_call(Communicator& comm, CallKind attempted, std::string_view call);

// compare_failed_call queued on the communicator's progress engine behind the calls submitted
// before it, so that the caller does not wait for the other ranks. Its MismatchError (the other
// ranks made the call: their error) is dropped; the caller reports its own. Needs MPI at
// MPI_THREAD_MULTIPLE where there are other ranks.
Request ifailed_call(Communicator& comm, CallKind attempted, std::string call);

// Keeps the ranks' calls in step where a front door's call fails on this rank before it begins
// (its arguments refused here): unwinding from such a failure, compare_failed_call takes the
// call's place (its own errors are dropped: the caller gets this rank's). A call begins with its
// outermost CallScope, or at began() (a nonblocking front door, once it has queued the call).
// Declared first in every front door, after settle(); in nested front doors the innermost
// one that had not begun stands in. A blocking front door's stand-in runs at once; a
// nonblocking one's (`queued`) is queued on the communicator's engine behind the calls before
// it, so that the caller never waits for the other ranks there (they may be waiting for this
// rank's next call on another communicator first).
class KeepInStep {
 public:
  KeepInStep(Communicator& comm, CallKind kind, std::string_view call, bool queued = false);
  ~KeepInStep();
  KeepInStep(const KeepInStep&) = delete;
  KeepInStep& operator=(const KeepInStep&) = delete;

  static void began();

 private:
  Communicator& comm_;
  const CallKind kind_;
  const std::string_view call_;
  const bool queued_;
  const int exceptions_;  // in flight when the call was made
  const bool outer_;      // whether an enclosing front door's call had begun
};

// "ranks disagree on ...: ranks 0,1 call allreduce #4: ...; rank 2 calls ..." from the
// fingerprints of every rank (index = rank).
std::string describe_mismatch(const std::vector<CallInfo>& calls);

}  // namespace gradcomm::collectives
