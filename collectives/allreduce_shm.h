#pragma once

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// Intra-node all-reduce through shared memory, for communicators whose ranks all share one
// host. Ranks read each other's data from a segment every rank maps, synchronised by counters in
// that segment (acquire/release; waits spin briefly, then yield the core). Two paths:
//   - latency path (<= kShmSmallBytes, 16 KiB): each rank copies its input into its slot, raises
//   one counter, and
//     every rank reduces all slots in rank order straight into its output: one flag round;
//   - staged path: the buffer goes in rounds of kShmRoundBytes (256 KiB) per rank; each rank copies
//   a round into
//     its slot, reduces its 1/n of the round from all slots (rank order) into a shared result,
//     and copies the whole round out, the next round's copy-in overlapping the wait for peers.
//     The working set stays cache-resident, so memory sees about one read of the input and one
//     write of the output per rank. A registered input (Communicator::allocate) skips the
//     copy-in: peers read it in place.
// Each part is reduced by one rank, in rank order, so every rank ends with the same bits (those
// of the serial reduction). Ranks that disagree on count, dtype or op get an error on every rank
// instead of reading past a buffer. A peer that exits while others wait is detected (its pid),
// and the waiters throw CommError instead of hanging.
// The segment, its counters and waits: shm/segment.h; the choice of plain or streamed stores
// into it from 4 MiB: shm/store_choice.h.
class AllreduceShm : public AllreduceAlgorithm {
 public:
  std::string_view name() const override { return "shm"; }
  AllreduceCapabilities capabilities() const override {
    return {.host_buffers = true, .device_buffers = false, .polls_check = true};
  }
  void run(const AllreduceArgs& args, Communicator& comm) override;
  std::optional<double> predicted_seconds(const CostModel& model,
                                          const CostQuery& q) const override;
};

}  // namespace gradcomm::collectives
