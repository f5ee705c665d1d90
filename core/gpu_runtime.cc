#include "core/gpu_runtime.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "gradcomm/config.h"

namespace gradcomm::gpu {
namespace {

std::atomic<Runtime*> g_fake{nullptr};

struct Loaded {
  std::once_flag once;
  std::unique_ptr<Runtime> runtime;  // never destroyed before exit: NCCL and CUDA tear down last
  std::string why_not;
};

Loaded& loaded() {
  static Loaded* state = new Loaded;  // leaked on purpose: no destructor races CUDA's at exit
  return *state;
}

std::string this_object_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&this_object_directory), &info) == 0 || !info.dli_fname)
    return {};
  std::error_code ec;
  const std::filesystem::path path = std::filesystem::canonical(info.dli_fname, ec);
  return ec ? std::string() : path.parent_path().string();
}

void load(Loaded& state) {
  // Where to look, in order. GRADCOMM_NCCL_MODULE is read here rather than in Config because
  // the module is loaded once per process, not per communicator. A build without the GPU path
  // (no CUDA where it was built) still loads a module it is pointed at: one built elsewhere
  // from the same source (the runtime ABI version is checked below).
  std::vector<std::string> candidates;
  if (const char* explicit_path = std::getenv("GRADCOMM_NCCL_MODULE");
      explicit_path && *explicit_path) {
    candidates.emplace_back(explicit_path);
  } else if (!GRADCOMM_HAVE_NCCL) {
    state.why_not =
        "this gradcomm was built without the GPU path (GRADCOMM_WITH_NCCL=OFF); set "
        "GRADCOMM_NCCL_MODULE to a " GRADCOMM_NCCL_MODULE_NAME " built from the same source";
    return;
  } else {
    if (const std::string here = this_object_directory(); !here.empty())
      candidates.push_back(here + "/" GRADCOMM_NCCL_MODULE_NAME);
    candidates.emplace_back(GRADCOMM_NCCL_MODULE_INSTALLED);
    candidates.emplace_back(GRADCOMM_NCCL_MODULE_BUILT);
    candidates.emplace_back(GRADCOMM_NCCL_MODULE_NAME);  // the loader's own search path
  }
  std::string errors;
  void* handle = nullptr;
  for (const std::string& path : candidates) {
    const bool is_path = path.find('/') != std::string::npos;
    if (is_path && !std::filesystem::exists(path)) continue;
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle) break;
    const char* error = dlerror();
    errors += (errors.empty() ? "" : "; ") + std::string(error ? error : path);
  }
  if (!handle) {
    state.why_not = errors.empty() ? "the GPU module " GRADCOMM_NCCL_MODULE_NAME
                                     " was not found (set GRADCOMM_NCCL_MODULE to its path)"
                                   : "the GPU module cannot be loaded: " + errors;
    return;
  }
  auto create = reinterpret_cast<gradcomm_gpu_module_fn>(dlsym(handle, GRADCOMM_GPU_MODULE_SYMBOL));
  if (!create) {
    state.why_not = "the GPU module has no symbol " GRADCOMM_GPU_MODULE_SYMBOL;
    return;  // the handle stays open: unloading CUDA libraries mid-process is not safe
  }
  char why_not[512] = {};
  Runtime* runtime = create(kRuntimeAbiVersion, why_not, sizeof why_not);
  if (!runtime) {
    state.why_not = why_not[0] ? why_not : "the GPU module declined without a reason";
    return;
  }
  state.runtime.reset(runtime);
}

// Counts objects ever loaded into the process (dl_iterate_phdr's dlpi_adds): while it does not
// change, libcuda cannot have appeared.
unsigned long long loaded_object_count() {
  unsigned long long adds = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t size, void* data) -> int {
        if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds))
          *static_cast<unsigned long long*>(data) = info->dlpi_adds;
        return 1;  // the first object is enough: the counters are process-wide
      },
      &adds);
  return adds;
}

}  // namespace

Runtime* runtime(std::string* why_not) {
  if (Runtime* fake = g_fake.load(std::memory_order_acquire)) return fake;
  Loaded& state = loaded();
  std::call_once(state.once, [&] { load(state); });
  if (!state.runtime && why_not) *why_not = state.why_not;
  return state.runtime.get();
}

Runtime* active_runtime() {
  if (Runtime* fake = g_fake.load(std::memory_order_acquire)) return fake;
  static std::atomic<bool> cuda_live{false};
  static std::atomic<unsigned long long> seen_adds{~0ULL};
  if (cuda_live.load(std::memory_order_acquire)) return runtime();
  const unsigned long long adds = loaded_object_count();
  if (adds == seen_adds.load(std::memory_order_relaxed)) return nullptr;
  seen_adds.store(adds, std::memory_order_relaxed);
  void* cuda = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!cuda) return nullptr;
  dlclose(cuda);  // NOLOAD took a reference
  cuda_live.store(true, std::memory_order_release);
  return runtime();
}

void set_runtime_for_testing(Runtime* fake) {
  g_fake.store(fake, std::memory_order_release);
}

int pick_device(Runtime& runtime, int configured, int local_rank) {
  const int count = runtime.device_count();
  if (count <= 0) {
    throw Unsupported(error_message("gpu::pick_device", -1, "no CUDA device is visible"));
  }
  if (configured >= 0) {
    if (configured >= count) {
      throw InvalidArgument(error_message(
          "gpu::pick_device", -1,
          "GRADCOMM_DEVICE=" + std::to_string(configured) + " but only " + std::to_string(count) +
              " device(s) are visible (valid: 0 to " + std::to_string(count - 1) + ")"));
    }
    return configured;
  }
  return local_rank % count;
}

std::string_view to_string(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::host:
      return "host memory";
    case MemoryKind::device:
      return "device memory";
    case MemoryKind::managed:
      return "managed memory";
  }
  return "invalid";
}

}  // namespace gradcomm::gpu
