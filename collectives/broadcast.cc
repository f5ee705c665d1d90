#include "collectives/broadcast.h"

#include <mpi.h>

#include <algorithm>
#include <limits>
#include <string>

#include "collectives/check/consistency.h"
#include "core/error.h"

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

}  // namespace

void broadcast(Communicator& comm, void* buffer, std::size_t count, DataType dtype, int root) {
  broadcast_bytes(comm, buffer, checked_bytes(comm, "broadcast", count, dtype), root);
}

void broadcast_bytes(Communicator& comm, void* buffer, std::size_t bytes, int root) {
  const char* call = "broadcast";
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
    check_mpi(MPI_Bcast(p + done, static_cast<int>(piece), MPI_BYTE, root, comm.mpi_comm()),
              "broadcast: MPI_Bcast", comm.rank());
    done += piece;
  }
  scope.finish(buffer, bytes);
}

}  // namespace gradcomm
