// libgradcomm_nccl.so: the CUDA runtime and NCCL behind gradcomm::gpu::Runtime. Loaded with
// dlopen by core/gpu_runtime.cc, so nothing else in gradcomm needs CUDA at load time.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/gpu_runtime.h"
#include "gpu/copy_kernel.h"

namespace gradcomm {

// The module's own copy (core's error.cc also carries MPI, which the module must not link).
std::string error_message(std::string_view call, int rank, std::string_view detail) {
  std::string message(call);
  if (rank >= 0) message += ": rank " + std::to_string(rank);
  message += ": ";
  message += detail;
  return message;
}

namespace gpu {
namespace {

[[noreturn]] void fail_cuda(cudaError_t rc, const char* call) {
  cudaGetLastError();  // clear the sticky-free error state for the next call
  const std::string detail =
      std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
  if (rc == cudaErrorInvalidValue || rc == cudaErrorInvalidDevice ||
      rc == cudaErrorInvalidDevicePointer)
    throw InvalidArgument(error_message(call, -1, detail));
  throw CommError(error_message(call, -1, detail));
}

void check_cuda(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess) fail_cuda(rc, call);
}

// ncclInProgress is not an error for non-blocking communicators: the caller polls comm_state.
void check_nccl(ncclResult_t rc, const char* call, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  std::string detail = ncclGetErrorString(rc);
  if (const char* last = ncclGetLastError(comm); last && *last) detail += ": " + std::string(last);
  if (rc == ncclInvalidArgument || rc == ncclInvalidUsage)
    throw InvalidArgument(error_message(call, -1, detail));
  throw CommError(error_message(call, -1, detail));
}

ncclDataType_t nccl_type(DataType dtype) {
  switch (dtype) {
    case DataType::float32:
      return ncclFloat32;
    case DataType::float64:
      return ncclFloat64;
    case DataType::float16:
      return ncclFloat16;
    case DataType::bfloat16:
      return ncclBfloat16;
    case DataType::int32:
      return ncclInt32;
    case DataType::int64:
      return ncclInt64;
  }
  throw InvalidArgument(error_message("nccl", -1, "invalid dtype"));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::min:
      return ncclMin;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::prod:
      return ncclProd;
  }
  throw InvalidArgument(error_message("nccl", -1, "invalid reduce op"));
}

cudaStream_t as_stream(Stream s) {
  return static_cast<cudaStream_t>(s);
}
ncclComm_t as_comm(GpuComm c) {
  return static_cast<ncclComm_t>(c);
}

struct Batch {
  std::vector<CopyOp> ops;
  std::vector<CopyBlock> blocks;  // host copy of the kernel's table
  CopyBlock* device_blocks = nullptr;
  CopyOp* device_ops = nullptr;
};

class CudaNcclRuntime final : public Runtime {
 public:
  std::string describe() override {
    int runtime = 0, driver = 0, nccl = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    ncclGetVersion(&nccl);
    auto cuda_version = [](int v) {
      return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    };
    return "CUDA runtime " + cuda_version(runtime) + ", driver " + cuda_version(driver) +
           ", NCCL " + std::to_string(nccl / 10000) + "." + std::to_string((nccl / 100) % 100) +
           "." + std::to_string(nccl % 100) + ", " + std::to_string(device_count()) + " device(s)";
  }

  int device_count() override {
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    return count;
  }

  PointerInfo classify(const void* pointer) override {
    cudaPointerAttributes attributes{};
    const cudaError_t rc = cudaPointerGetAttributes(&attributes, pointer);
    if (rc != cudaSuccess) {
      cudaGetLastError();  // older drivers report plain host memory as an error
      return {};
    }
    switch (attributes.type) {
      case cudaMemoryTypeDevice:
        return {MemoryKind::device, attributes.device};
      case cudaMemoryTypeManaged:
        return {MemoryKind::managed, attributes.device};
      default:
        return {};
    }
  }

  int current_device() override {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    return device;
  }
  void set_device(int device) override { check_cuda(cudaSetDevice(device), "cudaSetDevice"); }

