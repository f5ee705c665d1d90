#pragma once

#include <mpi.h>

#include <string_view>

namespace gradcomm {

// The ranks of `parent` that share this rank's host, as an MPI communicator of their own
// (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED, ordered by rank in `parent`), freed with this
// object. Collective over `parent`. The one node split of the library: topology's node
// discovery, the host queries and registered memory all use it. `call` names the caller in
// errors (CommError naming the MPI function).
class NodeComm {
 public:
  NodeComm(MPI_Comm parent, int parent_rank, std::string_view call);
  ~NodeComm();
  NodeComm(const NodeComm&) = delete;
  NodeComm& operator=(const NodeComm&) = delete;

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace gradcomm
