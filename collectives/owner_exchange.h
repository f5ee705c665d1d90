#pragma once

// Direct reduce-scatter and all-gather by column owners, shared by `hierarchical` (inside each
// group) and the reproducible mode (over the whole communicator).
//
// The buffer is cut into `columns` near-equal ranges; column c belongs to member c % g of the
// g-member communicator. Reduce-scatter: every member sends each column to its owner, which
// reduces the g contributions in member order, (((x0 op x1) op x2) ...), so the result is the
// bits of a serial reduction in member order. All-gather: owners send their columns to every
// other member. Each sends (g-1)/g * S bytes (with columns == g), in one round of concurrent
// messages.

#include <cstddef>
#include <vector>

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

struct ColumnLayout {
  ColumnLayout(std::size_t count, std::size_t columns, int members, int member);

  struct Range {
    std::size_t offset, length;
  };
  Range column(std::size_t c) const;
  int owner(std::size_t c) const { return static_cast<int>(c % static_cast<std::size_t>(members)); }

  std::size_t count, columns;
  int members, member;
  std::vector<std::size_t> owned;  // this member's columns
  std::size_t owned_elements = 0;
};

// Writes the owned columns of args.recv with the reduction (op) of all members' args.send.
// `group` is the communicator of the members (its rank == layout.member).
void reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op, const ColumnLayout& layout,
                              Communicator& group, Communicator& scratch_owner);

// Copies every column from its owner's args.recv into every member's args.recv.
void allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                           Communicator& group);

// Ring forms of the two (hierarchical's intra-group phases for large buffers): g - 1 steps in
// which member m sends to m + 1 one member's block (the columns it owns): the same
// (g-1)/g * S bytes per rank, to one neighbour per step instead of g - 1 peers at once. Each
// column is still reduced along one chain, so all members end with the same bits (not in
// member order: the reproducible mode uses the direct form).
void ring_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                   const ColumnLayout& layout, Communicator& group,
                                   Communicator& scratch_owner);
void ring_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                                Communicator& group);

// The reproducible mode (Config::deterministic): an all-reduce whose output is exactly the bits
// of the serial reduction in rank order, for any algorithm name: column owners reduce the n
// contributions in rank order, then all-gather. Same bytes as the ring's 2(n-1)/n * S per rank.
void reproducible_allreduce(const AllreduceArgs& args, Communicator& comm);

}  // namespace gradcomm::collectives
