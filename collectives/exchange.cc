#include "collectives/exchange.h"

#include <mpi.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/check/consistency.h"
#include "collectives/shm/segment.h"
#include "core/error.h"

namespace gradcomm {
namespace {

using collectives::CallInfo;
using collectives::CallKind;
using collectives::CallScope;

int int_bytes(const char* call, const Communicator& comm, std::size_t bytes, std::size_t ranks) {
  if (bytes > static_cast<std::size_t>(INT_MAX) ||
      bytes * ranks > static_cast<std::size_t>(INT_MAX)) {
    throw InvalidArgument(error_message(
        call, comm.rank(),
        std::to_string(bytes) + " bytes per rank exceed 2 GiB in all (MPI's int counts)"));
  }
  return static_cast<int>(bytes);
}

void check_root(const char* call, const Communicator& comm, int root) {
  if (root < 0 || root >= comm.size()) {
    throw InvalidArgument(error_message(
        call, comm.rank(),
        "root " + std::to_string(root) + " is not a rank of " + std::to_string(comm.size())));
  }
}

void check_buffer(const char* call, const Communicator& comm, const void* p, std::size_t bytes,
                  const char* name) {
  if (bytes > 0 && p == nullptr) {
    throw InvalidArgument(
        error_message(call, comm.rank(),
                      std::string(name) + " is null with " + std::to_string(bytes) + " bytes"));
  }
}

CallInfo info_of(Communicator& comm, CallKind kind, std::size_t bytes, int root) {
  CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = kind;
  info.count = bytes;
  info.root = root;
  return info;
}

}  // namespace

void gather_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes, int root) {
  const char* call = "gather";
  comm.settle();
  const collectives::KeepInStep in_step(comm, CallKind::gather, call);
  require_mpi_alive(call, comm.rank());
  check_root(call, comm, root);
  const int n = int_bytes(call, comm, bytes, static_cast<std::size_t>(comm.size()));
  check_buffer(call, comm, send, bytes, "send");
  if (comm.rank() == root) check_buffer(call, comm, recv, bytes, "recv");
  CallScope scope(comm, info_of(comm, CallKind::gather, bytes, root), call);
  scope.check_now();
  if (bytes > 0) {
    check_mpi(MPI_Gather(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm.mpi_comm()),
              "gather: MPI_Gather", comm.rank());
  }
  scope.finish();
}

void allgather_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes) {
  const char* call = "allgather";
  comm.settle();
  const collectives::KeepInStep in_step(comm, CallKind::allgather, call);
  require_mpi_alive(call, comm.rank());
  const int n = int_bytes(call, comm, bytes, static_cast<std::size_t>(comm.size()));
  check_buffer(call, comm, send, bytes, "send");
  check_buffer(call, comm, recv, bytes, "recv");
  CallScope scope(comm, info_of(comm, CallKind::allgather, bytes, -1), call);
  scope.check_now();
  const std::string_view algorithm = comm.config().algorithm;
  // With `shm` named, from kShmGatherMinBytes on one host: shm's all-gather (exchange.h says
  // why only then).
  if (algorithm == "shm" && comm.size() > 1 &&
      bytes * static_cast<std::size_t>(comm.size()) >= collectives::kShmGatherMinBytes &&
      collectives::shm_available(comm)) {
    collectives::allgather_shm(comm, scope.context(), send, recv, bytes);
  } else if (bytes > 0) {
    check_mpi(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm.mpi_comm()),
              "allgather: MPI_Allgather", comm.rank());
  }
  scope.finish(recv, bytes * static_cast<std::size_t>(comm.size()));
}

void allgatherv_bytes(Communicator& comm, const void* send, void* recv,
                      std::span<const std::size_t> counts) {
  const char* call = "allgatherv";
  comm.settle();
  const collectives::KeepInStep in_step(comm, CallKind::allgatherv, call);
  require_mpi_alive(call, comm.rank());
  const auto size = static_cast<std::size_t>(comm.size());
  if (counts.size() != size) {
    throw InvalidArgument(error_message(call, comm.rank(),
                                        "counts has " + std::to_string(counts.size()) +
                                            " entries for " + std::to_string(size) + " ranks"));
  }
  std::vector<int> byte_counts(size), displs(size);
  std::size_t total = 0;
  for (std::size_t r = 0; r < size; ++r) {
    if (total + counts[r] > static_cast<std::size_t>(INT_MAX)) {
      int_bytes(call, comm, static_cast<std::size_t>(INT_MAX) + 1, 1);  // throws
    }
    byte_counts[r] = static_cast<int>(counts[r]);
    displs[r] = static_cast<int>(total);
    total += counts[r];
  }
  check_buffer(call, comm, send, counts[static_cast<std::size_t>(comm.rank())], "send");
  check_buffer(call, comm, recv, total, "recv");
  CallInfo info = info_of(comm, CallKind::allgatherv, total, -1);
  for (std::size_t c : counts)  // the counts every rank passes must agree
    info.detail = (info.detail ^ c) * 0x100000001b3ULL;
  CallScope scope(comm, info, call);
  scope.check_now();
  if (total > 0) {
    check_mpi(MPI_Allgatherv(send, byte_counts[static_cast<std::size_t>(comm.rank())], MPI_BYTE,
                             recv, byte_counts.data(), displs.data(), MPI_BYTE, comm.mpi_comm()),
              "allgatherv: MPI_Allgatherv", comm.rank());
  }
  scope.finish(recv, total);
}

