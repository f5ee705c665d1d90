// Shared-memory all-reduce inside one host (allreduce_shm.h for the two paths; the segment's
// protocol in shm/segment.h).

#include "collectives/allreduce_shm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "collectives/check/call_info.h"
#include "collectives/shm/segment.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

// PREFETCHW on every line of [p, p + bytes): the lines come into this core's cache owned, as a
// store would take them, without waiting (x86 executes it as a no-op where it is missing).
void prefetch_for_write(const void* p, std::size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const auto* at = static_cast<const std::byte*>(p);
  for (std::size_t offset = 0; offset < bytes; offset += kShmLine)
    asm volatile("prefetchw %0" ::"m"(*(at + offset)));
#else
  (void)p;
  (void)bytes;
#endif
}

// Once every rank's packet of round `first` is readable (its `round` or `copied` counter seen):
// where all carry this call's fingerprint the check reads no peer's post; where they agree on
// the descriptors but not on the hash (the same buffers and sequence, another call: kind, tensor
// list), completing the check throws on every rank alike, before anything is reduced.
void prove_from_packets(const ShmState& s, std::uint64_t first, const SmallPacket& packet,
                        const AllreduceArgs& args, Communicator& comm) {
  bool proven = packet.in_call != 0;
  for (int j = 0; j < s.size && proven; ++j) {
    const SmallPacket& theirs = s.control(j).packet[first % 2];
    proven = theirs.round.load(std::memory_order_relaxed) == first && theirs.in_call &&
             theirs.fingerprint == packet.fingerprint;
  }
  if (proven) {
    args.call.call_proven(comm);
  } else if (packet.in_call) {
    args.call.require_check();
  }
}

}  // namespace

void reduce_sources(std::byte* result, const std::vector<const std::byte*>& sources, std::size_t n,
                    const AllreduceArgs& args, int ranks) {
  if (n == 0) return;
  const ReduceOp op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  reduce_to(result, sources[0], sources[1], n, args.dtype, op);
  for (std::size_t j = 2; j < sources.size(); ++j)
    reduce_into(result, sources[j], n, args.dtype, op);
  if (args.op == ReduceOp::avg) divide_by(result, n, args.dtype, ranks);
}

static_assert(CostModel{}.shm_small_own_cpu == kShmSmallOwnCpuBytes,
              "the model's default latency-path limit is shm's");

bool AllreduceShm::proves_call(const AllreduceArgs& args, Communicator& comm) const {
  // Not before the segment is made: making it is collective, and the check before an
  // algorithm's first use must come first (ranks that disagree would not all make it).
  const ShmState* s = comm.find_attachment<ShmState>();
  return s != nullptr && s->unavailable.empty() && !args.device;
}

std::optional<double> AllreduceShm::predicted_seconds(const CostModel& model,
                                                      const CostQuery& q) const {
  if (!model.one_host || q.groups > 1) return std::nullopt;  // emulated nodes count as nodes
  const double S = static_cast<double>(q.bytes);
  if (q.bytes <= shm_small_limit(model.crowded, model.shm_small_own_cpu)) {
    return model.flag_alpha + S * model.copy_beta + q.ranks * S * model.gamma;
  }
  // The machine-wide view (more ranks than hardware threads) stands in for the segment's own.
  const double rounds = std::ceil(S / static_cast<double>(shm_allreduce_round_bytes(
                                          model.crowded, model.shm_small_own_cpu, q.ranks)));
  // Two waits per round: every rank's copy-in, then every rank's reduction (run()).
  return 2 * rounds * model.flag_alpha + 2 * S * model.copy_beta + S * model.gamma;
}

