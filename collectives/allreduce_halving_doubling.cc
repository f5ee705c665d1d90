// Rabenseifner's all-reduce (Thakur, Rabenseifner and Gropp 2005): recursive-halving
// reduce-scatter, then recursive-doubling all-gather.
//
// Vocabulary: p = the largest power of two <= n, rem = n - p; a window is the element range a
// rank is responsible for at one level of the halving tree.
//
// Phases:
//   fold (only when n is not a power of two): among the first 2*rem ranks, each even rank sends
//     its whole buffer to the odd rank above it, which reduces it and takes part in the rest as
//     "new rank" r/2; ranks >= 2*rem become r - rem. The even ranks wait for the result.
//   reduce-scatter, log2(p) steps: partners at distance 1, 2, 4, ..., p/2 (in new ranks) split
//     their common window in two halves (the lower new rank keeps the lower half), exchange the
//     halves they give away and reduce the halves they keep. A rank ends owning 1/p of the
//     buffer, fully reduced (and divided by n for avg). Nearest partners first: the halves
//     shrink as the distance grows, so when ranks are placed node by node (mpirun's default) the
//     steps that cross nodes carry the smallest pieces; with 2^a ranks per node a rank sends
//     2(G-1)/G * S/2^a across, as hierarchical does, where farthest-first would send S/2 at once.
//   all-gather, log2(p) steps in reverse: partners swap their windows, straight into the output.
//   unfold: odd ranks of the fold send the full result to their even partner.
// 2*log2(p) steps (+2 for the fold), about 2*(p-1)/p * S bytes sent per rank.
// Short messages (<= kRecursiveDoublingMaxBytes) skip the halving: partners exchange and reduce
// whole buffers (recursive doubling), log2(p) steps and log2(p) * S bytes, fold as above. Windows
// split at (lo + hi) / 2, so counts not divisible by p (and count < p: empty windows) need nothing
// special. Every element is reduced by one owner and only copied afterwards: all ranks end
// bit-identical.

#include "collectives/allreduce_halving_doubling.h"

#include <vector>

#include "collectives/p2p.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

// Up to this size whole-buffer recursive doubling (half the steps, log2(p) times the bytes) beats
// halving + doubling; measured on 2 and 4 ranks.
constexpr std::size_t kRecursiveDoublingMaxBytes = std::size_t{16} << 10;

}  // namespace

std::optional<double> AllreduceHalvingDoubling::predicted_seconds(const CostModel& model,
                                                                  const CostQuery& q) const {
  const double S = static_cast<double>(q.bytes);
  const int n = q.ranks;
  const CostModel::Link link = model.worst_link(q.groups);
  int p = 1;
  while (p * 2 <= n)
    p *= 2;
  // The step at distance d pairs ranks d apart: inside a group while d < group_size (ranks
  // placed group by group), else across, with every rank of a group crossing at once.
  auto step = [&](int distance) {
    return q.groups > 1 && distance >= q.group_size ? model.shared_inter(q.group_size)
                                                    : model.intra;
  };
  const double fold = p == n ? 0.0 : 2 * (link.alpha + S * link.beta) + S * model.gamma;
  double t = fold;
  if (q.bytes <= kRecursiveDoublingMaxBytes) {
    for (int d = 1; d < p; d *= 2)
      t += step(d).alpha + S * step(d).beta + S * model.gamma;
    return t;
  }
  double piece = S;  // halves at every step of the reduce-scatter, nearest partner first
  for (int d = 1; d < p; d *= 2) {
    piece /= 2;
    t += 2 * (step(d).alpha + piece * step(d).beta);  // reduce-scatter and all-gather steps
  }
  return t + (p - 1.0) / p * S * model.gamma;
}

