#include "collectives/broadcast.h"

#include <mpi.h>

#include <algorithm>
#include <limits>
#include <string>

#include "collectives/check/consistency.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/progress_engine.h"

namespace gradcomm {
namespace {

// Every rank splits a broadcast into the same pieces, whether its buffer is host or device
// memory (a device buffer's pieces pass through a pinned host buffer of this size).
constexpr std::size_t kPieceBytes = std::size_t{64} << 20;

std::size_t checked_bytes(const Communicator& comm, const char* call, std::size_t count,
                          DataType dtype) {
  if (!is_valid(dtype)) {
    throw InvalidArgument(error_message(
        call, comm.rank(), "invalid dtype " + std::to_string(static_cast<int>(dtype))));
  }
  const std::size_t es = element_size(dtype);
  if (count > std::numeric_limits<std::size_t>::max() / es) {
    throw InvalidArgument(error_message(
        call, comm.rank(),
        "count " + std::to_string(count) + " x " + std::to_string(es) + " bytes overflows size_t"));
  }
  return count * es;
}

void validate_root_and_buffer(const Communicator& comm, const char* call, const void* buffer,
                              std::size_t bytes, int root) {
  require_mpi_alive(call, comm.rank());
  if (root < 0 || root >= comm.size()) {
    throw InvalidArgument(error_message(
        call, comm.rank(),
        "root " + std::to_string(root) + " is outside [0, " + std::to_string(comm.size()) + ")"));
  }
  if (bytes > 0 && buffer == nullptr) {
    throw InvalidArgument(error_message(call, comm.rank(),
                                        "buffer is null with " + std::to_string(bytes) + " bytes"));
  }
}

// The GPU that owns `buffer` when it is device memory (cudaMalloc), else -1. Asked only when CUDA
// is live in the process, so a CPU-only program never loads the GPU module. Managed memory is
// read by the CPU and goes through MPI as host memory.
int device_of(const void* buffer, std::size_t bytes) {
  if (bytes == 0) return -1;
  gpu::Runtime* runtime = gpu::active_runtime();
  if (!runtime) return -1;
  const gpu::PointerInfo info = runtime->classify(buffer);
  return info.kind == gpu::MemoryKind::device ? info.device : -1;
}

// One piece of the broadcast through MPI, from the progress thread or the caller's.
void broadcast_piece(Communicator& comm, void* data, std::size_t piece, int root) {
  if (on_progress_thread()) {  // the application computes meanwhile: wait without spinning
    MPI_Request request = MPI_REQUEST_NULL;
    check_mpi(MPI_Ibcast(data, static_cast<int>(piece), MPI_BYTE, root, comm.mpi_comm(), &request),
              "broadcast: MPI_Ibcast", comm.rank());
    check_mpi(wait_all_mpi(1, &request), "broadcast: MPI_Wait", comm.rank());
  } else {
    check_mpi(MPI_Bcast(data, static_cast<int>(piece), MPI_BYTE, root, comm.mpi_comm()),
              "broadcast: MPI_Bcast", comm.rank());
  }
}

// Device memory: MPI here is not CUDA-aware, so the pieces pass through one pinned host buffer
// (at most kPieceBytes, allocated for this call): the root copies each piece out of the GPU,
// MPI broadcasts it, the others copy it in. Ordered on the owning GPU's legacy default stream,
// and synchronised before the call returns. Broadcast moves parameters once at start-up; it is
// not on the step's path, so staging costs nothing a training step sees.
void broadcast_device(Communicator& comm, void* buffer, std::size_t bytes, int root, int device) {
  gpu::Runtime& runtime = *gpu::active_runtime();
  const int previous = runtime.current_device();
  if (previous != device) runtime.set_device(device);
  const std::size_t staging_bytes = std::min(bytes, kPieceBytes);
  void* staging = runtime.host_alloc_pinned(staging_bytes);
  try {
    auto* p = static_cast<std::byte*>(buffer);
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t piece = std::min(staging_bytes, bytes - done);
      if (comm.rank() == root) {
        runtime.copy_async(staging, p + done, piece, nullptr);
        runtime.stream_synchronize(nullptr);
      }
      broadcast_piece(comm, staging, piece, root);
      if (comm.rank() != root) {
        runtime.copy_async(p + done, staging, piece, nullptr);
        runtime.stream_synchronize(nullptr);
      }
      done += piece;
    }
  } catch (...) {
    runtime.host_free_pinned(staging);
    if (previous != device) runtime.set_device(previous);
    throw;
  }
  runtime.host_free_pinned(staging);
  if (previous != device) runtime.set_device(previous);
}

// A validated broadcast.
void execute(Communicator& comm, void* buffer, std::size_t bytes, int root) {
  const char* call = "broadcast";
  require_mpi_alive(call, comm.rank());
  collectives::CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = collectives::CallKind::broadcast;
  info.count = bytes;
  info.root = root;
  collectives::CallScope scope(comm, info, call);
  if (comm.size() == 1) return scope.finish();
  scope.check_now();
  if (const int device = device_of(buffer, bytes); device >= 0) {
    broadcast_device(comm, buffer, bytes, root, device);
    return scope.finish();  // the output check reads host memory only
  }
  auto* p = static_cast<std::byte*>(buffer);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t piece = std::min(kPieceBytes, bytes - done);
    broadcast_piece(comm, p + done, piece, root);
    done += piece;
  }
  scope.finish(buffer, bytes);
}

}  // namespace

void broadcast(Communicator& comm, void* buffer, std::size_t count, DataType dtype, int root) {
  broadcast_bytes(comm, buffer, checked_bytes(comm, "broadcast", count, dtype), root);
}

void broadcast_bytes(Communicator& comm, void* buffer, std::size_t bytes, int root) {
  comm.settle();
  validate_root_and_buffer(comm, "broadcast", buffer, bytes, root);
  execute(comm, buffer, bytes, root);
}

Request ibroadcast(Communicator& comm, void* buffer, std::size_t count, DataType dtype, int root) {
  const char* call = "ibroadcast";
  const std::size_t bytes = checked_bytes(comm, call, count, dtype);
  validate_root_and_buffer(comm, call, buffer, bytes, root);
  require_thread_multiple(call, comm.rank());
  auto state = std::make_shared<detail::RequestState>();
  state->call = call;
  state->work = [&comm, buffer, bytes, root] { execute(comm, buffer, bytes, root); };
  comm.engine().submit(state);
  return Request(std::move(state));
}

}  // namespace gradcomm
