// The C ABI: every entry point converts its arguments, calls the C++ API inside one guard that
// turns any exception into a status code and a per-thread message, and returns.

#include "bindings/c/gradcomm.h"

#include <mpi.h>

#include <climits>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/reduce_scatter.h"
#include "core/communicator.h"
#include "core/error.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"

struct gradcomm_comm_s {
  std::unique_ptr<gradcomm::Communicator> comm;
};

struct gradcomm_packer_s {
  std::unique_ptr<gradcomm::packing::GradientPacker> packer;
};

struct gradcomm_request_s {
  std::unique_ptr<gradcomm::Request> request;
};

namespace {

static_assert(GRADCOMM_FLOAT32 == static_cast<int>(gradcomm::DataType::float32) &&
              GRADCOMM_FLOAT64 == static_cast<int>(gradcomm::DataType::float64) &&
              GRADCOMM_FLOAT16 == static_cast<int>(gradcomm::DataType::float16) &&
              GRADCOMM_BFLOAT16 == static_cast<int>(gradcomm::DataType::bfloat16) &&
              GRADCOMM_INT32 == static_cast<int>(gradcomm::DataType::int32) &&
              GRADCOMM_INT64 == static_cast<int>(gradcomm::DataType::int64));
static_assert(GRADCOMM_SUM == static_cast<int>(gradcomm::ReduceOp::sum) &&
              GRADCOMM_AVG == static_cast<int>(gradcomm::ReduceOp::avg) &&
              GRADCOMM_MIN == static_cast<int>(gradcomm::ReduceOp::min) &&
              GRADCOMM_MAX == static_cast<int>(gradcomm::ReduceOp::max) &&
              GRADCOMM_PROD == static_cast<int>(gradcomm::ReduceOp::prod));
static_assert(GRADCOMM_ERROR_INVALID_ARGUMENT ==
                  static_cast<int>(gradcomm::ErrorCode::invalid_argument) &&
              GRADCOMM_ERROR_UNSUPPORTED == static_cast<int>(gradcomm::ErrorCode::unsupported) &&
              GRADCOMM_ERROR_COMM == static_cast<int>(gradcomm::ErrorCode::comm_error) &&
              GRADCOMM_ERROR_INTERNAL == static_cast<int>(gradcomm::ErrorCode::internal) &&
              GRADCOMM_ERROR_MISMATCH == static_cast<int>(gradcomm::ErrorCode::mismatch));

thread_local std::string t_last_error;

// Runs `body`, mapping every exception to a status and remembering its message.
template <class F>
gradcomm_status guarded(F&& body) noexcept {
  try {
    t_last_error.clear();
    body();
    return GRADCOMM_SUCCESS;
  } catch (const gradcomm::Error& e) {
    t_last_error = e.what();
    return static_cast<gradcomm_status>(e.code());
  } catch (const std::bad_alloc&) {
    t_last_error = "out of memory";
    return GRADCOMM_ERROR_INTERNAL;
  } catch (const std::exception& e) {
    t_last_error = e.what();
    return GRADCOMM_ERROR_INTERNAL;
  } catch (...) {
    t_last_error = "unknown exception";
    return GRADCOMM_ERROR_INTERNAL;
  }
}

[[noreturn]] void invalid(const char* call, const std::string& detail) {
  throw gradcomm::InvalidArgument(gradcomm::error_message(call, -1, detail));
}

template <class T>
void require(const T* p, const char* call, const char* name) {
  if (p == nullptr) invalid(call, std::string(name) + " is NULL");
}

// Every handle ever created, with what it is: a freed, made-up or wrong-kind handle is an
// error, not a use after free (a double free included). Freeing destroys the object but keeps
// its 8-byte shell allocated, so that its address is never reused by a later handle and a stale
// handle stays recognisable. One lock and hash lookup per call.
enum class HandleKind { comm, packer, request, freed };

class Handles {
 public:
  void add(const void* h, HandleKind kind) {
    std::lock_guard lock(mutex_);
    kinds_[h] = kind;
  }
  bool is(const void* h, HandleKind kind) {
    std::lock_guard lock(mutex_);
    const auto it = kinds_.find(h);
    return it != kinds_.end() && it->second == kind;
  }
  // Marks a live handle of `kind` freed; false if it was not one.
  bool retire(const void* h, HandleKind kind) {
    std::lock_guard lock(mutex_);
    const auto it = kinds_.find(h);
    if (it == kinds_.end() || it->second != kind) return false;
    it->second = HandleKind::freed;
    return true;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const void*, HandleKind> kinds_;
};

Handles& handles() {
  static Handles* all = new Handles;  // never destroyed: usable from atexit handlers
  return *all;
}

std::string address(const void* p) {
  char text[32];
  std::snprintf(text, sizeof text, "%p", p);
  return text;
}

gradcomm::Communicator& unwrap(gradcomm_comm comm, const char* call) {
  if (comm == nullptr) invalid(call, "comm is NULL");
  if (!handles().is(comm, HandleKind::comm)) {
    invalid(call, "comm " + address(comm) + " is not a live communicator (already freed?)");
  }
  return *comm->comm;
}

gradcomm::packing::GradientPacker& unwrap(gradcomm_packer packer, const char* call) {
  if (packer == nullptr) invalid(call, "packer is NULL");
  if (!handles().is(packer, HandleKind::packer)) {
    invalid(call, "packer " + address(packer) + " is not a live packer (already freed?)");
  }
  return *packer->packer;
}

gradcomm::Request& unwrap(gradcomm_request request, const char* call) {
  if (request == nullptr) invalid(call, "request is NULL");
  if (!handles().is(request, HandleKind::request)) {
    invalid(call, "request " + address(request) + " is not a live request (already freed?)");
  }
  return *request->request;
}

// Hands a new object to the caller as a live handle.
template <class Handle>
Handle publish(std::unique_ptr<std::remove_pointer_t<Handle>> object, HandleKind kind) {
  handles().add(object.get(), kind);  // may throw: the object is still owned here
  return object.release();
}

// Destroys the object behind a live handle (its shell stays, see Handles); NULL is a no-op.
template <class Handle>
void release(Handle h, HandleKind kind, const char* call, const char* what) {
  if (h == nullptr) return;
  if (!handles().retire(h, kind)) {
    invalid(call, std::string(what) + " " + address(h) + " is not live (freed twice?)");
  }
  if constexpr (std::is_same_v<Handle, gradcomm_comm>) {
    h->comm.reset();
  } else if constexpr (std::is_same_v<Handle, gradcomm_request>) {
    h->request.reset();  // waits for an unfinished call
  } else {
    h->packer.reset();
  }
}

void require_mpi(const char* call) {
  if (!gradcomm::mpi_ready()) invalid(call, "MPI is not initialized (call gradcomm_init first)");
}

std::vector<gradcomm::packing::TensorDesc> tensors_of(void* const* buffers, const size_t* counts,
                                                      const gradcomm_dtype* dtypes, size_t n,
                                                      const char* call) {
  if (n > std::numeric_limits<size_t>::max() / 64) {
    invalid(call, "n " + std::to_string(n) + " is too large (a negative value cast to size_t?)");
  }
  if (n > 0) {
    require(buffers, call, "buffers");
    require(counts, call, "counts");
    require(dtypes, call, "dtypes");
  }
  std::vector<gradcomm::packing::TensorDesc> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    tensors[i] = {buffers[i], counts[i], static_cast<gradcomm::DataType>(dtypes[i])};
  }
  return tensors;
}

}  // namespace

