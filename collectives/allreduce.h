#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "core/communicator.h"
#include "core/data_type.h"
#include "core/reduce_op.h"
#include "core/request.h"

namespace gradcomm {

struct AllreduceOptions {
  // A registered algorithm name or "auto"; empty means the communicator's Config::algorithm
  // (GRADCOMM_ALGORITHM, default "auto").
  std::string_view algorithm = {};
  // GPU buffers only (host algorithms are synchronous and ignore both): the cudaStream_t the
  // work is enqueued on (nullptr: the legacy default stream), and whether the call returns as
  // soon as the work is enqueued (true) or once it has finished (false, the default). An
  // asynchronous call's errors surface on the stream or at the next call; its buffers must stay
  // untouched until the stream has passed it.
  void* stream = nullptr;
  bool asynchronous = false;
};

// Reduces `count` elements of `sendbuf` over all ranks of `comm` with `op` and writes the result
// to `recvbuf` on every rank (bit-identical on all ranks). `sendbuf == recvbuf` is the in-place
// form. Collective: every rank calls it with the same count, dtype, op and algorithm.
// Throws InvalidArgument before any communication for bad input (null buffer with count > 0,
// invalid dtype or op, count * element size overflowing, partially overlapping buffers, unknown
// algorithm), Unsupported when the algorithm cannot take these buffers, CommError when MPI fails.
//
// Device buffers (cudaMalloc'ed, or managed) are recognised when CUDA is live in the process:
// `auto` then runs `nccl`, `hierarchical` runs its GPU form, and every other algorithm (which
// reads buffers on the CPU) rejects device memory with InvalidArgument; `nccl` rejects host
// buffers the same way. Managed memory is also accepted by the host algorithms.
void allreduce(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t count,
               DataType dtype, ReduceOp op, const AllreduceOptions& options = {});

// The non-blocking form (MPI_Iallreduce's role). Validates like allreduce, so bad input throws
// here on the rank that passed it, before anything is submitted; then queues the call on the
// communicator's progress engine (core/progress_engine.h) and returns. Calls on a communicator
// run in the order they were made, non-blocking or not: every rank must submit them in the same
// order (as DDP's buckets). The engine runs the call whether or not the request is ever tested;
// buffers must stay valid and untouched until the request has finished. A mismatch between ranks
// or an MPI failure is rethrown by Request::wait (or test) on every rank. Needs MPI at
// MPI_THREAD_MULTIPLE (gradcomm::init asks for it): otherwise throws Unsupported, naming the level.
// A blocking call on a communicator with requests in flight first waits for them. GPU buffers:
// the work is ordered on options.stream and the request finishes once the stream has passed it
// (options.asynchronous is ignored).
Request iallreduce(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t count,
                   DataType dtype, ReduceOp op, const AllreduceOptions& options = {});

// Bytes and messages this rank sent inside its group (node) and across groups, counted by
// gradcomm's own algorithms (MPI_Allreduce's internals are not visible). The first call on a
// communicator discovers its topology: collective then.
struct TrafficReport {
  std::uint64_t intra_bytes = 0, inter_bytes = 0, intra_messages = 0, inter_messages = 0;
};
TrafficReport traffic(Communicator& comm);
void reset_traffic(Communicator& comm);

namespace collectives {
class CallContext;
// The front door for an all-reduce that gradcomm makes inside another call (grouped_allreduce's
// buckets, hierarchical's GPU form across groups): validated and run like gradcomm::allreduce,
// but part of `outer` (its comparison of fingerprints, its message tags and its flight-recorder
// entry; collectives/check/consistency.h).
void allreduce_within(const CallContext& outer, Communicator& comm, const void* sendbuf,
                      void* recvbuf, std::size_t count, DataType dtype, ReduceOp op,
                      const AllreduceOptions& options = {});
}  // namespace collectives

namespace detail {
[[noreturn]] void throw_span_size_mismatch(const Communicator& comm, std::size_t send_size,
                                           std::size_t recv_size);
}  // namespace detail

// Typed forms: out-of-place (spans of equal length) and in-place.
template <class T>
void allreduce(Communicator& comm, std::span<const T> send, std::span<T> recv, ReduceOp op,
               const AllreduceOptions& options = {}) {
  if (send.size() != recv.size()) detail::throw_span_size_mismatch(comm, send.size(), recv.size());
  allreduce(comm, send.data(), recv.data(), send.size(), dtype_of<T>, op, options);
}

template <class T>
void allreduce(Communicator& comm, std::span<T> inout, ReduceOp op,
               const AllreduceOptions& options = {}) {
  allreduce(comm, inout.data(), inout.data(), inout.size(), dtype_of<T>, op, options);
}

template <class T>
Request iallreduce(Communicator& comm, std::span<const T> send, std::span<T> recv, ReduceOp op,
                   const AllreduceOptions& options = {}) {
  if (send.size() != recv.size()) detail::throw_span_size_mismatch(comm, send.size(), recv.size());
  return iallreduce(comm, send.data(), recv.data(), send.size(), dtype_of<T>, op, options);
}

template <class T>
Request iallreduce(Communicator& comm, std::span<T> inout, ReduceOp op,
                   const AllreduceOptions& options = {}) {
  return iallreduce(comm, inout.data(), inout.data(), inout.size(), dtype_of<T>, op, options);
}

}  // namespace gradcomm
