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
#include "collectives/allreduce_nccl.h"
#include "collectives/owner_exchange.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

// The sub-communicators of one communicator, built once (collectively, on first use).
class Hierarchy : public Attachment {
 public:
  explicit Hierarchy(Communicator& comm) {
    const topology::Topology& topo = topology::topology_of(comm);
    const int group = topo.group();
    const std::vector<int>& mine = topo.my_group();
    groups = static_cast<int>(topo.groups.size());
    group_size = static_cast<int>(mine.size());
    local = topo.group_local_rank();
    for (const auto& g : topo.groups)
      columns = std::max(columns, static_cast<int>(g.size()));
    trivial = groups == 1 || columns == 1;
    if (trivial) return;
    // Sub-communicators add to this communicator's counters.
    const std::shared_ptr<TrafficCounters> counters = comm.attachment<Traffic>().shared_counters();
    MPI_Comm split = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm.mpi_comm(), group, comm.rank(), &split),
              "allreduce(hierarchical): MPI_Comm_split", comm.rank());
    group_comm = std::make_unique<Communicator>(split, comm.config().for_sub_communicator());
    MPI_Comm_free(&split);
    group_comm->attach(std::make_unique<Traffic>(counters, std::vector<int>(mine.size(), 0)));
    column_comms.resize(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) {
      const bool owner = c % group_size == local;
      check_mpi(MPI_Comm_split(comm.mpi_comm(), owner ? 0 : MPI_UNDEFINED, comm.rank(), &split),
                "allreduce(hierarchical): MPI_Comm_split", comm.rank());
      if (!owner) continue;
      auto column = std::make_unique<Communicator>(split, comm.config().for_sub_communicator());
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
  if (args.device) return gpu_hierarchical_allreduce(args, comm);
  Hierarchy& h = comm.attachment<Hierarchy>();
  if (h.trivial) return comm.attachment<AlgorithmCache>().find("ring")->run(args, comm);

  const ColumnLayout layout(args.count, static_cast<std::size_t>(h.columns), h.group_size, h.local);
  const ReduceOp phase_op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  reduce_scatter_to_owners(args, phase_op, layout, *h.group_comm, comm);  // phase 1

  // Phase 2: across groups, column by column.
  const std::size_t es = args.element_bytes();
  for (std::size_t c : layout.owned) {
    const auto col = layout.column(c);
    std::byte* data = static_cast<std::byte*>(args.recv) + col.offset * es;
    const std::string_view algorithm =
        col.length * es < kHierarchicalRingFromBytes ? "halving_doubling" : "ring";
    allreduce(*h.column_comms[c], data, data, col.length, args.dtype, phase_op,
              {.algorithm = algorithm});
    if (args.op == ReduceOp::avg) divide_by(data, col.length, args.dtype, comm.size());
  }

  allgather_from_owners(args, layout, *h.group_comm);  // phase 3
}

}  // namespace gradcomm::collectives
