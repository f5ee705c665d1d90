// Hierarchical all-reduce (Goyal et al. 2017; Horovod's hierarchical all-reduce): groups are the
// topology's nodes (or emulated nodes, or the quads of the DGX-1 preset).
//
// Vocabulary: G groups, group i has g_i ranks; P = the largest g_i; the buffer is cut into P
// columns (near-equal, the first count % P one element longer). In group i, column c belongs to
// local rank c % g_i, so with equal groups every rank owns exactly one column and with uneven
// groups (5 = 3 + 2) some ranks of the smaller groups own two.
//
// Phases:
//   1. reduce-scatter inside each group: each column ends reduced at its owner. (g-1)/g * S
//      bytes per rank, all inside the group, in one of three forms (Config::hierarchical_intra):
//      direct (every rank sends each column to its owner, one round of concurrent messages),
//      ring (g - 1 steps between neighbours) or shm (no messages: through the group's shared
//      segment, when the group shares one host).
//   2. all-reduce across groups of each column, among its G owners (one per group), on a cached
//      column communicator, with the library's halving_doubling (below 4 MiB) or ring: the only
//      cross-group traffic, 2(G-1)/G * S/g per rank with the ring, in 2(G-1) dependent steps.
//      With a second level (the DGX-1 preset on several servers: quads, then servers), the
//      column communicator is itself split by the next level and phase 2 is this algorithm
//      again on it: quad -> the two quads of a server -> across servers, so each server's
//      uplink carries S/8 per rank instead of S/4.
//   3. all-gather inside each group (the same form as phase 1): owners' columns to every member.
// Cross-group bytes are cut by the group size against a flat ring. With one group, or groups of
// one rank, there is no hierarchy and the call is the plain ring.

#include "collectives/allreduce_hierarchical.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "collectives/allreduce_halving_doubling.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/allreduce_ring.h"
#include "collectives/owner_exchange.h"
#include "collectives/owner_exchange_shm.h"
#include "collectives/p2p.h"
#include "collectives/shm/segment.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "topology/host.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kCall = "allreduce(hierarchical)";

// The cross-group phase all-reduces each shard with halving_doubling below this size, with the
// ring from it (the crossover measured on 2 and 4 ranks).
constexpr std::size_t kRingFromBytes = std::size_t{4} << 20;

const AllreduceRing kRing;
const AllreduceHalvingDoubling kHalvingDoubling;

std::unique_ptr<Communicator> split(Communicator& comm, int color) {
  MPI_Comm part = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm.mpi_comm(), color, comm.rank(), &part),
            "allreduce(hierarchical): MPI_Comm_split", comm.rank());
  if (part == MPI_COMM_NULL) return nullptr;
  auto result = std::make_unique<Communicator>(part, comm.config().for_sub_communicator());
  check_mpi(MPI_Comm_free(&part), "allreduce(hierarchical): MPI_Comm_free", comm.rank());
  return result;
}

// Counts a sub-communicator's messages into the root's counters, classified by the members'
// topology groups; the members' hosts decide how messages between them are cut (p2p.h).
void attach_traffic(Communicator& sub, const std::shared_ptr<TrafficCounters>& counters,
                    int traffic_group, int host) {
  const auto n = static_cast<std::size_t>(sub.size());
  const int mine[2] = {traffic_group, host};
  std::vector<int> both(2 * n);
  check_mpi(MPI_Allgather(mine, 2, MPI_INT, both.data(), 2, MPI_INT, sub.mpi_comm()),
            "allreduce(hierarchical): MPI_Allgather", sub.rank());
  std::vector<int> member_groups(n), member_hosts(n);
  for (std::size_t i = 0; i < n; ++i) {
    member_groups[i] = both[2 * i];
    member_hosts[i] = both[2 * i + 1];
  }
  sub.attach(
      std::make_unique<Traffic>(counters, std::move(member_groups), std::move(member_hosts)));
}

