#include "collectives/allgather.h"

#include <mpi.h>

#include <climits>
#include <string>
#include <vector>

#include "collectives/check/consistency.h"
#include "core/error.h"

namespace gradcomm {

void allgatherv(Communicator& comm, const void* send, std::size_t send_count, void* recv,
                std::span<const std::size_t> counts, DataType dtype) {
  const char* call = "allgatherv";
  comm.settle();
  const collectives::KeepInStep in_step(comm, collectives::CallKind::allgatherv, call);
  require_mpi_alive(call, comm.rank());
  if (!is_valid(dtype)) {
    throw InvalidArgument(error_message(
        call, comm.rank(), "invalid dtype " + std::to_string(static_cast<int>(dtype))));
  }
  const std::size_t es = element_size(dtype);
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(call, comm.rank(), detail));
  };
  if (counts.size() != static_cast<std::size_t>(comm.size())) {
    invalid("counts has " + std::to_string(counts.size()) + " entries for " +
            std::to_string(comm.size()) + " ranks");
  }
  if (counts[static_cast<std::size_t>(comm.rank())] != send_count) {
    invalid("counts[" + std::to_string(comm.rank()) + "] is " +
            std::to_string(counts[static_cast<std::size_t>(comm.rank())]) +
            " but this rank sends " + std::to_string(send_count) + " elements");
  }
  std::vector<int> byte_counts(counts.size()), displs(counts.size());
  std::size_t total = 0;
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const std::size_t bytes = counts[r] * es;
    if (counts[r] > static_cast<std::size_t>(INT_MAX) / es || total + bytes > INT_MAX) {
      invalid("the gathered data exceeds 2 GiB (MPI's int displacements)");
    }
    byte_counts[r] = static_cast<int>(bytes);
    displs[r] = static_cast<int>(total);
    total += bytes;
  }
  if (send_count > 0 && send == nullptr)
    invalid("send is null with count " + std::to_string(send_count));
  if (total > 0 && recv == nullptr)
    invalid("recv is null with " + std::to_string(total) + " bytes to gather");
  collectives::CallInfo info;
  info.sequence = comm.next_sequence();
  info.kind = collectives::CallKind::allgatherv;
  info.count = total / es;
  info.dtype = static_cast<int>(dtype);
  for (std::size_t c : counts)  // the counts every rank passes must agree
    info.detail = (info.detail ^ c) * 0x100000001b3ULL;
  collectives::CallScope scope(comm, info, call);
  scope.check_now();
  if (total > 0) {
    check_mpi(MPI_Allgatherv(send, static_cast<int>(send_count * es), MPI_BYTE, recv,
                             byte_counts.data(), displs.data(), MPI_BYTE, comm.mpi_comm()),
              "allgatherv: MPI_Allgatherv", comm.rank());
  }
  scope.finish(recv, total);
}

}  // namespace gradcomm
