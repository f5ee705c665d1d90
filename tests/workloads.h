#pragma once

// Test helpers for the gradient workloads in bench/workloads/: load one by name and lay its
// tensors out in one arena, with a gap after each tensor so stray writes are caught.

#include <cstddef>
#include <string>
#include <vector>

#include "packing/tensor.h"
#include "packing/workload.h"

namespace gradcomm::testing {

inline const std::vector<std::string> kWorkloads = {"resnet50", "mobilenet_v2", "bert_base",
                                                    "vgg16"};

inline packing::Workload load_named_workload(const std::string& name) {
  return packing::load_workload(std::string(GRADCOMM_WORKLOAD_DIR) + "/" + name + ".json");
}

// Tensors of `w` (as float32 unless `dtype` says otherwise) inside `arena`, `gap` elements apart.
inline std::vector<packing::TensorDesc> lay_out(const packing::Workload& w, DataType dtype,
                                                std::vector<std::byte>& arena,
                                                std::size_t gap = 16) {
  const std::size_t es = element_size(dtype);
  arena.assign((w.total_elements() + gap * w.tensors.size()) * es, std::byte{0});
  std::vector<packing::TensorDesc> tensors;
  std::size_t offset = 0;
  for (const auto& t : w.tensors) {
    tensors.push_back({arena.data() + offset * es, t.count, dtype});
    offset += t.count + gap;
  }
  return tensors;
}

}  // namespace gradcomm::testing
