#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "packing/tensor.h"

namespace gradcomm::packing {

struct FusionOptions {
  // Largest bucket in bytes; 0 disables fusion (every tensor is its own bucket).
  std::size_t threshold_bytes = 0;
  // The order gradients become ready, as tensor indices (a permutation). Empty: reverse
  // registration order, the order a backward pass produces them in.
  std::span<const std::size_t> order = {};
};

// A group of same-dtype tensors reduced together. A bucket of one tensor is reduced in place in
// the tensor's own memory; larger ones are copied into a fused buffer and back.
struct Bucket {
  DataType dtype;
  std::vector<std::size_t> tensors;  // indices, in ready order
  std::size_t count = 0;             // elements, sum over the tensors
  std::size_t bytes() const { return count * element_size(dtype); }
  bool in_place() const { return tensors.size() == 1; }
};

// Buckets in the order they were opened (by their first tensor in ready order). Deterministic from
// (counts, dtypes, order, threshold); `hash` fingerprints exactly those inputs, so ranks can
// compare plans cheaply.
struct FusionPlan {
  std::vector<Bucket> buckets;
  std::size_t max_fused_bytes = 0;  // largest bucket that needs a fused buffer
  std::uint64_t hash = 0;
};

// Walks the tensors in ready order, one open bucket per dtype: a tensor joins its dtype's open
// bucket if the bucket stays within the threshold, else the bucket closes and a new one opens.
// A tensor larger than the threshold gets a bucket of its own. Zero-size tensors are skipped.
// Throws InvalidArgument when `order` is not a permutation of the tensor indices.
// Throws InvalidArgument naming `call` unless `order` is a permutation of [0, n) (the ready
// order of n tensors).
void check_order(std::span<const std::size_t> order, std::size_t n, std::string_view call,
                 int rank);

FusionPlan plan_fusion(std::span<const TensorDesc> tensors, const FusionOptions& options);

// plan_fusion(tensors, options).hash without building the plan (cheap: one pass, no buckets).
std::uint64_t fusion_hash(std::span<const TensorDesc> tensors, const FusionOptions& options);

}  // namespace gradcomm::packing
