// Python's first: it sets feature macros the system headers read (the GIL, in the destructor).
#include <Python.h>

#include "bindings/torch/process_group.h"

#include "bindings/torch/reduction.h"
#include "bindings/torch/subgroup.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "collectives/allreduce.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/exchange.h"
#include "collectives/shm/segment.h"
#include "core/error.h"
#include "core/progress_engine.h"
#include "core/request.h"
#include "packing/grouped_allreduce.h"

namespace gradcomm::torch_backend {
namespace {

// The GIL, released for the scope where this thread holds it. A group is destroyed where
// Python drops its last reference (destroy_process_group, or a group going out of scope), with
// the GIL held, and its destructor waits for the calls in flight: their completion may need the
// GIL on the engine's thread (a future's Python callback, or the last reference to a tensor whose
// Python object the call kept alive), and waiting with it held deadlocked both ranks. Not while
// Python finalizes: a thread that takes the GIL then is ended by Python mid-call (gradcomm.torch
// drains every engine at exit, before that).
class GilReleasedIfHeld {
 public:
  GilReleasedIfHeld() {
    if (Py_IsInitialized() && !python_finalizing() && PyGILState_Check()) {
      saved_ = PyEval_SaveThread();
    }
  }
  ~GilReleasedIfHeld() {
    if (saved_ != nullptr) PyEval_RestoreThread(saved_);
  }
  GilReleasedIfHeld(const GilReleasedIfHeld&) = delete;
  GilReleasedIfHeld& operator=(const GilReleasedIfHeld&) = delete;

 private:
  static bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }
  PyThreadState* saved_ = nullptr;
};

// --- Checks, on the caller's thread, before anything is submitted ------------------------------

[[noreturn]] void invalid(const std::string& call, int rank, const std::string& detail) {
  throw InvalidArgument(error_message("torch.distributed " + call + " (gradcomm)", rank, detail));
}

// Set by submit(), for the InStep around the call on this thread.
thread_local bool t_submitted = false;

std::string describe(const at::Tensor& t) {
  std::string text = std::string(c10::toString(t.scalar_type())) + "[";
  for (std::size_t i = 0; i < static_cast<std::size_t>(t.dim()); ++i) {
    if (i) text += ", ";
    text += std::to_string(t.sizes()[i]);
  }
  return text + "] on " + t.device().str();
}

// A tensor gradcomm can communicate: dense, contiguous, on the CPU or (torch 2.x) a CUDA device.
void check_tensor(const std::string& call, int rank, const at::Tensor& t,
                  const char* what = "tensor") {
  if (!t.defined()) invalid(call, rank, std::string("the ") + what + " is undefined");
  if (t.is_sparse())
    invalid(call, rank, std::string("the ") + what + " is sparse; pass a dense one");
  if (!t.device().is_cpu() && !(GRADCOMM_TORCH_CUDA && t.device().is_cuda())) {
    unsupported(call, rank,
                std::string("the ") + what + " is " + describe(t) +
                    (GRADCOMM_TORCH_CUDA
                         ? ": the gradcomm backend takes CPU and CUDA tensors"
                         : ": the gradcomm backend built for torch " TORCH_VERSION
                           " takes CPU tensors (CUDA tensors need its build for torch 2.x)"));
  }
  if (!t.is_contiguous()) {
    invalid(call, rank,
            std::string("the ") + what + " (" + describe(t) +
                ") is not contiguous; pass tensor.contiguous()");
  }
}

void check_one(const std::string& call, int rank, const std::vector<at::Tensor>& tensors) {
  if (tensors.size() != 1) {
    invalid(call, rank, "takes one tensor per process, got " + std::to_string(tensors.size()));
  }
  check_tensor(call, rank, tensors[0]);
}

void check_root(const std::string& call, int rank, int size, int64_t root) {
  if (root < 0 || root >= size) {
    invalid(
        call, rank,
        "root " + std::to_string(root) + " is not a rank of the group of " + std::to_string(size));
  }
}

// Two tensors that must hold the same elements (a list's entries, input against output).
void check_like(const std::string& call, int rank, const at::Tensor& t, const at::Tensor& like,
                const char* what) {
  check_tensor(call, rank, t, what);
  if (t.scalar_type() != like.scalar_type() || t.numel() != like.numel()) {
    invalid(call, rank,
            std::string("the ") + what + " is " + describe(t) + ", the input " + describe(like) +
                ": they must have the same dtype and size");
  }
}

// The root's list of one tensor per rank for gather's outputs or scatter's inputs, each like
// `like`; an empty list elsewhere, where passing one is an error.
std::vector<at::Tensor> root_list(const std::string& call, int rank, int size,
                                  const std::vector<std::vector<at::Tensor>>& lists,
                                  const at::Tensor& like, int64_t root, const char* what) {
  if (rank != root) {
    if (!lists.empty() && !lists[0].empty()) {
      invalid(call, rank,
              "only the root (rank " + std::to_string(root) + ") passes an " + what + " list");
    }
    return {};
  }
  if (lists.size() != 1 || lists[0].size() != static_cast<std::size_t>(size)) {
    invalid(call, rank,
            std::string("the root's ") + what + " list must hold one tensor per rank (" +
                std::to_string(size) + ")");
  }
  for (const at::Tensor& t : lists[0])
    check_like(call, rank, t, like, (std::string(what) + " tensor").c_str());
  return lists[0];
}

std::size_t bytes_of(const at::Tensor& t) {
  return static_cast<std::size_t>(t.numel()) * t.element_size();
}

// A sparse COO all_reduce (DDP's gradients of sparse embeddings): checked on the caller's
// thread, before anything is sent. SUM and AVG (what "missing" means for MIN or MAX is not
// defined); CPU tensors.
void check_sparse(const std::string& call, int rank, const at::Tensor& t,
                  const c10d::ReduceOp& op) {
  if (t.device().type() != c10::DeviceType::CPU) {
    unsupported(call, rank,
                "the tensor is sparse on " + t.device().str() +
                    ": the gradcomm backend reduces sparse tensors on the CPU only");
  }
  if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG) {
    unsupported(call, rank, "a sparse tensor is reduced with SUM or AVG only");
  }
  if (!c10::isFloatingType(t.scalar_type()) && !c10::isIntegralType(t.scalar_type(), false)) {
    unsupported(call, rank,
                std::string("a sparse tensor of ") + c10::toString(t.scalar_type()) +
                    " (sparse tensors of floating and integer types are reduced)");
  }
}

// The sum over the ranks of sparse COO tensors `t` (divided by the group's size for `average`),
// written back into `t` (coalesced), as gloo does. Every rank's indices and values are gathered
// (allgatherv) and summed where they coincide. Ranks whose tensors differ in size, sparse or
// dense dimensions fail alike on every rank, before the indices move; in dtype, at the first
// call (the call check compares the torch dtype).
void reduce_sparse_into(Communicator& comm, const at::Tensor& t, bool average) {
  const std::string call = "all_reduce";
  const at::Tensor in = t.coalesce();
  const at::Tensor indices = in._indices().contiguous();  // [sparse_dim, nnz] int64
  const at::Tensor values = in._values().contiguous();    // [nnz, dense sizes...]
  const auto note = sparse_annotation_of(values);
  const int n = comm.size();
  // What each rank has: dimensions, nnz, the op, then the sizes (ranks whose dimension counts
  // differ differ in this call's size: a MismatchError on every rank).
  constexpr std::size_t kNnz = 2, kSizes = 4;
  std::vector<int64_t> mine = {in.dim(), in.sparse_dim(), in._nnz(), average ? 1 : 0};
  for (int64_t d : in.sizes())
    mine.push_back(d);
  std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(n));
  allgather_bytes(comm, mine.data(), all.data(), mine.size() * sizeof(int64_t));
  std::vector<std::size_t> index_bytes, value_bytes;
  const auto what = [&](const int64_t* of) {
    std::string text = "[";
    for (std::size_t k = kSizes; k < mine.size(); ++k)
      text += (k > kSizes ? ", " : "") + std::to_string(of[k]);
    return text + "] with " + std::to_string(of[1]) + " sparse dimensions, " +
           (of[3] ? "AVG" : "SUM");
  };
  // Every rank compares every rank with one reference, the same on every rank: the first rank
  // with entries (else rank 0), whose layout is the result's. A rank with no entries matches
  // whatever its sparse dimensions (torch 1.13's zero_grad leaves a sparse gradient with all of
  // them sparse).
  int reference = 0;
  for (int r = 0; r < n; ++r) {
    if (all[static_cast<std::size_t>(r) * mine.size() + kNnz] > 0) {
      reference = r;
      break;
    }
  }
  const int64_t* ref = all.data() + static_cast<std::size_t>(reference) * mine.size();
  const int64_t sparse_dim = ref[1];
  for (int r = 0; r < n; ++r) {
    const int64_t* theirs = all.data() + static_cast<std::size_t>(r) * mine.size();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (i == kNnz || theirs[i] == ref[i]) continue;  // (nnz may differ)
      if (i == 1 && theirs[kNnz] == 0) continue;
      throw MismatchError(error_message(
          "torch.distributed " + call + " (gradcomm)", comm.rank(),
          "the ranks' sparse all_reduce calls differ: rank " + std::to_string(r) + "'s is " +
              what(theirs) + "; rank " + std::to_string(reference) + "'s " + what(ref)));
    }
  }
  int64_t dense_elements = 1;
  std::vector<int64_t> value_shape = {0};
  for (int64_t d = sparse_dim; d < in.dim(); ++d) {
    dense_elements *= in.size(d);
    value_shape.push_back(in.size(d));
  }
  for (int r = 0; r < n; ++r) {
    const auto nnz =
        static_cast<std::size_t>(all[static_cast<std::size_t>(r) * mine.size() + kNnz]);
    index_bytes.push_back(nnz * static_cast<std::size_t>(sparse_dim) * sizeof(int64_t));
    value_bytes.push_back(nnz * static_cast<std::size_t>(dense_elements) * values.element_size());
  }
  int64_t total = 0;
  for (int r = 0; r < n; ++r)
    total += all[static_cast<std::size_t>(r) * mine.size() + kNnz];
  // Each rank's [sparse_dim, nnz_r] block, one after another; their values likewise.
  at::Tensor blocks = at::empty({total * sparse_dim}, indices.options());
  value_shape[0] = total;
  at::Tensor gathered_values = at::empty(value_shape, values.options());
  allgatherv_bytes(comm, indices.data_ptr(), blocks.data_ptr(), index_bytes);
  allgatherv_bytes(comm, values.data_ptr(), gathered_values.data_ptr(), value_bytes);
  std::vector<at::Tensor> columns;
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t nnz = all[static_cast<std::size_t>(r) * mine.size() + kNnz];
    columns.push_back(blocks.narrow(0, at * sparse_dim, nnz * sparse_dim).view({sparse_dim, nnz}));
    at += nnz;
  }
  // Narrow integers are summed as int64 and converted back, as the dense path reduces them: a
  // sum wraps as in the narrow type, an average of values whose sum overflows it does not.
  const bool widen =
      !c10::isFloatingType(values.scalar_type()) && values.scalar_type() != at::kLong;
  at::Tensor sum =
      at::sparse_coo_tensor(at::cat(columns, 1),
                            widen ? gathered_values.to(at::kLong) : gathered_values, in.sizes())
          .coalesce();
  if (average) {
    at::Tensor v = sum._values();
    if (c10::isFloatingType(v.scalar_type())) {
      v.div_(n);
    } else {
      v.div_(n, "trunc");  // as the dense integer AVG
    }
  }
  t.copy_(widen ? sum.to(values.scalar_type()) : sum);
}