void AllreduceShm::run(const AllreduceArgs& args, Communicator& comm) {
  ShmState& s = usable_state(comm);
  const int n = s.size, me = s.rank;
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  RankControl& mine = s.control(me);
  const std::uint64_t first = s.round + 1;
  // No gate before reusing round first - 2's halves (descriptor, packet, small slot): this rank's
  // last round, first - 1, waited until every peer had begun it, so every peer is done with them.
  const ShmPath path = bytes <= s.small_limit() ? ShmPath::small : ShmPath::staged;
  SmallPacket& packet = fill_packet(s, first, args, path);

  if (path == ShmPath::small) {  // latency path: one flag round, in one line where it fits
    const bool inline_data = bytes <= kShmInlineBytes;
    std::memcpy(inline_data ? packet.data : s.small_slot(me, first), send, bytes);
    // For a peer that made a different call and reads descriptors (agree_on_call).
    mine.descriptor[first % 2] = descriptor_of(args, path, std::nullopt);
    packet.round.store(first, std::memory_order_release);
    mine.copied.store(first, std::memory_order_release);
    bool same = true;
    for (int j = 0; j < n; ++j) {
      if (j == me) continue;
      const SmallPacket& theirs = s.control(j).packet[first % 2];
      s.wait_for(j, theirs.round, first, "copy-in", args.call);
      same = same && theirs.count == packet.count && theirs.dtype == packet.dtype &&
             theirs.op == packet.op && theirs.path == packet.path &&
             (!theirs.in_call || !packet.in_call ||
              (theirs.sequence == packet.sequence && theirs.algorithm == packet.algorithm));
    }
    if (!same) {  // every rank finds the difference in the descriptors and throws alike
      s.wait_all(&RankControl::copied, first, "copy-in", args.call);
      agree_on_call(s, first, args.call);
    }
    prove_from_packets(s, first, packet, args, comm);
    std::vector<const std::byte*>& sources = s.sources;  // no allocation per call
    for (int j = 0; j < n; ++j) {
      sources[static_cast<std::size_t>(j)] =
          inline_data ? s.control(j).packet[first % 2].data : s.small_slot(j, first);
    }
    reduce_sources(recv, sources, args.count, args, n);
    mine.reduced.store(first, std::memory_order_release);
    mine.drained.store(first, std::memory_order_release);
    s.round = first;
    // The next round's small slot is round first - 1's, which every peer has finished reading
    // (each began this round): ask for its lines for writing now, so that the next call's copy-in
    // finds them owned instead of waiting for the peers' copies to be invalidated (Intel Xeon, 2
    // ranks: 1 KiB 0.74-0.78 of the time; docs/results/shm.md). Not the packet's line: a peer
    // done with this round may already be polling it for the next, and taking it from the peer
    // made 8-32 B calls 12-19% slower.
    if (!inline_data) prefetch_for_write(s.small_slot(me, first + 1), bytes);
    return;
  }
  packet.round.store(first, std::memory_order_release);  // for a peer on the latency path

  // Registered buffers are read (input) and written (output) where they lie; a private input is
  // staged into this rank's slot and a private output comes back through it.
  const std::optional<RegisteredLocation> input = find_registered(send, bytes, s.pids);
  const std::optional<RegisteredLocation> output =
      args.in_place() ? input : find_registered(recv, bytes, s.pids);
  mine.descriptor[first % 2] = descriptor_of(args, ShmPath::staged, input, output);
  // Where ranks share CPUs (spin == 0, the same on every rank), a round takes all of a rank's
  // stage slots and is staged only once the last is drained: a quarter of the waits, each of
  // which may cost a context switch (docs/results/shm.md, "The lead-in").
  const bool whole = s.spin == 0;
  const std::size_t round_elements = s.allreduce_round() / es;
  auto stage_of = [&](int j, std::uint64_t r) { return whole ? s.stage(j, 0) : s.stage(j, r); };
  // Round k's chunk is [k * chunk, ...) of the buffer; this rank reduces [p0, p1) of it.
  struct Piece {
    std::size_t e0, m, p0, p1;
  };
  auto piece = [&](std::size_t chunk, std::uint64_t k) {
    Piece p;
    p.e0 = static_cast<std::size_t>(k) * chunk;
    p.m = std::min(chunk, args.count - p.e0);
    const std::size_t part = align_up((p.m + n - 1) / n, std::max<std::size_t>(1, kShmLine / es));
    p.p0 = std::min(p.m, part * static_cast<std::size_t>(me));
    p.p1 = std::min(p.m, p.p0 + part);
    return p;
  };
  // Stages the parts of round k's chunk that peers reduce (all but [p0, p1)) into this rank's
  // slot, at their offsets in the chunk, round_elements at a time.
  auto stage_in = [&](std::uint64_t k) {
    if (input) return;
    const Piece p = piece(round_elements, k);
    std::byte* slot = stage_of(me, first + k);
    std::memcpy(slot, send + p.e0 * es, p.p0 * es);
    std::memcpy(slot + p.p1 * es, send + (p.e0 + p.p1) * es, (p.m - p.p1) * es);
  };
  stage_in(0);
  mine.copied.store(first, std::memory_order_release);
  s.wait_all(&RankControl::copied, first, "copy-in", args.call);
  const ShmPeers& peers = agree_on_call(s, first, args.call, s.peers);
  prove_from_packets(s, first, packet, args, comm);  // (each filled before its rank's `copied`)
  bool all_registered = true;
  for (int j = 0; j < n; ++j) {
    const auto jj = static_cast<std::size_t>(j);
    all_registered = all_registered && peers.inputs[jj] && peers.outputs[jj];
  }
  // Where every rank's buffers are registered, the call is one round: nothing is staged.
  const std::size_t chunk = all_registered ? args.count : round_elements;
  const std::uint64_t rounds = (args.count + chunk - 1) / chunk;

  std::vector<const std::byte*>& sources = s.sources;  // no allocation per call
  std::vector<std::byte*>& targets = s.targets;
  for (std::uint64_t k = 0; k < rounds; ++k) {
    const std::uint64_t r = first + k;
    const Piece p = piece(chunk, k);
    if (k > 0) s.wait_all(&RankControl::copied, r, "copy-in", args.call);
    // My part of the round from every rank's input, in rank order, into every rank's output: a
    // registered buffer where it lies, else the rank's slot (the lines just read there).
    const std::size_t at = (p.e0 + p.p0) * es;
    for (int j = 0; j < n; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      std::byte* slot = stage_of(j, r) + p.p0 * es;
      if (j == me) {
        sources[jj] = send + at;
        targets[jj] = recv + at;
      } else {
        sources[jj] = peers.inputs[jj] ? peers.inputs[jj] + at : slot;
        targets[jj] = peers.outputs[jj] ? peers.outputs[jj] + at : slot;
      }
    }
    reduce_to_all(targets, sources, p.p1 - p.p0, args.dtype, args.op, n);
    mine.reduced.store(r, std::memory_order_release);
    if (k + 1 < rounds && !whole) {  // the next round's copy-in overlaps the peers' reductions
      stage_in(k + 1);
      mine.copied.store(r + 1, std::memory_order_release);
    }
    s.wait_all(&RankControl::reduced, r, "reduce", args.call);
    if (!output) {  // the peers' parts of my result, from my slot
      const std::byte* slot = stage_of(me, r);
      std::memcpy(recv + p.e0 * es, slot, p.p0 * es);
      std::memcpy(recv + (p.e0 + p.p1) * es, slot + p.p1 * es, (p.m - p.p1) * es);
    }
    mine.drained.store(r, std::memory_order_release);
    if (k + 1 < rounds && whole) {
      stage_in(k + 1);
      mine.copied.store(r + 1, std::memory_order_release);
    }
  }
  s.round = first + rounds - 1;
}

}  // namespace gradcomm::collectives
