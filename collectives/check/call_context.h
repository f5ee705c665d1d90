#pragma once

// One collective call as its algorithm sees it, passed explicitly (AllreduceArgs::call): the
// fingerprint every rank should agree on, the salt of its message tags, and the comparison of
// fingerprints in flight (GRADCOMM_CHECK), which the algorithm's waits poll. Calls that gradcomm
// makes inside a call (sub-communicators of hierarchical, auto's calibration, grouped_allreduce's
// buckets) run with the outer call's context. A default context belongs to no call: no salt, no
// comparison (tests and benchmarks that run an algorithm directly).

#include <cstdint>
#include <string_view>

#include "collectives/check/call_info.h"

namespace gradcomm {
class Communicator;
}

namespace gradcomm::collectives {

class CallScope;

class CallContext {
 public:
  CallContext() = default;

  // The fingerprint of the call (null outside one).
  const CallInfo* info() const { return info_; }
  // The message tag for `base` (< 256) inside this call: salted with the fingerprint's hash, so
  // calls that disagree never match each other's messages.
  int tag(int base) const { return salt_ == 0 ? base : base + 256 * salt_; }
  // True while the call's comparison is in flight (wait loops then poll it).
  bool check_pending() const;
  // Tests the comparison; throws MismatchError on every rank when the ranks disagree.
  void poll_check() const;
  // Completes the comparison now (before blocking in an MPI collective).
  void require_check() const;
  // A hash of the whole fingerprint (0 outside a call): equal on two ranks exactly when they make
  // the same call (up to a 64-bit hash's collisions).
  std::uint64_t fingerprint() const { return fingerprint_; }
  // Says that every rank of `comm` was seen in this call with the same fingerprint() (an
  // algorithm that exchanged it in its first step, CallScope::start's `proves_call`): the
  // comparison then needs nothing more. Ignored unless `comm` is the call's own communicator.
  void call_proven(const Communicator& comm) const;

 private:
  friend class CallScope;
  CallContext(CallScope* scope, const CallInfo* info, int salt, std::uint64_t fingerprint)
      : scope_(scope), info_(info), salt_(salt), fingerprint_(fingerprint) {}

  CallScope* scope_ = nullptr;
  const CallInfo* info_ = nullptr;
  int salt_ = 0;
  std::uint64_t fingerprint_ = 0;
};

}  // namespace gradcomm::collectives