// Whether the caller may go on before the call completes (torch 2.2+ says so in the options).
template <class Options>
bool async_op(const Options& opts) {
  if constexpr (requires { opts.asyncOp; }) {
    return opts.asyncOp;
  } else {
    return true;
  }
}

// --- Work ------------------------------------------------------------------------------------

// A future of tensors; for a call on CUDA tensors, one that follows torch's stream rules for
// `device` (what waits for it or chains onto it waits for the stream that completed it).
c10::intrusive_ptr<c10::ivalue::Future> make_future(
    std::optional<c10::Device> device = std::nullopt) {
  std::vector<c10::Device> devices;
  if (device) devices.push_back(*device);
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                  std::move(devices));
}

// Point-to-point messages carry the tensor's dtype in the MPI tag's low bits (torch's tag above
// them), so that a receive matches only a send of its dtype; a send of another dtype with the
// same torch tag is found by probing while the receive waits, and reported.
constexpr int kDtypeTagBits = 6;

int dtype_code(at::ScalarType type) {
  return std::min(static_cast<int>(type), (1 << kDtypeTagBits) - 1);
}

// The MPI tag of torch's `tag` for tensors of `type`.
int mpi_tag(int tag, at::ScalarType type) {
  return (tag << kDtypeTagBits) | dtype_code(type);
}

// Transfers whose work was dropped after they timed out: MPI may still complete them, so their
// requests and buffers are kept (never freed) rather than waited for forever.
struct Abandoned {
  MPI_Request request;
  at::Tensor tensor, staged;
};
std::mutex g_abandoned_mutex;
std::vector<Abandoned>* g_abandoned = new std::vector<Abandoned>();  // outlives static teardown

void abandon(MPI_Request request, const at::Tensor& tensor, const at::Tensor& staged) {
  std::lock_guard<std::mutex> lock(g_abandoned_mutex);
  g_abandoned->push_back({request, tensor, staged});
}

// Frees the abandoned transfers MPI has completed since (called at each new transfer).
void sweep_abandoned() {
  std::lock_guard<std::mutex> lock(g_abandoned_mutex);
  std::erase_if(*g_abandoned, [](Abandoned& a) {
    int done = 0;
    MPI_Test(&a.request, &done, MPI_STATUS_IGNORE);
    return done || a.request == MPI_REQUEST_NULL;  // (a failed request is freed by MPI)
  });
}

// Completes its future once MPI says the transfer is done (send, recv). Not on the engine:
// point-to-point calls must not queue behind each other (a pair of ranks that each send, then
// receive, would wait for each other forever). A wait ends within the group's timeout
// (or the wait's own timeout) with an error naming the peer, the tag and the tensor; a receive
// whose sender sent another size or dtype fails, never completes with the bytes that came.
class PointToPointWork : public c10d::Work {
 public:
  struct Transfer {
    bool sending = false;
    int peer = 0;  // MPI_ANY_SOURCE for recvAnysource
    int tag = 0;   // torch's
    int rank = 0;
    int timeout_seconds = 0;                          // 0: no limit
    std::shared_ptr<const std::string> timeout_text;  // "GRADCOMM_TIMEOUT=300 s"
    std::shared_ptr<const MPI_Comm> comm;             // the group's, kept while a work may probe it
  };

  // `staged`: for a CUDA tensor, the host copy MPI sends from or receives into (a received one
  // is copied to the tensor, on the current stream of whoever completes the work).
  PointToPointWork(c10d::OpType type, const char* title, at::Tensor tensor, at::Tensor staged,
                   MPI_Request request, Transfer transfer)
      : c10d::Work(transfer.rank, type, title, c10::optional<std::vector<at::Tensor>>({tensor})),
        tensor_(std::move(tensor)),
        staged_(std::move(staged)),
        transfer_(transfer),
        request_(request),
        future_(make_future()) {}

