#pragma once

#include <cstddef>

#include "collectives/allreduce.h"
#include "core/communicator.h"
#include "core/data_type.h"
#include "core/reduce_op.h"

namespace gradcomm {

// Reduces `recv_count * size` elements of `sendbuf` over all ranks of `comm` with `op`, and
// writes block r of the result (its elements [r * recv_count, (r + 1) * recv_count)) to
// `recvbuf` on rank r: MPI_Reduce_scatter_block's role, and torch's reduce_scatter_tensor (the
// gradient reduction of FSDP and ZeRO). Each block is the same as that block of an all-reduce of
// the buffers. Collective: every rank passes the same recv_count, dtype, op and algorithm.
// Throws InvalidArgument before any communication for bad input (null buffer with a non-zero
// count, invalid dtype or op, overflowing sizes, overlapping buffers, unknown algorithm, GPU
// buffers with an algorithm that reads them on the CPU).
//
// How it runs:
// - host buffers on one host, `auto` or `shm`, from kShmScatterMinBytes of input: shm's staged
//   rounds, in which each rank reads only its own block from every rank's input
//   (reduce_scatter_shm.cc), about half the time of an all-reduce of the same buffers where the
//   ranks' CPUs share a cache; or, where that measured slower here (select/two_paths.h: per size
//   class, the first calls try both), shm's all-reduce and this rank's block;
// - GPU buffers (auto, nccl): ncclReduceScatter on options.stream (allreduce_nccl.h);
// - otherwise (smaller inputs, other host algorithms, ranks on several hosts,
//   GRADCOMM_DETERMINISTIC=1): an all-reduce of the whole input with that algorithm into a
//   buffer the communicator keeps, then this rank's block.
void reduce_scatter(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t recv_count,
                    DataType dtype, ReduceOp op, const AllreduceOptions& options = {});

namespace collectives {
class CallContext;
// Where shm's reduce-scatter starts (bytes of input). Below it the all-reduce's staged path is
// faster, though it moves more: a reduce-scatter's staged lines are only read by the peers, and
// writing them again at the next call waits for each peer's shared copy to be invalidated, line
// by line (AMD EPYC, 2 ranks, 64 KiB: staging its 32 KiB took 3.1-4.5 us, 0.75 us when no peer
// read it), where the all-reduce's are written back by a peer and read again here before that.
// Measured (gradcomm-reduce-scatter-bench, shm against shm's all-reduce): 1.13-1.31x at 8-256
// KiB on 2 ranks, 0.76 at 512 KiB, 0.47-0.72 from 1 MiB; on 4 ranks sharing 2 CPUs 0.9-1.27 up
// to 256 KiB, 0.82 at 512 KiB, 0.39-0.72 from 1 MiB (docs/results/reduce_scatter.md).
inline constexpr std::size_t kShmScatterMinBytes = std::size_t{512} << 10;
// shm's reduce-scatter (the front door has checked the arguments and started the call's
// comparison): comm's ranks share one host and shm is available on it.
void reduce_scatter_shm(Communicator& comm, const CallContext& call, const void* sendbuf,
                        void* recvbuf, std::size_t recv_count, DataType dtype, ReduceOp op);
}  // namespace collectives

}  // namespace gradcomm
