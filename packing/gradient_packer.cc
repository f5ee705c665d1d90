#include "packing/gradient_packer.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace gradcomm::packing {

GradientPacker::GradientPacker(std::span<const TensorDesc> tensors, PackerOptions options)
    : tensors_(tensors.begin(), tensors.end()), options_(options) {
  validate_tensors(tensors, "GradientPacker", -1);
  if (options.num_split < 1) {
    throw InvalidArgument(
        error_message("GradientPacker", -1,
                      "num_split " + std::to_string(options.num_split) + " must be at least 1"));
  }
  std::size_t elements = 0;
  for (const TensorDesc& t : tensors)
    elements += t.count;
  if (elements == 0) {
    decline_reason_ = tensors.empty() ? "no tensors to pack" : "all tensors are empty";
    return;
  }
  // Group by dtype, keeping the tensors' order inside each group. Empty tensors have nothing to
  // pack and join no group.
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].count == 0) continue;
    Packed* group = nullptr;
    for (Packed& p : packed_) {
      if (p.dtype == tensors[i].dtype) group = &p;
    }
    if (!group) group = &packed_.emplace_back(Packed{tensors[i].dtype, 0, nullptr, {}, {}, {}});
    group->tensors.push_back(i);
    group->offsets.push_back(group->count);
    group->count += tensors[i].count;
  }
  const auto splits = static_cast<std::size_t>(options.num_split);
  for (Packed& p : packed_) {
    const std::size_t per_chunk = p.count / splits;
    if (per_chunk < options.min_chunk_elements) {
      decline_reason_ = std::string(to_string(p.dtype)) + " tensors hold " +
                        std::to_string(p.count) + " elements: " + std::to_string(splits) +
                        " chunks would have " + std::to_string(per_chunk) +
                        " elements each, fewer than the minimum " +
                        std::to_string(options.min_chunk_elements);
      packed_.clear();
      return;
    }
    for (std::size_t c = 0; c < splits; ++c) {
      const std::size_t count = c + 1 < splits ? per_chunk : p.count - per_chunk * (splits - 1);
      p.chunks.push_back({c * per_chunk, count});
    }
    // Not value-initialized: the first pack() writes every byte.
    const std::size_t bytes = p.count * element_size(p.dtype);
    p.data = options.registered_on
                 ? registered_.emplace_back(options.registered_on->allocate(bytes)).data()
                 : storage_.emplace_back(bytes).data();
  }
}

void GradientPacker::require_plan(const char* call) const {
  if (declined()) {
    throw InvalidArgument(error_message(call, -1, "the packer declined: " + decline_reason_));
  }
}

void GradientPacker::pack() {
  require_plan("GradientPacker::pack");
  for (Packed& p : packed_) {
    const std::size_t es = element_size(p.dtype);
    for (std::size_t k = 0; k < p.tensors.size(); ++k) {
      const TensorDesc& t = tensors_[p.tensors[k]];
      if (t.count > 0) std::memcpy(p.data + p.offsets[k] * es, t.data, t.bytes());
    }
  }
}

void GradientPacker::unpack() {
  require_plan("GradientPacker::unpack");
  for (const Packed& p : packed_) {
    const std::size_t es = element_size(p.dtype);
    for (std::size_t k = 0; k < p.tensors.size(); ++k) {
      const TensorDesc& t = tensors_[p.tensors[k]];
      if (t.count > 0) std::memcpy(t.data, p.data + p.offsets[k] * es, t.bytes());
    }
  }
}

}  // namespace gradcomm::packing
