#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/communicator.h"
#include "core/gpu_runtime.h"
#include "packing/tensor.h"

namespace gradcomm::packing {

struct PackerOptions {
  int num_split = 8;                      // chunks per packed buffer
  std::size_t min_chunk_elements = 1024;  // below this, packing declines
  // When set, the packed buffers are registered memory of this communicator
  // (Communicator::allocate): packing is then the copy-in of `shm`, which reads them in place.
  // Construction becomes collective over it (every rank plans the same tensors).
  Communicator* registered_on = nullptr;
  // Device tensors (all on one GPU; recognised when CUDA is live in the process): the packed
  // buffers are device memory, and pack()/unpack() are enqueued on `stream` (a cudaStream_t;
  // nullptr: the legacy default stream) as one batch, either one copy kernel for every tensor
  // (kernel, the default: measured faster on ResNet-50 and BERT, README) or one
  // cudaMemcpyAsync per tensor. They wait for the stream unless `asynchronous`.
  void* stream = nullptr;
  gpu::CopyMethod copy_method = gpu::CopyMethod::kernel;
  bool asynchronous = false;
};

// Concatenates many tensors into one flat buffer per dtype, split into num_split near-equal
// chunks (the last takes the remainder), and back. Planned once from the tensor list, then
// pack()/unpack() every step with no allocation; the round trip is bit-exact.
//
// Planning declines, instead of failing, when packing makes no sense: no tensors, or a dtype
// whose chunks would hold fewer than min_chunk_elements elements. Check declined() and
// decline_reason(); pack()/unpack() of a declined packer throw. Empty tensors are skipped.
class GradientPacker {
 public:
  struct Chunk {
    std::size_t offset;  // elements from the start of the packed buffer
    std::size_t count;
  };
  struct Packed {
    DataType dtype;
    std::size_t count;                 // elements
    std::byte* data;                   // 64-byte aligned (page-aligned if registered), owned
    std::vector<Chunk> chunks;         // num_split of them
    std::vector<std::size_t> tensors;  // indices into the tensor list, in packing order
    std::vector<std::size_t> offsets;  // element offset of each of those tensors
  };

  // Validates the tensors (validate_tensors) and plans. The tensors' memory must stay valid.
  explicit GradientPacker(std::span<const TensorDesc> tensors, PackerOptions options = {});
  ~GradientPacker();
  GradientPacker(GradientPacker&&) noexcept;
  GradientPacker& operator=(GradientPacker&&) noexcept;

  // True when the tensors (and so the packed buffers) are GPU memory.
  bool on_device() const { return device_ != nullptr; }

  bool declined() const { return !decline_reason_.empty(); }
  const std::string& decline_reason() const { return decline_reason_; }

  // One packed buffer per dtype, in order of each dtype's first tensor.
  const std::vector<Packed>& packed() const { return packed_; }

  void pack();    // tensors -> packed buffers
  void unpack();  // packed buffers -> tensors

 private:
  void require_plan(const char* call) const;

  std::vector<TensorDesc> tensors_;
  PackerOptions options_;
  std::string decline_reason_;
  std::vector<Packed> packed_;
  std::vector<AlignedBuffer> storage_;
  std::vector<RegisteredBuffer> registered_;
  struct Device;  // device buffers and prepared copy batches
  std::unique_ptr<Device> device_;
};

}  // namespace gradcomm::packing
