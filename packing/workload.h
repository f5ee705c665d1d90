#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/data_type.h"

namespace gradcomm::packing {

// A model's gradient shapes, from a workload file (bench/workloads/*.json):
// {"model", "source", "dtype", "tensors": [{"name", "shape": [...]}, ...], ...}.
struct Workload {
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> shape;
    std::size_t count = 1;  // product of the shape
  };
  std::string model;
  std::string source;
  DataType dtype = DataType::float32;
  std::vector<Tensor> tensors;

  std::size_t total_elements() const;
};

// Parses a workload from JSON text; `origin` names it in errors. Throws InvalidArgument naming
// the origin and the field for malformed input (bad JSON, missing or mistyped fields, negative
// dimensions, an unknown dtype, element counts that overflow, num_tensors / num_elements that
// disagree with the list).
Workload parse_workload(const std::string& text, const std::string& origin);
// Reads and parses a file.
Workload load_workload(const std::string& path);

}  // namespace gradcomm::packing
