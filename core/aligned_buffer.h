#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace gradcomm {

// An owned, 64-byte aligned byte buffer whose memory is not initialized (touching fresh memory
// is the expensive part, and its owner writes it before reading).
class AlignedBuffer {
 public:
  static constexpr std::size_t kAlignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes)
      : storage_(std::make_unique_for_overwrite<std::byte[]>(bytes + kAlignment)), size_(bytes) {
    const auto address = reinterpret_cast<std::uintptr_t>(storage_.get());
    data_ = storage_.get() + (kAlignment - address % kAlignment) % kAlignment;
  }

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::unique_ptr<std::byte[]> storage_;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace gradcomm