void AllreduceHalvingDoubling::run(const AllreduceArgs& args, Communicator& comm) {
  const Caller kCall{"allreduce(halving_doubling)", args.call};
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);

  int p = 1;
  while (p * 2 <= n)
    p *= 2;
  const int rem = n - p;

  // Fold. `data` is where this rank's current partial values live: the send buffer until the
  // first reduction writes the output buffer.
  const std::byte* data = send;
  int new_rank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      send_bytes(send, bytes, r + 1, kTagHalvingDoubling, comm, kCall);
      recv_bytes(recv, bytes, r + 1, kTagHalvingDoubling, comm, kCall);
      return;
    }
    std::byte* incoming = comm.scratch(bytes);
    recv_bytes(incoming, bytes, r - 1, kTagHalvingDoubling, comm, kCall);
    reduce_to(recv, incoming, send, args.count, args.dtype, args.op);  // lower rank first
    data = recv;
    new_rank = r / 2;
  } else {
    new_rank = r - rem;
  }
  auto real_rank = [&](int nr) { return nr < rem ? 2 * nr + 1 : nr + rem; };

  if (bytes <= kRecursiveDoublingMaxBytes) {
    // Short messages: recursive doubling on whole buffers, log2(p) steps instead of 2 log2(p).
    // Both partners compute (lower new rank's values) op (higher's), so they get equal bits.
    std::byte* incoming = comm.scratch(bytes);
    for (int mask = 1; mask < p; mask *= 2) {
      const int partner = new_rank ^ mask;
      send_recv_bytes(data, bytes, real_rank(partner), incoming, bytes, real_rank(partner),
                      kTagHalvingDoubling, comm, kCall);
      if (new_rank < partner) {
        reduce_to(recv, data, incoming, args.count, args.dtype, args.op);
      } else {
        reduce_to(recv, incoming, data, args.count, args.dtype, args.op);
      }
      data = recv;
    }
    if (args.op == ReduceOp::avg) divide_by(recv, args.count, args.dtype, n);
    if (r < 2 * rem) send_bytes(recv, bytes, r - 1, kTagHalvingDoubling, comm, kCall);
    return;
  }

  // Reduce-scatter by recursive halving; remember each level's window for the all-gather.
  struct Window {
    std::size_t lo, hi;
  };
  struct Level {
    Window parent;
    bool kept_lower;
  };
  std::vector<Level> levels;
  std::size_t lo = 0;
  std::size_t hi = args.count;
  std::byte* incoming = comm.scratch((args.count / 2 + 1) * es);
  for (int mask = 1; mask < p; mask *= 2) {
    const int partner = real_rank(new_rank ^ mask);
    const std::size_t mid = lo + (hi - lo) / 2;
    const bool lower = (new_rank & mask) == 0;
    const Window keep = lower ? Window{lo, mid} : Window{mid, hi};
    const Window give = lower ? Window{mid, hi} : Window{lo, mid};
    send_recv_bytes(data + give.lo * es, (give.hi - give.lo) * es, partner, incoming,
                    (keep.hi - keep.lo) * es, partner, kTagHalvingDoubling, comm, kCall);
    reduce_to(recv + keep.lo * es, data + keep.lo * es, incoming, keep.hi - keep.lo, args.dtype,
              args.op);
    data = recv;
    levels.push_back({{lo, hi}, lower});
    lo = keep.lo;
    hi = keep.hi;
  }
  if (args.op == ReduceOp::avg) divide_by(recv + lo * es, hi - lo, args.dtype, n);

  // All-gather by recursive doubling: swap windows with the partner of each level, in reverse.
  for (int mask = p / 2; mask >= 1; mask /= 2) {
    const int partner = real_rank(new_rank ^ mask);
    const auto [parent, kept_lower] = levels.back();
    levels.pop_back();
    const Window other = kept_lower ? Window{hi, parent.hi} : Window{parent.lo, lo};
    send_recv_bytes(recv + lo * es, (hi - lo) * es, partner, recv + other.lo * es,
                    (other.hi - other.lo) * es, partner, kTagHalvingDoubling, comm, kCall);
    lo = parent.lo;
    hi = parent.hi;
  }

  // Unfold.
  if (r < 2 * rem) send_bytes(recv, bytes, r - 1, kTagHalvingDoubling, comm, kCall);
}

}  // namespace gradcomm::collectives
