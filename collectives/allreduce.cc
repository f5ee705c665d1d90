#include "collectives/allreduce.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "collectives/check/consistency.h"
#include "collectives/owner_exchange.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "collectives/select/auto_select.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/timeline.h"

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
  comm.settle();
  require_mpi_alive("traffic", comm.rank());  // the counters' first use finds the topology
  const collectives::TrafficCounters& c = comm.attachment<collectives::Traffic>().counters();
  return {c.intra_bytes, c.inter_bytes, c.intra_messages, c.inter_messages};
}

void reset_traffic(Communicator& comm) {
  comm.settle();
  require_mpi_alive("reset_traffic", comm.rank());
  comm.attachment<collectives::Traffic>().counters() = collectives::TrafficCounters{};
}

namespace {

// What validation learns about a call: the algorithm named (registry-owned, so it outlives the
// caller's options) and where the buffers live.
struct Validated {
  std::string_view requested;
  int index = -1;  // algorithm_index(requested), looked up once per call
  bool device = false;
  int gpu = -1;
};

std::string call_name(std::string_view prefix, std::string_view requested) {
  return std::string(prefix) + "(" + std::string(requested) + ")";
}

// Everything local about a call: a bad call fails on the rank that made it, before any message
// is sent (and, for a non-blocking call, before it is submitted).
Validated validate(std::string_view prefix, const Communicator& comm, const void* sendbuf,
                   const void* recvbuf, std::size_t count, DataType dtype, ReduceOp op,
                   const AllreduceOptions& options) {
  const std::string_view requested =
      options.algorithm.empty() ? std::string_view(comm.config().algorithm) : options.algorithm;
  // Built only on the error path: this function is on the latency-critical path of every call.
  auto call = [&] { return call_name(prefix, requested); };
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(call(), comm.rank(), detail));
  };
  if (mpi_finalized()) invalid("MPI has been finalized: no collective can run after it");

  const int index = collectives::algorithm_index(requested);
  if (index < 0) invalid(collectives::unknown_algorithm(requested, options.algorithm.empty()));
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

  // Where the buffers live. Asked only when CUDA is live in the process (or a device-only
  // algorithm is named), so a CPU-only program never loads the GPU module.
  const collectives::AllreduceAlgorithm* named = collectives::prototype_at(index);
  const collectives::AllreduceCapabilities caps =
      named ? named->capabilities()
            : collectives::AllreduceCapabilities{.host_buffers = true, .device_buffers = true};
  const bool device_only = !caps.host_buffers;
  bool device = false;
  int gpu_index = -1;
  if (count > 0) {
    std::string why_not;
    gpu::Runtime* runtime = device_only ? gpu::runtime(&why_not) : gpu::active_runtime();
    if (device_only && !runtime) {
      throw Unsupported(error_message(call(), comm.rank(),
                                      std::string(requested) + " is unavailable: " + why_not));
    }
    if (runtime) {
      const gpu::PointerInfo send_info = runtime->classify(sendbuf);
      const gpu::PointerInfo recv_info =
          sendbuf == recvbuf ? send_info : runtime->classify(recvbuf);
      auto where = [](const gpu::PointerInfo& p) {
        return std::string(gpu::to_string(p.kind)) +
               (p.kind == gpu::MemoryKind::host ? "" : " of GPU " + std::to_string(p.device));
      };
      const bool send_gpu = send_info.kind != gpu::MemoryKind::host;
      const bool recv_gpu = recv_info.kind != gpu::MemoryKind::host;
      if (send_gpu != recv_gpu || (send_gpu && send_info.device != recv_info.device)) {
        invalid("sendbuf is " + where(send_info) + " but recvbuf is " + where(recv_info) +
                ": both must be on the same GPU, or both in host memory");
      }
      const bool host_only = !caps.device_buffers;
      if (host_only && send_info.kind == gpu::MemoryKind::device) {
        invalid("algorithm '" + std::string(requested) +
                "' reads buffers on the CPU but sendbuf is " + where(send_info) + "; use " +
                collectives::device_algorithm_names_joined() + " or auto for GPU buffers");
      }
      device = send_gpu && !host_only;
      gpu_index = send_info.device;
    }
    if (device_only && !device) {
      invalid(std::string(requested) +
              " reduces GPU buffers but sendbuf is host memory; use a host algorithm "
              "(auto, shm, ring, ...) or cudaMalloc the buffers");
    }
  }

  return {collectives::algorithm_name_at(index), index, device, gpu_index};
}