extern "C" {

int gradcomm_version(void) {
  return GRADCOMM_VERSION;
}

gradcomm_status gradcomm_init(int* argc, char*** argv) {
  return guarded([&] { gradcomm::init(argc, argv); });
}

gradcomm_status gradcomm_finalize(void) {
  return guarded([] { gradcomm::finalize(); });
}

gradcomm_status gradcomm_comm_create_world(gradcomm_comm* out) {
  return guarded([&] {
    const char* call = "gradcomm_comm_create_world";
    require(out, call, "out");
    *out = nullptr;
    require_mpi(call);
    auto handle = std::make_unique<gradcomm_comm_s>();
    handle->comm = std::make_unique<gradcomm::Communicator>(MPI_COMM_WORLD);
    *out = publish<gradcomm_comm>(std::move(handle), HandleKind::comm);
  });
}

gradcomm_status gradcomm_comm_create_from_fortran(int64_t mpi_fortran_handle, gradcomm_comm* out) {
  return guarded([&] {
    const char* call = "gradcomm_comm_create_from_fortran";
    require(out, call, "out");
    *out = nullptr;
    require_mpi(call);
    // An unknown handle gives a null MPI_Comm (Open MPI), which MPI_Comm_dup would answer by
    // aborting the job.
    if (mpi_fortran_handle < INT_MIN || mpi_fortran_handle > INT_MAX) {
      invalid(call, "handle " + std::to_string(mpi_fortran_handle) + " is not an MPI_Fint");
    }
    const MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(mpi_fortran_handle));
    if (c == MPI_COMM_NULL) invalid(call, "the handle is MPI_COMM_NULL");
    // Open MPI gives a null handle, MPICH (integer handles) one MPI rejects when asked.
    if (!gradcomm::is_communicator(c)) {
      invalid(call, "handle " + std::to_string(mpi_fortran_handle) + " names no communicator");
    }
    auto handle = std::make_unique<gradcomm_comm_s>();
    handle->comm = std::make_unique<gradcomm::Communicator>(c);
    *out = publish<gradcomm_comm>(std::move(handle), HandleKind::comm);
  });
}

