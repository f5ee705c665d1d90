#include "packing/tensor.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"

namespace gradcomm::packing {

void validate_tensors(std::span<const TensorDesc> tensors, std::string_view call, int rank) {
  auto invalid = [&](std::size_t i, const std::string& detail) {
    throw InvalidArgument(error_message(call, rank, "tensor " + std::to_string(i) + ": " + detail));
  };
  struct Extent {
    std::uintptr_t begin, end;
    std::size_t index;
  };
  std::vector<Extent> extents;
  extents.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorDesc& t = tensors[i];
    if (!is_valid(t.dtype))
      invalid(i, "invalid dtype " + std::to_string(static_cast<int>(t.dtype)));
    if (t.count > std::numeric_limits<std::size_t>::max() / element_size(t.dtype)) {
      invalid(i, "count " + std::to_string(t.count) + " overflows size_t in bytes");
    }
    if (t.count == 0) continue;
    if (t.data == nullptr) invalid(i, "data is null with count " + std::to_string(t.count));
    const auto begin = reinterpret_cast<std::uintptr_t>(t.data);
    extents.push_back({begin, begin + t.bytes(), i});
  }
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (std::size_t k = 1; k < extents.size(); ++k) {
    if (extents[k].begin < extents[k - 1].end) {
      const std::size_t a = std::min(extents[k - 1].index, extents[k].index);
      const std::size_t b = std::max(extents[k - 1].index, extents[k].index);
      invalid(a, "memory overlaps tensor " + std::to_string(b));
    }
  }
}

}  // namespace gradcomm::packing