// Runs a validated call. `outer` is null for a user's call, the enclosing call's context
// otherwise.
void execute(const collectives::CallContext* outer, Communicator& comm, const Validated& v,
             const void* sendbuf, void* recvbuf, std::size_t count, DataType dtype, ReduceOp op,
             const AllreduceOptions& options) {
  using collectives::AllreduceArgs;
  // A request queued before MPI_Finalize began and reached after it: an error, not an abort.
  require_mpi_alive("allreduce", comm.rank());
  const std::string_view requested = v.requested;
  const bool device = v.device;
  const int gpu_index = v.gpu;
  const std::size_t bytes = count * element_size(dtype);
  auto call = [&] { return call_name("allreduce", requested); };
  AllreduceArgs args{sendbuf, recvbuf, count, dtype, op, comm.next_sequence()};
  collectives::CallInfo info;
  info.sequence = args.sequence;
  info.kind = collectives::CallKind::allreduce;
  info.count = count;
  info.dtype = static_cast<int>(dtype);
  info.op = static_cast<int>(op);
  info.algorithm = v.index;
  info.algorithm_name = collectives::algorithm_name_at(v.index);
  info.device = device;
  collectives::CallScope scope(comm, info, "allreduce", outer);
  args.call = scope.context();
  if (count == 0) {
    scope.check_now();  // an empty call still takes part in the comparison
    return scope.finish();
  }
  if (device) {
    if (comm.config().deterministic) {
      throw Unsupported(error_message(call(), comm.rank(),
                                      "GRADCOMM_DETERMINISTIC=1 has no GPU form: reduce host "
                                      "buffers, or leave reproducible mode off"));
    }
    args.device = true;
    args.gpu = gpu_index;
    args.stream = options.stream;
    args.asynchronous = options.asynchronous;
    // auto: the first registered algorithm that takes only device buffers (nccl).
    std::string_view name = requested;
    if (requested == "auto") {
      for (const collectives::AlgorithmEntry& entry : collectives::registered_algorithms()) {
        const collectives::AllreduceCapabilities c = entry.prototype->capabilities();
        if (c.device_buffers && !c.host_buffers) {
          name = entry.name;
          break;
        }
      }
    }
    if (comm.log_enabled(LogLevel::trace)) {
      comm.log(LogLevel::trace, "allreduce(auto): " + std::string(name) + " for GPU buffers");
    }
    scope.check_now();
    comm.attachment<collectives::AlgorithmCache>().find(name)->run(args, comm);
    return scope.finish();
  }
  if (comm.size() == 1) {
    if (!args.in_place()) std::memcpy(recvbuf, sendbuf, bytes);
    return scope.finish();  // avg over one rank divides by 1
  }

  if (comm.config().deterministic) {
    // Reproducible mode: whatever the name, the reduction order is the serial rank order.
    scope.check_now();
    collectives::reproducible_allreduce(args, comm);
    return scope.finish(recvbuf, bytes);
  }
  if (requested == "auto") scope.before_first_use("auto");  // may calibrate (collectively)
  bool timed = false;
  const std::string_view name =
      requested == "auto" ? collectives::begin_auto_call(args, comm, timed) : requested;
  try {
    collectives::AllreduceAlgorithm* algorithm =
        comm.attachment<collectives::AlgorithmCache>().find(name);
    if (!algorithm->supports(args, comm)) {
      throw Unsupported(error_message(call(), comm.rank(),
                                      "algorithm '" + std::string(name) + "' cannot reduce " +
                                          std::string(to_string(dtype)) + " buffers here"));
    }
    scope.start(name, algorithm->capabilities().polls_check, algorithm->proves_call(args, comm));
    timeline::Span span("allreduce", "collective");
    if (span.on()) {
      span.args("\"algorithm\":\"" + std::string(name) + "\",\"bytes\":" + std::to_string(bytes) +
                ",\"sequence\":" + std::to_string(args.sequence));
    }
    if (timed) {
      const auto started = std::chrono::steady_clock::now();
      algorithm->run(args, comm);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
      collectives::end_auto_call(args, comm, took.count());
    } else {
      algorithm->run(args, comm);
    }
    scope.finish(recvbuf, bytes);
  } catch (const MismatchError&) {
    // The ranks' calls differed: what auto counted for this one is undone on every rank that
    // counted it (the others did not), so that their measuring stays in step.
    if (requested == "auto") collectives::cancel_auto_call(args, comm);
    throw;
  }
}

}  // namespace

void allreduce(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t count,
               DataType dtype, ReduceOp op, const AllreduceOptions& options) {
  comm.settle();
  const collectives::KeepInStep in_step(comm, collectives::CallKind::allreduce, "allreduce");
  const Validated v = validate("allreduce", comm, sendbuf, recvbuf, count, dtype, op, options);
  execute(nullptr, comm, v, sendbuf, recvbuf, count, dtype, op, options);
}

Request iallreduce(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t count,
                   DataType dtype, ReduceOp op, const AllreduceOptions& options) {
  const collectives::KeepInStep in_step(comm, collectives::CallKind::allreduce, "iallreduce",
                                        /*queued=*/true);
  const Validated v = validate("iallreduce", comm, sendbuf, recvbuf, count, dtype, op, options);
  require_thread_multiple(call_name("iallreduce", v.requested), comm.rank());
  auto state = std::make_shared<detail::RequestState>();
  state->call = call_name("iallreduce", v.requested);
  AllreduceOptions kept = options;
  kept.algorithm = v.requested;  // registry-owned: the caller's string may be gone when it runs
  // GPU buffers: the request wraps the stream, so it finishes once the stream has passed the
  // all-reduce (the engine waits for it, not the caller).
  kept.asynchronous = false;
  state->work = [&comm, v, sendbuf, recvbuf, count, dtype, op, kept] {
    execute(nullptr, comm, v, sendbuf, recvbuf, count, dtype, op, kept);
  };
  comm.engine().submit(state);
  collectives::KeepInStep::began();
  return Request(std::move(state));
}

namespace collectives {

void allreduce_within(const CallContext& outer, Communicator& comm, const void* sendbuf,
                      void* recvbuf, std::size_t count, DataType dtype, ReduceOp op,
                      const AllreduceOptions& options) {
  const Validated v = validate("allreduce", comm, sendbuf, recvbuf, count, dtype, op, options);
  execute(&outer, comm, v, sendbuf, recvbuf, count, dtype, op, options);
}

}  // namespace collectives

}  // namespace gradcomm