  UniqueId unique_id() override {
    static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId));
    ncclUniqueId id;
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    UniqueId out;
    std::memcpy(out.data(), &id, sizeof id);
    return out;
  }

  GpuComm comm_init(int nranks, const UniqueId& id, int rank, bool blocking) override {
    ncclUniqueId nccl_id;
    std::memcpy(&nccl_id, id.data(), sizeof nccl_id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t rc = ncclCommInitRankConfig(&comm, nranks, nccl_id, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      if (comm) ncclCommAbort(comm);
      check_nccl(rc, "ncclCommInitRankConfig");
    }
    return comm;
  }
  void comm_destroy(GpuComm comm) override {
    if (!comm) return;
    // ncclCommFinalize flushes outstanding work (a blocking communicator returns once it has); a
    // non-blocking one is then polled (bounded: 10 s) before ncclCommDestroy. Errors here have
    // nobody left to report to.
    ncclCommFinalize(as_comm(comm));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      if (ncclCommGetAsyncError(as_comm(comm), &state) != ncclSuccess) break;
      if (state == ncclInProgress) std::this_thread::yield();
    }
    if (state == ncclSuccess)
      ncclCommDestroy(as_comm(comm));
    else
      ncclCommAbort(as_comm(comm));
  }
  void comm_abort(GpuComm comm) override {
    if (comm) ncclCommAbort(as_comm(comm));
  }
  CommState comm_state(GpuComm comm, std::string* error) override {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(as_comm(comm), &state);
    if (rc != ncclSuccess) state = rc;
    if (state == ncclSuccess) return CommState::ready;
    if (state == ncclInProgress) return CommState::in_progress;
    if (error) {
      *error = ncclGetErrorString(state);
      if (const char* last = ncclGetLastError(as_comm(comm)); last && *last)
        *error += ": " + std::string(last);
    }
    return CommState::failed;
  }

  void allreduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                 int /*nranks*/, GpuComm comm, Stream stream) override {
    check_nccl(ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), as_comm(comm),
                             as_stream(stream)),
               "ncclAllReduce", as_comm(comm));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, DataType dtype,
                      ReduceOp op, int /*nranks*/, GpuComm comm, Stream stream) override {
    check_nccl(ncclReduceScatter(send, recv, count_per_rank, nccl_type(dtype), nccl_op(op),
                                 as_comm(comm), as_stream(stream)),
               "ncclReduceScatter", as_comm(comm));
  }
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, DataType dtype,
                  GpuComm comm, Stream stream) override {
    check_nccl(ncclAllGather(send, recv, count_per_rank, nccl_type(dtype), as_comm(comm),
                             as_stream(stream)),
               "ncclAllGather", as_comm(comm));
  }
  void group_start() override { check_nccl(ncclGroupStart(), "ncclGroupStart"); }
  void group_end() override { check_nccl(ncclGroupEnd(), "ncclGroupEnd"); }

  bool stream_done(Stream stream) override {
    const cudaError_t rc = cudaStreamQuery(as_stream(stream));
    if (rc == cudaErrorNotReady) return false;
    check_cuda(rc, "cudaStreamQuery");
    return true;
  }
  bool event_done(void* event) override {
    const cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (rc == cudaErrorNotReady) return false;
    check_cuda(rc, "cudaEventQuery");
    return true;
  }
  void stream_wait_event(Stream stream, void* event) override {
    check_cuda(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0),
               "cudaStreamWaitEvent");
  }
  void stream_synchronize(Stream stream) override {
    check_cuda(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
  }
  Stream stream_create() override {
    cudaStream_t stream = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
    return stream;
  }
  void stream_destroy(Stream stream) override {
    if (stream) cudaStreamDestroy(as_stream(stream));
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, Stream stream) override {
    if (bytes == 0) return;
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)),
               "cudaMemcpyAsync");
  }

  void* batch_create(const CopyOp* ops, std::size_t n) override {
    auto batch = std::make_unique<Batch>();
    batch->ops.assign(ops, ops + n);
    batch->blocks = plan_copy_blocks(ops, n);
    if (!batch->blocks.empty()) {
      check_cuda(cudaMalloc(&batch->device_blocks, batch->blocks.size() * sizeof(CopyBlock)),
                 "cudaMalloc");
      check_cuda(cudaMalloc(&batch->device_ops, n * sizeof(CopyOp)), "cudaMalloc");
      check_cuda(cudaMemcpy(batch->device_blocks, batch->blocks.data(),
                            batch->blocks.size() * sizeof(CopyBlock), cudaMemcpyHostToDevice),
                 "cudaMemcpy");
      check_cuda(cudaMemcpy(batch->device_ops, ops, n * sizeof(CopyOp), cudaMemcpyHostToDevice),
                 "cudaMemcpy");
    }
    return batch.release();
  }
  void batch_run(void* handle, CopyMethod method, Stream stream) override {
    auto* batch = static_cast<Batch*>(handle);
    if (method == CopyMethod::memcpy) {
      for (const CopyOp& op : batch->ops)
        copy_async(op.dst, op.src, op.bytes, stream);
      return;
    }
    if (batch->blocks.empty()) return;
    check_cuda(launch_copy_blocks(batch->device_ops, batch->device_blocks, batch->blocks.size(),
                                  as_stream(stream)),
               "copy kernel launch");
  }
  void batch_destroy(void* handle) override {
    auto* batch = static_cast<Batch*>(handle);
    if (!batch) return;
    cudaFree(batch->device_blocks);
    cudaFree(batch->device_ops);
    delete batch;
  }

  void* device_alloc(std::size_t bytes) override {
    void* pointer = nullptr;
    if (bytes > 0) check_cuda(cudaMalloc(&pointer, bytes), "cudaMalloc");
    return pointer;
  }
  void device_free(void* pointer) override {
    if (pointer) cudaFree(pointer);
  }
  void* host_alloc_pinned(std::size_t bytes) override {
    void* pointer = nullptr;
    if (bytes > 0) check_cuda(cudaMallocHost(&pointer, bytes), "cudaMallocHost");
    return pointer;
  }
  void host_free_pinned(void* pointer) override {
    if (pointer) cudaFreeHost(pointer);
  }
};

}  // namespace
}  // namespace gpu
}  // namespace gradcomm

extern "C" __attribute__((visibility("default"))) gradcomm::gpu::Runtime*
gradcomm_gpu_module_create(int abi_version, char* why_not, std::size_t why_not_bytes) {
  auto refuse = [&](const std::string& reason) -> gradcomm::gpu::Runtime* {
    if (why_not && why_not_bytes > 0) {
      std::strncpy(why_not, reason.c_str(), why_not_bytes - 1);
      why_not[why_not_bytes - 1] = '\0';
    }
    return nullptr;
  };
  if (abi_version != gradcomm::gpu::kRuntimeAbiVersion) {
    return refuse("the GPU module speaks runtime ABI " +
                  std::to_string(gradcomm::gpu::kRuntimeAbiVersion) + " but gradcomm asks for " +
                  std::to_string(abi_version) + " (module and library come from different builds)");
  }
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    return refuse("no usable CUDA device: cudaGetDeviceCount: " +
                  std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")");
  }
  if (count == 0) return refuse("no CUDA device is visible (cudaGetDeviceCount returned 0)");
  try {
    return new gradcomm::gpu::CudaNcclRuntime();
  } catch (const std::exception& e) {
    return refuse(e.what());
  }
}
