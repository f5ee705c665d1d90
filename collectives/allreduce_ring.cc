// Ring all-reduce (Patarasuk and Yuan 2009; Baidu, Horovod): bandwidth-optimal.
//
// Vocabulary: the buffer is cut into n chunks (1/n each; the first count % n chunks take one
// extra element, so chunks may be empty when count < n); each chunk is cut into K segments of at
// most Config::segment_bytes (of ring_piece_bytes where a link crosses hosts: p2p.h), the unit in
// flight.
//
// Phases, on ring r -> r+1:
//   reduce-scatter, steps s = 0 .. n-2: send chunk (r-s), receive chunk (r-s-1) and reduce it
//     with the local contribution. After it, rank r owns chunk (r+1) fully reduced (and divided
//     by n for avg).
//   all-gather, steps s = n-1 .. 2n-3: forward the chunk received last step; receive straight
//     into the output buffer, nothing is re-reduced, so all ranks end bit-identical.
// 2(n-1) steps, 2(n-1)/n * S bytes sent per rank.
//
// Pipelining: work items are (step, segment) in that order. The chunk a rank sends at step s+1
// is the one it reduced at step s, so segment k is forwarded as soon as it is reduced, while
// later segments are still on the wire: communication of one segment overlaps the reduction of
// the previous one. Up to Config::pipeline_depth receives are posted ahead (a chunk more where
// segments are pieces between hosts), reduce-scatter ones into that many scratch slots.
// Out-of-place, reductions read the send buffer and write the output (dst = send op incoming),
// so there is no initial copy.

#include "collectives/allreduce_ring.h"

#include <algorithm>
#include <vector>

#include "collectives/p2p.h"
#include "core/error.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

struct Range {
  std::size_t offset;  // elements
  std::size_t length;  // elements
};

// Splits `total` into `parts` near-equal ranges; the first total % parts take one extra element.
Range split(std::size_t total, std::size_t parts, std::size_t index) {
  const std::size_t base = total / parts;
  const std::size_t extra = total % parts;
  return {index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

}  // namespace

std::optional<double> AllreduceRing::predicted_seconds(const CostModel& model,
                                                       const CostQuery& q) const {
  // One rank per group sends across (to the next group's first rank) in each step; every step
  // waits for its slowest link.
  const double S = static_cast<double>(q.bytes);
  const int n = q.ranks;
  const CostModel::Link link = model.worst_link(q.groups);
  return 2.0 * (n - 1) * (link.alpha + S / n * link.beta) + (n - 1.0) / n * S * model.gamma;
}

void AllreduceRing::run(const AllreduceArgs& args, Communicator& comm) {
  const Caller kCall{"allreduce(ring)", args.call};
  const int n = comm.size();
  const int r = comm.rank();
  const int right = (r + 1) % n;
  const int left = (r + n - 1) % n;
  const std::size_t es = args.element_bytes();

  // Where a link crosses hosts, no segment is larger than a piece (p2p.h): a larger one would
  // wait for a clear-to-send queued behind the peer's own segments.
  const Config& config = comm.config();
  const std::size_t piece = ring_piece_bytes(comm);
  const bool pieces = piece < config.segment_bytes;
  const std::size_t segment_bytes = pieces ? piece : config.segment_bytes;

  const std::size_t max_chunk = (args.count + n - 1) / n;
  const std::size_t segment_elems = std::max<std::size_t>(1, segment_bytes / es);
  const std::size_t K = std::max<std::size_t>(1, (max_chunk + segment_elems - 1) / segment_elems);
  const std::size_t max_segment_bytes = ((max_chunk + K - 1) / K) * es;
  const int steps = 2 * (n - 1);
  const std::size_t total = static_cast<std::size_t>(steps) * K;
  // Pieces go eagerly: one that finds no receive posted waits in the MPI library's buffers and
  // is copied once more. A rank sends up to a chunk ahead of what its right neighbour reduces
  // (all of step 0 at once, then each segment of the next step as soon as it is reduced), so
  // with pieces the receives are posted a chunk ahead too (scratch: a chunk).
  const std::size_t depth = static_cast<std::size_t>(config.pipeline_depth) + (pieces ? K : 0);

  auto chunk_of = [&](long long c) { return static_cast<std::size_t>(((c % n) + n) % n); };
  auto segment = [&](std::size_t chunk, std::size_t k) {
    const Range c = split(args.count, n, chunk);
    const Range s = split(c.length, K, k);
    return Range{c.offset + s.offset, s.length};
  };
  // The chunk a rank receives at step s (and forwards at step s+1).
  auto recv_chunk = [&](std::size_t s) { return chunk_of(static_cast<long long>(r) - s - 1); };

  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  std::byte* slots = comm.scratch(depth * max_segment_bytes);

  std::vector<MPI_Request> sends(total, MPI_REQUEST_NULL);
  std::vector<bool> send_posted(total, false);
  std::vector<MPI_Request> recvs(depth, MPI_REQUEST_NULL);

  auto post_send = [&](std::size_t item, const std::byte* base, Range seg) {
    sends[item] =
        isend_bytes(base + seg.offset * es, seg.length * es, right, kTagRing, comm, kCall);
    send_posted[item] = true;
  };

  // Step 0 sends this rank's own chunk, straight from the send buffer.
  for (std::size_t k = 0; k < K; ++k)
    post_send(k, send, segment(chunk_of(r), k));

  std::size_t next_post = 0;
  auto post_receives = [&](std::size_t done) {
    while (next_post < total && next_post < done + depth) {
      const std::size_t s = next_post / K;
      const std::size_t k = next_post % K;
      const Range seg = segment(recv_chunk(s), k);
      void* target;
      if (s < static_cast<std::size_t>(n - 1)) {
        target = slots + (next_post % depth) * max_segment_bytes;
      } else {
        // All-gather receives overwrite a region this rank sent from at step t = s-(n-1):
        // that send must have been posted and completed first.
        const std::size_t earlier = (s - (n - 1)) * K + k;
        if (!send_posted[earlier]) break;
        wait(sends[earlier], kCall);
        target = recv + seg.offset * es;
      }
      recvs[next_post % depth] = irecv_bytes(target, seg.length * es, left, kTagRing, comm, kCall);
      ++next_post;
    }
  };

  for (std::size_t item = 0; item < total; ++item) {
    post_receives(item);
    const std::size_t s = item / K;
    const std::size_t k = item % K;
    const Range seg = segment(recv_chunk(s), k);
    wait(recvs[item % depth], kCall);
    if (s < static_cast<std::size_t>(n - 1)) {
      const std::byte* incoming = slots + (item % depth) * max_segment_bytes;
      reduce_to(recv + seg.offset * es, send + seg.offset * es, incoming, seg.length, args.dtype,
                args.op);
      if (s == static_cast<std::size_t>(n - 2) && args.op == ReduceOp::avg) {
        divide_by(recv + seg.offset * es, seg.length, args.dtype, n);
      }
    }
    if (s + 1 < static_cast<std::size_t>(steps)) post_send(item + K, recv, seg);
  }
  wait_all(sends.size(), sends.data(), kCall);
}

}  // namespace gradcomm::collectives
