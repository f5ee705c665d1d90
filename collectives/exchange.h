#pragma once
// The data-movement collectives besides broadcast and allgatherv, on bytes: gather, scatter,
// all-to-all and the barrier. Each is checked like every front door (the call check compares
// kind, sizes and root across ranks before any data moves, and the watchdog sees the call), and
// runs on MPI's own collectives over the communicator's private duplicate (the all-gather on one
// host through shm's segment with algorithm `shm`). They serve the
// torch.distributed backend, whose tensors of any dtype travel as bytes.

#include <cstddef>
#include <span>

#include "core/communicator.h"

namespace gradcomm {

// Gathers `bytes` from every rank into root's `recv` (size() * bytes, in rank order). `recv` is
// used on root only. Every rank passes the same `bytes` and `root`.
void gather_bytes(Communicator& comm, const void* send, void* recv, std::size_t bytes, int root);

// Concatenates `bytes` from every rank into every rank's `recv` (size() * bytes, rank order).
// With the communicator's algorithm `shm`, from kShmGatherMinBytes of output on one host:
// through shm's segment (allgather_shm.cc); otherwise MPI_Allgather.
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

namespace collectives {
class CallContext;
// Where allgather_bytes goes through shm when the communicator's algorithm is `shm` (bytes of
// output, all ranks' blocks); otherwise it is MPI_Allgather. Not under `auto`: which is faster
// changes with where the ranks run. The staged lines are only read by the peers, and writing
// them again at the next call waits for each peer's copy to be invalidated, slowly between CPUs
// that share no cache; between two ranks Open MPI's exchange is also one copy out of the peer's
// buffer where shm's is two. AMD EPYC VM, shm against MPI_Allgather: 2 ranks 0.75-0.81 at
// 1 MiB and 0.58-0.81 at 16-64 MiB in one spell, 1.09-1.33x at 2-8 MiB, and 1.85-1.96x at
// 16 MiB in another; 4 ranks sharing the 2 CPUs 0.43-0.92 from 1 MiB
// (docs/results/reduce_scatter.md).
inline constexpr std::size_t kShmGatherMinBytes = std::size_t{512} << 10;
// shm's all-gather (the front door has checked the arguments and compared the call).
void allgather_shm(Communicator& comm, const CallContext& call, const void* send, void* recv,
                   std::size_t bytes);
}  // namespace collectives

}  // namespace gradcomm