  ~PointToPointWork() override {
    if (!mpi_ready()) return;
    // A work dropped before its transfer completed. Where nobody holds its future (get_future()
    // was not called, or that future is gone too) and the tensor is on the CPU, MPI completes the
    // transfer into or from the tensor whenever the peer gets there: the request and tensor are
    // kept till then. Otherwise it is waited for here, within the timeout: a future's holder
    // waits for it, and what a CUDA tensor received is copied to the device.
    if (!staged_.defined() && future_.use_count() == 1) {
      std::lock_guard<std::mutex> lock(request_mutex_);
      int done = 0;
      if (request_ != MPI_REQUEST_NULL &&
          (MPI_Test(&request_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done)) {
        abandon(request_, tensor_, staged_);
      }
      return;
    }
    try {
      poll(true, std::chrono::milliseconds(0));
    } catch (...) {
    }
  }

  bool isCompleted() override {
    poll(false, std::chrono::milliseconds(0));
    return c10d::Work::isCompleted();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    poll(true, timeout);
    return c10d::Work::wait(timeout);
  }

  int sourceRank() const override { return source_; }
  std::vector<at::Tensor> result() override { return {tensor_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::string what() const {
    const Transfer& t = transfer_;
    return std::string(t.sending ? "send to " : "recv from ") +
           (t.peer == MPI_ANY_SOURCE ? std::string("any rank") : "rank " + std::to_string(t.peer)) +
           " (tag " + std::to_string(t.tag) + ", " + describe(tensor_) + ")";
  }

  std::exception_ptr failure(const std::string& why) const {
    return std::make_exception_ptr(CommError(error_message(
        std::string("torch.distributed ") + (transfer_.sending ? "send" : "recv") + " (gradcomm)",
        transfer_.rank, what() + ": " + why)));
  }

  // A send of another dtype with this receive's torch tag, from its peer, waiting to be matched
  // (each dtype's MPI tag probed: messages of other tags may be queued ahead of it).
  std::exception_ptr other_dtype_pending() const {
    const int mine = dtype_code(tensor_.scalar_type());
    for (int code = 0; code < (1 << kDtypeTagBits); ++code) {
      int flag = 0;
      MPI_Status status;
      if (code == mine ||
          MPI_Iprobe(transfer_.peer, (transfer_.tag << kDtypeTagBits) | code, *transfer_.comm,
                     &flag, &status) != MPI_SUCCESS ||
          !flag) {
        continue;
      }
      return failure("rank " + std::to_string(status.MPI_SOURCE) + " sends " +
                     torch_dtype_name(code) +
                     " with this tag: the ranks' tensors differ in dtype (the message stays "
                     "for a receive of its dtype)");
    }
    return nullptr;
  }

  // Tests the request, or with `block` waits for it until the timeout (`timeout`, or the
  // group's when 0).
  void poll(bool block, std::chrono::milliseconds timeout) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(request_mutex_);
      if (request_ == MPI_REQUEST_NULL) return;
      MPI_Status status;
      int done = 0;
      const auto started = std::chrono::steady_clock::now();
      const auto limit = timeout.count() > 0
                             ? std::chrono::duration<double>(timeout)
                             : std::chrono::duration<double>(transfer_.timeout_seconds);
      int rc = MPI_SUCCESS;
      for (long polls = 0;; ++polls) {
        rc = MPI_Test(&request_, &done, &status);
        if (rc != MPI_SUCCESS || done || !block) break;
        if (polls < 1000) continue;  // as MPI_Wait would spin, then share the core
        sched_yield();
        if (polls % 1024 != 0) continue;
        const auto waited = std::chrono::steady_clock::now() - started;
        if (!transfer_.sending && waited > std::chrono::milliseconds(500) &&
            (error = other_dtype_pending())) {
          break;
        }
        if (limit.count() > 0 && waited > limit) {
          error = failure(
              "not completed after " +
              std::to_string(static_cast<long>(std::chrono::duration<double>(waited).count())) +
              " s (" +
              (timeout.count() > 0 ? std::string("the wait's timeout") : *transfer_.timeout_text) +
              "): " +
              (transfer_.sending ? "the peer never received it"
                                 : "no message of this tag and dtype came"));
          break;
        }
      }
      if (error) {
        // A receive is cancelled (it may have completed meanwhile); a send cannot be: it and its
        // buffers stay with MPI.
        if (!transfer_.sending && MPI_Cancel(&request_) == MPI_SUCCESS) {
          rc = MPI_Wait(&request_, &status);
          int cancelled = 0;
          if (rc == MPI_SUCCESS) MPI_Test_cancelled(&status, &cancelled);
          if (!cancelled) error = nullptr;  // it completed after all: deliver it (or its error)
        }
        if (error) {
          if (request_ != MPI_REQUEST_NULL) abandon(request_, tensor_, staged_);
          request_ = MPI_REQUEST_NULL;
        }
      }
      if (!error && rc != MPI_SUCCESS) {
        char text[MPI_MAX_ERROR_STRING] = "";
        int length = 0;
        MPI_Error_string(rc, text, &length);
        int error_class = 0;
        MPI_Error_class(rc, &error_class);
        error = failure(error_class == MPI_ERR_TRUNCATE
                            ? "rank " + std::to_string(status.MPI_SOURCE) +
                                  " sent more bytes than the tensor holds: the ranks' tensors "
                                  "differ in size"
                            : std::string(text));
        request_ = MPI_REQUEST_NULL;
      } else if (!error && (block || done)) {
        source_ = status.MPI_SOURCE;
        int received = 0;
        if (!transfer_.sending && MPI_Get_count(&status, MPI_BYTE, &received) == MPI_SUCCESS &&
            static_cast<std::size_t>(received) != bytes_of(tensor_)) {
          error =
              failure("rank " + std::to_string(status.MPI_SOURCE) + " sent " +
                      std::to_string(received) + " bytes, the tensor holds " +
                      std::to_string(bytes_of(tensor_)) + ": the ranks' tensors differ in size");
        }
      } else if (!error) {
        return;
      }
    }
    if (!error && staged_.defined() && retrieveOpType() != c10d::OpType::SEND) {
      try {
        at::NoGradGuard no_grad;  // the tensor may be a leaf that requires grad
        tensor_.copy_(staged_);
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) {
      future_->setError(error);
      finish(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{tensor_}));
      finish();
    }
  }

  at::Tensor tensor_;
  at::Tensor staged_;
  const Transfer transfer_;
  std::mutex request_mutex_;
  MPI_Request request_;
  int source_ = -1;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

// --- CUDA tensors ------------------------------------------------------------------------------

// A call's place on the group's stream of one CUDA device (torch's NCCL backend orders its work
// the same way):
// - at the call, an event on the caller's current stream, which the group's stream waits for
//   before the call's work: the collective reads what the caller's kernels wrote;
// - every tensor of the call is recorded on the group's stream with torch's caching allocator,
//   so memory the caller frees early is not handed out again while the call still uses it;
// - the body runs on the engine with the group's stream current: NCCL's work and torch's own
//   copies and conversions in it are enqueued there, and the host does not wait for them;
// - collectives gradcomm runs on the host (broadcast, the gathers and scatters, all-to-all) see
//   a pinned host copy of each CUDA tensor: filled from the device before the body (the engine
//   waits for that copy), copied back asynchronously after it.
// Whether this torch's c10::Stream gives its native handle (torch 2.11 and later): gradcomm's
// NCCL path needs the cudaStream_t to enqueue on.
template <class S>
constexpr bool kHasNativeHandle = requires(const S& s) {
  s.native_handle();
};

// A CUDA call's event recorded after its work on the group's stream, and what to do once the GPU
// has run it.
struct GpuDone {
  std::shared_ptr<c10::Event> event;
  std::function<void()> then;
};

#if GRADCOMM_TORCH_CUDA
// Ends the job over a CUDA call that stalled or failed on the GPU: nobody waits on the call to
// throw to (its caller may have gone on), so the job ends, saying why.
[[noreturn]] void abort_job(const std::string& call, int rank, const std::string& why) {
  gradcomm::abort_job(
      error_message("torch.distributed " + call + " (gradcomm)", rank, why + ": aborting the job"));
}

// Watches a group's CUDA calls from their enqueue until the GPU has run them, on a thread of its
// own, so that the engine goes on to the group's next call at once (torch's NCCL backend enqueues
// without waiting either). Past the group's timeout it aborts the job naming the call, as
// gradcomm's watchdog aborts a stalled call and torch's NCCL watchdog a stalled kernel: the call's
// work may have completed for its caller long before, so there is nobody to throw to. It polls
// every millisecond while calls are in flight (timeouts count in seconds, and a poll takes the CUDA
// driver's lock that the application's launches want too), and is never woken for a new call.
class GpuWatch {
 public:
  explicit GpuWatch(int rank) : rank_(rank), thread_([this] { loop(); }) {}
  // Waits until the GPU has run every call watched (each within its timeout).
  ~GpuWatch() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  GpuWatch(const GpuWatch&) = delete;
  GpuWatch& operator=(const GpuWatch&) = delete;

  // The call whose work `done` was recorded after on its stream (of `device`);
  // `timeout_seconds` 0: no limit; `timeout_text` names it in the message.
  void watch(GpuDone done, c10::Device device, const std::string& call, int timeout_seconds,
             const std::string& timeout_text) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({std::move(done), call, device, std::chrono::steady_clock::now(),
                        timeout_seconds, timeout_text});
  }

 private:
  struct Entry {
    GpuDone done;
    std::string call;
    c10::Device device;
    std::chrono::steady_clock::time_point enqueued;
    int timeout_seconds;
    std::string timeout_text;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (entries_.empty()) {
        if (stopping_) return;                                 // the GPU has run everything watched
        wake_.wait_for(lock, std::chrono::milliseconds(100));  // woken early only to stop
        continue;
      }
      // In enqueue order: a group's calls on one device run in that order on its stream.
      Entry* front = &entries_.front();  // a deque's push_back leaves references to it valid
      lock.unlock();
      bool done = false;
      try {
        c10::DeviceGuard guard(front->device);
        done = front->done.event->query();
      } catch (const std::exception& e) {  // a CUDA error (a device assert, a fault)
        abort_job(front->call, rank_, std::string("CUDA failed while its work ran: ") + e.what());
      }
      if (!done && front->timeout_seconds > 0 &&
          std::chrono::steady_clock::now() - front->enqueued >
              std::chrono::seconds(front->timeout_seconds)) {
        abort_job(front->call, rank_,
                  "its work on " + front->device.str() + " did not finish within " +
                      front->timeout_text +
                      " of its enqueue (a peer may have stopped inside NCCL, or the GPU hangs)");
      }
      if (done && front->done.then) front->done.then();
      lock.lock();
      if (done) {
        // The work may still hold the event; where it does not, it goes with the device current.
        c10::DeviceGuard guard(front->device);
        entries_.pop_front();
      } else {
        wake_.wait_for(lock, std::chrono::milliseconds(1));
      }
    }
  }

  const int rank_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Entry> entries_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};
#endif

class DeviceCall {
 public:
#if GRADCOMM_TORCH_CUDA
  // `call` and `rank` name the call in a timeout's message; `timeout_seconds` is the group's
  // timeout (0: no limit), `timeout_text` names it ("GRADCOMM_TIMEOUT=300 s").
  DeviceCall(c10::Device device, c10::Stream stream, std::string call, int rank,
             int timeout_seconds, std::string timeout_text, GpuWatch* watch)
      : device_(device),
        stream_(stream),
        ready_(device.type()),
        call_(std::move(call)),
        rank_(rank),
        timeout_seconds_(timeout_seconds),
        timeout_text_(std::move(timeout_text)),
        watch_(watch) {}

  c10::Device device() const {
    return device_;
  }

  // The tensor the body reads and writes for `t`: `t` itself on the NCCL path, a pinned host
  // copy of it when `staged`. Before submit.
  at::Tensor place(const at::Tensor& t, bool read, bool written) {
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    staged_.push_back({t, host, read, written});
    return host;
  }

  // At the call, on the caller's thread.
  void enter(const std::vector<at::Tensor>& tensors) {
    c10::impl::VirtualGuardImpl impl(device_.type());
    ready_.record(impl.getStream(device_));
    for (const at::Tensor& t : tensors) {
      if (t.defined() && t.is_cuda()) impl.recordDataPtrOnStream(t.storage().data_ptr(), stream_);
    }
  }

  // On the engine (or the caller's thread for a call torch waits for at once): `body` and then
  // `then` (which completes the work and gives its event) with the group's stream current. The
  // group's GpuWatch then watches the call until the GPU has run it, so that a peer that stops
  // inside NCCL, or a hung GPU, ends the job within the group's timeout instead of leaving the
  // caller's stream waiting forever; neither the caller nor the engine waits for the GPU.
  void run(const std::function<void()>& body, const std::function<GpuDone()>& then) {
    c10::DeviceGuard device_guard(device_);
    ready_.block(stream_);
    c10::StreamGuard stream_guard(stream_);
    bool copied = false;
    for (Staged& s : staged_) {
      if (s.read) {
        s.host.copy_(s.device, /*non_blocking=*/true);
        copied = true;
      }
    }
    if (copied) wait_for_stream("copying its CUDA tensors to the host");
    body();
    for (Staged& s : staged_) {
      if (s.written) s.device.copy_(s.host, /*non_blocking=*/true);
    }
    // Released before the waiter wakes (see submit). The pinned copies may go while the copies
    // back are in flight: torch's host allocator keeps such memory until its copy is done.
    staged_.clear();
    if (GpuDone done = then(); done.event)
      watch_->watch(std::move(done), device_, call_, timeout_seconds_, timeout_text_);
  }

  // The cudaStream_t of the group's stream (nullptr where this torch cannot give it).
  void* native_stream() const {
    if constexpr (kHasNativeHandle<c10::Stream>) {
      return stream_.native_handle();
    } else {
      return nullptr;
    }
  }