gradcomm_status gradcomm_comm_rank(gradcomm_comm comm, int* rank) {
  return guarded([&] {
    require(rank, "gradcomm_comm_rank", "rank");
    *rank = unwrap(comm, "gradcomm_comm_rank").rank();
  });
}

gradcomm_status gradcomm_comm_size(gradcomm_comm comm, int* size) {
  return guarded([&] {
    require(size, "gradcomm_comm_size", "size");
    *size = unwrap(comm, "gradcomm_comm_size").size();
  });
}

gradcomm_status gradcomm_comm_free(gradcomm_comm comm) {
  // After MPI_Finalize the MPI objects are gone already; the memory is released either way.
  return guarded([&] { release(comm, HandleKind::comm, "gradcomm_comm_free", "comm"); });
}

gradcomm_status gradcomm_allreduce(gradcomm_comm comm, const void* send, void* recv, size_t count,
                                   gradcomm_dtype dtype, gradcomm_op op, const char* algorithm) {
  return guarded([&] {
    gradcomm::allreduce(
        unwrap(comm, "gradcomm_allreduce"), send, recv, count,
        static_cast<gradcomm::DataType>(dtype), static_cast<gradcomm::ReduceOp>(op),
        {.algorithm = algorithm ? std::string_view(algorithm) : std::string_view()});
  });
}

gradcomm_status gradcomm_grouped_allreduce(gradcomm_comm comm, void* const* buffers,
                                           const size_t* counts, const gradcomm_dtype* dtypes,
                                           size_t n, gradcomm_op op, const char* algorithm,
                                           size_t fusion_threshold) {
  return guarded([&] {
    const char* call = "gradcomm_grouped_allreduce";
    gradcomm::Communicator& c = unwrap(comm, call);
    const gradcomm::collectives::KeepInStep in_step(
        c, gradcomm::collectives::CallKind::grouped_allreduce, call);
    const auto tensors = tensors_of(buffers, counts, dtypes, n, call);
    gradcomm::GroupedAllreduceOptions o;
    o.algorithm = algorithm ? std::string_view(algorithm) : std::string_view();
    if (fusion_threshold > 0) o.fusion_threshold = fusion_threshold;
    gradcomm::grouped_allreduce(c, tensors, static_cast<gradcomm::ReduceOp>(op), o);
  });
}

gradcomm_status gradcomm_reduce_scatter(gradcomm_comm comm, const void* send, void* recv,
                                        size_t recv_count, gradcomm_dtype dtype, gradcomm_op op,
                                        const char* algorithm) {
  return guarded([&] {
    gradcomm::reduce_scatter(
        unwrap(comm, "gradcomm_reduce_scatter"), send, recv, recv_count,
        static_cast<gradcomm::DataType>(dtype), static_cast<gradcomm::ReduceOp>(op),
        {.algorithm = algorithm ? std::string_view(algorithm) : std::string_view()});
  });
}

