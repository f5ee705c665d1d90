#include "collectives/allreduce.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "collectives/auto_select.h"
#include "collectives/owner_exchange.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "core/error.h"

namespace gradcomm {
namespace detail {

void throw_span_size_mismatch(const Communicator& comm, std::size_t send_size,
                              std::size_t recv_size) {
  throw InvalidArgument(error_message("allreduce", comm.rank(),
                                      "send has " + std::to_string(send_size) +
                                          " elements but recv has " + std::to_string(recv_size)));
}

}  // namespace detail

TrafficReport traffic(Communicator& comm) {
  const collectives::TrafficCounters& c = comm.attachment<collectives::Traffic>().counters();
  return {c.intra_bytes, c.inter_bytes, c.intra_messages, c.inter_messages};
}

void reset_traffic(Communicator& comm) {
  comm.attachment<collectives::Traffic>().counters() = collectives::TrafficCounters{};
}

void allreduce(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t count,
               DataType dtype, ReduceOp op, const AllreduceOptions& options) {
  using collectives::AllreduceArgs;
  const std::string_view requested =
      options.algorithm.empty() ? std::string_view(comm.config().algorithm) : options.algorithm;
  // Built only on the error path: this function is on the latency-critical path of every call.
  auto call = [&] { return "allreduce(" + std::string(requested) + ")"; };
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(call(), comm.rank(), detail));
  };

  // Validation: everything here is local, so a bad call fails on the rank that made it, before
  // any message is sent.
  if (!collectives::is_algorithm_name(requested)) {
    invalid("unknown algorithm '" + std::string(requested) + "'" +
            (options.algorithm.empty() ? " (from GRADCOMM_ALGORITHM)" : "") +
            "; valid names: " + collectives::algorithm_names_joined());
  }
  if (!is_valid(dtype)) invalid("invalid dtype " + std::to_string(static_cast<int>(dtype)));
  if (!is_valid(op)) invalid("invalid reduce op " + std::to_string(static_cast<int>(op)));
  const std::size_t es = element_size(dtype);
  if (count > std::numeric_limits<std::size_t>::max() / es) {
    invalid("count " + std::to_string(count) + " x " + std::to_string(es) +
            " bytes overflows size_t");
  }
  if (count > 0 && sendbuf == nullptr)
    invalid("sendbuf is null with count " + std::to_string(count));
  if (count > 0 && recvbuf == nullptr)
    invalid("recvbuf is null with count " + std::to_string(count));
  const std::size_t bytes = count * es;
  if (count > 0 && sendbuf != recvbuf) {
    const auto s = reinterpret_cast<std::uintptr_t>(sendbuf);
    const auto r = reinterpret_cast<std::uintptr_t>(recvbuf);
    if (s < r + bytes && r < s + bytes) {
      invalid("sendbuf and recvbuf overlap partially (" + std::to_string(bytes) + " bytes each, " +
              std::to_string(s > r ? s - r : r - s) +
              " bytes apart); pass the same pointer for in-place");
    }
  }

  AllreduceArgs args{sendbuf, recvbuf, count, dtype, op, comm.next_sequence()};
  if (count == 0) return;
  if (comm.size() == 1) {
    if (!args.in_place()) std::memcpy(recvbuf, sendbuf, bytes);
    return;  // avg over one rank divides by 1
  }

  if (comm.config().deterministic) {
    // Reproducible mode: whatever the name, the reduction order is the serial rank order.
    return collectives::reproducible_allreduce(args, comm);
  }
  const std::string_view name =
      requested == "auto" ? collectives::select_allreduce_algorithm(args, comm) : requested;
  collectives::AllreduceAlgorithm* algorithm =
      comm.attachment<collectives::AlgorithmCache>().find(name);
  if (!algorithm->supports(args, comm)) {
    throw Unsupported(error_message(call(), comm.rank(),
                                    "algorithm '" + std::string(name) + "' cannot reduce " +
                                        std::string(to_string(dtype)) + " buffers here"));
  }
  algorithm->run(args, comm);
}

}  // namespace gradcomm
