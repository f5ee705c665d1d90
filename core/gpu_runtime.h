#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/data_type.h"
#include "core/reduce_op.h"

// The seam between gradcomm (which never links CUDA) and the GPU module libgradcomm_nccl.so
// (which links the CUDA runtime and NCCL). The module is loaded with dlopen on first use; a
// machine without it, without a driver or without a device gets a reason instead of a runtime.
// Tests install a fake runtime (set_runtime_for_testing) to exercise the host-side logic of the
// `nccl` algorithm everywhere.
namespace gradcomm::gpu {

// Bumped whenever the Runtime class changes: a module built for another version is refused.
inline constexpr int kRuntimeAbiVersion = 2;

enum class MemoryKind {
  host,     // not CUDA memory, or pinned host memory: the CPU reads it, NCCL does not take it
  device,   // cudaMalloc'ed: only the GPU reads it
  managed,  // cudaMallocManaged: both can
};

struct PointerInfo {
  MemoryKind kind = MemoryKind::host;
  int device = -1;  // the owning device for device and managed memory
};

// cudaStream_t and ncclComm_t, type-erased (nullptr is CUDA's legacy default stream).
using Stream = void*;
using GpuComm = void*;
using UniqueId = std::array<char, 128>;  // ncclUniqueId is 128 bytes

// One copy of a batch (GradientPacker): `bytes` from src to dst, both device memory.
struct CopyOp {
  void* dst;
  const void* src;
  std::size_t bytes;
};

enum class CommState { ready, in_progress, failed };

// How a batch of copies is issued: one cudaMemcpyAsync each, or one kernel launch for all.
enum class CopyMethod { memcpy, kernel };

// What the module implements. Every method throws gradcomm::Error naming the CUDA or NCCL call
// and its error string when that call fails.
class Runtime {
 public:
  virtual ~Runtime() = default;
  // "CUDA runtime 13.0, driver 13.0, NCCL 2.28.9"
  virtual std::string describe() = 0;
  virtual int device_count() = 0;
  virtual PointerInfo classify(const void* pointer) = 0;
  virtual int current_device() = 0;
  virtual void set_device(int device) = 0;

  virtual UniqueId unique_id() = 0;  // ncclGetUniqueId
  // ncclCommInitRankConfig on the current device, with NCCL's config.blocking = `blocking`
  // (GRADCOMM_NCCL_BLOCKING). Blocking, NCCL's calls return once they are done on the host (the
  // GPU work enqueued), as torch's NCCL backend uses them. Non-blocking, creation and enqueueing
  // may return before NCCL is done, and the caller polls comm_state with its own timeout, so a
  // missing peer never holds the calling thread; NCCL 2.19 and later then start a thread for
  // every call's launch.
  virtual GpuComm comm_init(int nranks, const UniqueId& id, int rank, bool blocking) = 0;
  virtual void comm_destroy(GpuComm comm) = 0;  // never throws
  virtual void comm_abort(GpuComm comm) = 0;    // never throws
  // ncclCommGetAsyncError: in progress (a non-blocking communicator's call not yet done), ready,
  // or failed (`error` gets NCCL's message).
  virtual CommState comm_state(GpuComm comm, std::string* error) = 0;

  // Enqueue on `stream`; counts are elements.
  virtual void allreduce(const void* send, void* recv, std::size_t count, DataType dtype,
                         ReduceOp op, int nranks, GpuComm comm, Stream stream) = 0;
  // recv holds count_per_rank elements; send holds nranks * count_per_rank.
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                              DataType dtype, ReduceOp op, int nranks, GpuComm comm,
                              Stream stream) = 0;
  virtual void all_gather(const void* send, void* recv, std::size_t count_per_rank, DataType dtype,
                          GpuComm comm, Stream stream) = 0;
  // ncclGroupStart / ncclGroupEnd around several calls on one communicator.
  virtual void group_start() = 0;
  virtual void group_end() = 0;

  // True when everything enqueued on `stream` has finished (cudaStreamQuery).
  virtual bool stream_done(Stream stream) = 0;
  // True once the work before `event` (a cudaEvent_t the caller recorded) has run
  // (cudaEventQuery).
  virtual bool event_done(void* event) = 0;
  // Work enqueued on `stream` from now on waits for `event` (cudaStreamWaitEvent).
  virtual void stream_wait_event(Stream stream, void* event) = 0;
  virtual void stream_synchronize(Stream stream) = 0;
  virtual Stream stream_create() = 0;
  virtual void stream_destroy(Stream stream) = 0;  // never throws

  // Any direction (cudaMemcpyDefault), enqueued on `stream`.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, Stream stream) = 0;
  // A fixed batch of copies, prepared once (its table uploaded to the device) and run often.
  virtual void* batch_create(const CopyOp* ops, std::size_t n) = 0;
  virtual void batch_run(void* batch, CopyMethod method, Stream stream) = 0;
  virtual void batch_destroy(void* batch) = 0;  // never throws
  virtual void* device_alloc(std::size_t bytes) = 0;
  virtual void device_free(void* pointer) = 0;  // never throws
  virtual void* host_alloc_pinned(std::size_t bytes) = 0;
  virtual void host_free_pinned(void* pointer) = 0;  // never throws
};

// The process's runtime, loaded on first call: nullptr, with the reason in `*why_not`, when the
// module is missing or cannot load, the ABI differs, or no device is visible. The answer is
// cached (one dlopen per process). GRADCOMM_NCCL_MODULE names the module's path explicitly.
Runtime* runtime(std::string* why_not = nullptr);

// The runtime if CUDA is already live in this process (libcuda is loaded), else nullptr without
// loading anything. The all-reduce front door calls this on every call to tell device pointers
// from host pointers; it costs a few ns while no CUDA library is loaded.
Runtime* active_runtime();

// Replaces the process's runtime (nullptr restores the loaded one). For tests only.
void set_runtime_for_testing(Runtime* fake);

// The device this rank should use: `configured` (GRADCOMM_DEVICE) when >= 0, else local_rank
// modulo the visible devices.
int pick_device(Runtime& runtime, int configured, int local_rank);

std::string_view to_string(MemoryKind kind);

}  // namespace gradcomm::gpu

// The module's one exported symbol: returns a new Runtime, or nullptr with a reason.
extern "C" {
using gradcomm_gpu_module_fn = gradcomm::gpu::Runtime* (*)(int abi_version, char* why_not,
                                                           std::size_t why_not_bytes);
}
#define GRADCOMM_GPU_MODULE_SYMBOL "gradcomm_gpu_module_create"