void scatter_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes, int root) {
  const char* call = "scatter";
  comm.settle();
  const collectives::KeepInStep in_step(comm, CallKind::scatter, call);
  require_mpi_alive(call, comm.rank());
  check_root(call, comm, root);
  const int n = int_bytes(call, comm, bytes, static_cast<std::size_t>(comm.size()));
  if (comm.rank() == root) check_buffer(call, comm, send, bytes, "send");
  check_buffer(call, comm, recv, bytes, "recv");
  CallScope scope(comm, info_of(comm, CallKind::scatter, bytes, root), call);
  scope.check_now();
  if (bytes > 0) {
    check_mpi(MPI_Scatter(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm.mpi_comm()),
              "scatter: MPI_Scatter", comm.rank());
  }
  scope.finish();
}

void alltoallv_bytes(Communicator& comm, const void* send, std::span<const std::size_t> send_bytes,
                     void* recv, std::span<const std::size_t> recv_bytes) {
  const char* call = "alltoall";
  comm.settle();
  const collectives::KeepInStep in_step(comm, CallKind::alltoall, call);
  require_mpi_alive(call, comm.rank());
  const auto size = static_cast<std::size_t>(comm.size());
  if (send_bytes.size() != size || recv_bytes.size() != size) {
    throw InvalidArgument(
        error_message(call, comm.rank(),
                      "the split sizes have " + std::to_string(send_bytes.size()) + " (send) and " +
                          std::to_string(recv_bytes.size()) + " (receive) entries for " +
                          std::to_string(size) + " ranks"));
  }
  std::vector<int> scounts(size), sdispls(size), rcounts(size), rdispls(size);
  std::size_t stotal = 0, rtotal = 0;
  for (std::size_t j = 0; j < size; ++j) {
    if (stotal + send_bytes[j] > static_cast<std::size_t>(INT_MAX) ||
        rtotal + recv_bytes[j] > static_cast<std::size_t>(INT_MAX)) {
      int_bytes(call, comm, static_cast<std::size_t>(INT_MAX) + 1, 1);  // throws
    }
    scounts[j] = static_cast<int>(send_bytes[j]);
    sdispls[j] = static_cast<int>(stotal);
    rcounts[j] = static_cast<int>(recv_bytes[j]);
    rdispls[j] = static_cast<int>(rtotal);
    stotal += send_bytes[j];
    rtotal += recv_bytes[j];
  }
  check_buffer(call, comm, send, stotal, "send");
  check_buffer(call, comm, recv, rtotal, "recv");
  // Every rank makes an all-to-all of its own sizes: the fingerprint holds what all agree on.
  CallScope scope(comm, info_of(comm, CallKind::alltoall, 0, -1), call);
  scope.check_now();
  // What each peer will send here, against what this rank expects from it.
  std::vector<unsigned long long> mine(send_bytes.begin(), send_bytes.end()), theirs(size);
  check_mpi(MPI_Alltoall(mine.data(), 1, MPI_UNSIGNED_LONG_LONG, theirs.data(), 1,
                         MPI_UNSIGNED_LONG_LONG, comm.mpi_comm()),
            "alltoall: MPI_Alltoall of the split sizes", comm.rank());
  int first_bad = -1;
  for (std::size_t j = 0; j < size && first_bad < 0; ++j) {
    if (theirs[j] != recv_bytes[j]) first_bad = static_cast<int>(j);
  }
  int any_bad = first_bad >= 0 ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &any_bad, 1, MPI_INT, MPI_MAX, comm.mpi_comm()),
            "alltoall: MPI_Allreduce of the size check", comm.rank());
  if (any_bad) {
    // Every rank reports the first disagreeing pair (lowest receiving rank).
    int pair[3] = {first_bad >= 0 ? comm.rank() : INT_MAX, first_bad, 0};
    long long sizes[2] = {
        first_bad >= 0 ? static_cast<long long>(theirs[static_cast<std::size_t>(first_bad)]) : 0,
        first_bad >= 0 ? static_cast<long long>(recv_bytes[static_cast<std::size_t>(first_bad)])
                       : 0};
    int lowest = pair[0];
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT, MPI_MIN, comm.mpi_comm()),
              "alltoall: MPI_Allreduce of the size check", comm.rank());
    int info[2] = {pair[1], 0};
    long long detail[2] = {sizes[0], sizes[1]};
    check_mpi(MPI_Bcast(info, 1, MPI_INT, lowest, comm.mpi_comm()), "alltoall: MPI_Bcast",
              comm.rank());
    check_mpi(MPI_Bcast(detail, 2, MPI_LONG_LONG, lowest, comm.mpi_comm()), "alltoall: MPI_Bcast",
              comm.rank());
    throw MismatchError(
        error_message(call, comm.rank(),
                      "ranks disagree on the split sizes: rank " + std::to_string(info[0]) +
                          " sends " + std::to_string(detail[0]) + " bytes to rank " +
                          std::to_string(lowest) + ", which expects " + std::to_string(detail[1])));
  }
  check_mpi(MPI_Alltoallv(send, scounts.data(), sdispls.data(), MPI_BYTE, recv, rcounts.data(),
                          rdispls.data(), MPI_BYTE, comm.mpi_comm()),
            "alltoall: MPI_Alltoallv", comm.rank());
  scope.finish();
}

void barrier(Communicator& comm) {
  const char* call = "barrier";
  comm.settle();
  require_mpi_alive(call, comm.rank());
  CallScope scope(comm, info_of(comm, CallKind::barrier, 0, -1), call);
  scope.check_now();  // the comparison is itself an exchange with every rank
  check_mpi(MPI_Barrier(comm.mpi_comm()), "barrier: MPI_Barrier", comm.rank());
  scope.finish();
}

}  // namespace gradcomm
