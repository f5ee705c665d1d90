#include "collectives/owner_exchange_shm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "collectives/shm/segment.h"
#include "core/reduce_kernels.h"
#include "core/stream_copy.h"

namespace gradcomm::collectives {

// Hierarchical's intra-group phases. Rounds carry one sub-piece of every column: `q` elements
// of each (a multiple of a cache line, the P sub-pieces together at most one staged round),
// at offset c * q of a rank's stage slot (reduce-scatter) or of the round's result
// (all-gather). Column c of round k is [k * q, (k + 1) * q) of the column, cut at its length.
namespace {

struct ColumnRounds {
  ColumnRounds(const ColumnLayout& layout, std::size_t es) {
    const std::size_t line = std::max<std::size_t>(1, kShmLine / es);
    const std::size_t per_column = kShmRoundBytes / es / layout.columns;
    q = std::max<std::size_t>(1, per_column >= line ? per_column / line * line : per_column);
    const std::size_t longest = layout.column(0).length;
    rounds = std::max<std::uint64_t>(1, (longest + q - 1) / q);
  }
  // Elements of column `c` (of `length`) in round k, and where they start in the column.
  std::size_t start(std::uint64_t k) const { return static_cast<std::size_t>(k) * q; }
  std::size_t length(std::size_t column_length, std::uint64_t k) const {
    return column_length > start(k) ? std::min(q, column_length - start(k)) : 0;
  }
  std::size_t q = 1;
  std::uint64_t rounds = 1;
};

}  // namespace

bool shm_columns_fit(std::size_t columns, std::size_t element_bytes) {
  return columns * element_bytes <= kShmRoundBytes;
}

void shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                  const ColumnLayout& layout, Communicator& group) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  const ColumnRounds plan(layout, es);
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  std::vector<const std::byte*> sources(static_cast<std::size_t>(s.size));
  // The owner reads its own contribution from its input, not a copy, unless the output overwrites
  // it before it is read: in place, as the third or later operand of the chain.
  const bool own_from_input = !args.in_place() || me < 2;
  // Stores into the slots as in the all-reduce (ShmStores), from 4 MiB.
  const std::size_t bytes = args.count * es;
  const auto started = std::chrono::steady_clock::now();
  const bool streams = bytes >= kShmStreamFromBytes && s.scatter_stores.next_call_streams(bytes);
  const std::uint64_t first = s.round + 1;
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    // My slot's half was last read by round r - 2's owners.
    s.wait_all(&RankControl::drained, r < 2 ? 0 : r - 2, "drain", args.call);
    if (k == 0) mine.descriptor[first % 2] = descriptor_of(args, ShmPath::columns, std::nullopt);
    std::byte* slot = s.stage(me, r);
    for (std::size_t c = 0; c < layout.columns; ++c) {
      if (layout.owner(c) == me && own_from_input) continue;  // read where it lies
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      copy_to_segment(slot + c * plan.q * es, send + (col.offset + plan.start(k)) * es, m * es,
                      streams);
    }
    if (streams) stream_fence();  // before the release that publishes the slot
    mine.copied.store(r, std::memory_order_release);
    s.wait_all(&RankControl::copied, r, "copy-in", args.call);
    if (k == 0) agree_on_call(s, first, args.call);
    // The owner reduces its columns from every member's slot, in member order, into its output.
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      if (m == 0) continue;
      std::byte* out = recv + (col.offset + plan.start(k)) * es;
      for (int j = 0; j < s.size; ++j) {
        sources[static_cast<std::size_t>(j)] = j == me && own_from_input
                                                   ? send + (col.offset + plan.start(k)) * es
                                                   : s.stage(j, r) + c * plan.q * es;
      }
      reduce_to(out, sources[0], sources[1], m, args.dtype, op);
      for (std::size_t j = 2; j < sources.size(); ++j)
        reduce_into(out, sources[j], m, args.dtype, op);
    }
    mine.reduced.store(r, std::memory_order_release);
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
  if (bytes >= kShmStreamFromBytes) {
    record_stores(s.scatter_stores, " reduce-scatter", bytes, streams, started, group);
  }
}

void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  const ColumnRounds plan(layout, es);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  // Stores into the published result as in the all-reduce (ShmStores), from 4 MiB.
  const std::size_t bytes = args.count * es;
  const auto started = std::chrono::steady_clock::now();
  const bool streams = bytes >= kShmStreamFromBytes && s.gather_stores.next_call_streams(bytes);
  const std::uint64_t first = s.round + 1;
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    // The result half was last read by every rank in round r - 2.
    s.wait_all(&RankControl::drained, r < 2 ? 0 : r - 2, "drain", args.call);
    std::byte* result = s.result(r);
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      copy_to_segment(result + c * plan.q * es, recv + (col.offset + plan.start(k)) * es, m * es,
                      streams);
    }
    if (streams) stream_fence();  // before the releases that publish the result
    mine.copied.store(r, std::memory_order_release);
    mine.reduced.store(r, std::memory_order_release);
    s.wait_all(&RankControl::reduced, r, "publish", args.call);
    for (std::size_t c = 0; c < layout.columns; ++c) {
      if (layout.owner(c) == layout.member) continue;
      const auto col = layout.column(c);
      std::memcpy(recv + (col.offset + plan.start(k)) * es, result + c * plan.q * es,
                  plan.length(col.length, k) * es);
    }
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
  if (bytes >= kShmStreamFromBytes) {
    record_stores(s.gather_stores, " all-gather", bytes, streams, started, group);
  }
}

}  // namespace gradcomm::collectives
