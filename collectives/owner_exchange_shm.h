#pragma once

#include <cstddef>

#include "collectives/owner_exchange.h"

namespace gradcomm::collectives {

// Hierarchical's intra-group phases through the group's segment (group: a communicator whose
// ranks share this host, shm_available). Same contract as reduce_scatter_to_owners and
// allgather_from_owners (owner_exchange.h), without messages: rounds carry a cache-sized
// sub-piece of every column; in the reduce-scatter each rank copies its round into its slot and
// each column's owner reduces the members' slots, in member order, straight into its output; in
// the all-gather owners publish their columns and every rank copies the others' out. Ranks that
// disagree on the call fail together, as in shm's all-reduce.
void shm_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                  const ColumnLayout& layout, Communicator& group);
void shm_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                               Communicator& group);
// True when a round can carry one element of each of `columns` columns.
bool shm_columns_fit(std::size_t columns, std::size_t element_bytes);

}  // namespace gradcomm::collectives
