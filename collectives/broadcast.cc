#include "collectives/broadcast.h"

#include <mpi.h>

#include <algorithm>
#include <limits>
#include <string>

#include "collectives/check/consistency.h"
#include "core/error.h"
#include "core/progress_engine.h"

namespace gradcomm {
namespace {

constexpr std::size_t kMaxPieceBytes = std::size_t{1} << 30;

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
  auto* p = static_cast<std::byte*>(buffer);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t piece = std::min(kMaxPieceBytes, bytes - done);
    if (on_progress_thread()) {  // the application computes meanwhile: wait without spinning
      MPI_Request request = MPI_REQUEST_NULL;
      check_mpi(
          MPI_Ibcast(p + done, static_cast<int>(piece), MPI_BYTE, root, comm.mpi_comm(), &request),
          "broadcast: MPI_Ibcast", comm.rank());
      check_mpi(wait_all_mpi(1, &request), "broadcast: MPI_Wait", comm.rank());
    } else {
      check_mpi(MPI_Bcast(p + done, static_cast<int>(piece), MPI_BYTE, root, comm.mpi_comm()),
                "broadcast: MPI_Bcast", comm.rank());
    }
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