// One level of the hierarchy over a communicator: this rank's group communicator, and for each
// column it owns the communicator of that column's owners (one per group), which carries the
// next level or the cross-group all-reduce. Built once, collectively.
class Level {
 public:
  // `ids[l][r]`: the group of rank r of `comm` at level l (innermost first).
  // `machine_ranks`: ranks running on this machine (for shm's spin-or-yield choice); `host`:
  // this rank's real host (topology's host_of_rank).
  Level(Communicator& comm, std::vector<std::vector<int>> ids,
        const std::shared_ptr<TrafficCounters>& counters, int traffic_group, int host,
        int machine_ranks) {
    std::vector<std::vector<int>> groups;
    // Levels that do not split this communicator (one group, or groups of one rank) are skipped.
    while (!ids.empty()) {
      groups = topology::members(ids.front());
      std::erase_if(groups, [](const std::vector<int>& g) { return g.empty(); });
      columns = 0;
      for (const auto& g : groups)
        columns = std::max(columns, static_cast<int>(g.size()));
      if (groups.size() > 1 && columns > 1) break;
      ids.erase(ids.begin());
    }
    if (ids.empty()) return;
    flat = false;
    const std::vector<int>& group_of_rank = ids.front();
    const int group = group_of_rank[static_cast<std::size_t>(comm.rank())];
    group_comm = split(comm, group);
    attach_traffic(*group_comm, counters, traffic_group, host);
    share_machine_with(*group_comm, machine_ranks);
    group_size = group_comm->size();
    local = group_comm->rank();
    column_comms.resize(static_cast<std::size_t>(columns));
    next.resize(static_cast<std::size_t>(columns));
    for (int c = 0; c < columns; ++c) {
      const bool owner = c % group_size == local;
      std::unique_ptr<Communicator> column = split(comm, owner ? 0 : MPI_UNDEFINED);
      if (!owner) continue;
      attach_traffic(*column, counters, traffic_group, host);
      if (ids.size() > 1) {  // the outer levels, restricted to this column's owners
        const int parent_rank = comm.rank();
        std::vector<int> parents(static_cast<std::size_t>(column->size()));
        check_mpi(
            MPI_Allgather(&parent_rank, 1, MPI_INT, parents.data(), 1, MPI_INT, column->mpi_comm()),
            "allreduce(hierarchical): MPI_Allgather", column->rank());
        std::vector<std::vector<int>> outer;
        for (std::size_t l = 1; l < ids.size(); ++l) {
          std::vector<int> level;
          for (int p : parents)
            level.push_back(ids[l][static_cast<std::size_t>(p)]);
          outer.push_back(std::move(level));
        }
        auto nested = std::make_unique<Level>(*column, std::move(outer), counters, traffic_group,
                                              host, machine_ranks);
        if (!nested->flat) next[static_cast<std::size_t>(c)] = std::move(nested);
      }
      column_comms[static_cast<std::size_t>(c)] = std::move(column);
    }
  }

  // All-reduces args (count elements; args.send may differ from args.recv only at the root)
  // with `op` (never avg) on `comm`, this level's communicator; every owned column is divided
  // by `divisor` once reduced (avg at the root).
  void run(const AllreduceArgs& args, ReduceOp op, int divisor, Communicator& comm) {
    const ColumnLayout layout(args.count, static_cast<std::size_t>(columns), group_size, local);
    const std::size_t es = args.element_bytes();
    const Intra intra = intra_form(args, layout, comm.config());
    ShmPeers peers;   // shm: where the members' registered buffers lie, for phase 3
    switch (intra) {  // phase 1
      case Intra::direct:
        reduce_scatter_to_owners(args, op, layout, *group_comm, comm);
        break;
      case Intra::ring:
        ring_reduce_scatter_to_owners(args, op, layout, *group_comm, comm);
        break;
      case Intra::shm:
        peers = shm_reduce_scatter_to_owners(args, op, layout, *group_comm);
        break;
    }
    for (std::size_t c : layout.owned) {  // phase 2
      const auto col = layout.column(c);
      std::byte* data = static_cast<std::byte*>(args.recv) + col.offset * es;
      Communicator& column = *column_comms[c];
      AllreduceArgs shard = args;  // the same call (AllreduceArgs::call)
      shard.send = shard.recv = data;
      shard.count = col.length;
      shard.op = op;
      shard.sequence = column.next_sequence();
      if (Level* inner = next[c].get()) {
        inner->run(shard, op, 1, column);
      } else if (column.size() > 1 && shard.count > 0) {
        if (col.length * es < kRingFromBytes) {
          AllreduceHalvingDoubling().run(shard, column);
        } else {
          AllreduceRing().run(shard, column);
        }
      }
      if (divisor > 1) divide_by(data, col.length, args.dtype, divisor);
    }
    switch (intra) {  // phase 3
      case Intra::direct:
        return allgather_from_owners(args, layout, *group_comm);
      case Intra::ring:
        return ring_allgather_from_owners(args, layout, *group_comm);
      case Intra::shm:
        return shm_allgather_from_owners(args, layout, *group_comm, peers);
    }
  }