gradcomm_status gradcomm_broadcast(gradcomm_comm comm, void* buffer, size_t count,
                                   gradcomm_dtype dtype, int root) {
  return guarded([&] {
    gradcomm::broadcast(unwrap(comm, "gradcomm_broadcast"), buffer, count,
                        static_cast<gradcomm::DataType>(dtype), root);
  });
}

namespace {

// Publishes a submitted request through `out` (checked before the call is submitted).
void hand_out(gradcomm::Request request, gradcomm_request* out) {
  auto shell = std::make_unique<gradcomm_request_s>();
  shell->request = std::make_unique<gradcomm::Request>(std::move(request));
  *out = publish<gradcomm_request>(std::move(shell), HandleKind::request);
}

}  // namespace

gradcomm_status gradcomm_iallreduce(gradcomm_comm comm, const void* send, void* recv, size_t count,
                                    gradcomm_dtype dtype, gradcomm_op op, const char* algorithm,
                                    void* stream, gradcomm_request* request) {
  return guarded([&] {
    const char* call = "gradcomm_iallreduce";
    gradcomm::Communicator& c = unwrap(comm, call);
    const gradcomm::collectives::KeepInStep in_step(c, gradcomm::collectives::CallKind::allreduce,
                                                    call, /*queued=*/true);
    require(request, call, "request");
    gradcomm::AllreduceOptions o;
    o.algorithm = algorithm ? std::string_view(algorithm) : std::string_view();
    o.stream = stream;
    hand_out(gradcomm::iallreduce(c, send, recv, count, static_cast<gradcomm::DataType>(dtype),
                                  static_cast<gradcomm::ReduceOp>(op), o),
             request);
  });
}

gradcomm_status gradcomm_grouped_allreduce_start(gradcomm_comm comm, void* const* buffers,
                                                 const size_t* counts, const gradcomm_dtype* dtypes,
                                                 size_t n, gradcomm_op op, const char* algorithm,
                                                 size_t fusion_threshold,
                                                 gradcomm_request* request) {
  return guarded([&] {
    const char* call = "gradcomm_grouped_allreduce_start";
    gradcomm::Communicator& c = unwrap(comm, call);
    const gradcomm::collectives::KeepInStep in_step(
        c, gradcomm::collectives::CallKind::grouped_allreduce, call, /*queued=*/true);
    require(request, call, "request");
    const auto tensors = tensors_of(buffers, counts, dtypes, n, call);
    gradcomm::GroupedAllreduceOptions o;
    o.algorithm = algorithm ? std::string_view(algorithm) : std::string_view();
    if (fusion_threshold > 0) o.fusion_threshold = fusion_threshold;
    hand_out(gradcomm::igrouped_allreduce(c, tensors, static_cast<gradcomm::ReduceOp>(op), o),
             request);
  });
}

gradcomm_status gradcomm_ibroadcast(gradcomm_comm comm, void* buffer, size_t count,
                                    gradcomm_dtype dtype, int root, gradcomm_request* request) {
  return guarded([&] {
    const char* call = "gradcomm_ibroadcast";
    gradcomm::Communicator& c = unwrap(comm, call);
    const gradcomm::collectives::KeepInStep in_step(c, gradcomm::collectives::CallKind::broadcast,
                                                    call, /*queued=*/true);
    require(request, call, "request");
    hand_out(gradcomm::ibroadcast(c, buffer, count, static_cast<gradcomm::DataType>(dtype), root),
             request);
  });
}

gradcomm_status gradcomm_request_test(gradcomm_request request, int* done) {
  return guarded([&] {
    const char* call = "gradcomm_request_test";
    require(done, call, "done");
    *done = 0;
    gradcomm::Request& r = unwrap(request, call);
    try {
      *done = r.test() ? 1 : 0;
    } catch (...) {  // test() throws only a finished call's error
      *done = 1;
      throw;
    }
  });
}

gradcomm_status gradcomm_request_wait(gradcomm_request request) {
  return guarded([&] { unwrap(request, "gradcomm_request_wait").wait(); });
}

