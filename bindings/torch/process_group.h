#pragma once
// gradcomm as a torch.distributed backend ("gradcomm"): torch's own DistributedDataParallel, FSDP
// and the functional collectives run on gradcomm's algorithms, its call check and its watchdog.
//
// One source for two generations of torch's c10d:
// - torch 1.x (1.13): a backend is a c10d::ProcessGroup, and the object the creator returns is
//   the group;
// - torch 2.x: a backend is a c10d::Backend, which torch wraps in its own ProcessGroup per device.
// TORCH_VERSION_MAJOR picks the base; the collectives' signatures are the same in both.
//
// Every collective of a group runs on the progress engine of the group's gradcomm Communicator,
// in the order the group's calls were made (torch's DDP calls from autograd's threads), and
// returns a Work at once. Input that is wrong on this rank (dtype, layout, sizes, a root outside
// the group) throws from the call itself, before anything is submitted, and the group stays
// usable: where it is wrong on some ranks only, the call check's marker (InStep) gives the
// others a MismatchError naming them. What can only be known while a call runs (ranks that
// disagree, a stalled rank) fails the Work and its future on every rank.

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "collectives/check/call_info.h"
#include "core/communicator.h"
#include "core/request.h"

namespace gradcomm::torch_backend {

#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

// The version-independent torch spellings used here.
#define GRADCOMM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||           \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// CUDA tensors (torch 2.x): ordered on streams through c10's device-generic interfaces
// (c10::Stream, c10::Event, the device guard), so the backend compiles without CUDA's headers and
// loads where torch has no CUDA. Torch 1.13 here is Debian's, without CUDA: CUDA tensors are
// refused there with a clear error.
#if TORCH_VERSION_MAJOR >= 2
#define GRADCOMM_TORCH_CUDA 1
#else
#define GRADCOMM_TORCH_CUDA 0
#endif

// c10d::Work::blockCurrentStream, where this torch has it (with the stream-blocking kernel it
// uses).
#if GRADCOMM_TORCH_CUDA && __has_include(<torch/csrc/distributed/c10d/cuda/StreamBlock.hpp>)
#define GRADCOMM_TORCH_BLOCK_CURRENT_STREAM 1
#else
#define GRADCOMM_TORCH_BLOCK_CURRENT_STREAM 0
#endif

// c10d::Work::getFutureResult (torch 2.6 and later): a future of the call's c10d::WorkResult.
#define GRADCOMM_TORCH_FUTURE_RESULT GRADCOMM_TORCH_AT_LEAST(2, 6)

class DeviceCall;
class GpuWatch;

// A call in flight: completed (or failed) by the progress engine; its future holds the outputs.
// A call on CUDA tensors (`device` set) completes once its work is enqueued on the group's stream
// of that device: complete() then runs with that stream current, so the future (made for the
// device) records its event there, and wait() makes the caller's current stream wait for it
// without blocking the host, as torch's NCCL backend does.
class GradcommWork : public c10d::Work {
 public:
  GradcommWork(c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
               std::optional<c10::Device> device = std::nullopt);

  // The engine's side. Neither holds a lock while callbacks of the future run.
  void complete();
  void fail(std::exception_ptr error);

  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Counted in waiters() while it blocks: the engine then waits as a blocking call would.
  // Without a timeout, a call still queued behind nothing running runs on the waiting thread
  // (ProgressEngine::run_here): no hand-over to the engine's thread and back.
  // c10d::Work::wait ends with synchronize() (torch 1.13 and 2.x).
  bool wait(std::chrono::milliseconds timeout) override;
  // The engine's request that runs this call (submit sets it before the work is returned).
  void set_request(std::weak_ptr<detail::RequestState> request) { request_ = std::move(request); }
  // A CUDA call: true once its work has run on the GPU.
  bool isCompleted() override;
  // A CUDA call: the caller's current stream waits for its work (no host wait). c10d::Work::wait
  // calls it holding the work's mutex, so it must not take that mutex (c10d::Work::isCompleted
  // does): it reads enqueued_ instead.
  void synchronize() override;
#if GRADCOMM_TORCH_BLOCK_CURRENT_STREAM
  // work.block_current_stream(): the caller's current stream waits for the call on the GPU.
  void blockCurrentStream() override;
#endif
  const std::atomic<int>* waiters() const {
    return &waiters_;
  }
  // A CUDA call's event on the group's stream, recorded by complete() (null before, and for a
  // call on CPU tensors).
  std::shared_ptr<c10::Event> done_event() const {
    return done_event_;
  }
  // Marks get_future_result() SUCCESS (a call on CPU tensors, at complete()).
  void gpu_done();
  // For a CUDA call: what the group's GPU watch runs once the GPU has run it (holding the result's
  // future, not the work: the watch thread must not release the work's tensors).
  std::function<void()> gpu_done_callback();
#if GRADCOMM_TORCH_FUTURE_RESULT
  // work.get_future_result(): completes with c10d::WorkResult SUCCESS once the call has finished
  // (a CUDA call: once the GPU has run it), TIMEOUT when it failed past the group's timeout and
  // COMM_ERROR when it failed otherwise, as on torch's NCCL backend.
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
#endif

