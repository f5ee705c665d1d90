#pragma once

#include <cstddef>
#include <span>
#include <string_view>

#include "core/data_type.h"

namespace gradcomm::packing {

// One gradient tensor: where its elements live, how many, of which type. Shapes do not matter
// to communication; only the element count does.
struct TensorDesc {
  void* data;
  std::size_t count;
  DataType dtype;

  std::size_t bytes() const { return count * element_size(dtype); }
};

// Throws InvalidArgument, naming `call` and the tensor index, for an invalid dtype, a count whose
// byte size overflows, a null pointer with count > 0, or two tensors whose memory overlaps.
void validate_tensors(std::span<const TensorDesc> tensors, std::string_view call, int rank);

}  // namespace gradcomm::packing
