#include "packing/fusion_planner.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace gradcomm::packing {
namespace {

std::uint64_t mix(std::uint64_t hash, std::uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    hash = (hash ^ ((value >> (8 * i)) & 0xff)) * 1099511628211ull;  // FNV-1a, byte by byte
  }
  return hash;
}

}  // namespace

void check_order(std::span<const std::size_t> order, std::size_t n, std::string_view call,
                 int rank) {
  std::vector<bool> seen(n, false);
  bool ok = order.size() == n;
  for (std::size_t i : order) {
    ok = ok && i < n && !seen[i];
    if (i < n) seen[i] = true;
  }
  if (!ok) {
    throw InvalidArgument(error_message(
        call, rank, "order must be a permutation of the " + std::to_string(n) + " tensor indices"));
  }
}

namespace {

// The ready order: options.order validated, or reverse registration order.
std::vector<std::size_t> ready_order(std::size_t n, const FusionOptions& options) {
  std::vector<std::size_t> order(options.order.begin(), options.order.end());
  if (order.empty()) {
    for (std::size_t i = n; i-- > 0;)
      order.push_back(i);
    return order;
  }
  check_order(order, n, "plan_fusion", -1);
  return order;
}

std::uint64_t hash_ordered(std::span<const TensorDesc> tensors, std::size_t threshold,
                           const std::vector<std::size_t>& order) {
  std::uint64_t hash = mix(mix(1469598103934665603ull, tensors.size()), threshold);
  for (std::size_t index : order) {
    const TensorDesc& t = tensors[index];
    hash = mix(mix(mix(hash, index), t.count), static_cast<std::uint64_t>(t.dtype));
  }
  return hash;
}

}  // namespace

std::uint64_t fusion_hash(std::span<const TensorDesc> tensors, const FusionOptions& options) {
  return hash_ordered(tensors, options.threshold_bytes, ready_order(tensors.size(), options));
}

FusionPlan plan_fusion(std::span<const TensorDesc> tensors, const FusionOptions& options) {
  const std::vector<std::size_t> order = ready_order(tensors.size(), options);
  FusionPlan plan;
  std::vector<std::size_t> open;  // index into plan.buckets of each dtype's open bucket
  auto close = [&](std::size_t b) {
    open.erase(std::remove(open.begin(), open.end(), b), open.end());
  };
  for (std::size_t index : order) {
    const TensorDesc& t = tensors[index];
    if (t.count == 0) continue;
    const std::size_t bytes = t.bytes();
    if (bytes > options.threshold_bytes) {
      plan.buckets.push_back({t.dtype, {index}, t.count});
      continue;
    }
    auto it = std::find_if(open.begin(), open.end(),
                           [&](std::size_t b) { return plan.buckets[b].dtype == t.dtype; });
    if (it != open.end() && plan.buckets[*it].bytes() + bytes > options.threshold_bytes) {
      close(*it);
      it = open.end();
    }
    if (it == open.end()) {
      plan.buckets.push_back({t.dtype, {}, 0});
      open.push_back(plan.buckets.size() - 1);
      it = open.end() - 1;
    }
    Bucket& bucket = plan.buckets[*it];
    bucket.tensors.push_back(index);
    bucket.count += t.count;
  }
  for (const Bucket& bucket : plan.buckets) {
    if (!bucket.in_place()) plan.max_fused_bytes = std::max(plan.max_fused_bytes, bucket.bytes());
  }
  plan.hash = hash_ordered(tensors, options.threshold_bytes, order);
  return plan;
}

}  // namespace gradcomm::packing
