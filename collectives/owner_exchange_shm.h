#pragma once

#include <cstddef>

#include "collectives/owner_exchange.h"
#include "collectives/shm/segment.h"

namespace gradcomm::collectives {

// Hierarchical's intra-group phases through the group's segment (group: a communicator whose
// ranks share this host, shm_available). Same contract as reduce_scatter_to_owners and
// allgather_from_owners (owner_exchange.h), without messages, on shm's design (allreduce_shm.h):
//   - reduce-scatter: each column's owner reduces it from every member's input, in member order,
//     straight into its output. A registered input is read where it lies; a private one is
//     staged, round by round, into its rank's stage slot, and only the columns peers own.
//   - all-gather: each owner writes its columns straight into every registered output; where
//     some output is private, it also publishes them in its own stage slot, from which those
//     ranks copy them.
// Where every input (reduce-scatter) or every output (all-gather) is registered, the phase is
// one round; otherwise rounds carry a cache-sized sub-piece of every column. Stores never target
// a slot before every rank is done with the round that last used it (kShmStageSlots back).
// Ranks that disagree on the call fail together, as in shm's all-reduce. The reduce-scatter
// returns where every member's registered buffers lie, which the all-gather of the same call
// takes.
ShmPeers shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                      const ColumnLayout& layout, Communicator& group);
void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group, const ShmPeers& peers);
// True when a round can carry one element of each of `columns` columns.
bool shm_columns_fit(std::size_t columns, std::size_t element_bytes);

}  // namespace gradcomm::collectives
