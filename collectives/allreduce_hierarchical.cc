// Hierarchical all-reduce (Goyal et al. 2017; Horovod's hierarchical all-reduce): groups are the
// topology's nodes (or emulated nodes, or the quads of the DGX-1 preset).
//
// Vocabulary: G groups, group i has g_i ranks; P = the largest g_i; the buffer is cut into P
// columns (near-equal, the first count % P one element longer). In group i, column c belongs to
// local rank c % g_i, so with equal groups every rank owns exactly one column and with uneven
// groups (5 = 3 + 2) some ranks of the smaller groups own two.
//
// Phases:
//   1. reduce-scatter inside each group: every rank sends each column to its owner, which
//      reduces the g_i contributions in local-rank order. (g-1)/g * S bytes sent per rank, all
//      inside the group, in one round of concurrent messages.
//   2. all-reduce across groups of each column, among its G owners (one per group), on a cached
//      column communicator, with the library's halving_doubling (below 4 MiB) or ring: the only
//      cross-group traffic, 2(G-1)/G * S/g per rank with the ring, in 2(G-1) dependent steps.
//   3. all-gather inside each group: owners send their columns to the rest of the group.
// Cross-group bytes are cut by the group size against a flat ring. With one group, or groups of
// one rank, there is no hierarchy and the call is the plain ring.

#include "collectives/allreduce_hierarchical.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kCall = "allreduce(hierarchical)";
constexpr std::size_t kRingFromBytes = std::size_t{4} << 20;

struct Range {
  std::size_t offset, length;
};
Range split(std::size_t total, std::size_t parts, std::size_t index) {
  const std::size_t base = total / parts;
  const std::size_t extra = total % parts;
  return {index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

// The sub-communicators of one communicator, built once (collectively, on first use).
class Hierarchy : public Attachment {
 public:
  explicit Hierarchy(Communicator& comm) {
    const topology::Topology& topo = topology::topology_of(comm);
    const int group = topo.group_of_rank[static_cast<std::size_t>(comm.rank())];
    const std::vector<int>& mine = topo.groups[static_cast<std::size_t>(group)];
    groups = static_cast<int>(topo.groups.size());
    group_size = static_cast<int>(mine.size());
    local = static_cast<int>(std::find(mine.begin(), mine.end(), comm.rank()) - mine.begin());
    for (const auto& g : topo.groups)
      columns = std::max(columns, static_cast<int>(g.size()));
    trivial = groups == 1 || columns == 1;
    if (trivial) return;
    // Sub-communicators add to this communicator's counters.
    const std::shared_ptr<TrafficCounters> counters =
        comm.attachment<Traffic>().shared_counters();
    MPI_Comm split = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm.mpi_comm(), group, comm.rank(), &split),
              "allreduce(hierarchical): MPI_Comm_split", comm.rank());
    group_comm = std::make_unique<Communicator>(split, comm.config());
    MPI_Comm_free(&split);
    group_comm->attach(std::make_unique<Traffic>(counters, std::vector<int>(mine.size(), 0)));
    column_comms.resize(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) {
      const bool owner = c % group_size == local;
      check_mpi(MPI_Comm_split(comm.mpi_comm(), owner ? 0 : MPI_UNDEFINED, comm.rank(), &split),
                "allreduce(hierarchical): MPI_Comm_split", comm.rank());
      if (!owner) continue;
      auto column = std::make_unique<Communicator>(split, comm.config());
      MPI_Comm_free(&split);
      // Every member of a column communicator is in a different group.
      std::vector<int> member_groups(static_cast<std::size_t>(column->size()));
      MPI_Allgather(&group, 1, MPI_INT, member_groups.data(), 1, MPI_INT, column->mpi_comm());
      column->attach(std::make_unique<Traffic>(counters, member_groups));
      column_comms[static_cast<std::size_t>(c)] = std::move(column);
    }
  }

  bool trivial = false;
  int groups = 1, group_size = 1, local = 0, columns = 1;
  std::unique_ptr<Communicator> group_comm;
  std::vector<std::unique_ptr<Communicator>> column_comms;  // null where this rank is no owner
};

}  // namespace

