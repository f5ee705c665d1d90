#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/gpu_runtime.h"

namespace gradcomm::gpu {

// One thread block's share of a batch of copies: `bytes` of op `op` from byte `offset`.
struct CopyBlock {
  std::uint32_t op;
  std::uint32_t bytes;
  std::uint64_t offset;
};

// Bytes one block copies (the last block of a copy takes less).
inline constexpr std::size_t kCopyBlockBytes = std::size_t{64} << 10;

// Splits the copies into blocks of at most kCopyBlockBytes (empty copies get none).
std::vector<CopyBlock> plan_copy_blocks(const CopyOp* ops, std::size_t n);

// Runs every block of the table in one kernel launch on `stream`; both tables in device memory.
cudaError_t launch_copy_blocks(const CopyOp* ops, const CopyBlock* blocks, std::size_t nblocks,
                               cudaStream_t stream);

}  // namespace gradcomm::gpu
