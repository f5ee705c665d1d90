#include "collectives/allreduce_nccl.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "collectives/allreduce.h"
#include "collectives/check/consistency.h"
#include "collectives/p2p.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

std::atomic<long> g_created{0}, g_destroyed{0}, g_aborted{0};

// The NCCL communicator of one gradcomm communicator.
class NcclState : public Attachment {
 public:
  explicit NcclState(Communicator&) {}
  ~NcclState() override {
    if (comm) {
      runtime->comm_destroy(comm);
      g_destroyed.fetch_add(1, std::memory_order_relaxed);
    }
  }

  gpu::Runtime* runtime = nullptr;
  gpu::GpuComm comm = nullptr;
  int device = -1;
  std::string broken;  // why the NCCL communicator was aborted; calls fail from then on
};

// Makes `device` current for the scope of one call and restores the caller's device.
class DeviceGuard {
 public:
  DeviceGuard(gpu::Runtime& runtime, int device) : runtime_(runtime) {
    previous_ = runtime.current_device();
    if (device >= 0 && device != previous_) runtime.set_device(device);
  }
  ~DeviceGuard() {
    try {
      if (runtime_.current_device() != previous_) runtime_.set_device(previous_);
    } catch (...) {
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  gpu::Runtime& runtime_;
  int previous_ = 0;
};

std::string call_name(std::string_view algorithm) {
  return "allreduce(" + std::string(algorithm) + ")";
}

// Aborts the NCCL communicator of `state` and throws CommError with `why`.
[[noreturn]] void abort_and_throw(NcclState& state, Communicator& comm, std::string_view call,
                                  const std::string& why) {
  state.runtime->comm_abort(state.comm);
  g_aborted.fetch_add(1, std::memory_order_relaxed);
  state.comm = nullptr;
  state.broken = why;
  throw CommError(error_message(call, comm.rank(), why + "; the NCCL communicator was aborted"));
}

class Deadline {
 public:
  explicit Deadline(int seconds)
      : forever_(seconds == 0),
        end_(std::chrono::steady_clock::now() + std::chrono::seconds(seconds)) {}
  bool passed() const { return !forever_ && std::chrono::steady_clock::now() > end_; }

 private:
  bool forever_;
  std::chrono::steady_clock::time_point end_;
};

// Polls briefly, then sleeps between polls, so waiting ranks leave the cores to the others. Lets
// MPI progress now and then: a peer may still wait in MPI for this rank (a host ring before).
class Backoff {
 public:
  explicit Backoff(Communicator& comm) : mpi_(comm.mpi_comm()) {}
  void pause() {
    if (++polls_ < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (polls_ % 16 == 0) drive_mpi_progress(mpi_);
  }

 private:
  MPI_Comm mpi_;
  int polls_ = 0;
};

std::string timeout_message(const Communicator& comm, std::string_view what) {
  return std::string(what) + " did not finish within " + comm.config().timeout_text() +
         " (a rank may be missing from this call, or stuck before it)";
}

// Waits until NCCL has finished enqueueing on a non-blocking communicator.
void wait_ready(NcclState& state, Communicator& comm, std::string_view call,
                std::string_view what) {
  const Deadline deadline(comm.config().timeout_seconds);
  Backoff backoff(comm);
  for (;;) {
    std::string error;
    switch (state.runtime->comm_state(state.comm, &error)) {
      case gpu::CommState::ready:
        return;
      case gpu::CommState::failed:
        abort_and_throw(state, comm, call, std::string(what) + " failed: " + error);
      case gpu::CommState::in_progress:
        break;
    }
    if (deadline.passed()) abort_and_throw(state, comm, call, timeout_message(comm, what));
    backoff.pause();
  }
}

// Waits for `stream` while watching every communicator in `states` for asynchronous errors.
void wait_stream(gpu::Runtime& runtime, void* stream, std::initializer_list<NcclState*> states,
                 Communicator& comm, std::string_view call) {
  const Deadline deadline(comm.config().timeout_seconds);
  Backoff backoff(comm);
  while (!runtime.stream_done(stream)) {
    for (NcclState* state : states) {
      std::string error;
      if (state && state->comm &&
          state->runtime->comm_state(state->comm, &error) == gpu::CommState::failed)
        abort_and_throw(*state, comm, call, "NCCL reported an asynchronous error: " + error);
    }
    if (deadline.passed()) {
      for (NcclState* state : states) {
        if (state && state->comm && state != *states.begin()) {
          state->runtime->comm_abort(state->comm);
          g_aborted.fetch_add(1, std::memory_order_relaxed);
          state->comm = nullptr;
          state->broken = "aborted with a sibling communicator";
        }
      }
      abort_and_throw(**states.begin(), comm, call, timeout_message(comm, "the collective"));
    }
    backoff.pause();
  }
}

// The NCCL communicator of `comm` on `device`, created on first use (collective: every rank of
// `comm` is in the same call).
NcclState& nccl_state(Communicator& comm, gpu::Runtime& runtime, int device,
                      std::string_view call) {
  NcclState& state = comm.attachment<NcclState>();
  if (!state.broken.empty()) {
    throw CommError(error_message(call, comm.rank(),
                                  "this communicator's NCCL communicator was aborted earlier (" +
                                      state.broken + "); create a new communicator"));
  }
  if (state.comm) {
    if (device != state.device) {
      throw InvalidArgument(error_message(
          call, comm.rank(),
          "the buffers are on GPU " + std::to_string(device) +
              " but this communicator's NCCL communicator lives on GPU " +
              std::to_string(state.device) + " (one device per communicator and rank)"));
    }
    return state;
  }
  state.runtime = &runtime;
  gpu::UniqueId id{};
  if (comm.rank() == 0) id = runtime.unique_id();
  check_mpi(MPI_Bcast(id.data(), static_cast<int>(id.size()), MPI_BYTE, 0, comm.mpi_comm()),
            std::string(call) + ": MPI_Bcast of the ncclUniqueId", comm.rank());
  state.comm = runtime.comm_init(comm.size(), id, comm.rank(), comm.config().nccl_blocking);
  state.device = device;
  g_created.fetch_add(1, std::memory_order_relaxed);
  wait_ready(state, comm, call, "ncclCommInitRankConfig");
  if (comm.log_enabled(LogLevel::debug)) {
    comm.log(LogLevel::debug, std::string(call) + ": NCCL communicator of " +
                                  std::to_string(comm.size()) + " ranks on GPU " +
                                  std::to_string(device));
  }
  return state;
}

gpu::Runtime& require_runtime(const Communicator& comm, std::string_view call) {
  std::string why;
  gpu::Runtime* runtime = gpu::runtime(&why);
  if (!runtime) throw Unsupported(error_message(call, comm.rank(), "nccl is unavailable: " + why));
  return *runtime;
}

std::byte* offset(void* base, std::size_t bytes) {
  return static_cast<std::byte*>(base) + bytes;
}

// Device and pinned buffers of the GPU hierarchical all-reduce, grown on demand.
class GpuBuffer {
 public:
  GpuBuffer(gpu::Runtime* runtime, bool pinned) : runtime_(runtime), pinned_(pinned) {}
  ~GpuBuffer() { release(); }
  GpuBuffer(const GpuBuffer&) = delete;
  GpuBuffer& operator=(const GpuBuffer&) = delete;
  void* get(std::size_t bytes) {
    if (bytes > bytes_) {
      release();
      data_ = pinned_ ? runtime_->host_alloc_pinned(bytes) : runtime_->device_alloc(bytes);
      bytes_ = bytes;
    }
    return data_;
  }

 private:
  void release() {
    if (!data_) return;
    if (pinned_)
      runtime_->host_free_pinned(data_);
    else
      runtime_->device_free(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  gpu::Runtime* runtime_;
  bool pinned_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// The groups of the GPU hierarchical all-reduce, built once per communicator.
class GpuHierarchy : public Attachment {
 public:
  explicit GpuHierarchy(Communicator& comm) {
    const topology::Topology& topo = topology::topology_of(comm);
    const int group = topo.group();
    const std::vector<int>& mine = topo.my_group();
    groups = static_cast<int>(topo.groups.size());
    group_size = static_cast<int>(mine.size());
    local = topo.group_local_rank();
    even = std::all_of(topo.groups.begin(), topo.groups.end(),
                       [&](const std::vector<int>& g) { return g.size() == mine.size(); });
    if (groups == 1 || !even) return;  // flat nccl: nothing to build
    MPI_Comm split = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm.mpi_comm(), group, comm.rank(), &split),
              "allreduce(hierarchical): MPI_Comm_split (group)", comm.rank());
    group_comm = std::make_unique<Communicator>(split, comm.config().for_sub_communicator());
    check_mpi(MPI_Comm_free(&split), "allreduce(hierarchical): MPI_Comm_free", comm.rank());
    check_mpi(MPI_Comm_split(comm.mpi_comm(), local, comm.rank(), &split),
              "allreduce(hierarchical): MPI_Comm_split (column)", comm.rank());
    column_comm = std::make_unique<Communicator>(split, comm.config().for_sub_communicator());
    check_mpi(MPI_Comm_free(&split), "allreduce(hierarchical): MPI_Comm_free", comm.rank());
  }

  int groups = 1, group_size = 1, local = 0;
  bool even = true;
  // Declared before the communicators: freed after their NCCL communicators are destroyed.
  std::unique_ptr<GpuBuffer> work, staging;
  std::unique_ptr<Communicator> group_comm, column_comm;
};

}  // namespace

std::string nccl_unavailable_reason() {
  std::string why;
  return gpu::runtime(&why) ? std::string() : why;
}

NcclCommCounts nccl_comm_counts() {
  return {g_created.load(), g_destroyed.load(), g_aborted.load()};
}

void AllreduceNccl::run(const AllreduceArgs& args, Communicator& comm) {
  const std::string call = call_name("nccl");
  gpu::Runtime& runtime = require_runtime(comm, call);
  const std::size_t bytes = args.count * args.element_bytes();
  DeviceGuard guard(runtime, args.gpu);
  if (comm.size() == 1) {  // avg over one rank divides by 1
    if (!args.in_place()) runtime.copy_async(args.recv, args.send, bytes, args.stream);
    if (!args.asynchronous) runtime.stream_synchronize(args.stream);
    return;
  }
  NcclState& state = nccl_state(comm, runtime, args.gpu, call);
  runtime.allreduce(args.send, args.recv, args.count, args.dtype, args.op, comm.size(), state.comm,
                    args.stream);
  wait_ready(state, comm, call, "ncclAllReduce");
  if (!args.asynchronous) wait_stream(runtime, args.stream, {&state}, comm, call);
}

void gpu_hierarchical_allreduce(const AllreduceArgs& args, Communicator& comm) {
  const std::string call = call_name("hierarchical");
  gpu::Runtime& runtime = require_runtime(comm, call);
  GpuHierarchy& h = comm.attachment<GpuHierarchy>();
  const bool integer_avg = args.op == ReduceOp::avg && !is_floating(args.dtype);
  if (h.groups == 1 || !h.even || integer_avg || comm.size() == 1) {
    if (comm.log_enabled(LogLevel::debug)) {
      comm.log(LogLevel::debug, call + ": flat nccl (" +
                                    (h.groups == 1 ? "one group"
                                     : !h.even     ? "groups of different sizes"
                                                   : "integer avg needs one division") +
                                    ")");
    }
    return AllreduceNccl().run(args, comm);
  }
  const std::size_t es = args.element_bytes();
  const std::size_t bytes = args.count * es;
  const auto g = static_cast<std::size_t>(h.group_size);
  const std::size_t shard = (args.count + g - 1) / g;
  const std::size_t shard_bytes = shard * es;
  const std::size_t mine = static_cast<std::size_t>(h.local) * shard_bytes;
  DeviceGuard guard(runtime, args.gpu);
  if (!h.work) h.work = std::make_unique<GpuBuffer>(&runtime, false);
  void* work = h.work->get(shard_bytes * g);  // padded to g equal shards
  void* stream = args.stream;

  runtime.copy_async(work, args.send, bytes, stream);
  NcclState& group = nccl_state(*h.group_comm, runtime, args.gpu, call);
  runtime.reduce_scatter(work, offset(work, mine), shard, args.dtype, args.op, h.group_size,
                         group.comm, stream);  // phase 1 (in place)
  wait_ready(group, comm, call, "ncclReduceScatter");

  NcclState* column = nullptr;
  if (comm.config().gpu_inter_node == "nccl") {  // phase 2 on the GPU
    column = &nccl_state(*h.column_comm, runtime, args.gpu, call);
    runtime.allreduce(offset(work, mine), offset(work, mine), shard, args.dtype, args.op, h.groups,
                      column->comm, stream);
    wait_ready(*column, comm, call, "ncclAllReduce across groups");
  } else {  // phase 2 through host memory and the host algorithms
    if (!h.staging) h.staging = std::make_unique<GpuBuffer>(&runtime, true);
    void* host = h.staging->get(shard_bytes);
    runtime.copy_async(host, offset(work, mine), shard_bytes, stream);
    wait_stream(runtime, stream, {&group}, comm, call);
    allreduce_within(args.call, *h.column_comm, host, host, shard, args.dtype, args.op);
    runtime.copy_async(offset(work, mine), host, shard_bytes, stream);
  }

  runtime.all_gather(offset(work, mine), work, shard, args.dtype, group.comm, stream);  // phase 3
  wait_ready(group, comm, call, "ncclAllGather");
  runtime.copy_async(args.recv, work, bytes, stream);
  if (!args.asynchronous) wait_stream(runtime, stream, {&group, column}, comm, call);
}

namespace {

// One all-gather or reduce-scatter on device buffers (see nccl_allgather).
template <class Enqueue>
void device_call(Communicator& comm, CallKind kind, const char* call, const void* send, void* recv,
                 std::size_t count, DataType dtype, ReduceOp op, void* stream, bool asynchronous,
                 Enqueue enqueue) {
  comm.settle();
  require_mpi_alive(call, comm.rank());
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(call, comm.rank(), detail));
  };
  if (!is_valid(dtype)) invalid("invalid dtype " + std::to_string(static_cast<int>(dtype)));
  if (kind == CallKind::reduce_scatter && !is_valid(op))
    invalid("invalid op " + std::to_string(static_cast<int>(op)));
  if (count > 0 && (send == nullptr || recv == nullptr))
    invalid("a buffer is null with count " + std::to_string(count));
  gpu::Runtime& runtime = require_runtime(comm, call);
  int device = -1;
  if (count > 0) {
    const gpu::PointerInfo s = runtime.classify(send), r = runtime.classify(recv);
    if (s.kind == gpu::MemoryKind::host || r.kind == gpu::MemoryKind::host)
      invalid("takes GPU buffers, and a buffer is in host memory");
    if (s.device != r.device) {
      invalid("send is on GPU " + std::to_string(s.device) + " but recv on GPU " +
              std::to_string(r.device) + ": both must be on one GPU");
    }
    device = s.device;
  }
  if (kind == CallKind::reduce_scatter && comm.config().deterministic) {  // (a gather copies)
    throw Unsupported(error_message(call, comm.rank(),
                                    "GRADCOMM_DETERMINISTIC=1 has no GPU form: reduce host "
                                    "buffers, or leave reproducible mode off"));
  }
  CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = kind;
  info.count = count;
  info.dtype = static_cast<int>(dtype);
  if (kind == CallKind::reduce_scatter) info.op = static_cast<int>(op);
  info.device = true;
  CallScope scope(comm, info, call);
  scope.check_now();  // before NCCL: ranks in different calls get an error, not a hang
  if (count == 0) return scope.finish();
  DeviceGuard guard(runtime, device);
  if (comm.size() == 1) {  // one rank: its own data (avg over one rank divides by 1)
    if (send != recv) runtime.copy_async(recv, send, count * element_size(dtype), stream);
    if (!asynchronous) runtime.stream_synchronize(stream);
  } else {
    NcclState& state = nccl_state(comm, runtime, device, call);
    enqueue(runtime, state.comm);
    wait_ready(state, comm, call, call);
    if (!asynchronous) wait_stream(runtime, stream, {&state}, comm, call);
  }
  scope.finish();
}

}  // namespace

void nccl_allgather(Communicator& comm, const void* send, void* recv, std::size_t count,
                    DataType dtype, void* stream, bool asynchronous) {
  device_call(comm, CallKind::allgather, "allgather(nccl)", send, recv, count, dtype, ReduceOp::sum,
              stream, asynchronous, [&](gpu::Runtime& runtime, gpu::GpuComm nccl) {
                runtime.all_gather(send, recv, count, dtype, nccl, stream);
              });
}

void nccl_reduce_scatter(Communicator& comm, const void* send, void* recv, std::size_t count,
                         DataType dtype, ReduceOp op, void* stream, bool asynchronous) {
  device_call(comm, CallKind::reduce_scatter, "reduce_scatter(nccl)", send, recv, count, dtype, op,
              stream, asynchronous, [&](gpu::Runtime& runtime, gpu::GpuComm nccl) {
                runtime.reduce_scatter(send, recv, count, dtype, op, comm.size(), nccl, stream);
              });
}

}  // namespace gradcomm::collectives