 private:
  // Polls (never an unbounded synchronize) until the group's stream has passed what is enqueued
  // on it now (the copies to the host, before the body reads them). Past the group's timeout the
  // job is aborted, as GpuWatch aborts.
  void wait_for_stream(const char* what) {
    c10::Event done(device_.type());
    done.record(stream_);
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !done.query(); ++polls) {
      if (timeout_seconds_ > 0 &&
          std::chrono::steady_clock::now() - start > std::chrono::seconds(timeout_seconds_)) {
        abort_job(call_, rank_,
                  std::string(what) + " did not finish within " + timeout_text_ + " on " +
                      device_.str() + " (a peer may have stopped inside NCCL, or the GPU hangs)");
      }
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  struct Staged {
    at::Tensor device, host;
    bool read, written;
  };
  c10::Device device_;
  c10::Stream stream_;
  c10::Event ready_;
  std::string call_;
  int rank_;
  int timeout_seconds_;
  std::string timeout_text_;
  GpuWatch* watch_;
  std::vector<Staged> staged_;
#else
  c10::Device device() const {
    return c10::Device(c10::kCPU);
  }
  at::Tensor place(const at::Tensor& t, bool, bool) {
    return t;
  }
  void run(const std::function<void()>& body, const std::function<GpuDone()>& then) {
    body();
    then();
  }
  void* native_stream() const {
    return nullptr;
  }
#endif
};

namespace {

// The tensor a body uses for `t` of a call placed by `device` (see DeviceCall::place).
at::Tensor on_host(const std::shared_ptr<DeviceCall>& device, const at::Tensor& t, bool read,
                   bool written) {
  return device ? device->place(t, read, written) : t;
}

std::vector<at::Tensor> on_host(const std::shared_ptr<DeviceCall>& device,
                                const std::vector<at::Tensor>& ts, bool read, bool written) {
  std::vector<at::Tensor> placed;
  placed.reserve(ts.size());
  for (const at::Tensor& t : ts)
    placed.push_back(on_host(device, t, read, written));
  return placed;
}

// `list` and `more`, for device_call.
std::vector<at::Tensor> joined(std::vector<at::Tensor> list, const std::vector<at::Tensor>& more) {
  list.insert(list.end(), more.begin(), more.end());
  return list;
}

// gradcomm's all-reduce options for a call placed by `device`: enqueued on the group's stream,
// returning once enqueued (the call's check across ranks is done by then).
// A CUDA tensor's bytes as the words NCCL moves in an all-gather, which copies bits, so any dtype
// of the same width serves: the widest of int64, int32 and float16 that divides them; none for an
// odd number of bytes (staged through the host instead).
std::optional<std::pair<DataType, std::size_t>> nccl_words(const at::Tensor& t) {
  const std::size_t bytes = bytes_of(t);
  if (bytes % 8 == 0) return std::make_pair(DataType::int64, bytes / 8);
  if (bytes % 4 == 0) return std::make_pair(DataType::int32, bytes / 4);
  if (bytes % 2 == 0) return std::make_pair(DataType::float16, bytes / 2);
  return std::nullopt;
}

// The data a reduce-scatter by plan `r` hands NCCL for `t`: the tensor itself, or the real view
// of a complex one; none where the plan converts the dtype (reduced through an all-reduce then).
std::optional<at::Tensor> nccl_elements(const Reduction& r, const at::Tensor& t) {
  if (r.via == Reduction::Via::native) return t;
  if (r.via == Reduction::Via::complex_parts) return at::view_as_real(t);
  return std::nullopt;
}

AllreduceOptions reduce_options(const std::shared_ptr<DeviceCall>& device) {
  AllreduceOptions options;
  if (device) {
    options.stream = device->native_stream();
    options.asynchronous = true;
  }
  return options;
}

}  // namespace

GradcommWork::GradcommWork(c10d::OpType type, const char* profiling_title,
                           std::vector<at::Tensor> outputs, std::optional<c10::Device> device)
    : c10d::Work(-1, type, profiling_title, c10::optional<std::vector<at::Tensor>>(outputs)),
      outputs_(std::move(outputs)),
      device_(device),
      future_(make_future(device))
#if GRADCOMM_TORCH_FUTURE_RESULT
      ,
      result_future_(c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get()))
#endif
{
}

void GradcommWork::gpu_done() {
#if GRADCOMM_TORCH_FUTURE_RESULT
  result_future_->markCompleted(c10::IValue(static_cast<int64_t>(c10d::WorkResult::SUCCESS)));
#endif
}

std::function<void()> GradcommWork::gpu_done_callback() {
#if GRADCOMM_TORCH_FUTURE_RESULT
  // The result's future only: the work (its tensors) must not be released on the watch thread.
  return [result = result_future_] {
    result->markCompleted(c10::IValue(static_cast<int64_t>(c10d::WorkResult::SUCCESS)));
  };
#else
  return {};
#endif
}

#if GRADCOMM_TORCH_FUTURE_RESULT
c10::intrusive_ptr<c10::ivalue::Future> GradcommWork::getFutureResult() {
  return result_future_;
}
#endif

void GradcommWork::complete() {
#if GRADCOMM_TORCH_CUDA
  if (device_) {
    // Called with the group's stream current (DeviceCall::run).
    c10::impl::VirtualGuardImpl impl(device_->type());
    done_event_ = std::make_shared<c10::Event>(device_->type());
    done_event_->record(impl.getStream(*device_));
    enqueued_.store(true, std::memory_order_release);
  }
#endif
  future_->markCompleted(c10::IValue(outputs_));
  finish();
  if (!device_) gpu_done();  // (a CUDA call's is marked once the GPU has run it)
}

void GradcommWork::fail(std::exception_ptr error) {
  future_->setError(error);
  finish(error);
#if GRADCOMM_TORCH_FUTURE_RESULT
  auto result = c10d::WorkResult::COMM_ERROR;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    // Every timeout's message says so (the NCCL path's and the GPU watch's).
    if (std::strstr(e.what(), " did not finish within ") != nullptr) {
      result = c10d::WorkResult::TIMEOUT;
    }
  } catch (...) {
  }
  result_future_->markCompleted(c10::IValue(static_cast<int64_t>(result)));
#endif
}

bool GradcommWork::wait(std::chrono::milliseconds timeout) {
  waiters_.fetch_add(1, std::memory_order_relaxed);
  struct Leave {
    std::atomic<int>& waiters;
    ~Leave() { waiters.fetch_sub(1, std::memory_order_relaxed); }
  } leave{waiters_};
  if (timeout == std::chrono::milliseconds(0)) {  // kNoTimeout (global in torch 1.13)
    // (An engine outlives the requests it has queued: its destructor runs them first.)
    if (auto request = request_.lock(); request && !request->done.load(std::memory_order_acquire))
      request->runner->run_here(request.get());
  }
  return c10d::Work::wait(timeout);  // which ends with synchronize()
}

bool GradcommWork::isCompleted() {
  if (!c10d::Work::isCompleted()) return false;
#if GRADCOMM_TORCH_CUDA
  // A CUDA call is complete once the GPU has run it, as on torch's NCCL backend.
  if (enqueued_.load(std::memory_order_acquire)) return done_event_->query();
#endif
  return true;
}

#if GRADCOMM_TORCH_BLOCK_CURRENT_STREAM
void GradcommWork::blockCurrentStream() {
  if (!device_) {
    c10d::Work::blockCurrentStream();
    return;
  }
  // torch's default blocks the stream until the future completes, which for a CUDA call is once
  // it is enqueued, not once the GPU has run it: wait for the enqueue, then order the stream
  // after the call's event (wait() ends with synchronize()).
  c10d::Work::wait();
}
#endif

void GradcommWork::synchronize() {
#if GRADCOMM_TORCH_CUDA
  // The caller's stream waits for the call's work on the group's stream; the host does not.
  // Not c10d::Work::isCompleted(): c10d::Work::wait calls this holding the mutex that one takes
  // (every CUDA call's wait() deadlocked on it).
  if (enqueued_.load(std::memory_order_acquire)) {
    done_event_->block(c10::impl::VirtualGuardImpl(device_->type()).getStream(*device_));
  }
#endif
}

std::vector<at::Tensor> GradcommWork::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> GradcommWork::getFuture() {
  return future_;
}

// --- The group ---------------------------------------------------------------------------------

ProcessGroupGradcomm::ProcessGroupGradcomm(MPI_Comm comm, int rank, int size, Config config)
    : BackendBase(rank, size),
      comm_(std::make_unique<Communicator>(comm, std::move(config))),
      timeout_text_(std::make_shared<const std::string>(comm_->config().timeout_text())) {
  if (comm_->rank() != rank || comm_->size() != size) {
    throw InvalidArgument(
        error_message("torch.distributed (gradcomm)", comm_->rank(),
                      "torch gave rank " + std::to_string(rank) + " of " + std::to_string(size) +
                          ", the MPI communicator has rank " + std::to_string(comm_->rank()) +
                          " of " + std::to_string(comm_->size())));
  }
  MPI_Comm p2p = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm_->mpi_comm(), &p2p), "torch.distributed (gradcomm): MPI_Comm_dup",
            rank);
  p2p_ = std::shared_ptr<const MPI_Comm>(new MPI_Comm(p2p), [](const MPI_Comm* c) {
    MPI_Comm freed = *c;
    if (mpi_ready()) MPI_Comm_free(&freed);
    delete c;
  });
  // Started here, not at the first call: calls may come from several threads at once (autograd's
  // and the application's), and the engine is made on first use without a lock.
  comm_->engine();
  collectives::set_element_namer(&torch_dtype_name);  // "torch.int8" in the reports
}

ProcessGroupGradcomm::~ProcessGroupGradcomm() {
  const GilReleasedIfHeld unlocked;  // the calls in flight may need it to finish
#if GRADCOMM_TORCH_CUDA
  // The calls in flight (which hand the watch their events), then the GPU's work on them: the
  // NCCL communicators go with comm_, and must not be finalized under queued kernels.
  if (comm_) comm_->engine().drain();
  gpu_watch_.reset();
#endif
  comm_.reset();  // waits for the calls in flight
  p2p_.reset();   // freed with the last send or recv that holds it
}

bool ProcessGroupGradcomm::nccl_usable() {
  if constexpr (!kHasNativeHandle<c10::Stream>) {
    return false;
  } else {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    if (!gpu_unavailable_) gpu_unavailable_ = collectives::nccl_unavailable_reason();
    return gpu_unavailable_->empty();
  }
}

std::shared_ptr<DeviceCall> ProcessGroupGradcomm::device_call(
    const std::string& call, const std::vector<at::Tensor>& tensors, bool nccl) {
  std::optional<c10::Device> device;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (!device) {
      device = t.device();
    } else if (t.device() != *device) {
      invalid(call, rank_,
              "its tensors are on " + device->str() + " and " + t.device().str() +
                  ": every tensor of one call must be on one device");
    }
  }
  if (!device || device->is_cpu()) return nullptr;
