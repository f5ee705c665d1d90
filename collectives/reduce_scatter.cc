// reduce_scatter's front door: the checks, the call's comparison, the choice of path
// (reduce_scatter.h).

#include "collectives/reduce_scatter.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "collectives/allreduce_algorithm.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/check/consistency.h"
#include "collectives/registry.h"
#include "collectives/shm/segment.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/timeline.h"

namespace gradcomm {
namespace {

// The whole input's all-reduce, kept by the communicator: fresh memory is expensive to touch,
// and a training loop makes the same call every step.
struct ReduceScatterBuffer : Attachment {
  explicit ReduceScatterBuffer(Communicator&) {}
  std::vector<std::byte> bytes;
};

}  // namespace

void reduce_scatter(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t recv_count,
                    DataType dtype, ReduceOp op, const AllreduceOptions& options) {
  comm.settle();
  const std::string_view requested =
      options.algorithm.empty() ? std::string_view(comm.config().algorithm) : options.algorithm;
  const std::string call = "reduce_scatter(" + std::string(requested) + ")";
  const collectives::KeepInStep in_step(comm, collectives::CallKind::reduce_scatter, call);
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(call, comm.rank(), detail));
  };
  if (mpi_finalized()) invalid("MPI has been finalized: no collective can run after it");
  if (!collectives::is_algorithm_name(requested))
    invalid(collectives::unknown_algorithm(requested, options.algorithm.empty()));
  if (!is_valid(dtype)) invalid("invalid dtype " + std::to_string(static_cast<int>(dtype)));
  if (!is_valid(op)) invalid("invalid reduce op " + std::to_string(static_cast<int>(op)));
  const std::size_t es = element_size(dtype);
  const auto n = static_cast<std::size_t>(comm.size());
  if (recv_count > std::numeric_limits<std::size_t>::max() / es / n) {
    invalid("recv_count " + std::to_string(recv_count) + " x " + std::to_string(n) + " ranks x " +
            std::to_string(es) + " bytes overflows size_t");
  }
  const std::size_t block = recv_count * es, total = block * n;
  if (recv_count > 0 && (sendbuf == nullptr || recvbuf == nullptr)) {
    invalid(std::string(sendbuf == nullptr ? "sendbuf" : "recvbuf") + " is null with recv_count " +
            std::to_string(recv_count));
  }
  if (recv_count > 0) {
    const auto s = reinterpret_cast<std::uintptr_t>(sendbuf);
    const auto r = reinterpret_cast<std::uintptr_t>(recvbuf);
    if (s < r + block && r < s + total) {
      invalid("recvbuf (" + std::to_string(block) + " bytes) overlaps sendbuf (" +
              std::to_string(total) + " bytes); they must be separate buffers");
    }
  }
  bool device = false;
  if (recv_count > 0) {
    if (gpu::Runtime* runtime = gpu::active_runtime()) {
      const bool send_gpu = runtime->classify(sendbuf).kind != gpu::MemoryKind::host;
      const bool recv_gpu = runtime->classify(recvbuf).kind != gpu::MemoryKind::host;
      if (send_gpu != recv_gpu)
        invalid("one buffer is GPU memory and the other is not: both must be on one side");
      device = send_gpu;
      if (device && requested != "auto" && requested != "nccl") {
        invalid("algorithm '" + std::string(requested) +
                "' reads buffers on the CPU but the buffers are GPU memory; use nccl or auto");
      }
    }
  }
  if (device) {  // the NCCL path checks and compares the call itself
    collectives::nccl_reduce_scatter(comm, sendbuf, recvbuf, recv_count, dtype, op, options.stream,
                                     options.asynchronous);
    return;
  }
  require_mpi_alive("reduce_scatter", comm.rank());

  collectives::CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = collectives::CallKind::reduce_scatter;
  info.count = recv_count;
  info.dtype = static_cast<int>(dtype);
  info.op = static_cast<int>(op);
  info.algorithm = collectives::algorithm_index(requested);
  info.algorithm_name = collectives::algorithm_name_at(info.algorithm);
  collectives::CallScope scope(comm, info, "reduce_scatter");
  if (recv_count == 0) {
    scope.check_now();  // an empty call still takes part in the comparison
    return scope.finish();
  }
  if (n == 1) {
    std::memcpy(recvbuf, sendbuf, block);  // avg over one rank divides by 1
    return scope.finish();
  }
  // On one host with `auto` or `shm`: shm's all-reduce of the whole input; with `shm` named,
  // from kShmScatterMinBytes, shm's reduce-scatter (reduce_scatter.h says why only then).
  const bool shm_named =
      !comm.config().deterministic && (requested == "auto" || requested == "shm");
  if (shm_named) scope.before_first_use("shm");  // the segment is made collectively on first use
  const bool on_shm = shm_named && collectives::shm_available(comm);
  timeline::Span span("reduce_scatter", "collective");
  if (span.on()) {
    span.args("\"algorithm\":\"" + std::string(on_shm ? "shm" : requested) + "\",\"bytes\":" +
              std::to_string(total) + ",\"sequence\":" + std::to_string(info.sequence));
  }
  if (on_shm && requested == "shm" && total >= collectives::kShmScatterMinBytes) {
    scope.start("shm", /*polls_check=*/true);
    collectives::reduce_scatter_shm(comm, scope.context(), sendbuf, recvbuf, recv_count, dtype, op);
    return scope.finish();  // (no output hash: every rank's block differs)
  }
  // The all-reduce of the whole input as part of this call, then this rank's block.
  std::vector<std::byte>& whole = comm.attachment<ReduceScatterBuffer>().bytes;
  if (whole.size() < total) whole.resize(total);
  if (on_shm) {
    // shm's all-reduce run directly under this call: its latency path's packets carry this
    // call's fingerprint (a reduce_scatter), so they prove it as they prove an all-reduce, with
    // no comparison round of its own.
    collectives::AllreduceAlgorithm* algorithm =
        comm.attachment<collectives::AlgorithmCache>().find("shm");
    collectives::AllreduceArgs args{sendbuf, whole.data(), recv_count * n,
                                    dtype,   op,           info.sequence};
    scope.start("shm", algorithm->capabilities().polls_check, algorithm->proves_call(args, comm));
    args.call = scope.context();
    algorithm->run(args, comm);
  } else {
    // Another algorithm, several hosts or reproducible mode.
    scope.check_now();
    AllreduceOptions inner = options;
    inner.algorithm = requested;
    collectives::allreduce_within(scope.context(), comm, sendbuf, whole.data(), recv_count * n,
                                  dtype, op, inner);
  }
  std::memcpy(recvbuf, whole.data() + static_cast<std::size_t>(comm.rank()) * block, block);
  scope.finish();
}

}  // namespace gradcomm
