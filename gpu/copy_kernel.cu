#include "gpu/copy_kernel.h"

namespace gradcomm::gpu {
namespace {

constexpr int kThreads = 256;

template <class Word>
__device__ void copy_words(char* dst, const char* src, std::size_t bytes) {
  const std::size_t words = bytes / sizeof(Word);
  for (std::size_t i = threadIdx.x; i < words; i += kThreads)
    reinterpret_cast<Word*>(dst)[i] = reinterpret_cast<const Word*>(src)[i];
  for (std::size_t i = words * sizeof(Word) + threadIdx.x; i < bytes; i += kThreads)
    dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(const CopyOp* ops, const CopyBlock* blocks) {
  const CopyBlock block = blocks[blockIdx.x];
  const CopyOp op = ops[block.op];
  const char* src = static_cast<const char*>(op.src) + block.offset;
  char* dst = static_cast<char*>(op.dst) + block.offset;
  const auto alignment =
      reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst);
  if ((alignment & 15) == 0)
    copy_words<uint4>(dst, src, block.bytes);
  else if ((alignment & 3) == 0)
    copy_words<std::uint32_t>(dst, src, block.bytes);
  else
    copy_words<char>(dst, src, block.bytes);
}

}  // namespace

std::vector<CopyBlock> plan_copy_blocks(const CopyOp* ops, std::size_t n) {
  std::vector<CopyBlock> blocks;
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t offset = 0; offset < ops[i].bytes; offset += kCopyBlockBytes) {
      const std::size_t bytes =
          ops[i].bytes - offset < kCopyBlockBytes ? ops[i].bytes - offset : kCopyBlockBytes;
      blocks.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(bytes), offset});
    }
  }
  return blocks;
}

cudaError_t launch_copy_blocks(const CopyOp* ops, const CopyBlock* blocks, std::size_t nblocks,
                               cudaStream_t stream) {
  if (nblocks == 0) return cudaSuccess;
  if (nblocks > 0x7fffffffu) return cudaErrorInvalidValue;
  copy_blocks_kernel<<<static_cast<unsigned>(nblocks), kThreads, 0, stream>>>(ops, blocks);
  return cudaGetLastError();
}

}  // namespace gradcomm::gpu
