// gradcomm-gpu-pack-bench: GradientPacker on device tensors, one copy kernel for all tensors
// against one cudaMemcpyAsync per tensor, on real models' gradient shapes. Alternates the two
// methods round by round; prints per-method medians of pack+unpack and the effective bandwidth
// (bytes read + written). Needs a GPU; prints why and exits 0 without one.
//
//   gradcomm-gpu-pack-bench [workload ...]   (default: resnet50 bert_base mobilenet_v2 vgg16)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/gpu_runtime.h"
#include "packing/gradient_packer.h"
#include "packing/workload.h"

namespace {

using gradcomm::gpu::CopyMethod;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(int argc, char** argv) {
  std::string why;
  gradcomm::gpu::Runtime* gpu = gradcomm::gpu::runtime(&why);
  if (!gpu) {
    std::printf("# gradcomm-gpu-pack-bench: skipped, no GPU: %s\n", why.c_str());
    return 0;
  }
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i)
    names.emplace_back(argv[i]);
  if (names.empty()) names = {"resnet50", "bert_base", "mobilenet_v2", "vgg16"};
  std::printf("# %s\n# pack+unpack per step, median of 30 alternating rounds\n",
              gpu->describe().c_str());
  std::printf("# %-14s %8s %10s %14s %14s %12s %12s %8s\n", "workload", "tensors", "MB",
              "kernel_us", "memcpy_us", "kernel_GB/s", "memcpy_GB/s", "speedup");
  for (const std::string& name : names) {
    const std::string path = std::filesystem::exists(name)
                                 ? name
                                 : std::string(GRADCOMM_WORKLOAD_DIR) + "/" + name + ".json";
    const gradcomm::packing::Workload w = gradcomm::packing::load_workload(path);
    const std::size_t es = gradcomm::element_size(w.dtype);
    std::vector<void*> buffers;
    std::vector<gradcomm::packing::TensorDesc> tensors;
    for (const auto& t : w.tensors) {
      buffers.push_back(gpu->device_alloc(t.count * es));
      tensors.push_back({buffers.back(), t.count, w.dtype});
    }
    void* stream = gpu->stream_create();
    const CopyMethod methods[2] = {CopyMethod::kernel, CopyMethod::memcpy};
    std::vector<gradcomm::packing::GradientPacker> packers;
    for (CopyMethod m : methods) {
      packers.emplace_back(tensors, gradcomm::packing::PackerOptions{.num_split = 1,
                                                                     .min_chunk_elements = 1,
                                                                     .stream = stream,
                                                                     .copy_method = m,
                                                                     .asynchronous = true});
    }
    std::vector<double> times[2];
    for (int round = 0; round < 35; ++round) {
      for (int k = 0; k < 2; ++k) {
        const int m = (k + round) % 2;
        gpu->stream_synchronize(stream);
        const auto t0 = std::chrono::steady_clock::now();
        for (int rep = 0; rep < 10; ++rep) {
          packers[m].pack();
          packers[m].unpack();
        }
        gpu->stream_synchronize(stream);
        const double us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count() /
            10;
        if (round >= 5) times[m].push_back(us);  // the first rounds warm up
      }
    }
    const double bytes = static_cast<double>(w.total_elements() * es);
    const double k = median(times[0]), c = median(times[1]);
    std::printf("  %-14s %8zu %10.1f %14.1f %14.1f %12.1f %12.1f %8.2f\n", w.model.c_str(),
                w.tensors.size(), bytes / 1e6, k, c, 4 * bytes / (k * 1e-6) / 1e9,
                4 * bytes / (c * 1e-6) / 1e9, c / k);
    packers.clear();
    gpu->stream_destroy(stream);
    for (void* b : buffers)
      gpu->device_free(b);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