 private:
  std::atomic<int> waiters_{0};
  std::weak_ptr<detail::RequestState> request_;
  std::vector<at::Tensor> outputs_;
  std::optional<c10::Device> device_;
  // Recorded on the group's stream once the call is enqueued (CUDA calls only); enqueued_ says
  // (release) that it has been.
  std::shared_ptr<c10::Event> done_event_;
  std::atomic<bool> enqueued_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
#if GRADCOMM_TORCH_FUTURE_RESULT
  c10::intrusive_ptr<c10::ivalue::Future> result_future_;
#endif
};

class ProcessGroupGradcomm : public BackendBase {
 public:
  // Wraps `comm` (a group of `size` ranks in which this process is `rank`; both checked against
  // the communicator), with `config` (the group's timeout may be torch's). Collective over the
  // group.
  ProcessGroupGradcomm(MPI_Comm comm, int rank, int size, Config config);
  ~ProcessGroupGradcomm() override;

  const std::string getBackendName() const override { return "gradcomm"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
#if GRADCOMM_TORCH_AT_LEAST(2, 1)
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
#endif

#if GRADCOMM_TORCH_TENSOR_ALLOC
  // torch's DDP (2.x, where DDP_DISABLE_COMM_MEM=0) asks the group for its gradient buckets.
  // Host buckets come from gradcomm's registered memory (Communicator::allocate), so shm
  // reduces them in place, as gradcomm's own DDP does its buckets. Collective: every rank asks
  // in the same order with the same size (DDP's buckets are the same on every rank), behind the
  // group's earlier calls; a rank whose next call is another collective, or another size, gets
  // an error on every rank (with the call check on: GRADCOMM_CHECK=off drops that guarantee, as
  // for every call). Other devices get torch's own memory. torch's FSDP2 asks too, for every
  // collective, where set_allocate_memory_from_process_group_for_comm(True) was called: each
  // such call then makes a segment of its own (about even with torch's memory there).
  bool supportsTensorAlloc(c10::DeviceIndex device) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;
#endif

  // The number of collectives submitted on this rank so far. torch's ProcessGroupWrapper
  // (TORCH_DISTRIBUTED_DEBUG=DETAIL) sets it when it wraps the group and compares it between
  // ranks before each call, as it does gloo's. Every rank starts at 0, so they agree.
  void setSequenceNumberForGroup() override {
    sequence_ = 0;
  }
  uint64_t getSequenceNumberForGroup() override {
    return sequence_;
  }

  // The gradcomm communicator the group runs on (tests and the Python side read it).
  Communicator& communicator() {
    return *comm_;
  }

 private:
  // Submits `body` to the engine behind the group's earlier calls; the returned Work completes
  // with `outputs` once it ran, or fails with what it threw.
  // Where torch says the caller waits at once (the options' asyncOp, torch 2.2 and later:
  // dist.all_reduce(t) without async_op), `body` runs on the caller's thread behind the
  // group's earlier calls instead, with no hand-over to the engine.
  // `device` (from device_call) orders a call on CUDA tensors on the group's stream: the body
  // runs with that stream current, after the caller's stream has reached the call.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const char* title,
                                        std::vector<at::Tensor> outputs, std::function<void()> body,
                                        bool async = true,
                                        std::shared_ptr<DeviceCall> device = nullptr);
  c10::intrusive_ptr<c10d::Work> point_to_point(bool sending, at::Tensor& tensor, int peer,
                                                int tag);
  // Keeps the ranks in step when a collective fails on this rank before it is submitted (its
  // arguments refused here): on unwinding, a marker takes the call's place behind the group's
  // earlier calls (collectives::compare_failed_call), so that the ranks which made the call get
  // a MismatchError naming this rank at once, instead of waiting for it, or meeting this rank's
  // next call of the same shape in its place. The first line of every collective that checks
  // its arguments; the inner one counts where one is made inside another (a coalesced list's).
  class InStep {
   public:
    InStep(ProcessGroupGradcomm& group, collectives::CallKind kind);
    ~InStep();
    InStep(const InStep&) = delete;
    InStep& operator=(const InStep&) = delete;