void AllreduceHierarchical::run(const AllreduceArgs& args, Communicator& comm) {
  Hierarchy& h = comm.attachment<Hierarchy>();
  if (h.trivial) return comm.attachment<AlgorithmCache>().find("ring")->run(args, comm);

  const std::size_t es = args.element_bytes();
  const auto P = static_cast<std::size_t>(h.columns);
  const int g = h.group_size;
  auto owner = [&](std::size_t c) { return static_cast<int>(c % static_cast<std::size_t>(g)); };
  std::vector<std::size_t> owned;
  std::size_t owned_elements = 0;
  for (std::size_t c = 0; c < P; ++c) {
    if (owner(c) == h.local) {
      owned.push_back(c);
      owned_elements += split(args.count, P, c).length;
    }
  }
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  Communicator& group = *h.group_comm;

  // Phase 1. Scratch: one slot per group member (the own slot holds a copy of this rank's
  // contribution, needed in-place when this rank is not local rank 0), each `owned_elements`.
  std::byte* slots = comm.scratch(static_cast<std::size_t>(g) * owned_elements * es);
  auto slot = [&](int member) {
    return slots + static_cast<std::size_t>(member) * owned_elements * es;
  };
  std::vector<MPI_Request> requests;
  for (int m = 0; m < g; ++m) {
    if (m == h.local) continue;
    std::size_t offset = 0;
    for (std::size_t c : owned) {
      const Range col = split(args.count, P, c);
      irecv_pieces(slot(m) + offset * es, col.length * es, m, kTagHierarchical, group, kCall,
                   requests);
      offset += col.length;
    }
  }
  for (std::size_t c = 0; c < P; ++c) {
    if (owner(c) == h.local) continue;
    const Range col = split(args.count, P, c);
    isend_pieces(send + col.offset * es, col.length * es, owner(c), kTagHierarchical, group, kCall,
                 requests);
  }
  wait_all(requests.size(), requests.data(), kCall);
  requests.clear();
  const ReduceOp phase_op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  std::size_t offset = 0;
  for (std::size_t c : owned) {
    const Range col = split(args.count, P, c);
    std::byte* dst = recv + col.offset * es;
    const std::byte* own = send + col.offset * es;
    if (args.in_place() && h.local != 0) {
      std::memcpy(slot(h.local) + offset * es, own, col.length * es);
      own = slot(h.local) + offset * es;
    }
    auto contribution = [&](int m) { return m == h.local ? own : slot(m) + offset * es; };
    if (g == 1) {
      if (dst != own) std::memcpy(dst, own, col.length * es);
    } else {
      reduce_to(dst, contribution(0), contribution(1), col.length, args.dtype, phase_op);
      for (int m = 2; m < g; ++m) {
        reduce_into(dst, contribution(m), col.length, args.dtype, phase_op);
      }
    }
    offset += col.length;
  }

  // Phase 2: across groups, column by column.
  for (std::size_t c : owned) {
    const Range col = split(args.count, P, c);
    std::byte* data = recv + col.offset * es;
    const std::string_view algorithm =
        col.length * es < kRingFromBytes ? "halving_doubling" : "ring";
    allreduce(*h.column_comms[c], data, data, col.length, args.dtype, phase_op,
              {.algorithm = algorithm});
    if (args.op == ReduceOp::avg) divide_by(data, col.length, args.dtype, comm.size());
  }

  // Phase 3: all-gather inside the group, straight into the output.
  for (std::size_t c = 0; c < P; ++c) {
    const Range col = split(args.count, P, c);
    if (owner(c) == h.local) {
      for (int m = 0; m < g; ++m) {
        if (m != h.local) {
          isend_pieces(recv + col.offset * es, col.length * es, m, kTagHierarchical, group, kCall,
                       requests);
        }
      }
    } else {
      irecv_pieces(recv + col.offset * es, col.length * es, owner(c), kTagHierarchical, group,
                   kCall, requests);
    }
  }
  wait_all(requests.size(), requests.data(), kCall);
}

}  // namespace gradcomm::collectives
