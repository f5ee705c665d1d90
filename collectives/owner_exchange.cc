#include "collectives/owner_exchange.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "collectives/p2p.h"
#include "core/reduce_kernels.h"

namespace gradcomm::collectives {
namespace {

constexpr std::string_view kName = "allreduce(owner exchange)";
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
  const Caller kCall{kName, args.call};
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
  const Caller kCall{kName, args.call};
  const std::size_t es = args.element_bytes();
  auto* recv = static_cast<std::byte*>(args.recv);
  std::vector<MPI_Request> requests;
  // Every receive first, then every send (p2p.h: pieces between hosts need no clear-to-send);
  // between two ranks, columns go in column order either way.
  for (std::size_t c = 0; c < layout.columns; ++c) {
    const auto col = layout.column(c);
    if (layout.owner(c) != layout.member) {
      irecv_pieces(recv + col.offset * es, col.length * es, layout.owner(c), kTag, group, kCall,
                   requests);
    }
  }
  for (std::size_t c = 0; c < layout.columns; ++c) {
    const auto col = layout.column(c);
    if (layout.owner(c) != layout.member) continue;
    for (int m = 0; m < layout.members; ++m) {
      if (m != layout.member) {
        isend_pieces(recv + col.offset * es, col.length * es, m, kTag, group, kCall, requests);
      }
    }
  }
  wait_all(requests.size(), requests.data(), kCall);
}

namespace {

// The columns member b owns (its block), and their total length.
std::vector<std::size_t> block_columns(const ColumnLayout& layout, int b) {
  std::vector<std::size_t> columns;
  for (std::size_t c = static_cast<std::size_t>(b); c < layout.columns;
       c += static_cast<std::size_t>(layout.members))
    columns.push_back(c);
  return columns;
}

std::size_t block_length(const ColumnLayout& layout, const std::vector<std::size_t>& columns) {
  std::size_t length = 0;
  for (std::size_t c : columns)
    length += layout.column(c).length;
  return length;
}

int modulo(int value, int n) {
  return ((value % n) + n) % n;
}

}  // namespace

void ring_reduce_scatter_to_owners(const AllreduceArgs& args, ReduceOp op,
                                   const ColumnLayout& layout, Communicator& group,
                                   Communicator& scratch_owner) {
  const Caller kCall{kName, args.call};
  const std::size_t es = args.element_bytes();
  const int g = layout.members, m = layout.member;
  const auto* send = static_cast<const std::byte*>(args.send);
  auto* recv = static_cast<std::byte*>(args.recv);
  if (g == 1) {
    for (std::size_t c : layout.owned) {
      const auto col = layout.column(c);
      if (recv != send)
        std::memcpy(recv + col.offset * es, send + col.offset * es, col.length * es);
    }
    return;
  }
  std::size_t largest = 0;
  for (int b = 0; b < g; ++b)
    largest = std::max(largest, block_length(layout, block_columns(layout, b)));
  std::byte* incoming = scratch_owner.scratch(largest * es);
  const int right = (m + 1) % g, left = modulo(m - 1, g);
  std::vector<MPI_Request> requests;
  for (int step = 0; step + 1 < g; ++step) {
    // Send my partial of block m - 1 - step (my own contribution at step 0); receive block
    // m - 2 - step, to which I add mine: after g - 1 steps block m is complete here.
    const std::vector<std::size_t> out = block_columns(layout, modulo(m - 1 - step, g));
    const std::vector<std::size_t> in = block_columns(layout, modulo(m - 2 - step, g));
    const std::byte* from = step == 0 ? send : recv;
    requests.clear();
    std::size_t offset = 0;
    for (std::size_t c : in) {
      const auto col = layout.column(c);
      irecv_pieces(incoming + offset * es, col.length * es, left, kTag, group, kCall, requests);
      offset += col.length;
    }
    for (std::size_t c : out) {
      const auto col = layout.column(c);
      isend_pieces(from + col.offset * es, col.length * es, right, kTag, group, kCall, requests);
    }
    wait_all(requests.size(), requests.data(), kCall);
    offset = 0;
    for (std::size_t c : in) {
      const auto col = layout.column(c);
      reduce_to(recv + col.offset * es, incoming + offset * es, send + col.offset * es, col.length,
                args.dtype, op);
      offset += col.length;
    }
  }
}

void ring_allgather_from_owners(const AllreduceArgs& args, const ColumnLayout& layout,
                                Communicator& group) {
  const Caller kCall{kName, args.call};
  const std::size_t es = args.element_bytes();
  const int g = layout.members, m = layout.member;
  auto* recv = static_cast<std::byte*>(args.recv);
  const int right = (m + 1) % g, left = modulo(m - 1, g);
  std::vector<MPI_Request> requests;
  for (int step = 0; step + 1 < g; ++step) {
    requests.clear();
    for (std::size_t c : block_columns(layout, modulo(m - 1 - step, g))) {
      const auto col = layout.column(c);
      irecv_pieces(recv + col.offset * es, col.length * es, left, kTag, group, kCall, requests);
    }
    for (std::size_t c : block_columns(layout, modulo(m - step, g))) {
      const auto col = layout.column(c);
      isend_pieces(recv + col.offset * es, col.length * es, right, kTag, group, kCall, requests);
    }
    wait_all(requests.size(), requests.data(), kCall);
  }
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