   private:
    ProcessGroupGradcomm& group_;
    const collectives::CallKind kind_;
    const int exceptions_;  // in flight when the call began
    const bool outer_;      // whether the enclosing call had submitted
  };
  // One call of a coalesced list (torch's *_tensor_coalesced): `mark`, the list's list_mark,
  // compared with each of its calls; `failure`, the error of the first call of the list that
  // fails, which the rest then throw without communicating (so the list's last work, which
  // torch waits for, says what went wrong). Else a rank whose list is longer than another's
  // would leave calls behind, to meet that rank's next call. A call of its own: 0 and null.
  struct ListFailure {
    std::mutex mutex;
    std::exception_ptr error;
  };
  struct ListCall {
    std::uint64_t mark = 0;
    std::shared_ptr<ListFailure> failure;
  };
  // `body` as a call of `list`.
  static std::function<void()> in_list(const ListCall& list, std::function<void()> body);
  // all_gather_into_tensor and reduce_scatter_tensor, alone or as a call of `list`.
  c10::intrusive_ptr<c10d::Work> allgather_into(at::Tensor& output, at::Tensor& input,
                                                const c10d::AllgatherOptions& opts,
                                                const ListCall& list);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_into(at::Tensor& output, at::Tensor& input,
                                                     const c10d::ReduceScatterOptions& opts,
                                                     const ListCall& list);
  // Where a call's tensors live: nullptr for CPU tensors; for CUDA tensors (all on one device,
  // else InvalidArgument), the call's place on the group's stream of that device. Called on the
  // caller's thread, after the call's checks: it records the caller's current stream. `nccl`:
  // the call reduces on the GPU through gradcomm's GPU module (Unsupported, naming why, where
  // that cannot run); other calls run on the host, on pinned copies (DeviceCall::place).
  std::shared_ptr<DeviceCall> device_call(const std::string& call,
                                          const std::vector<at::Tensor>& tensors,
                                          bool nccl = false);
  // Whether a call on CUDA tensors can run through gradcomm's GPU path here (this torch gives
  // streams' handles, and the GPU module runs); otherwise the data-moving collectives stage
  // through the host, as they did before they had a GPU form.
  bool nccl_usable();

  std::unique_ptr<Communicator> comm_;
  std::atomic<uint64_t> sequence_{0};
  // send and recv: a duplicate of their own (freed with the last of the group and its works)
  std::shared_ptr<const MPI_Comm> p2p_;
  std::shared_ptr<const std::string> timeout_text_;  // the config's, for send/recv's messages
  // The group's communication stream per CUDA device, taken from torch's pool at the first call
  // on that device; and why gradcomm's GPU path cannot run here, once asked.
  std::mutex streams_mutex_;
  std::map<c10::DeviceIndex, c10::Stream> streams_;
  std::optional<std::string> gpu_unavailable_;
#if GRADCOMM_TORCH_CUDA
  std::unique_ptr<GpuWatch> gpu_watch_;  // made by the first CUDA call
#endif
};

// The group torch asks for: the world (empty `global_ranks`) or the ranks of a new_group, in
// which this process is `group_rank` of `group_size`. Initializes MPI (thread level multiple)
// where nobody has; fails with a clear error where the sizes and ranks torch was given disagree
// with MPI's (a start without mpirun, or other RANK / WORLD_SIZE). `timeout_seconds`: the
// timeout the caller gave torch (init_process_group's or new_group's), which replaces
// GRADCOMM_TIMEOUT for this group; none where torch has its default. `group_name`: torch's name
// of the group, the same on every rank for one new_group call; a subgroup's members agree on it
// and on the ranks before they make its communicator (agree_on_members).
c10::intrusive_ptr<BackendBase> create_process_group(int group_rank, int group_size,
                                                     const std::vector<int64_t>& global_ranks,
                                                     std::optional<double> timeout_seconds,
                                                     const std::string& group_name = "");

}  // namespace gradcomm::torch_backend
