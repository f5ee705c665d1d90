// shm's all-gather (exchange.h's allgather_bytes on one host, from kShmGatherMinBytes): each
// round, every rank stages the next piece of its block into its stage slot (the segment's
// protocol in shm/segment.h), and copies every peer's piece from theirs into its output. Every
// byte is written once into the segment and read once by each peer, where MPI's shared-memory
// transport moves each block through a queue per pair of ranks.

#include <algorithm>
#include <cstring>

#include "collectives/check/call_context.h"
#include "collectives/exchange.h"
#include "collectives/shm/segment.h"

namespace gradcomm::collectives {

void allgather_shm(Communicator& comm, const CallContext& call, const void* sendbuf, void* recvbuf,
                   std::size_t bytes) {
  ShmState& s = usable_state(comm);
  const int n = s.size, me = s.rank;
  const auto* send = static_cast<const std::byte*>(sendbuf);
  auto* recv = static_cast<std::byte*>(recvbuf);
  RankControl& mine = s.control(me);
  const std::uint64_t first = s.round + 1;
  // The descriptor's count is the block's bytes; dtype and op mean nothing here.
  AllreduceArgs args{sendbuf, recvbuf, bytes, DataType::float32, ReduceOp::sum};
  args.call = call;
  const CallInfo* info = call.info();
  args.sequence = info ? info->sequence : 0;

  // The first round's packet and descriptor say this is an all-gather: a peer in another shm
  // call of this round finds the difference and every rank throws alike.
  fill_packet(s, first, args, ShmPath::gather).round.store(first, std::memory_order_release);
  mine.descriptor[first % 2] = descriptor_of(args, ShmPath::gather, std::nullopt);

  // Rounds of one slot each, or all of them where ranks share CPUs (the all-reduce's, but for
  // its half rounds on 2 ranks of an Intel CPU).
  const bool whole = s.spin == 0;
  const std::size_t piece = shm_round_bytes(whole);
  const std::uint64_t rounds = std::max<std::uint64_t>(1, (bytes + piece - 1) / piece);
  auto slot_of = [&](int j, std::uint64_t r) { return whole ? s.stage(j, 0) : s.stage(j, r); };
  auto stage_in = [&](std::uint64_t k) {
    const std::size_t b0 = static_cast<std::size_t>(k) * piece;
    std::memcpy(slot_of(me, first + k), send + b0, std::min(piece, bytes - b0));
  };

  stage_in(0);
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in", call);
  agree_on_call(s, first, call);  // throws on every rank where a peer made another call

  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t r = first + k;
    const std::size_t b0 = static_cast<std::size_t>(k) * piece;
    const std::size_t m = std::min(piece, bytes - b0);
    if (k > 0) s.wait_all(&RankControl::copied, r, "copy-in", call);
    for (int j = 0; j < n; ++j) {
      std::byte* to = recv + static_cast<std::size_t>(j) * bytes + b0;
      std::memcpy(to, j == me ? send + b0 : slot_of(j, r), m);
    }
    end_read_round(
        s, r, k + 1 == rounds, [&] { stage_in(k + 1); }, "copy-out", call);
  }
  s.round = first + rounds - 1;
}

}  // namespace gradcomm::collectives
