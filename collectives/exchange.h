#pragma once
// The data-movement collectives besides broadcast and allgatherv, on bytes: gather, scatter,
// all-to-all and the barrier. Each is checked like every front door (the call check compares
// kind, sizes and root across ranks before any data moves, and the watchdog sees the call), and
// runs on MPI's own collectives over the communicator's private duplicate. They serve the
// torch.distributed backend, whose tensors of any dtype travel as bytes.

#include <cstddef>
#include <span>

#include "core/communicator.h"

namespace gradcomm {

// Gathers `bytes` from every rank into root's `recv` (size() * bytes, in rank order). `recv` is
// used on root only. Every rank passes the same `bytes` and `root`.
void gather_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes, int root);

// Concatenates `bytes` from every rank into every rank's `recv` (size() * bytes, rank order).
void allgather_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes);

// Concatenates counts[r] bytes from each rank r into every rank's `recv` (sum(counts), rank
// order); this rank sends counts[rank()] bytes from `send`. Every rank passes the same counts:
// ranks whose counts differ get a MismatchError on every rank.
void allgatherv_bytes(Communicator& comm, const void* send, void* recv,
                      std::span<const std::size_t> counts);

// Scatters root's `send` (size() * bytes, rank order): rank r receives piece r into `recv`.
void scatter_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes, int root);

// Rank r sends send_bytes[j] bytes (consecutive in `send`, in rank order) to each rank j and
// receives recv_bytes[j] bytes from each rank j (consecutive in `recv`). What each pair agrees
// on is checked first: a rank that expects another size from a peer than the peer sends gets a
// MismatchError on every rank, naming both.
void alltoallv_bytes(Communicator& comm, const void* send, std::span<const std::size_t> send_bytes,
                     void* recv, std::span<const std::size_t> recv_bytes);

// Returns once every rank has called it.
void barrier(Communicator& comm);

}  // namespace gradcomm
