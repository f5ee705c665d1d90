// shm's reduce-scatter: the all-reduce's staged rounds (allreduce_shm.cc; the segment's protocol
// in shm/segment.h) without their second half. Round k covers piece k of every rank's block:
// each rank stages the pieces of the other ranks' blocks into its slot, then reduces its own
// block's piece from every rank (its own input where it lies, the peers' slots) straight into
// its output. Nothing is written back to the peers, so a round ends with one flag, not two, and
// every input byte is read once.

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/check/call_context.h"
#include "collectives/reduce_scatter.h"
#include "collectives/shm/segment.h"

namespace gradcomm::collectives {

void reduce_scatter_shm(Communicator& comm, const CallContext& call, const void* sendbuf,
                        void* recvbuf, std::size_t recv_count, DataType dtype, ReduceOp op) {
  ShmState& s = usable_state(comm);
  const int n = s.size, me = s.rank;
  const auto nn = static_cast<std::size_t>(n);
  const std::size_t es = element_size(dtype);
  const auto* send = static_cast<const std::byte*>(sendbuf);
  auto* recv = static_cast<std::byte*>(recvbuf);
  RankControl& mine = s.control(me);
  const std::uint64_t first = s.round + 1;
  AllreduceArgs args{sendbuf, recvbuf, recv_count * nn, dtype, op};
  args.call = call;
  const CallInfo* info = call.info();
  args.sequence = info ? info->sequence : 0;

  // The first round's packet and descriptor say this is a reduce-scatter: a peer in an
  // all-reduce of this round (either path) finds the difference and every rank throws alike.
  fill_packet(s, first, args, ShmPath::scatter).round.store(first, std::memory_order_release);
  mine.descriptor[first % 2] = descriptor_of(args, ShmPath::scatter, std::nullopt);

  // Rounds of one slot each, or all of them where ranks share CPUs (the all-reduce's, but for
  // its half rounds on 2 ranks of an Intel CPU). A round stages a piece of `piece` elements of each
  // of the other ranks' blocks, at the block's place in the slot (whole cache lines each where the
  // pieces are not tiny).
  const bool whole = s.spin == 0;
  const std::size_t line = std::max<std::size_t>(1, kShmLine / es);
  std::size_t piece = shm_round_bytes(whole) / es / nn;
  piece = piece >= line ? piece / line * line : std::max<std::size_t>(1, piece);
  const std::uint64_t rounds = std::max<std::uint64_t>(1, (recv_count + piece - 1) / piece);
  auto slot_of = [&](int j, std::uint64_t r) { return whole ? s.stage(j, 0) : s.stage(j, r); };
  auto stage_in = [&](std::uint64_t k) {
    const std::size_t e0 = static_cast<std::size_t>(k) * piece;
    const std::size_t m = std::min(piece, recv_count - e0);
    std::byte* slot = slot_of(me, first + k);
    for (std::size_t b = 0; b < nn; ++b) {
      if (b == static_cast<std::size_t>(me)) continue;
      std::memcpy(slot + b * piece * es, send + (b * recv_count + e0) * es, m * es);
    }
  };

  stage_in(0);
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in", call);
  agree_on_call(s, first, call);  // throws on every rank where a peer made another call

  std::vector<const std::byte*> sources(nn);
  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t r = first + k;
    const std::size_t e0 = static_cast<std::size_t>(k) * piece;
    const std::size_t m = std::min(piece, recv_count - e0);
    if (k > 0) s.wait_all(&RankControl::copied, r, "copy-in", call);
    for (int j = 0; j < n; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      sources[jj] = j == me ? send + (static_cast<std::size_t>(me) * recv_count + e0) * es
                            : slot_of(j, r) + static_cast<std::size_t>(me) * piece * es;
    }
    reduce_sources(recv + e0 * es, sources, m, args, n);
    end_read_round(
        s, r, k + 1 == rounds, [&] { stage_in(k + 1); }, "reduce", call);
  }
  s.round = first + rounds - 1;
}

}  // namespace gradcomm::collectives
