#pragma once

#include <cstddef>
#include <span>

#include "core/communicator.h"
#include "core/data_type.h"
#include "core/request.h"

namespace gradcomm {

// Copies `count` elements of `buffer` on rank `root` into `buffer` on every other rank of `comm`
// (MPI_Bcast underneath, in pieces of at most 64 MiB so any count works). Collective: every rank
// passes the same count, dtype and root. Throws InvalidArgument before any communication for a
// root outside [0, size), a null buffer with count > 0, an invalid dtype or an overflowing count.
// A buffer in GPU memory (cudaMalloc) is staged through pinned host memory on its GPU's default
// stream, and the stream is synchronised before the call returns; each rank's buffer may live on
// the host or on its GPU independently of the others'.
void broadcast(Communicator& comm, void* buffer, std::size_t count, DataType dtype, int root = 0);

// The same for `bytes` raw bytes.
void broadcast_bytes(Communicator& comm, void* buffer, std::size_t bytes, int root = 0);

// The non-blocking form: validated here, run on the communicator's progress engine in submission
// order (see iallreduce in collectives/allreduce.h for the contract).
Request ibroadcast(Communicator& comm, void* buffer, std::size_t count, DataType dtype,
                   int root = 0);

template <class T>
void broadcast(Communicator& comm, std::span<T> buffer, int root = 0) {
  broadcast(comm, buffer.data(), buffer.size(), dtype_of<T>, root);
}

}  // namespace gradcomm
