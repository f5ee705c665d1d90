#include "core/node_comm.h"

#include <string>

#include "core/error.h"
#include "core/internal_name.h"

namespace gradcomm {

NodeComm::NodeComm(MPI_Comm parent, int parent_rank, std::string_view call) {
  const std::string what(call);
  check_mpi(MPI_Comm_split_type(parent, MPI_COMM_TYPE_SHARED, parent_rank, MPI_INFO_NULL, &comm_),
            what + ": MPI_Comm_split_type", parent_rank);
  name_internal(comm_);
  const int rank_rc = MPI_Comm_rank(comm_, &rank_);
  const int size_rc = rank_rc == MPI_SUCCESS ? MPI_Comm_size(comm_, &size_) : rank_rc;
  if (size_rc != MPI_SUCCESS) {
    MPI_Comm_free(&comm_);
    check_mpi(size_rc, what + ": MPI_Comm_rank/MPI_Comm_size of the node communicator",
              parent_rank);
  }
}

NodeComm::~NodeComm() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

}  // namespace gradcomm
