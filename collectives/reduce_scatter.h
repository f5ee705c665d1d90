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
// - host buffers on one host, `auto` or `shm`: shm's all-reduce of the whole input into a buffer
//   the communicator keeps, then this rank's block (its latency path's packets prove the call);
// - with `shm` named, from kShmScatterMinBytes of input: shm's reduce-scatter, in which each
//   rank reads only its own block from every rank's input (reduce_scatter_shm.cc), about half
//   the all-reduce's traffic;
// - GPU buffers (auto, nccl): ncclReduceScatter on options.stream (allreduce_nccl.h);
// - otherwise (other host algorithms, ranks on several hosts, GRADCOMM_DETERMINISTIC=1): that
//   algorithm's all-reduce of the whole input into the kept buffer, then this rank's block.
void reduce_scatter(Communicator& comm, const void* sendbuf, void* recvbuf, std::size_t recv_count,
                    DataType dtype, ReduceOp op, const AllreduceOptions& options = {});

namespace collectives {
class CallContext;
// Where shm's reduce-scatter runs with `shm` named (bytes of input). Not under `auto`, and not
// below this: its staged lines are only read by the peers, and writing them again at the next
// call waits for each peer's shared copy to be invalidated, line by line (AMD EPYC, 2 ranks,
// 64 KiB: staging its 32 KiB took 3.1-4.5 us, 0.75 us when no peer read it), where the
// all-reduce's are written back by a peer and read again here before that. Between CPUs that
// share no cache this costs more than the traffic it saves: AMD EPYC VM, 2 ranks, against
// shm's all-reduce of the same buffers, 0.43-0.76 from 1 MiB in one spell, 1.6-2.4x at 4-16 MiB
// in another; 4 ranks sharing the 2 CPUs 0.40-0.73 (docs/results/reduce_scatter.md).
inline constexpr std::size_t kShmScatterMinBytes = std::size_t{512} << 10;
// shm's reduce-scatter (the front door has checked the arguments and started the call's
// comparison): comm's ranks share one host and shm is available on it.
void reduce_scatter_shm(Communicator& comm, const CallContext& call, const void* sendbuf,
                        void* recvbuf, std::size_t recv_count, DataType dtype, ReduceOp op);
}  // namespace collectives

}  // namespace gradcomm