gradcomm_status gradcomm_request_free(gradcomm_request request) {
  return guarded(
      [&] { release(request, HandleKind::request, "gradcomm_request_free", "request"); });
}

gradcomm_status gradcomm_traffic(gradcomm_comm comm, uint64_t* intra_bytes, uint64_t* inter_bytes,
                                 uint64_t* intra_messages, uint64_t* inter_messages) {
  return guarded([&] {
    const gradcomm::TrafficReport t = gradcomm::traffic(unwrap(comm, "gradcomm_traffic"));
    if (intra_bytes) *intra_bytes = t.intra_bytes;
    if (inter_bytes) *inter_bytes = t.inter_bytes;
    if (intra_messages) *intra_messages = t.intra_messages;
    if (inter_messages) *inter_messages = t.inter_messages;
  });
}

gradcomm_status gradcomm_reset_traffic(gradcomm_comm comm) {
  return guarded([&] { gradcomm::reset_traffic(unwrap(comm, "gradcomm_reset_traffic")); });
}

gradcomm_status gradcomm_packer_create(void* const* buffers, const size_t* counts,
                                       const gradcomm_dtype* dtypes, size_t n, int num_split,
                                       gradcomm_packer* out, int* declined) {
  return guarded([&] {
    const char* call = "gradcomm_packer_create";
    require(out, call, "out");
    *out = nullptr;
    if (num_split < 0) invalid(call, "num_split " + std::to_string(num_split) + " is negative");
    const auto tensors = tensors_of(buffers, counts, dtypes, n, call);
    gradcomm::packing::PackerOptions o;
    if (num_split > 0) o.num_split = num_split;
    auto handle = std::make_unique<gradcomm_packer_s>();
    handle->packer = std::make_unique<gradcomm::packing::GradientPacker>(tensors, o);
    if (declined) *declined = handle->packer->declined() ? 1 : 0;
    *out = publish<gradcomm_packer>(std::move(handle), HandleKind::packer);
  });
}

gradcomm_status gradcomm_packer_pack(gradcomm_packer packer) {
  return guarded([&] { unwrap(packer, "gradcomm_packer_pack").pack(); });
}

gradcomm_status gradcomm_packer_unpack(gradcomm_packer packer) {
  return guarded([&] { unwrap(packer, "gradcomm_packer_unpack").unpack(); });
}

gradcomm_status gradcomm_packer_buffer_count(gradcomm_packer packer, size_t* count) {
  return guarded([&] {
    require(count, "gradcomm_packer_buffer_count", "count");
    *count = unwrap(packer, "gradcomm_packer_buffer_count").packed().size();
  });
}

gradcomm_status gradcomm_packer_buffer(gradcomm_packer packer, size_t index, void** data,
                                       size_t* count, gradcomm_dtype* dtype) {
  return guarded([&] {
    const char* call = "gradcomm_packer_buffer";
    const auto& packed = unwrap(packer, call).packed();
    if (index >= packed.size()) {
      invalid(call, "index " + std::to_string(index) + " but the packer has " +
                        std::to_string(packed.size()) + " buffers");
    }
    if (data) *data = packed[index].data;
    if (count) *count = packed[index].count;
    if (dtype) *dtype = static_cast<gradcomm_dtype>(packed[index].dtype);
  });
}

gradcomm_status gradcomm_packer_free(gradcomm_packer packer) {
  return guarded([&] { release(packer, HandleKind::packer, "gradcomm_packer_free", "packer"); });
}

const char* gradcomm_error_string(gradcomm_status status) {
  switch (status) {
    case GRADCOMM_SUCCESS:
      return "success";
    case GRADCOMM_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case GRADCOMM_ERROR_UNSUPPORTED:
      return "unsupported";
    case GRADCOMM_ERROR_COMM:
      return "communication error";
    case GRADCOMM_ERROR_INTERNAL:
      return "internal error";
    case GRADCOMM_ERROR_MISMATCH:
      return "collective mismatch";
  }
  return "unknown status";
}

const char* gradcomm_last_error(void) {
  return t_last_error.c_str();
}

}  // extern "C"
