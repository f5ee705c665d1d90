#include "packing/gradient_packer.h"

#include <cstdint>
#include <cstring>
#include <optional>

#include "core/error.h"

namespace gradcomm::packing {

struct GradientPacker::Device {
  gpu::Runtime* runtime = nullptr;
  int device = -1;
  std::vector<void*> buffers;
  void* pack_batch = nullptr;
  void* unpack_batch = nullptr;
  ~Device() {
    runtime->batch_destroy(pack_batch);
    runtime->batch_destroy(unpack_batch);
    for (void* buffer : buffers)
      runtime->device_free(buffer);
  }
};

GradientPacker::~GradientPacker() = default;
GradientPacker::GradientPacker(GradientPacker&&) noexcept = default;
GradientPacker& GradientPacker::operator=(GradientPacker&&) noexcept = default;

namespace {

// Where the tensors live: nullptr for host memory, else the runtime and device. Host and device
// tensors, or tensors on two devices, cannot share a packer.
gpu::Runtime* tensors_device(std::span<const TensorDesc> tensors, int* device) {
  gpu::Runtime* runtime = gpu::active_runtime();
  if (!runtime) return nullptr;
  std::optional<std::size_t> first;
  bool on_gpu = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].count == 0) continue;
    const gpu::PointerInfo info = runtime->classify(tensors[i].data);
    const bool gpu = info.kind == gpu::MemoryKind::device;
    if (!first) {
      first = i;
      on_gpu = gpu;
      *device = info.device;
    } else if (gpu != on_gpu || (gpu && info.device != *device)) {
      throw InvalidArgument(error_message(
          "GradientPacker", -1,
          "tensor " + std::to_string(i) + " is " + std::string(gpu::to_string(info.kind)) +
              (gpu ? " of GPU " + std::to_string(info.device) : "") + " but tensor " +
              std::to_string(*first) + " is " +
              (on_gpu ? "device memory of GPU " + std::to_string(*device) : "host memory") +
              ": one packer takes tensors of one place"));
    }
  }
  return on_gpu ? runtime : nullptr;
}

}  // namespace

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
  }
  int gpu_index = -1;
  gpu::Runtime* runtime = tensors_device(tensors, &gpu_index);
  if (runtime && options.registered_on) {
    throw InvalidArgument(error_message(
        "GradientPacker", -1,
        "registered_on needs host tensors; these are on GPU " + std::to_string(gpu_index)));
  }
  if (runtime) {
    device_ = std::make_unique<Device>();
    device_->runtime = runtime;
    device_->device = gpu_index;
  }
  for (Packed& p : packed_) {
    const std::size_t bytes = p.count * element_size(p.dtype);
    if (device_) {
      p.data = static_cast<std::byte*>(device_->buffers.emplace_back(runtime->device_alloc(bytes)));
    } else {
      p.data = options.registered_on
                   ? registered_.emplace_back(options.registered_on->allocate(bytes)).data()
                   : storage_.emplace_back(bytes).data();
    }
  }
  if (device_) {  // the two copy batches, planned once
    std::vector<gpu::CopyOp> pack_ops, unpack_ops;
    for (const Packed& p : packed_) {
      const std::size_t es = element_size(p.dtype);
      for (std::size_t k = 0; k < p.tensors.size(); ++k) {
        const TensorDesc& t = tensors_[p.tensors[k]];
        pack_ops.push_back({p.data + p.offsets[k] * es, t.data, t.bytes()});
        unpack_ops.push_back({t.data, p.data + p.offsets[k] * es, t.bytes()});
      }
    }
    device_->pack_batch = runtime->batch_create(pack_ops.data(), pack_ops.size());
    device_->unpack_batch = runtime->batch_create(unpack_ops.data(), unpack_ops.size());
  }
}

void GradientPacker::require_plan(const char* call) const {
  if (declined()) {
    throw InvalidArgument(error_message(call, -1, "the packer declined: " + decline_reason_));
  }
}

void GradientPacker::pack() {
  require_plan("GradientPacker::pack");
  if (device_) {
    device_->runtime->batch_run(device_->pack_batch, options_.copy_method, options_.stream);
    if (!options_.asynchronous) device_->runtime->stream_synchronize(options_.stream);
    return;
  }
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
  if (device_) {
    device_->runtime->batch_run(device_->unpack_batch, options_.copy_method, options_.stream);
    if (!options_.asynchronous) device_->runtime->stream_synchronize(options_.stream);
    return;
  }
  for (const Packed& p : packed_) {
    const std::size_t es = element_size(p.dtype);
    for (std::size_t k = 0; k < p.tensors.size(); ++k) {
      const TensorDesc& t = tensors_[p.tensors[k]];
      if (t.count > 0) std::memcpy(t.data, p.data + p.offsets[k] * es, t.bytes());
    }
  }
}

}  // namespace gradcomm::packing
