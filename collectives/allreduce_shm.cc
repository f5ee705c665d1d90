// Shared-memory all-reduce inside one host (allreduce_shm.h for the two paths; the segment's
// protocol in shm/segment.h).

#include "collectives/allreduce_shm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "collectives/shm/segment.h"
#include "core/reduce_kernels.h"
#include "core/stream_copy.h"

namespace gradcomm::collectives {
namespace {

// result = src[0] op src[1] op ... in rank order, over `n` elements; avg divides at the end.
void reduce_sources(std::byte* result, const std::vector<const std::byte*>& sources, std::size_t n,
                    const AllreduceArgs& args, int ranks) {
  if (n == 0) return;
  const ReduceOp op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  reduce_to(result, sources[0], sources[1], n, args.dtype, op);
  for (std::size_t j = 2; j < sources.size(); ++j)
    reduce_into(result, sources[j], n, args.dtype, op);
  if (args.op == ReduceOp::avg) divide_by(result, n, args.dtype, ranks);
}

}  // namespace

std::optional<double> AllreduceShm::predicted_seconds(const CostModel& model,
                                                      const CostQuery& q) const {
  if (!model.one_host || q.groups > 1) return std::nullopt;  // emulated nodes count as nodes
  const double S = static_cast<double>(q.bytes);
  if (q.bytes <= kShmSmallBytes) {
    return model.flag_alpha + S * model.copy_beta + q.ranks * S * model.gamma;
  }
  const double rounds = std::ceil(S / static_cast<double>(kShmRoundBytes));
  return 3 * rounds * model.flag_alpha + 2 * S * model.copy_beta + S * model.gamma;
}

void AllreduceShm::run(const AllreduceArgs& args, Communicator& comm) {
  ShmState& s = usable_state(comm);
  const int n = s.size, me = s.rank;
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const ShmPath path = bytes <= kShmSmallBytes ? ShmPath::small : ShmPath::staged;
  const std::size_t round_elements = kShmRoundBytes / es;
  const std::uint64_t rounds =
      path == ShmPath::small ? 1 : (args.count + round_elements - 1) / round_elements;
  const std::optional<RegisteredLocation> registered =
      path == ShmPath::staged ? find_registered(args.send, bytes, s.pids) : std::nullopt;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);

  const auto started = std::chrono::steady_clock::now();
  // Round `first`: gate, descriptor, first input.
  const std::uint64_t first = s.round + 1;
  s.wait_all(&RankControl::drained, first < 2 ? 0 : first - 2, "drain", args.call);
  mine.descriptor[first % 2] = descriptor_of(args, path, registered);
  // From kShmStreamFromBytes on, the segment's stores follow Config::shm_stores (ShmStores); below,
  // where a round's data is still in cache when peers read it, streamed stores cost 2-2.5x
  // (1 MiB on 2 ranks) and plain ones are kept.
  const bool large = bytes >= kShmStreamFromBytes;
  const bool streams = large && !registered && s.stores.next_call_streams(bytes);
  auto copy_in = [&](std::uint64_t k) {  // the k-th round of this call
    if (registered) return;
    const std::size_t e0 = k * round_elements;
    const std::size_t m = std::min(round_elements, args.count - e0);
    copy_to_segment(s.stage(me, first + k), send + e0 * es, m * es, streams);
    if (streams) stream_fence();  // before the release that publishes the slot
  };
  if (path == ShmPath::small) {
    std::memcpy(s.small_slot(me, first), send, bytes);
  } else {
    copy_in(0);
  }
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in", args.call);
  const std::vector<const std::byte*> inputs = agree_on_call(s, first, args.call);

  std::vector<const std::byte*> sources(static_cast<std::size_t>(n));
  if (path == ShmPath::small) {
    for (int j = 0; j < n; ++j)
      sources[static_cast<std::size_t>(j)] = s.small_slot(j, first);
    reduce_sources(recv, sources, args.count, args, n);
    mine.reduced.store(first, std::memory_order_release);
    mine.drained.store(first, std::memory_order_release);
    s.round = first;
    return;
  }

  // Staged rounds: my part of every round is [p0, p1) of the round's elements, 64-byte aligned.
  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t r = first + k;
    const std::size_t e0 = k * round_elements;
    const std::size_t m = std::min(round_elements, args.count - e0);
    if (k > 0) s.wait_all(&RankControl::copied, r, "copy-in", args.call);
    const std::size_t part = align_up((m + n - 1) / n, kShmLine / es);
    const std::size_t p0 = std::min(m, part * static_cast<std::size_t>(me));
    const std::size_t p1 = std::min(m, p0 + part);
    for (int j = 0; j < n; ++j) {
      const std::byte* input = inputs[static_cast<std::size_t>(j)];
      sources[static_cast<std::size_t>(j)] = (input ? input + e0 * es : s.stage(j, r)) + p0 * es;
    }
    if (streams && p1 > p0) {
      if (s.scratch.size() < kShmRoundBytes) s.scratch.resize(kShmRoundBytes);
      reduce_sources(s.scratch.data(), sources, p1 - p0, args, n);
      stream_copy(s.result(r) + p0 * es, s.scratch.data(), (p1 - p0) * es);
      stream_fence();
    } else {
      reduce_sources(s.result(r) + p0 * es, sources, p1 - p0, args, n);
    }
    mine.reduced.store(r, std::memory_order_release);
    if (k + 1 < rounds) {  // the next round's copy-in overlaps the peers' reductions
      s.wait_all(&RankControl::drained, r - 1, "drain", args.call);
      copy_in(k + 1);
      mine.copied.store(r + 1, std::memory_order_release);
    }
    s.wait_all(&RankControl::reduced, r, "reduce", args.call);
    if (large) {
      stream_copy(recv + e0 * es, s.result(r), m * es);
      stream_fence();  // non-temporal stores are not ordered by the release below
    } else {
      std::memcpy(recv + e0 * es, s.result(r), m * es);
    }
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + rounds - 1;
  if (large && !registered) record_stores(s.stores, "", bytes, streams, started, comm);
}

}  // namespace gradcomm::collectives
