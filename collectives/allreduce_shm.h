#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// Intra-node all-reduce through shared memory, for communicators whose ranks all share one
// host. No rank ever stores into a cache line a peer has just read, and there is no shared result
// area (the slow case on these machines: docs/algorithms.md#shm). Paths:
//   - latency path (up to 1 KiB, 2 KiB on Intel CPUs, or 8 KiB where ranks share CPUs:
//     shm_small_limit in shm/segment.h): each rank writes one cache-line packet (the call's
//     fingerprint, data up to 32 B, the round as flag) and its input, if larger, into its small
//     slot; every rank reduces all inputs in rank order straight into its output: one flag round;
//   - registered buffers (Communicator::allocate) where every rank's input and output are
//     registered: one round; each rank reduces its 1/n slice from all n inputs into all n
//     outputs, the lines it just read; no copy-in, no copy-out;
//   - otherwise rounds of kShmRoundBytes (kShmRoundIntelPairBytes on 2 ranks of an Intel CPU:
//     shm_allreduce_round_bytes), the next round's copy-in overlapping the peers'
//     reductions (where ranks share CPUs: rounds of all kShmStageSlots slots at once, one after
//     the other, for a quarter of the waits): a private input stages only the parts peers reduce
//     into its rank's slot; each reducer writes its slice into its own output and back into each
//     peer's slot (or registered output), and owners copy their result out of their slot.
// Each slice is reduced by one rank, in rank order, so every rank ends with the same bits (those
// of the serial reduction). Ranks that disagree on count, dtype or op get an error on every rank
// instead of reading past a buffer. A peer that exits while others wait is detected (its pid),
// and the waiters throw CommError instead of hanging. The segment, its counters and waits:
// shm/segment.h.
class AllreduceShm : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "shm"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = true, .device_buffers = false, .polls_check = true};
  }
  void run(const AllreduceArgs& args, Communicator& comm) override;
  // Every call's first round carries each rank's packet, the call's whole fingerprint in it
  // (the latency path's flag; the other paths' packets are read once `copied` is up).
  bool proves_call(const AllreduceArgs& args, Communicator& comm) const override;
  std::optional<double> predicted_seconds(const CostModel& model,
                                          const CostQuery& q) const override;
};

}  // namespace gradcomm::collectives
