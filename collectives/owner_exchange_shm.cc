#include "collectives/owner_exchange_shm.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "core/reduce_kernels.h"

namespace gradcomm::collectives {

// Hierarchical's intra-group phases. A staged round carries one sub-piece of every column: `q`
// elements of each (a multiple of a cache line, the sub-pieces together at most one stage slot),
// at offset c * q of a rank's stage slot. Column c of round k is [k * q, (k + 1) * q) of the
// column, cut at its length. A one-round phase takes whole columns.
namespace {

struct ColumnRounds {
  ColumnRounds(const ColumnLayout& layout, std::size_t es, bool whole) {
    const std::size_t longest = layout.column(0).length;
    if (whole) {
      q = std::max<std::size_t>(1, longest);
      return;
    }
    const std::size_t line = std::max<std::size_t>(1, kShmLine / es);
    const std::size_t per_column = kShmRoundBytes / es / layout.columns;
    q = std::max<std::size_t>(1, per_column >= line ? per_column / line * line : per_column);
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

template <class T>
bool all_set(const std::vector<T*>& pointers) {
  return std::all_of(pointers.begin(), pointers.end(), [](T* p) { return p != nullptr; });
}

// Before round r stores into a stage slot: every rank has drained round r - kShmStageSlots, the
// last round that used that slot.
void wait_for_slot(const ShmState& s, std::uint64_t r, const CallContext& call) {
  s.wait_all(&RankControl::drained, r < kShmStageSlots ? 0 : r - kShmStageSlots, "drain", call);
}

// out = sources[0] op sources[1] op ... in member order over `m` elements, block by block, so
// that each block of `out` stays in L1 across the chain instead of making one pass per member
// over a whole column. When `out` is one of the later sources (in place, as the third or later
// operand), each block is reduced in L1 scratch and copied out, so the operand is read before it
// is overwritten.
void reduce_chain(std::byte* out, const std::vector<const std::byte*>& sources, std::size_t m,
                  DataType dtype, ReduceOp op, bool out_is_a_later_source) {
  constexpr std::size_t kBlockBytes = std::size_t{8} << 10;
  alignas(kShmLine) std::byte scratch[kBlockBytes];
  const std::size_t es = element_size(dtype);
  const std::size_t per_block = kBlockBytes / es;
  for (std::size_t b = 0; b < m; b += per_block) {
    const std::size_t n = std::min(per_block, m - b);
    const std::size_t at = b * es;
    std::byte* result = out_is_a_later_source ? scratch : out + at;
    reduce_to(result, sources[0] + at, sources[1] + at, n, dtype, op);
    for (std::size_t j = 2; j < sources.size(); ++j)
      reduce_into(result, sources[j] + at, n, dtype, op);
    if (out_is_a_later_source) std::memcpy(out + at, scratch, n * es);
  }
}

}  // namespace

bool shm_columns_fit(std::size_t columns, std::size_t element_bytes) {
  return columns * element_bytes <= kShmRoundBytes;
}

ShmPeers shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                      const ColumnLayout& layout, Communicator& group) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  const std::optional<RegisteredLocation> input = find_registered(send, bytes, s.pids);
  const std::optional<RegisteredLocation> output =
      args.in_place() ? input : find_registered(recv, bytes, s.pids);
  const std::uint64_t first = s.round + 1;
  // A private input stages the sub-pieces of the columns its peers own (its own are read from
  // the input), in the staged rounds.
  const ColumnRounds staged(layout, es, false);
  auto stage_in = [&](std::uint64_t k) {
    const std::uint64_t r = first + k;
    wait_for_slot(s, r, args.call);
    std::byte* slot = s.stage(me, r);
    for (std::size_t c = 0; c < layout.columns; ++c) {
      const auto col = layout.column(c);
      const std::size_t m = staged.length(col.length, k);
      if (layout.owner(c) == me || m == 0) continue;
      std::memcpy(slot + c * staged.q * es, send + (col.offset + staged.start(k)) * es, m * es);
    }
  };
  mine.descriptor[first % 2] = descriptor_of(args, ShmPath::columns, input, output);
  if (!input) stage_in(0);
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in", args.call);
  ShmPeers peers = agree_on_call(s, first, args.call);
  // Every input registered: one round over whole columns, nothing staged.
  const bool whole = all_set(peers.inputs);
  const ColumnRounds plan = whole ? ColumnRounds(layout, es, true) : staged;
  // In place, this rank's output is its own operand; read before written past the second.
  const bool aliased = args.in_place() && me >= 2;
  std::vector<const std::byte*> sources(static_cast<std::size_t>(s.size));
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    if (k > 0) {
      if (!input) stage_in(k);
      mine.copied.store(r, std::memory_order_release);
      s.wait_all(&RankControl::copied, r, "copy-in", args.call);
    }
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      if (m == 0) continue;
      const std::size_t at = (col.offset + plan.start(k)) * es;
      for (int j = 0; j < s.size; ++j) {
        const auto jj = static_cast<std::size_t>(j);
        sources[jj] = j == me            ? send + at
                      : peers.inputs[jj] ? peers.inputs[jj] + at
                                         : s.stage(j, r) + c * plan.q * es;
      }
      reduce_chain(recv + at, sources, m, args.dtype, op, aliased);
    }
    mine.reduced.store(r, std::memory_order_release);
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
  return peers;
}

void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group, const ShmPeers& peers) {
  ShmState& s = usable_state(group);
  const int me = s.rank;
  const std::size_t es = args.element_bytes();
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  // Every output registered: one round over whole columns, nothing published.
  const bool whole = all_set(peers.outputs);
  const bool mine_private = peers.outputs[static_cast<std::size_t>(me)] == nullptr;
  const ColumnRounds plan(layout, es, whole);
  const std::uint64_t first = s.round + 1;
  for (std::uint64_t k = 0; k < plan.rounds; ++k) {
    const std::uint64_t r = first + k;
    if (!whole) wait_for_slot(s, r, args.call);
    std::byte* slot = s.stage(me, r);
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      const std::size_t m = plan.length(col.length, k);
      if (m == 0) continue;
      const std::size_t at = (col.offset + plan.start(k)) * es;
      for (int j = 0; j < s.size; ++j) {
        std::byte* out = peers.outputs[static_cast<std::size_t>(j)];
        if (j != me && out) std::memcpy(out + at, recv + at, m * es);
      }
      if (!whole) std::memcpy(slot + c * plan.q * es, recv + at, m * es);
    }
    mine.copied.store(r, std::memory_order_release);
    mine.reduced.store(r, std::memory_order_release);
    s.wait_all(&RankControl::reduced, r, "publish", args.call);
    if (mine_private) {  // the others' columns, from their owners' slots
      for (std::size_t c = 0; c < layout.columns; ++c) {
        const int owner = layout.owner(c);
        const auto col = layout.column(c);
        const std::size_t m = plan.length(col.length, k);
        if (owner == me || m == 0) continue;
        std::memcpy(recv + (col.offset + plan.start(k)) * es, s.stage(owner, r) + c * plan.q * es,
                    m * es);
      }
    }
    mine.drained.store(r, std::memory_order_release);
  }
  s.round = first + plan.rounds - 1;
}

}  // namespace gradcomm::collectives