#if GRADCOMM_TORCH_CUDA
  c10::impl::VirtualGuardImpl impl(device->type());
  std::shared_ptr<DeviceCall> placed;
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    if (nccl && !kHasNativeHandle<c10::Stream>) {
      unsupported(call, rank_,
                  "CUDA tensors are reduced through NCCL on the group's stream, whose handle "
                  "this torch (" TORCH_VERSION
                  ") does not give (c10::Stream::native_handle, "
                  "torch 2.11 and later)");
    }
    if (nccl) {
      if (!gpu_unavailable_) gpu_unavailable_ = collectives::nccl_unavailable_reason();
      if (!gpu_unavailable_->empty()) {
        unsupported(call, rank_,
                    "CUDA tensors are reduced by NCCL through gradcomm's GPU module, which cannot "
                    "run here: " +
                        *gpu_unavailable_);
      }
    }
    auto it = streams_.find(device->index());
    if (it == streams_.end()) {
      // From the high-priority pool (as NCCL's own advice for communication): the low-priority
      // one is where torch.cuda.Stream() and ProcessGroupNCCL draw theirs, and a stream shared
      // with unrelated work would make the watch in DeviceCall::run wait for that work too.
      it = streams_.emplace(device->index(), impl.getStreamFromGlobalPool(*device, true)).first;
    }
    if (!gpu_watch_) gpu_watch_ = std::make_unique<GpuWatch>(rank_);
    placed = std::make_shared<DeviceCall>(*device, it->second, call, rank_,
                                          comm_->config().timeout_seconds,
                                          comm_->config().timeout_text(), gpu_watch_.get());
  }
  placed->enter(tensors);
  return placed;
#else
  (void)nccl;
  unsupported(call, rank_, "CUDA tensors need the gradcomm backend built for torch 2.x");
#endif
}

ProcessGroupGradcomm::InStep::InStep(ProcessGroupGradcomm& group, collectives::CallKind kind)
    : group_(group), kind_(kind), exceptions_(std::uncaught_exceptions()), outer_(t_submitted) {
  t_submitted = false;
}

