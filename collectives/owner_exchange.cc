#include "collectives/owner_exchange.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "collectives/p2p.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kCall = "allreduce(owner exchange)";
constexpr int kTag = kTagHierarchical;

}  // namespace

ColumnLayout::ColumnLayout(std::size_t count_, std::size_t columns_, int members_, int member_)
    : count(count_), columns(columns_), members(members_), member(member_) {
  for (std::size_t c = 0; c < columns; ++c) {
    if (owner(c) == member) {
      owned.push_back(c);
      owned_elements += column(c).length;
    }
  }
}

ColumnLayout::Range ColumnLayout::column(std::size_t c) const {
  const std::size_t base = count / columns;
  const std::size_t extra = count % columns;
  return {c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
}

void reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op, const ColumnLayout& layout,
                              Communicator& group, Communicator& scratch_owner) {
  const std::size_t es = args.element_bytes();
  const int g = layout.members;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  // One slot per member, each `owned_elements` long; the own slot holds a copy of this member's
  // contribution, needed in-place when it is not member 0 (its output would overwrite it).
  std::byte* slots =
      scratch_owner.scratch(static_cast<std::size_t>(g) * layout.owned_elements * es);
  auto slot = [&](int m) {
    return slots + static_cast<std::size_t>(m) * layout.owned_elements * es;
  };
  std::vector<MPI_Request> requests;
  for (int m = 0; m < g; ++m) {
    if (m == layout.member) continue;
    std::size_t offset = 0;
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      irecv_pieces(slot(m) + offset * es, col.length * es, m, kTag, group, kCall, requests);
      offset += col.length;
    }
  }
  for (std::size_t c = 0; c < layout.columns; ++c) {
    if (layout.owner(c) == layout.member) continue;
    const auto col = layout.column(c);
    isend_pieces(send + col.offset * es, col.length * es, layout.owner(c), kTag, group, kCall,
                 requests);
  }
  wait_all(requests.size(), requests.data(), kCall);
  std::size_t offset = 0;
  for (std::size_t c : layout.owned) {
    const auto col = layout.column(c);
    std::byte* dst = recv + col.offset * es;
    const std::byte* own = send + col.offset * es;
    if (args.in_place() && layout.member != 0) {
      std::memcpy(slot(layout.member) + offset * es, own, col.length * es);
      own = slot(layout.member) + offset * es;
    }
    auto contribution = [&](int m) { return m == layout.member ? own : slot(m) + offset * es; };
    if (g == 1) {
      if (dst != own) std::memcpy(dst, own, col.length * es);
    } else {
      reduce_to(dst, contribution(0), contribution(1), col.length, args.dtype, op);
      for (int m = 2; m < g; ++m)
        reduce_into(dst, contribution(m), col.length, args.dtype, op);
    }
    offset += col.length;
  }
}

void allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                           Communicator& group) {
  const std::size_t es = args.element_bytes();
  auto* recv = static_cast<std::byte*>(args.recv);
  std::vector<MPI_Request> requests;
  for (std::size_t c = 0; c < layout.columns; ++c) {
    const auto col = layout.column(c);
    if (layout.owner(c) == layout.member) {
      for (int m = 0; m < layout.members; ++m) {
        if (m != layout.member) {
          isend_pieces(recv + col.offset * es, col.length * es, m, kTag, group, kCall, requests);
        }
      }
    } else {
      irecv_pieces(recv + col.offset * es, col.length * es, layout.owner(c), kTag, group, kCall,
                   requests);
    }
  }
  wait_all(requests.size(), requests.data(), kCall);
}

void reproducible_allreduce(const AllreduceArgs& args, Communicator& comm) {
  const ColumnLayout layout(args.count, static_cast<std::size_t>(comm.size()), comm.size(),
                            comm.rank());
  const ReduceOp op = args.op == ReduceOp::avg ? ReduceOp::sum : args.op;
  reduce_scatter_to_owners(args, op, layout, comm, comm);
  if (args.op == ReduceOp::avg) {
    const std::size_t es = args.element_bytes();
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      divide_by(static_cast<std::byte*>(args.recv) + col.offset * es, col.length, args.dtype,
                comm.size());
    }
  }
  allgather_from_owners(args, layout, comm);
}

}  // namespace gradcomm::collectives
