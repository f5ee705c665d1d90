// Flat all-reduce: every rank sends its buffer to a root, the root reduces and sends the result
// back to every rank (the parameter-server shape). The root is the call's sequence number modulo
// n, so consecutive calls (one per tensor) spread the load over all ranks.
//
// The root reduces in rank order, ((x0 op x1) op x2) op ..., whoever the root is, so the result
// equals a serial reduction in rank order. Work is cut into segments of Config::segment_bytes;
// the root keeps Config::pipeline_depth segments of every peer in flight and sends each reduced
// segment out while later ones arrive.
// Cost: the root receives and sends (n-1) * S bytes; the others send and receive S. 2 steps.

#include "collectives/allreduce_flat.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/p2p.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {

std::optional<double> AllreduceFlat::predicted_seconds(const CostModel& model,
                                                       const CostQuery& q) const {
  const double S = static_cast<double>(q.bytes);
  const int n = q.ranks;
  const CostModel::Link link = model.worst_link(q.groups);
  return 2 * link.alpha + 2.0 * (n - 1) * S * link.beta + (n - 1.0) * S * model.gamma;
}

void AllreduceFlat::run(const AllreduceArgs& args, Communicator& comm) {
  const Caller kCall{"allreduce(flat)", args.call};
  const int n = comm.size();
  const int r = comm.rank();
  const int root = static_cast<int>(args.sequence % static_cast<std::uint64_t>(n));
  const std::size_t es = args.element_bytes();
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);

  const std::size_t segment_elems = std::max<std::size_t>(1, comm.config().segment_bytes / es);
  const std::size_t K = (args.count + segment_elems - 1) / segment_elems;
  auto seg_offset = [&](std::size_t k) { return k * segment_elems; };
  auto seg_length = [&](std::size_t k) {
    return std::min(segment_elems, args.count - seg_offset(k));
  };

  if (r != root) {
    std::vector<MPI_Request> sends(K);
    std::vector<MPI_Request> recvs(K);
    for (std::size_t k = 0; k < K; ++k) {
      sends[k] =
          isend_bytes(send + seg_offset(k) * es, seg_length(k) * es, root, kTagFlat, comm, kCall);
    }
    for (std::size_t k = 0; k < K; ++k) {
      wait(sends[k], kCall);  // in-place: the result lands where this segment was sent from
      recvs[k] =
          irecv_bytes(recv + seg_offset(k) * es, seg_length(k) * es, root, kTagFlat, comm, kCall);
    }
    wait_all(recvs.size(), recvs.data(), kCall);
    return;
  }

  // Root. Slot layout: depth groups of n segment buffers, indexed by source rank (the root's own
  // entry holds a copy of its contribution, needed only in-place when the root is not rank 0).
  // Sized by the call, not only by the configuration: a small call needs small slots.
  const std::size_t depth = std::min(static_cast<std::size_t>(comm.config().pipeline_depth), K);
  const std::size_t seg_bytes = std::min(segment_elems, args.count) * es;
  std::byte* slots = comm.scratch(depth * n * seg_bytes);
  auto slot = [&](std::size_t k, int source) {
    return slots + ((k % depth) * n + source) * seg_bytes;
  };
  std::vector<MPI_Request> recvs(depth * n, MPI_REQUEST_NULL);
  auto post = [&](std::size_t k) {
    for (int p = 0; p < n; ++p) {
      if (p == root) continue;
      recvs[(k % depth) * n + p] =
          irecv_bytes(slot(k, p), seg_length(k) * es, p, kTagFlat, comm, kCall);
    }
  };
  for (std::size_t k = 0; k < std::min(K, depth); ++k)
    post(k);

  std::vector<MPI_Request> sends;
  sends.reserve(K * (n - 1));
  const bool copy_own = args.in_place() && root != 0;
  for (std::size_t k = 0; k < K; ++k) {
    const std::size_t len = seg_length(k);
    std::byte* dst = recv + seg_offset(k) * es;
    wait_all(n, &recvs[(k % depth) * n], kCall);
    const std::byte* own = send + seg_offset(k) * es;
    if (copy_own) {
      std::memcpy(slot(k, root), own, len * es);
      own = slot(k, root);
    }
    auto contribution = [&](int p) -> const std::byte* { return p == root ? own : slot(k, p); };
    reduce_to(dst, contribution(0), contribution(1), len, args.dtype, args.op);
    for (int p = 2; p < n; ++p)
      reduce_into(dst, contribution(p), len, args.dtype, args.op);
    if (args.op == ReduceOp::avg) divide_by(dst, len, args.dtype, n);
    if (k + depth < K) post(k + depth);
    for (int p = 0; p < n; ++p) {
      if (p != root) sends.push_back(isend_bytes(dst, len * es, p, kTagFlat, comm, kCall));
    }
  }
  wait_all(sends.size(), sends.data(), kCall);
}

}  // namespace gradcomm::collectives