  bool flat = true;  // no level splits the communicator
  int group_size = 1, local = 0, columns = 1;
  std::unique_ptr<Communicator> group_comm;
  std::vector<std::unique_ptr<Communicator>> column_comms;  // null where this rank is no owner
  std::vector<std::unique_ptr<Level>> next;                 // null: one-level cross phase

 private:
  // The same on every member of the group (size, the group's placement and the config, which
  // are equal there): different groups may choose differently.
  Intra intra_form(const AllreduceArgs& args, const ColumnLayout& layout, const Config& config) {
    const std::string& asked = config.hierarchical_intra;
    if (asked == "direct" || group_size == 1) return Intra::direct;
    if (asked == "ring") return Intra::ring;
    const bool shm_ok =
        shm_columns_fit(layout.columns, args.element_bytes()) && shm_available(*group_comm);
    if (asked == "shm") return shm_ok ? Intra::shm : Intra::direct;
    return hierarchical_intra_auto(shm_ok);
  }
};

// The root level of a communicator, from its topology.
class Hierarchy : public Attachment {
 public:
  // Sub-communicators may hold messages of a call abandoned by a mismatch: built afresh then.
  bool survives_mismatch() const override { return false; }
  explicit Hierarchy(Communicator& comm) {
    const topology::Topology& topo = topology::topology_of(comm);
    // The intra-group form must agree inside each group; require it everywhere.
    const int form = comm.config().hierarchical_intra == "auto"     ? 0
                     : comm.config().hierarchical_intra == "direct" ? 1
                     : comm.config().hierarchical_intra == "ring"   ? 2
                                                                    : 3;
    int range[2] = {-form, form};
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MAX, comm.mpi_comm()),
              "allreduce(hierarchical): MPI_Allreduce", comm.rank());
    if (-range[0] != range[1]) {
      throw InvalidArgument(error_message(
          kCall, comm.rank(),
          "GRADCOMM_HIERARCHICAL_INTRA (Config::hierarchical_intra) differs across ranks (here '" +
              comm.config().hierarchical_intra + "'); set it identically for every rank"));
    }
    root = std::make_unique<Level>(comm, topo.levels, comm.attachment<Traffic>().shared_counters(),
                                   topo.group(),
                                   topo.host_of_rank[static_cast<std::size_t>(topo.rank)],
                                   topology::ranks_on_this_machine(comm));
  }
  std::unique_ptr<Level> root;
};

}  // namespace

Intra hierarchical_intra_auto(bool shm_ok) {
  return shm_ok ? Intra::shm : Intra::direct;
}

std::optional<double> AllreduceHierarchical::predicted_seconds(const CostModel& model,
                                                               const CostQuery& q) const {
  if (q.groups <= 1 || q.group_size <= 1) return std::nullopt;  // runs the ring
  const double S = static_cast<double>(q.bytes);
  const double g = q.group_size;
  const double shard = S / g;
  const bool shm_phases = hierarchical_intra_auto(model.group_shm) == Intra::shm;
  // direct: one round of messages each way; shm: 4 flag waits per staged round, copies in of the
  // others' columns, out of the owner's, and out of the others'.
  const double rounds = std::max(1.0, std::ceil(S / static_cast<double>(kShmRoundBytes)));
  const double intra_phases =
      shm_phases ? 4 * rounds * model.flag_alpha + (2 * (g - 1) / g + 1 / g) * S * model.copy_beta +
                       (g - 1) / g * S * model.gamma
                 : 2 * (g - 1) * model.intra.alpha + 2 * (g - 1) / g * S * model.intra.beta +
                       (g - 1) / g * S * model.gamma;
  CostModel across = model;
  across.intra = model.shared_inter(q.group_size);  // every rank of a group crosses at once
  const CostQuery cross{static_cast<std::size_t>(shard), q.groups, 1, q.groups};
  const AllreduceAlgorithm& algorithm =
      shard < static_cast<double>(kRingFromBytes)
          ? static_cast<const AllreduceAlgorithm&>(kHalvingDoubling)
          : kRing;
  return intra_phases + *algorithm.predicted_seconds(across, cross);
}

void AllreduceHierarchical::run(const AllreduceArgs& args, Communicator& comm) {
  if (args.device) return gpu_hierarchical_allreduce(args, comm);
  Level& root = *comm.attachment<Hierarchy>().root;
  if (root.flat) return AllreduceRing().run(args, comm);
  const bool avg = args.op == ReduceOp::avg;
  root.run(args, avg ? ReduceOp::sum : args.op, avg ? comm.size() : 1, comm);
}

}  // namespace gradcomm::collectives