ProcessGroupGradcomm::InStep::~InStep() {
  const bool submitted = t_submitted;
  t_submitted = outer_ || submitted;
  if (submitted || std::uncaught_exceptions() <= exceptions_) return;
  // The call failed here before it was submitted: its place goes to a marker, behind the
  // group's earlier calls. Its own outcome (a MismatchError where other ranks made the call)
  // has nobody to go to: the caller gets this rank's error.
  try {
    Communicator& comm = *group_.comm_;
    const collectives::CallKind kind = kind_;
    group_.submit(c10d::OpType::UNKNOWN, "gradcomm:failed", {}, [&comm, kind] {
      try {
        collectives::compare_failed_call(comm, kind,
                                         "torch.distributed (gradcomm), a call refused here");
      } catch (const MismatchError&) {
      }
    });
  } catch (...) {  // (nothing more can be done from an unwinding destructor)
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::submit(c10d::OpType type, const char* title,
                                                            std::vector<at::Tensor> outputs,
                                                            std::function<void()> body, bool async,
                                                            std::shared_ptr<DeviceCall> device) {
  t_submitted = true;  // (InStep)
  ++sequence_;  // collectives only: send and recv (point_to_point) do not come here, as on gloo
  auto work = c10::make_intrusive<GradcommWork>(
      type, title, std::move(outputs),
      device ? std::optional<c10::Device>(device->device()) : std::nullopt);
  // A call made inside a request (on the engine's thread, or on a waiting thread that runs it:
  // ProgressEngine::in_request) comes from a future's callback (a comm hook's then(), which runs
  // where the work completes): queued, it would wait behind the callback that waits
  // for it (PowerSGD's hook waits on the all-reduce it issues). It runs here and now instead;
  // every rank's engine reaches that callback at the same point of the same sequence of calls,
  // so the ranks still agree on the order. Not where a rank attaches the callback after its
  // work completed (torch runs it at once, on the caller's thread, and its call queues) and
  // another rank before, with a call submitted in between: then the two ranks order that call
  // and the callback's differently (a mismatch where their shapes differ; docs/design.md).
  if (!async || comm_->engine().in_request()) {
    // After the group's earlier calls, and with none starting meanwhile: autograd's threads may
    // submit while this runs.
    comm_->engine().run_exclusive([&] {
      bool completed = false;
      try {
        at::NoGradGuard no_grad;  // the copies in and out of the tensors are no graph's ops
        auto complete = [&] {
          completed = true;  // a callback that throws from here must not fail a completed work
          work->complete();
          return GpuDone{work->done_event(), work->gpu_done_callback()};
        };
        if (device) {
          device->run(body, complete);  // the caller's host does not wait for the GPU
        } else {
          body();
          complete();
        }
      } catch (...) {
        // wait() rethrows it, as for a call on the engine
        if (!completed) work->fail(std::current_exception());
      }
    });
    return work;
  }
  auto state = std::make_shared<detail::RequestState>();
  state->call = title;
  state->work = [work, body = std::move(body), device = std::move(device)]() mutable {
    ForegroundWhileWaited foreground(work->waiters());
    std::exception_ptr error;
    bool completed = false;
    try {
      at::NoGradGuard no_grad;  // the copies in and out of the tensors are no graph's ops
      if (device) {
        // The future's callbacks (DDP's, a comm hook's) run here, with the group's stream
        // current, as they would on torch's NCCL backend.
        device->run(body, [&] {
          body = nullptr;
          completed = true;  // a callback that throws from here must not fail the work
          work->complete();
          return GpuDone{work->done_event(), work->gpu_done_callback()};
        });
      } else {
        body();
      }
    } catch (...) {
      error = std::current_exception();
    }
    // The tensors the body holds go now, before the waiter wakes: released later, a tensor whose
    // Python object it keeps alive would take the GIL on this thread, and once the program has
    // returned after its last wait, Python is finalizing and ends such a thread (an abort).
    body = nullptr;
    device = nullptr;
    if (completed) return;
    // The future's callbacks (DDP's, a comm hook's) run here, on the engine.
    if (error) {
      work->fail(error);
    } else {
      work->complete();
    }
  };
  work->set_request(state);
  comm_->engine().submit(std::move(state));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const std::string call = "broadcast";
  const InStep in_step(*this, collectives::CallKind::broadcast);
  check_one(call, rank_, tensors);
  check_root(call, rank_, size_, opts.rootRank);
  if (opts.rootTensor != 0) invalid(call, rank_, "rootTensor must be 0 (one tensor per process)");
  const int root = static_cast<int>(opts.rootRank);
  auto device = device_call(call, tensors);
  at::Tensor t = on_host(device, tensors[0], rank_ == root, rank_ != root);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::BROADCAST, "gradcomm:broadcast", tensors,
      [&comm, t, root] {
        const auto note = annotation_of(t);
        broadcast_bytes(comm, t.data_ptr(), bytes_of(t), root);
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  const std::string call = "all_reduce";
  const InStep in_step(*this, collectives::CallKind::allreduce);
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    check_sparse(call, rank_, tensors[0], opts.reduceOp);
    plan_reduction(call, rank_, tensors[0].scalar_type(), opts.reduceOp);
    Communicator& comm = *comm_;
    const at::Tensor t = tensors[0];
    const bool average = opts.reduceOp == c10d::ReduceOp::AVG;
    return submit(
        c10d::OpType::ALLREDUCE, "gradcomm:all_reduce", tensors,
        [&comm, t, average] { reduce_sparse_into(comm, t, average); }, async_op(opts));
  }
  check_one(call, rank_, tensors);
  at::Tensor t = tensors[0];
  const Reduction r = plan_reduction(call, rank_, t.scalar_type(), opts.reduceOp);
  auto device = device_call(call, tensors, /*nccl=*/true);
  const AllreduceOptions options = reduce_options(device);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::ALLREDUCE, "gradcomm:all_reduce", tensors,
      [&comm, t, r, options] { reduce_into(comm, r, t, t, options); }, async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const std::string call = "all_reduce_coalesced";
  const InStep in_step(*this, collectives::CallKind::allreduce);
  if (tensors.empty()) invalid(call, rank_, "the tensor list is empty");
  std::vector<Reduction> plans;
  bool all_native = true;
  for (const at::Tensor& t : tensors) {
    check_tensor(call, rank_, t);
    plans.push_back(plan_reduction(call, rank_, t.scalar_type(), opts.reduceOp));
    all_native = all_native && plans.back().via == Reduction::Via::native;
  }
  auto device = device_call(call, tensors, /*nccl=*/true);
  const AllreduceOptions options = reduce_options(device);
  Communicator& comm = *comm_;
  std::vector<at::Tensor> list = tensors;
  if (all_native && !device) {
    // One fused call: gradcomm's buckets, checked as one call.
    const ReduceOp op = plans[0].op;
    return submit(
        c10d::OpType::ALLREDUCE_COALESCED, "gradcomm:all_reduce_coalesced", tensors,
        [&comm, list, plans, op] {
          std::vector<packing::TensorDesc> descs;
          for (std::size_t i = 0; i < list.size(); ++i) {
            descs.push_back(
                {list[i].data_ptr(), static_cast<std::size_t>(list[i].numel()), plans[i].dtype});
          }
          grouped_allreduce(comm, descs, op);
        },
        async_op(opts));
  }
  // Each call carries the list's mark: a rank whose list is longer or shorter fails on its
  // first call, not later, when its extra call meets another rank's next of the same shape.
  const CallMark mark{-1, collectives::CallKind::allreduce, list_mark(tensors)};
  return submit(
      c10d::OpType::ALLREDUCE_COALESCED, "gradcomm:all_reduce_coalesced", tensors,
      [&comm, list, plans, options, mark] {
        // One call per tensor: CUDA tensors (each one NCCL call on the group's stream), and
        // lists gradcomm's fused host path cannot take in one dtype.
        for (std::size_t i = 0; i < list.size(); ++i)
          reduce_into(comm, plans[i], list[i], list[i], options, mark);
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const std::string call = "reduce";
  const InStep in_step(*this, collectives::CallKind::reduce);
  check_one(call, rank_, tensors);
  check_root(call, rank_, size_, opts.rootRank);
  at::Tensor t = tensors[0];
  const Reduction r = plan_reduction(call, rank_, t.scalar_type(), opts.reduceOp);
  const bool root = opts.rootRank == rank_;
  const int root_rank = static_cast<int>(opts.rootRank);
  auto device = device_call(call, tensors, /*nccl=*/true);
  const AllreduceOptions options = reduce_options(device);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::REDUCE, "gradcomm:reduce", tensors,
      [&comm, t, root, root_rank, r, options] {
        // Every rank reduces; only the root's tensor receives the result. Scratch is made here,
        // on the stream that uses it.
        reduce_into(comm, r, t, root ? t : at::empty_like(t), options, CallMark{root_rank});
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const std::string call = "all_gather";
  const InStep in_step(*this, collectives::CallKind::allgather);
  check_one(call, rank_, inputs);
  if (outputs.size() != 1 || outputs[0].size() != static_cast<std::size_t>(size_)) {
    invalid(call, rank_,
            "the output list must hold one tensor per rank (" + std::to_string(size_) + "), got " +
                std::to_string(outputs.size() == 1 ? outputs[0].size() : outputs.size()));
  }
  for (const at::Tensor& o : outputs[0])
    check_like(call, rank_, o, inputs[0], "output tensor");
  Communicator& comm = *comm_;
  const auto words = nccl_words(inputs[0]);
  const bool on_nccl = inputs[0].is_cuda() && words && nccl_usable();
  auto device = device_call(call, joined(outputs[0], inputs), on_nccl);
  if (device && on_nccl) {  // ncclAllGather into one buffer on the group's stream, copied out
    const AllreduceOptions options = reduce_options(device);
    const at::Tensor in = inputs[0];
    const std::vector<at::Tensor> outs = outputs[0];
    const int64_t n = size_;
    return submit(
        c10d::OpType::ALLGATHER, "gradcomm:all_gather", outputs[0],
        [&comm, in, outs, n, w = *words, options] {
          at::Tensor flat = at::empty({n * in.numel()}, in.options());
          const auto note = annotation_of(in);
          collectives::nccl_allgather(comm, in.data_ptr(), flat.data_ptr(), w.second, w.first,
                                      options.stream, true);
          for (int64_t r = 0; r < n; ++r)
            outs[r].view({-1}).copy_(flat.narrow(0, r * in.numel(), in.numel()));
        },
        async_op(opts), device);
  }
  const at::Tensor in = on_host(device, inputs[0], true, false);
  const std::vector<at::Tensor> outs = on_host(device, outputs[0], false, true);
  at::Tensor flat = at::empty({static_cast<int64_t>(size_) * in.numel()}, in.options());
  return submit(
      c10d::OpType::ALLGATHER, "gradcomm:all_gather", outputs[0],
      [&comm, in, flat, outs] {
        {
          const auto note = annotation_of(in);
          allgather_bytes(comm, in.data_ptr(), flat.data_ptr(), bytes_of(in));
        }
        for (std::size_t r = 0; r < outs.size(); ++r)
          outs[r].view({-1}).copy_(
              flat.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()));
      },
      async_op(opts), device);
}

std::function<void()> ProcessGroupGradcomm::in_list(const ListCall& list,
                                                    std::function<void()> body) {
  if (!list.failure) return body;
  return [failure = list.failure, body = std::move(body)] {
    {
      const std::lock_guard<std::mutex> lock(failure->mutex);
      if (failure->error) std::rethrow_exception(failure->error);
    }
    try {
      body();
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure->mutex);
      failure->error = std::current_exception();
      throw;
    }
  };
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return allgather_into(output, input, opts, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allgather_into(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts,
    const ListCall& list) {
  const std::string call = "all_gather_into_tensor";
  const InStep in_step(*this, collectives::CallKind::allgather);
  const CallMark mark{-1, collectives::CallKind::allreduce, list.mark};
  check_tensor(call, rank_, input, "input");
  check_tensor(call, rank_, output, "output");
  if (output.scalar_type() != input.scalar_type() ||
      output.numel() != static_cast<int64_t>(size_) * input.numel()) {
    invalid(call, rank_,
            "the output is " + describe(output) + ", the input " + describe(input) +
                ": the output must hold group size (" + std::to_string(size_) +
                ") times the input's elements, of its dtype");
  }
  Communicator& comm = *comm_;
  const auto words = nccl_words(input);
  const bool on_nccl = input.is_cuda() && words && nccl_usable();
  auto device = device_call(call, {input, output}, on_nccl);
  if (device && on_nccl) {  // ncclAllGather; FSDP's in-place form (input the rank's slice) included
    const AllreduceOptions options = reduce_options(device);
    at::Tensor in = input, out = output;
    return submit(c10d::OpType::_ALLGATHER_BASE, "gradcomm:all_gather_into_tensor", {output},
                  in_list(list,
                          [&comm, in, out, w = *words, options, mark] {
                            const auto note = annotation_of(in, mark);
                            collectives::nccl_allgather(comm, in.data_ptr(), out.data_ptr(),
                                                        w.second, w.first, options.stream, true);
                          }),
                  async_op(opts), device);
  }
  at::Tensor in = on_host(device, input, true, false), out = on_host(device, output, false, true);
  return submit(c10d::OpType::_ALLGATHER_BASE, "gradcomm:all_gather_into_tensor", {output},
                in_list(list,
                        [&comm, in, out, mark] {
                          const auto note = annotation_of(in, mark);
                          allgather_bytes(comm, in.data_ptr(), out.data_ptr(), bytes_of(in));
                        }),
                async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const std::string call = "all_gather_coalesced";
  const InStep in_step(*this, collectives::CallKind::allgather);
  // As torch documents it and gloo checks it: outputs[r][i] receives rank r's inputs[i].
  if (outputs.size() != static_cast<std::size_t>(size_)) {
    invalid(call, rank_,
            "the output must hold one list per rank (" + std::to_string(size_) + "), not " +
                std::to_string(outputs.size()));
  }
  std::vector<at::Tensor> flats, all_outs;
  for (const at::Tensor& in : inputs) {
    check_tensor(call, rank_, in, "input");
  }
  for (std::size_t r = 0; r < outputs.size(); ++r) {
    if (outputs[r].size() != inputs.size()) {
      invalid(call, rank_,
              "output list " + std::to_string(r) + " holds " + std::to_string(outputs[r].size()) +
                  " tensors for " + std::to_string(inputs.size()) + " inputs");
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      check_like(call, rank_, outputs[r][i], inputs[i], "output tensor");
      all_outs.push_back(outputs[r][i]);
    }
  }
  auto device = device_call(call, joined(all_outs, inputs));
  const std::vector<at::Tensor> ins = on_host(device, inputs, true, false);
  std::vector<std::vector<at::Tensor>> outs;
  for (std::size_t r = 0; r < outputs.size(); ++r) {
    outs.push_back(on_host(device, outputs[r], false, true));
  }
  for (const at::Tensor& in : ins) {
    flats.push_back(at::empty({static_cast<int64_t>(size_) * in.numel()}, in.options()));
  }
  Communicator& comm = *comm_;
  const CallMark mark{-1, collectives::CallKind::allreduce, list_mark(inputs)};
  return submit(
      c10d::OpType::ALLGATHER_COALESCED, "gradcomm:all_gather_coalesced", all_outs,
      [&comm, ins, flats, outs, mark] {
        // An empty list is a call still (a barrier): a rank whose call was refused stands in
        // for it in the call check (InStep), and this rank must meet that there.
        if (ins.empty()) return gradcomm::barrier(comm);
        for (std::size_t i = 0; i < ins.size(); ++i) {
          {
            const auto note = annotation_of(ins[i], mark);
            allgather_bytes(comm, ins[i].data_ptr(), flats[i].data_ptr(), bytes_of(ins[i]));
          }
          for (std::size_t r = 0; r < outs.size(); ++r) {
            outs[r][i].view({-1}).copy_(
                flats[i].narrow(0, static_cast<int64_t>(r) * ins[i].numel(), ins[i].numel()));
          }
        }
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const std::string call = "gather";
  const InStep in_step(*this, collectives::CallKind::gather);
  check_one(call, rank_, inputs);
  check_root(call, rank_, size_, opts.rootRank);
  const bool root = opts.rootRank == rank_;
  const std::vector<at::Tensor> outputs_here =
      root_list(call, rank_, size_, outputs, inputs[0], opts.rootRank, "output");
  auto device = device_call(call, joined(outputs_here, inputs));
  const at::Tensor in = on_host(device, inputs[0], true, false);
  const std::vector<at::Tensor> outs = on_host(device, outputs_here, false, true);
  at::Tensor flat =
      root ? at::empty({static_cast<int64_t>(size_) * in.numel()}, in.options()) : at::Tensor();
  const int root_rank = static_cast<int>(opts.rootRank);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::GATHER, "gradcomm:gather", outputs_here,
      [&comm, in, flat, outs, root_rank] {
        {
          const auto note = annotation_of(in);
          gather_bytes(comm, in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr,
                       bytes_of(in), root_rank);
        }
        for (std::size_t r = 0; r < outs.size(); ++r) {
          outs[r].view({-1}).copy_(
              flat.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()));
        }
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const std::string call = "scatter";
  const InStep in_step(*this, collectives::CallKind::scatter);
  check_one(call, rank_, outputs);
  check_root(call, rank_, size_, opts.rootRank);
  const bool root = opts.rootRank == rank_;
  const std::vector<at::Tensor> inputs_here =
      root_list(call, rank_, size_, inputs, outputs[0], opts.rootRank, "input");
  auto device = device_call(call, joined(inputs_here, outputs));
  const at::Tensor out = on_host(device, outputs[0], false, true);
  const std::vector<at::Tensor> ins = on_host(device, inputs_here, true, false);
  at::Tensor flat =
      root ? at::empty({static_cast<int64_t>(size_) * out.numel()}, out.options()) : at::Tensor();
  const int root_rank = static_cast<int>(opts.rootRank);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::SCATTER, "gradcomm:scatter", outputs,
      [&comm, out, flat, ins, root_rank] {
        for (std::size_t r = 0; r < ins.size(); ++r) {
          flat.narrow(0, static_cast<int64_t>(r) * out.numel(), out.numel())
              .copy_(ins[r].view({-1}));
        }
        const auto note = annotation_of(out);
        scatter_bytes(comm, flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(),
                      bytes_of(out), root_rank);
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const std::string call = "reduce_scatter";
  const InStep in_step(*this, collectives::CallKind::reduce_scatter);
  check_one(call, rank_, outputs);
  const at::Tensor out = outputs[0];
  if (inputs.size() != 1 || inputs[0].size() != static_cast<std::size_t>(size_)) {
    invalid(call, rank_,
            "the input list must hold one tensor per rank (" + std::to_string(size_) + ")");
  }
  for (const at::Tensor& i : inputs[0])
    check_like(call, rank_, i, out, "input tensor");
  const Reduction r = plan_reduction(call, rank_, out.scalar_type(), opts.reduceOp);
  std::vector<at::Tensor> ins = inputs[0];
  auto device = device_call(call, joined(ins, outputs), /*nccl=*/true);
  const AllreduceOptions options = reduce_options(device);
  const int64_t me = rank_, n = size_;
  Communicator& comm = *comm_;
  if (device && nccl_elements(r, out)) {  // the inputs side by side, then ncclReduceScatter
    return submit(
        c10d::OpType::REDUCE_SCATTER, "gradcomm:reduce_scatter", outputs,
        [&comm, out, ins, r, n, options] {
          at::Tensor flat = at::empty({n * out.numel()}, out.options());
          for (int64_t k = 0; k < n; ++k)
            flat.narrow(0, k * out.numel(), out.numel()).copy_(ins[k].view({-1}));
          const at::Tensor from = *nccl_elements(r, flat), into = *nccl_elements(r, out);
          const auto note = annotation_of(out);
          collectives::nccl_reduce_scatter(comm, from.data_ptr(), into.data_ptr(),
                                           static_cast<std::size_t>(into.numel()), r.dtype, r.op,
                                           options.stream, true);
        },
        async_op(opts), device);
  }
  return submit(
      c10d::OpType::REDUCE_SCATTER, "gradcomm:reduce_scatter", outputs,
      [&comm, out, ins, r, me, n, options, device = device != nullptr] {
        at::Tensor flat = at::empty({n * out.numel()}, out.options());
        for (std::size_t k = 0; k < ins.size(); ++k) {
          flat.narrow(0, static_cast<int64_t>(k) * out.numel(), out.numel())
              .copy_(ins[k].view({-1}));
        }
        const CallMark mark{-1, collectives::CallKind::reduce_scatter};
        if (!device) return reduce_scatter_host(comm, r, flat, out, options, mark);
        // CUDA tensors whose plan converts the dtype: an all-reduce, then this rank's block.
        reduce_into(comm, r, flat, flat, options, mark);
        out.view({-1}).copy_(flat.narrow(0, me * out.numel(), out.numel()));
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return reduce_scatter_into(output, input, opts, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::reduce_scatter_into(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts,
    const ListCall& list) {
  const std::string call = "reduce_scatter_tensor";
  const InStep in_step(*this, collectives::CallKind::reduce_scatter);
  const CallMark mark{-1, collectives::CallKind::reduce_scatter, list.mark};
  check_tensor(call, rank_, input, "input");
  check_tensor(call, rank_, output, "output");
  if (output.scalar_type() != input.scalar_type() ||
      input.numel() != static_cast<int64_t>(size_) * output.numel()) {
    invalid(call, rank_,
            "the input is " + describe(input) + ", the output " + describe(output) +
                ": the input must hold group size (" + std::to_string(size_) +
                ") times the output's elements, of its dtype");
  }
  const Reduction r = plan_reduction(call, rank_, output.scalar_type(), opts.reduceOp);
  auto device = device_call(call, {input, output}, /*nccl=*/true);
  const AllreduceOptions options = reduce_options(device);
  at::Tensor in = input, out = output;
  const int64_t me = rank_;
  Communicator& comm = *comm_;
  if (device && nccl_elements(r, out)) {  // ncclReduceScatter (FSDP's gradient reduction)
    return submit(c10d::OpType::_REDUCE_SCATTER_BASE, "gradcomm:reduce_scatter_tensor", {output},
                  in_list(list,
                          [&comm, in, out, r, options, mark] {
                            const at::Tensor from = *nccl_elements(r, in),
                                             into = *nccl_elements(r, out);
                            const auto note = annotation_of(out, mark);
                            collectives::nccl_reduce_scatter(comm, from.data_ptr(), into.data_ptr(),
                                                             static_cast<std::size_t>(into.numel()),
                                                             r.dtype, r.op, options.stream, true);
                          }),
                  async_op(opts), device);
  }
  return submit(
      c10d::OpType::_REDUCE_SCATTER_BASE, "gradcomm:reduce_scatter_tensor", {output},
      in_list(list,
              [&comm, in, out, r, me, options, mark, device = device != nullptr] {
                if (!device) return reduce_scatter_host(comm, r, in, out, options, mark);
                // CUDA tensors whose plan converts the dtype: an all-reduce, then this rank's
                // block.
                at::Tensor flat = at::empty_like(in);
                reduce_into(comm, r, in, flat, options, mark);
                out.view({-1}).copy_(flat.view({-1}).narrow(0, me * out.numel(), out.numel()));
              }),
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  const std::string call = "all_to_all_single";
  const InStep in_step(*this, collectives::CallKind::alltoall);
  check_tensor(call, rank_, input, "input");
  check_tensor(call, rank_, output, "output");
  if (output.scalar_type() != input.scalar_type()) {
    invalid(call, rank_, "the output is " + describe(output) + ", the input " + describe(input));
  }
  // Splits are counts along dimension 0; empty means equal parts.
  auto bytes_per_rank = [&](const at::Tensor& t, const std::vector<int64_t>& splits,
                            const char* what) {
    const auto n = static_cast<std::size_t>(size_);
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const std::size_t row_bytes = rows == 0 ? 0 : bytes_of(t) / static_cast<std::size_t>(rows);
    std::vector<std::size_t> bytes(n);
    if (splits.empty()) {
      if (rows % size_ != 0) {
        invalid(call, rank_,
                std::string("the ") + what + "'s first dimension (" + std::to_string(rows) +
                    ") does not split evenly over " + std::to_string(size_) +
                    " ranks; pass split sizes");
      }
      for (std::size_t j = 0; j < n; ++j)
        bytes[j] = static_cast<std::size_t>(rows / size_) * row_bytes;
      return bytes;
    }
    if (splits.size() != n) {
      invalid(call, rank_,
              std::string("the ") + what + " split sizes have " + std::to_string(splits.size()) +
                  " entries for " + std::to_string(n) + " ranks");
    }
    int64_t total = 0;
    for (std::size_t j = 0; j < n; ++j) {
      if (splits[j] < 0) invalid(call, rank_, "a split size is negative");
      total += splits[j];
      bytes[j] = static_cast<std::size_t>(splits[j]) * row_bytes;
    }
    if (total != rows) {
      invalid(call, rank_,
              std::string("the ") + what + " split sizes add up to " + std::to_string(total) +
                  ", its first dimension is " + std::to_string(rows));
    }
    return bytes;
  };
  const std::vector<std::size_t> send = bytes_per_rank(input, input_split_sizes, "input");
  const std::vector<std::size_t> recv = bytes_per_rank(output, output_split_sizes, "output");
  auto device = device_call(call, {input, output});
  at::Tensor in = on_host(device, input, true, false), out = on_host(device, output, false, true);
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::ALLTOALL_BASE, "gradcomm:all_to_all_single", {output},
      [&comm, in, out, send, recv] {
        const auto note = annotation_of(in);
        alltoallv_bytes(comm, in.data_ptr(), send, out.data_ptr(), recv);
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  const std::string call = "all_to_all";
  const InStep in_step(*this, collectives::CallKind::alltoall);
  const auto n = static_cast<std::size_t>(size_);
  if (inputs.size() != n || outputs.size() != n) {
    invalid(call, rank_,
            "the input and output lists must hold one tensor per rank (" + std::to_string(n) +
                "), got " + std::to_string(inputs.size()) + " and " +
                std::to_string(outputs.size()));
  }
  std::vector<std::size_t> send(n), recv(n);
  int64_t send_elements = 0, recv_elements = 0;
  for (std::size_t j = 0; j < n; ++j) {
    check_tensor(call, rank_, inputs[j], "input tensor");
    check_tensor(call, rank_, outputs[j], "output tensor");
    if (inputs[j].scalar_type() != inputs[0].scalar_type() ||
        outputs[j].scalar_type() != inputs[0].scalar_type()) {
      invalid(call, rank_, "every input and output tensor must have one dtype");
    }
    send[j] = bytes_of(inputs[j]);
    recv[j] = bytes_of(outputs[j]);
    send_elements += inputs[j].numel();
    recv_elements += outputs[j].numel();
  }
  auto device = device_call(call, joined(inputs, outputs));
  const std::vector<at::Tensor> ins = on_host(device, inputs, true, false);
  const std::vector<at::Tensor> outs = on_host(device, outputs, false, true);
  at::Tensor send_flat = at::empty({send_elements}, ins[0].options());
  at::Tensor recv_flat = at::empty({recv_elements}, ins[0].options());
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::ALLTOALL, "gradcomm:all_to_all", outputs,
      [&comm, ins, outs, send, recv, send_flat, recv_flat] {
        int64_t at = 0;
        for (const at::Tensor& t : ins) {
          send_flat.narrow(0, at, t.numel()).copy_(t.view({-1}));
          at += t.numel();
        }
        {
          const auto note = annotation_of(send_flat);
          alltoallv_bytes(comm, send_flat.data_ptr(), send, recv_flat.data_ptr(), recv);
        }
        at = 0;
        for (const at::Tensor& t : outs) {
          t.view({-1}).copy_(recv_flat.narrow(0, at, t.numel()));
          at += t.numel();
        }
      },
      async_op(opts), device);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::barrier(const c10d::BarrierOptions& opts) {
  Communicator& comm = *comm_;
  return submit(
      c10d::OpType::BARRIER, "gradcomm:barrier", {}, [&comm] { gradcomm::barrier(comm); },
      async_op(opts));
}

#if GRADCOMM_TORCH_TENSOR_ALLOC
bool ProcessGroupGradcomm::supportsTensorAlloc(c10::DeviceIndex device) {
  // torch passes its options' device index: -1 for the host (a CUDA bucket's index is its
  // device's). allocateTensor gives a device's tensors torch's own memory anyway.
  return device < 0;
}

at::Tensor ProcessGroupGradcomm::allocateTensor(long size, at::TensorOptions options) {
  const std::string call = "allocateTensor";
  options = options.requires_grad(false);
  Communicator& comm = *comm_;
  if (size < 0) {
    if (options.device().type() == c10::DeviceType::CPU) {
      // In the allocation's place, so that the other ranks' allocation fails naming this rank
      // instead of waiting for it.
      comm.engine().run_exclusive([&] {
        try {
          collectives::compare_failed_call(comm, collectives::CallKind::allocate, call);
        } catch (const MismatchError&) {  // the other ranks' error; this rank has its own
        }
      });
    }
    invalid(call, rank_, "size " + std::to_string(size) + " is negative");
  }
  if (options.device().type() != c10::DeviceType::CPU) return at::empty({size}, options);
  const auto bytes =
      static_cast<std::size_t>(size) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  std::unique_ptr<RegisteredBuffer> buffer;
  comm.engine().run_exclusive([&] {
    // The call check first, as a call of its own kind: Communicator::allocate compares the sizes
    // with MPI, which a rank making another collective would never meet.
    std::int64_t asked = static_cast<std::int64_t>(bytes);
    {
      const collectives::CallAnnotation note(-1, -1, collectives::CallKind::allocate);
      gradcomm::allreduce(comm, &asked, &asked, 1, DataType::int64, ReduceOp::max);
    }
    // shm's own segment first (collective, made once): buckets that filled a small /dev/shm
    // before it would leave the group without shm, and themselves without the reader they are
    // for.
    collectives::shm_available(comm);
    try {
      buffer = std::make_unique<RegisteredBuffer>(comm.allocate(bytes));  // throws on other sizes
    } catch (const CommError& error) {
      // No shared segment (every rank throws alike): a /dev/shm too small for the buckets, as
      // containers' often are. DDP gets torch's memory, and shm copies the bucket in and out.
      TORCH_WARN("gradcomm: DDP's bucket of ", bytes,
                 " bytes is in torch's memory, not gradcomm's registered memory: ", error.what());
      buffer = std::make_unique<RegisteredBuffer>();
    }
  });
  if (!*buffer) return at::empty({size}, options);
  void* data = buffer->data();
  // The memory goes with the tensor's storage (released without communicating, on any thread).
  return at::from_blob(
      data, {size}, [held = std::shared_ptr<RegisteredBuffer>(std::move(buffer))](void*) {},
      options);
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::point_to_point(bool sending,
                                                                    at::Tensor& tensor, int peer,
                                                                    int tag) {
  const std::string call = sending ? "send" : "recv";
  check_tensor(call, rank_, tensor);
  if (peer != MPI_ANY_SOURCE && (peer < 0 || peer >= size_)) {
    invalid(
        call, rank_,
        "peer " + std::to_string(peer) + " is not a rank of the group of " + std::to_string(size_));
  }
  int* tag_bound = nullptr;
  int found = 0;
  MPI_Comm_get_attr(*p2p_, MPI_TAG_UB, &tag_bound, &found);
  // The MPI tag holds the dtype below torch's tag (mpi_tag): 0..2^25-1 under Open MPI, at least
  // 0..511 under any MPI (MPI_TAG_UB >= 32767).
  const int tag_limit =
      static_cast<int>(((found ? static_cast<long>(*tag_bound) : 32767L) + 1) >> kDtypeTagBits) - 1;
  if (tag < 0 || tag > tag_limit) {
    invalid(call, rank_,
            "tag " + std::to_string(tag) + " is outside 0.." + std::to_string(tag_limit));
  }
  const std::size_t bytes = bytes_of(tensor);
  if (bytes > static_cast<std::size_t>(INT_MAX)) invalid(call, rank_, "the tensor exceeds 2 GiB");
  // Posted now, not behind the group's queued collectives, as gloo and torch's MPI backend post
  // theirs: a send that waited for them deadlocked a valid program (rank 0: an async all_reduce,
  // then a send; rank 1: the receive, then its all_reduce) until the timeout. As there, a
  // tensor an async call still reads or writes is the caller's to wait() for first.
  // A CUDA tensor travels through a host copy: one sent is copied now, on the caller's current
  // stream (the host waits for that copy, so it sees what that stream wrote; as on torch's NCCL
  // backend, what an earlier collective of the group writes is seen once the caller has waited
  // for it); one received is copied to the device when the work completes, on the current
  // stream of the thread that completes it.
  at::Tensor staged;
  if (!tensor.device().is_cpu()) {
    staged = sending ? tensor.to(at::kCPU)
                     : at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  }
  void* buffer = staged.defined() ? staged.data_ptr() : tensor.data_ptr();
  MPI_Request request = MPI_REQUEST_NULL;
  const int n = static_cast<int>(bytes);
  sweep_abandoned();
  const int wire_tag = mpi_tag(tag, tensor.scalar_type());
  if (sending) {
    check_mpi(MPI_Isend(buffer, n, MPI_BYTE, peer, wire_tag, *p2p_, &request),
              "torch.distributed send (gradcomm): MPI_Isend", rank_);
  } else {
    check_mpi(MPI_Irecv(buffer, n, MPI_BYTE, peer, wire_tag, *p2p_, &request),
              "torch.distributed recv (gradcomm): MPI_Irecv", rank_);
  }
  return c10::make_intrusive<PointToPointWork>(
      sending ? c10d::OpType::SEND
              : (peer == MPI_ANY_SOURCE ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV),
      sending ? "gradcomm:send" : "gradcomm:recv", tensor, staged, request,
      PointToPointWork::Transfer{sending, peer, tag, rank_, comm_->config().timeout_seconds,
                                 timeout_text_, p2p_});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::send(std::vector<at::Tensor>& tensors,
                                                          int dst_rank, int tag) {
  check_one("send", rank_, tensors);
  return point_to_point(true, tensors[0], dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::recv(std::vector<at::Tensor>& tensors,
                                                          int src_rank, int tag) {
  check_one("recv", rank_, tensors);
  return point_to_point(false, tensors[0], src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                   int tag) {
  check_one("recv", rank_, tensors);
  return point_to_point(false, tensors[0], MPI_ANY_SOURCE, tag);
}

#if GRADCOMM_TORCH_AT_LEAST(2, 1)
c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const InStep in_step(*this, collectives::CallKind::allgather);
  if (outputs.size() != inputs.size()) {
    invalid("all_gather_into_tensor_coalesced", rank_,
            std::to_string(inputs.size()) + " inputs but " + std::to_string(outputs.size()) +
                " outputs");
  }
  // Each call carries the list's mark: ranks whose lists differ disagree at the first.
  const ListCall list{list_mark(inputs), std::make_shared<ListFailure>()};
  c10::intrusive_ptr<c10d::Work> last;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    last = allgather_into(outputs[i], inputs[i], opts, list);
  // The calls run in order: the last one's end is the end of all.
  return last ? last : barrier(c10d::BarrierOptions());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradcomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const InStep in_step(*this, collectives::CallKind::reduce_scatter);
  if (outputs.size() != inputs.size()) {
    invalid("reduce_scatter_tensor_coalesced", rank_,
            std::to_string(inputs.size()) + " inputs but " + std::to_string(outputs.size()) +
                " outputs");
  }
  const ListCall list{list_mark(inputs), std::make_shared<ListFailure>()};
  c10::intrusive_ptr<c10d::Work> last;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    last = reduce_scatter_into(outputs[i], inputs[i], opts, list);
  return last ? last : barrier(c10d::BarrierOptions());
}
#endif

// --- Creation ------------------------------------------------------------------------------------

c10::intrusive_ptr<BackendBase> create_process_group(int group_rank, int group_size,
                                                     const std::vector<int64_t>& global_ranks,
                                                     std::optional<double> timeout_seconds,
                                                     const std::string& group_name) {
  const std::string call = "torch.distributed init_process_group (gradcomm)";
  if (!mpi_ready()) init();
  int world_rank = 0, world_size = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), call + ": MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), call + ": MPI_Comm_size");
  Config config = Config::from_environment();
  if (timeout_seconds) {
    // torch's timeout, where the caller gave one: whole seconds (the watchdog looks twice a
    // second), rounded up.
    if (!(*timeout_seconds > 0)) {
      throw InvalidArgument(error_message(
          call, world_rank,
          "the timeout is " + std::to_string(*timeout_seconds) + " s; it must be positive"));
    }
    config.timeout_seconds =
        static_cast<int>(std::min(std::ceil(*timeout_seconds), static_cast<double>(1 << 30)));
    config.timeout_setting = "torch.distributed timeout";
  }
  if (global_ranks.empty()) {
    if (group_size != world_size || group_rank != world_rank) {
      throw InvalidArgument(error_message(
          call, world_rank,
          "torch.distributed was given rank " + std::to_string(group_rank) + " of world size " +
              std::to_string(group_size) + ", but MPI has " + std::to_string(world_size) +
              " ranks and this is rank " + std::to_string(world_rank) +
              ": launch the job with mpirun -np " + std::to_string(group_size) +
              " (import gradcomm.torch sets RANK and WORLD_SIZE from MPI where they are unset)"));
    }
    return c10::make_intrusive<ProcessGroupGradcomm>(MPI_COMM_WORLD, group_rank, group_size,
                                                     std::move(config));
  }
  // A subgroup (new_group): torch calls this on its members only, so the communicator is made
  // by them alone (MPI_Comm_create_group), once they agree on who they are. Torch's global
  // ranks are MPI's world ranks.
  if (global_ranks.size() != static_cast<std::size_t>(group_size) || group_rank < 0 ||
      group_rank >= group_size ||
      global_ranks[static_cast<std::size_t>(group_rank)] != world_rank) {
    throw InvalidArgument(error_message(
        call, world_rank,
        "the subgroup's ranks do not place this process (world rank " + std::to_string(world_rank) +
            ") at group rank " + std::to_string(group_rank)));
  }
  std::vector<int> ranks(global_ranks.begin(), global_ranks.end());
  agree_on_members("torch.distributed new_group (gradcomm)", ranks, group_name, world_rank,
                   world_size, config.timeout_seconds, config.timeout_text());
  MPI_Group world_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  check_mpi(MPI_Comm_group(MPI_COMM_WORLD, &world_group), call + ": MPI_Comm_group");
  check_mpi(MPI_Group_incl(world_group, group_size, ranks.data(), &group),
            call + ": MPI_Group_incl");
  MPI_Comm comm = MPI_COMM_NULL;
  constexpr int kCreateTag = 0x6763;
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, kCreateTag, &comm);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  check_mpi(rc, call + ": MPI_Comm_create_group");
  try {
    auto pg =
        c10::make_intrusive<ProcessGroupGradcomm>(comm, group_rank, group_size, std::move(config));
    MPI_Comm_free(&comm);  // the group's communicator holds a duplicate
    return pg;
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
}

}  // namespace gradcomm::torch_backend
