// _gradcomm: the compiled half of the Python module `gradcomm` (the package in gradcomm/ wraps
// it). Arrays travel through the buffer protocol without copies; torch tensors as raw pointers
// from gradcomm.torch. The GIL is released while gradcomm communicates. C++ errors become
// gradcomm.Error (subclasses InvalidArgument, Unsupported, CommError, MismatchError) with the same
// message.

#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <bit>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/python/negotiation.h"
#include "collectives/allreduce.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/exchange.h"
#include "collectives/reduce_scatter.h"
#include "collectives/registry.h"
#include "core/communicator.h"
#include "core/error.h"
#include "core/timeline.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"
#include "packing/reducer.h"
#include "topology/topology.h"

namespace py = pybind11;

namespace gradcomm::python {
namespace {

[[noreturn]] void invalid(const std::string& call, const std::string& detail, int rank) {
  throw InvalidArgument(error_message(call, rank, detail));
}

ReduceOp parse_op(const std::string& name, const std::string& call, int rank) {
  if (name == "average" || name == "avg" || name == "mean") return ReduceOp::avg;
  if (name == "product") return ReduceOp::prod;
  if (const auto op = parse_reduce_op(name)) return *op;
  invalid(call, "unknown op '" + name + "' (sum, average, min, max, prod)", rank);
}

// The gradcomm dtype of a NumPy dtype (float16 is 'e'; NumPy has no bfloat16).
DataType dtype_of_array(const py::buffer_info& info, const std::string& call, int rank) {
  const std::string& f = info.format;
  const char kind = f.empty() ? '?' : f.back();
  // A leading '<' or '>' (or '!') fixes the byte order; only the machine's own is summed right.
  const char order = f.size() > 1 ? f.front() : '@';
  const bool little = std::endian::native == std::endian::little;
  const bool big_marked = order == '>' || order == '!';
  if ((big_marked && little) || (order == '<' && !little)) {
    invalid(call,
            std::string("the array's byte order ('") + order +
                "') is not this machine's; convert it first, e.g. "
                "a.astype(a.dtype.newbyteorder('='))",
            rank);
  }
  if (info.itemsize == 4 && kind == 'f') return DataType::float32;
  if (info.itemsize == 8 && kind == 'd') return DataType::float64;
  if (info.itemsize == 2 && kind == 'e') return DataType::float16;
  if (info.itemsize == 4 && (kind == 'i' || kind == 'l')) return DataType::int32;
  if (info.itemsize == 8 && (kind == 'l' || kind == 'q')) return DataType::int64;
  invalid(call,
          "unsupported dtype (buffer format '" + f + "', " + std::to_string(info.itemsize) +
              " bytes); supported: float32, float64, float16, int32, int64",
          rank);
}

DataType parse_dtype(const std::string& name, const std::string& call, int rank) {
  if (const auto d = parse_data_type(name)) return *d;
  invalid(call, "unknown dtype '" + name + "'", rank);
}

// A C-contiguous view of an array; writable when asked.
struct View {
  py::buffer_info info;
  DataType dtype;
  std::size_t count;
};

View view_of(const py::object& obj, bool writable, const std::string& call, const std::string& what,
             int rank) {
  if (!py::isinstance<py::buffer>(obj)) {
    invalid(
        call,
        what + " is a " + std::string(py::str(obj.get_type().attr("__name__"))) + ", not an array",
        rank);
  }
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();  // checked below
  // C-contiguous: strides are the row-major ones.
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim; d-- > 0;) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      invalid(call, what + " is not C-contiguous (use numpy.ascontiguousarray)", rank);
    }
    expected *= info.shape[d];
  }
  if (writable && info.readonly) invalid(call, what + " is read-only", rank);
  const DataType dtype = dtype_of_array(info, call, rank);
  const auto count = static_cast<std::size_t>(info.size);
  return {std::move(info), dtype, count};
}

// A non-blocking call's handle: wait() (the GIL released while it blocks) returns the result,
// done() polls without blocking. Both raise the call's error. Destroying an unfinished handle
// waits for the call, whose buffers it keeps exported until then.
class PyRequest {
 public:
  PyRequest(Request request, std::shared_ptr<Communicator> held, py::object result,
            std::vector<View> views)
      : held_(std::move(held)),
        views_(std::move(views)),
        result_(std::move(result)),
        request_(std::move(request)) {}

  py::object wait() {
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mutex_);  // another Python thread may poll meanwhile
      request_.wait();
    }
    return result_;
  }
  bool done() {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;  // another thread is in wait(): not known done yet
    return request_.test();
  }

 private:
  // Destroyed last to first: the request (which waits) before the exports and the communicator.
  std::shared_ptr<Communicator> held_;
  std::vector<View> views_;
  py::object result_;
  std::mutex mutex_;  // one thread at a time touches request_ (wait() runs without the GIL)
  Request request_;
};

// collectives::KeepInStep for the module's front doors: a blocking call's stand-in compares with
// the other ranks with the GIL released, as every collective here waits (another Python thread
// of this rank may be what they wait for).
class PyKeepInStep {
 public:
  PyKeepInStep(Communicator& comm, collectives::CallKind kind, std::string_view call,
               bool queued = false)
      : exceptions_(std::uncaught_exceptions()) {
    guard_.emplace(comm, kind, call, queued);
  }
  ~PyKeepInStep() {
    if (std::uncaught_exceptions() > exceptions_ && PyGILState_Check()) {
      py::gil_scoped_release release;
      guard_.reset();
    }
  }
  PyKeepInStep(const PyKeepInStep&) = delete;
  PyKeepInStep& operator=(const PyKeepInStep&) = delete;

 private:
  const int exceptions_;
  std::optional<collectives::KeepInStep> guard_;
};

// The communicator handed to Python: owns a gradcomm::Communicator.
class PyCommunicator {
 public:
  explicit PyCommunicator(MPI_Comm comm) : comm_(std::make_shared<Communicator>(comm)) {}

  static std::shared_ptr<PyCommunicator> from_mpi4py(const py::object& mpi4py_comm) {
    if (!mpi_ready()) invalid("Communicator", "MPI is not initialized", -1);
    if (!py::hasattr(mpi4py_comm, "py2f")) {
      invalid("Communicator", "expected an mpi4py communicator (with py2f())", -1);
    }
    MPI_Fint handle = 0;
    try {
      handle = mpi4py_comm.attr("py2f")().cast<MPI_Fint>();
    } catch (const py::cast_error&) {
      invalid("Communicator", "py2f() did not return an MPI Fortran handle (an int)", -1);
    }
    const MPI_Comm c = MPI_Comm_f2c(handle);
    if (c == MPI_COMM_NULL) invalid("Communicator", "the communicator is MPI.COMM_NULL", -1);
    return std::make_shared<PyCommunicator>(c);
  }

  // The communicator, held for the duration of a call: free() from another thread while the
  // call runs without the GIL only drops this object's reference.
  std::shared_ptr<Communicator> get() {
    std::shared_ptr<Communicator> held = comm_;
    if (!held) invalid("gradcomm", "the communicator was freed (after shutdown())", -1);
    if (mpi_finalized()) invalid("gradcomm", "MPI has been finalized", held->rank());
    return held;
  }
  int rank() { return get()->rank(); }
  int size() { return get()->size(); }
  int local_rank() { return topology::topology_of(*get()).local_rank(); }
  int local_size() { return topology::topology_of(*get()).local_size(); }
  // The node this rank is on, and how many nodes there are (Horovod's cross_rank, cross_size).
  int node() { return topology::topology_of(*get()).node(); }
  int node_count() { return static_cast<int>(topology::topology_of(*get()).nodes.size()); }
  void free() { comm_.reset(); }

  // An all-reduce's buffers, exported for the duration of the call.
  struct Prepared {
    std::shared_ptr<Communicator> held;
    ReduceOp op;
    View send;
    std::optional<View> recv;  // holds the export of `out` until the call is done
    py::object result;
    void* recv_ptr;
  };

  Prepared prepare(std::shared_ptr<Communicator> held, const std::string& call,
                   const py::object& array, const std::string& op, const py::object& out) {
    Communicator& c = *held;
    const ReduceOp rop = parse_op(op, call, c.rank());
    const bool in_place = !out.is_none() && out.is(array);
    View send = view_of(array, in_place, call, "array", c.rank());
    py::object result = out;
    if (out.is_none()) {
      result = py::array(py::dtype(send.info), send.info.shape);
    }
    void* recv_ptr = send.info.ptr;
    std::optional<View> recv_view;
    if (!in_place) {
      const View& recv = recv_view.emplace(view_of(result, true, call, "out", c.rank()));
      if (recv.dtype != send.dtype || recv.count != send.count) {
        invalid(call,
                "out has " + std::to_string(recv.count) + " elements of " +
                    std::string(to_string(recv.dtype)) + ", array has " +
                    std::to_string(send.count) + " of " + std::string(to_string(send.dtype)),
                c.rank());
      }
      recv_ptr = recv.info.ptr;
    }
    return {std::move(held),   rop,     std::move(send), std::move(recv_view),
            std::move(result), recv_ptr};
  }

  py::object allreduce(const py::object& array, const std::string& op,
                       const std::optional<std::string>& algorithm, const py::object& out) {
    std::shared_ptr<Communicator> held = get();
    const PyKeepInStep in_step(*held, collectives::CallKind::allreduce, "allreduce");
    Prepared p = prepare(held, "allreduce", array, op, out);
    const std::string alg = algorithm.value_or("");
    {
      py::gil_scoped_release release;
      gradcomm::allreduce(*p.held, p.send.info.ptr, p.recv_ptr, p.send.count, p.send.dtype, p.op,
                          {.algorithm = alg});
    }
    return p.result;
  }

  // Block rank() of the reduction of `array` (size() equal blocks) into `out` or a new 1-D array.
  py::object reduce_scatter(const py::object& array, const std::string& op,
                            const std::optional<std::string>& algorithm, const py::object& out) {
    const std::string call = "reduce_scatter";
    std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const PyKeepInStep in_step(c, collectives::CallKind::reduce_scatter, call);
    const ReduceOp rop = parse_op(op, call, c.rank());
    View send = view_of(array, false, call, "array", c.rank());
    const auto n = static_cast<std::size_t>(c.size());
    if (send.count % n != 0) {
      invalid(call,
              "array has " + std::to_string(send.count) + " elements, not a multiple of the " +
                  std::to_string(n) + " ranks",
              c.rank());
    }
    const std::size_t block = send.count / n;
    py::object result =
        out.is_none()
            ? py::object(py::array(py::dtype(send.info),
                                   std::vector<py::ssize_t>{static_cast<py::ssize_t>(block)}))
            : out;
    View recv = view_of(result, true, call, "out", c.rank());
    if (recv.dtype != send.dtype || recv.count != block) {
      invalid(call,
              "out has " + std::to_string(recv.count) + " elements of " +
                  std::string(to_string(recv.dtype)) + ", a block of array is " +
                  std::to_string(block) + " of " + std::string(to_string(send.dtype)),
              c.rank());
    }
    const std::string alg = algorithm.value_or("");
    {
      py::gil_scoped_release release;
      gradcomm::reduce_scatter(c, send.info.ptr, recv.info.ptr, block, send.dtype, rop,
                               {.algorithm = alg});
    }
    return result;
  }

  // The non-blocking form: the handle keeps the arrays exported and the communicator alive.
  std::unique_ptr<PyRequest> allreduce_async(const py::object& array, const std::string& op,
                                             const std::optional<std::string>& algorithm,
                                             const py::object& out) {
    std::shared_ptr<Communicator> held = get();
    const PyKeepInStep in_step(*held, collectives::CallKind::allreduce, "allreduce_async",
                               /*queued=*/true);
    Prepared p = prepare(held, "allreduce_async", array, op, out);
    const std::string alg = algorithm.value_or("");
    Request request = gradcomm::iallreduce(*p.held, p.send.info.ptr, p.recv_ptr, p.send.count,
                                           p.send.dtype, p.op, {.algorithm = alg});
    std::vector<View> views;
    views.push_back(std::move(p.send));
    if (p.recv) views.push_back(std::move(*p.recv));
    return std::make_unique<PyRequest>(std::move(request), std::move(p.held), std::move(p.result),
                                       std::move(views));
  }

  // Raw form for gradcomm.torch (the caller keeps the tensors alive until the handle is done).
  std::unique_ptr<PyRequest> allreduce_async_ptr(std::uintptr_t send, std::uintptr_t recv,
                                                 std::size_t count, const std::string& dtype,
                                                 const std::string& op,
                                                 const std::optional<std::string>& algorithm) {
    std::shared_ptr<Communicator> held = get();
    const PyKeepInStep in_step(*held, collectives::CallKind::allreduce, "allreduce_async",
                               /*queued=*/true);
    const ReduceOp rop = parse_op(op, "allreduce_async", held->rank());
    const DataType dt = parse_dtype(dtype, "allreduce_async", held->rank());
    const std::string alg = algorithm.value_or("");
    Request request =
        gradcomm::iallreduce(*held, reinterpret_cast<const void*>(send),
                             reinterpret_cast<void*>(recv), count, dt, rop, {.algorithm = alg});
    return std::make_unique<PyRequest>(std::move(request), std::move(held), py::none(),
                                       std::vector<View>{});
  }

  // In place on each array of the list; returns the list.
  py::list grouped_allreduce(const py::list& arrays, const std::string& op,
                             const std::optional<std::string>& algorithm,
                             std::optional<std::size_t> fusion_threshold) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const std::string call = "grouped_allreduce";
    const PyKeepInStep in_step(c, collectives::CallKind::grouped_allreduce, call);
    const ReduceOp rop = parse_op(op, call, c.rank());
    std::vector<View> views;
    std::vector<packing::TensorDesc> tensors;
    for (std::size_t i = 0; i < arrays.size(); ++i) {
      views.push_back(view_of(arrays[i], true, call, "array " + std::to_string(i), c.rank()));
      tensors.push_back({views.back().info.ptr, views.back().count, views.back().dtype});
    }
    run_grouped(c, tensors, rop, algorithm, fusion_threshold);
    return arrays;
  }

  // Raw form for gradcomm.torch: data pointers, element counts and dtype names.
  void grouped_allreduce_ptrs(const std::vector<std::uintptr_t>& ptrs,
                              const std::vector<std::size_t>& counts,
                              const std::vector<std::string>& dtypes, const std::string& op,
                              const std::optional<std::string>& algorithm,
                              std::optional<std::size_t> fusion_threshold) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const std::string call = "grouped_allreduce";
    const PyKeepInStep in_step(c, collectives::CallKind::grouped_allreduce, call);
    const std::vector<packing::TensorDesc> tensors =
        tensor_list(ptrs, counts, dtypes, call, c.rank());
    const ReduceOp rop = parse_op(op, call, c.rank());
    run_grouped(c, tensors, rop, algorithm, fusion_threshold);
  }

  // Data pointers, element counts and dtype names as tensor descriptions.
  static std::vector<packing::TensorDesc> tensor_list(const std::vector<std::uintptr_t>& ptrs,
                                                      const std::vector<std::size_t>& counts,
                                                      const std::vector<std::string>& dtypes,
                                                      const std::string& call, int rank) {
    if (ptrs.size() != counts.size() || ptrs.size() != dtypes.size()) {
      invalid(call, "ptrs, counts and dtypes differ in length", rank);
    }
    std::vector<packing::TensorDesc> tensors;
    for (std::size_t i = 0; i < ptrs.size(); ++i) {
      tensors.push_back(
          {reinterpret_cast<void*>(ptrs[i]), counts[i], parse_dtype(dtypes[i], call, rank)});
    }
    return tensors;
  }

  // The non-blocking form of grouped_allreduce_ptrs (the caller keeps the tensors alive).
  std::unique_ptr<PyRequest> grouped_allreduce_async_ptrs(
      const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& counts,
      const std::vector<std::string>& dtypes, const std::string& op,
      const std::optional<std::string>& algorithm, std::optional<std::size_t> fusion_threshold) {
    std::shared_ptr<Communicator> held = get();
    const std::string call = "grouped_allreduce_async";
    const PyKeepInStep in_step(*held, collectives::CallKind::grouped_allreduce, call,
                               /*queued=*/true);
    const std::vector<packing::TensorDesc> tensors =
        tensor_list(ptrs, counts, dtypes, call, held->rank());
    const ReduceOp rop = parse_op(op, call, held->rank());
    const std::string alg = algorithm.value_or("");
    GroupedAllreduceOptions o;
    o.algorithm = alg;
    o.fusion_threshold = fusion_threshold;
    Request request = gradcomm::igrouped_allreduce(*held, tensors, rop, o);
    return std::make_unique<PyRequest>(std::move(request), std::move(held), py::none(),
                                       std::vector<View>{});
  }

  std::unique_ptr<PyRequest> broadcast_async_ptr(std::uintptr_t data, std::size_t count,
                                                 const std::string& dtype, int root) {
    std::shared_ptr<Communicator> held = get();
    const PyKeepInStep in_step(*held, collectives::CallKind::broadcast, "broadcast_async",
                               /*queued=*/true);
    const DataType dt = parse_dtype(dtype, "broadcast_async", held->rank());
    Request request = gradcomm::ibroadcast(*held, reinterpret_cast<void*>(data), count, dt, root);
    return std::make_unique<PyRequest>(std::move(request), std::move(held), py::none(),
                                       std::vector<View>{});
  }

  void allreduce_ptr(std::uintptr_t send, std::uintptr_t recv, std::size_t count,
                     const std::string& dtype, const std::string& op,
                     const std::optional<std::string>& algorithm) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const PyKeepInStep in_step(c, collectives::CallKind::allreduce, "allreduce");
    const ReduceOp rop = parse_op(op, "allreduce", c.rank());
    const DataType dt = parse_dtype(dtype, "allreduce", c.rank());
    const std::string alg = algorithm.value_or("");
    py::gil_scoped_release release;
    gradcomm::allreduce(c, reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv),
                        count, dt, rop, {.algorithm = alg});
  }

  py::object broadcast(const py::object& array, int root) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const PyKeepInStep in_step(c, collectives::CallKind::broadcast, "broadcast");
    View v = view_of(array, true, "broadcast", "array", c.rank());
    py::gil_scoped_release release;
    gradcomm::broadcast(c, v.info.ptr, v.count, v.dtype, root);
    return array;
  }

  // `iterations` back-to-back all-reduces of `array` in place from C++ (GIL released once):
  // the baseline for measuring what a Python call adds. Returns seconds.
  double bench_allreduce(const py::object& array, int iterations, const std::string& op,
                         const std::optional<std::string>& algorithm) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    View v = view_of(array, true, "_bench_allreduce", "array", c.rank());
    const ReduceOp rop = parse_op(op, "_bench_allreduce", c.rank());
    const std::string alg = algorithm.value_or("");
    py::gil_scoped_release release;
    const double t0 = MPI_Wtime();
    for (int i = 0; i < iterations; ++i) {
      gradcomm::allreduce(c, v.info.ptr, v.info.ptr, v.count, v.dtype, rop, {.algorithm = alg});
    }
    return MPI_Wtime() - t0;
  }

  // This rank's next collective call failed here before it could run (`call` says why): the
  // other ranks' next checked call fails at once, naming this rank (compare_failed_call), where
  // they would wait for it until the watchdog. Their MismatchError is theirs; this rank raises
  // its own. A no-op alone or with GRADCOMM_CHECK=off.
  void fail_next_call(const std::string& call) {
    const std::shared_ptr<Communicator> held = get();
    if (held->size() == 1 || held->config().check == CheckMode::off) return;
    py::gil_scoped_release release;
    try {
      collectives::compare_failed_call(*held, collectives::CallKind::allreduce, call);
    } catch (const MismatchError&) {
    }
  }

  // The checked byte-level exchanges gradcomm.torch's allgather, barrier and object calls use.
  void barrier_() {
    const std::shared_ptr<Communicator> held = get();
    py::gil_scoped_release release;
    gradcomm::barrier(*held);
  }
  void allgather_bytes_ptr(std::uintptr_t send, std::uintptr_t recv, std::size_t bytes) {
    const std::shared_ptr<Communicator> held = get();
    py::gil_scoped_release release;
    gradcomm::allgather_bytes(*held, reinterpret_cast<const void*>(send),
                              reinterpret_cast<void*>(recv), bytes);
  }
  void allgatherv_bytes_ptr(std::uintptr_t send, std::uintptr_t recv,
                            const std::vector<std::size_t>& counts) {
    const std::shared_ptr<Communicator> held = get();
    py::gil_scoped_release release;
    gradcomm::allgatherv_bytes(*held, reinterpret_cast<const void*>(send),
                               reinterpret_cast<void*>(recv), counts);
  }
  void broadcast_bytes_ptr(std::uintptr_t data, std::size_t bytes, int root) {
    const std::shared_ptr<Communicator> held = get();
    py::gil_scoped_release release;
    gradcomm::broadcast_bytes(*held, reinterpret_cast<void*>(data), bytes, root);
  }

  void broadcast_ptr(std::uintptr_t data, std::size_t count, const std::string& dtype, int root) {
    const std::shared_ptr<Communicator> held = get();
    Communicator& c = *held;
    const PyKeepInStep in_step(c, collectives::CallKind::broadcast, "broadcast");
    const DataType dt = parse_dtype(dtype, "broadcast", c.rank());
    py::gil_scoped_release release;
    gradcomm::broadcast(c, reinterpret_cast<void*>(data), count, dt, root);
  }

 private:
  static void run_grouped(Communicator& c, const std::vector<packing::TensorDesc>& tensors,
                          ReduceOp op, const std::optional<std::string>& algorithm,
                          std::optional<std::size_t> fusion_threshold) {
    const std::string alg = algorithm.value_or("");
    GroupedAllreduceOptions o;
    o.algorithm = alg;
    o.fusion_threshold = fusion_threshold;
    py::gil_scoped_release release;
    gradcomm::grouped_allreduce(c, tensors, op, o);
  }

  std::shared_ptr<Communicator> comm_;
};

// GradientPacker over a list of arrays; buffers() are NumPy views of the packed memory that
// keep the packer alive.
class PyPacker {
 public:
  PyPacker(const py::list& arrays, int num_split) : arrays_(arrays) {
    std::vector<packing::TensorDesc> tensors;
    for (std::size_t i = 0; i < arrays.size(); ++i) {
      views_.push_back(
          view_of(arrays[i], true, "GradientPacker", "array " + std::to_string(i), -1));
      tensors.push_back({views_.back().info.ptr, views_.back().count, views_.back().dtype});
    }
    packing::PackerOptions o;
    if (num_split < 1) invalid("GradientPacker", "num_split must be at least 1", -1);
    o.num_split = num_split;
    packer_ = std::make_unique<packing::GradientPacker>(tensors, o);
  }
  bool declined() const { return packer_->declined(); }
  std::string decline_reason() const { return packer_->decline_reason(); }
  void pack() { packer_->pack(); }
  void unpack() { packer_->unpack(); }
  packing::GradientPacker& get() { return *packer_; }

 private:
  py::list arrays_;  // keeps the tensors alive
  std::vector<View> views_;
  std::unique_ptr<packing::GradientPacker> packer_;
};

Compression parse_compression(const std::string& name, const std::string& call, int rank) {
  if (name == "none") return Compression::none;
  if (name == "float16") return Compression::float16;
  if (name == "bfloat16") return Compression::bfloat16;
  invalid(call, "unknown compression '" + name + "' (none, float16, bfloat16)", rank);
}

// packing::Reducer over raw tensors (gradcomm.torch's DistributedDataParallel and
// DistributedOptimizer feed it from autograd hooks). Its bucket memory is exported through the
// buffer protocol (bytes), so torch.frombuffer can view buckets (gradient_as_bucket_view).
class PyReducer {
 public:
  PyReducer(PyCommunicator& comm, const std::vector<std::uintptr_t>& ptrs,
            const std::vector<std::size_t>& counts, const std::vector<std::string>& dtypes,
            const std::string& op, const std::optional<std::string>& algorithm,
            std::size_t bucket_cap_bytes, std::size_t first_bucket_bytes,
            const std::string& compression, const std::vector<std::size_t>& order,
            const std::vector<std::vector<std::size_t>>& groups, bool rebuild_buckets, bool overlap,
            bool divide_before_sum)
      : held_(comm.get()) {
    const std::string call = "Reducer";
    const int rank = held_->rank();
    std::vector<packing::TensorDesc> tensors =
        PyCommunicator::tensor_list(ptrs, counts, dtypes, call, rank);
    packing::ReducerOptions o;
    o.op = parse_op(op, call, rank);
    o.algorithm = algorithm.value_or("");
    o.bucket_cap_bytes = bucket_cap_bytes;
    o.first_bucket_bytes = first_bucket_bytes;
    o.compression = parse_compression(compression, call, rank);
    o.order = order;
    o.groups = groups;
    o.rebuild_buckets = rebuild_buckets;
    o.overlap = overlap;
    o.divide_before_sum = divide_before_sum;
    py::gil_scoped_release release;  // collective: allocates the buckets
    reducer_ = std::make_unique<packing::Reducer>(*held_, std::move(tensors), std::move(o));
  }

  void mark_ready(std::size_t index, std::optional<std::uintptr_t> data) {
    py::gil_scoped_release release;
    if (data) {
      reducer_->mark_ready(index, reinterpret_cast<void*>(*data));
    } else {
      reducer_->mark_ready(index);
    }
  }
  void finish() {
    py::gil_scoped_release release;
    reducer_->finish();
  }
  void fail_iteration(const std::string& why) {
    py::gil_scoped_release release;
    reducer_->fail_iteration(why);
  }
  // Byte offset of tensor `index` in buffer() (its slot in its bucket).
  std::size_t view_offset(std::size_t index) {
    const auto* view = static_cast<std::byte*>(reducer_->bucket_view(index));
    return static_cast<std::size_t>(view - reducer_->buffer().data());
  }
  // The buckets: (dtype, wire dtype, tensor indices, element count).
  py::list buckets() const {
    py::list out;
    for (const packing::ReducerBucket& b : reducer_->buckets()) {
      out.append(py::make_tuple(std::string(to_string(b.dtype)), std::string(to_string(b.wire)),
                                b.tensors, b.count));
    }
    return out;
  }
  std::size_t iterations() const { return reducer_->iterations(); }
  bool rebuilt() const { return reducer_->rebuilt(); }
  py::buffer_info buffer() {
    const std::span<std::byte> b = reducer_->buffer();
    return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(b.size())}, {py::ssize_t{1}});
  }

 private:
  std::shared_ptr<Communicator> held_;  // destroyed after the reducer
  std::unique_ptr<packing::Reducer> reducer_;
};

py::dtype numpy_dtype(DataType d) {
  switch (d) {
    case DataType::float32:
      return py::dtype::of<float>();
    case DataType::float64:
      return py::dtype::of<double>();
    case DataType::float16:
      return py::dtype("float16");
    case DataType::int32:
      return py::dtype::of<std::int32_t>();
    case DataType::int64:
      return py::dtype::of<std::int64_t>();
    default:
      return py::dtype("uint16");
  }
}

}  // namespace
}  // namespace gradcomm::python

PYBIND11_MODULE(_gradcomm, m) {
  using namespace gradcomm;
  using namespace gradcomm::python;
  m.doc() = "gradcomm: gradient all-reduce for data-parallel training (compiled core)";

  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  // Also a ValueError, the type Python code (and Horovod code) catches for bad arguments.
  static py::exception<InvalidArgument> invalid_argument(
      m, "InvalidArgument", py::make_tuple(error, py::handle(PyExc_ValueError)));
  static py::exception<Unsupported> unsupported(m, "Unsupported", error.ptr());
  static py::exception<CommError> comm_error(m, "CommError", error.ptr());
  static py::exception<MismatchError> mismatch_error(m, "MismatchError", error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      invalid_argument(e.what());
    } catch (const Unsupported& e) {
      unsupported(e.what());
    } catch (const CommError& e) {
      comm_error(e.what());
    } catch (const MismatchError& e) {
      mismatch_error(e.what());
    } catch (const Error& e) {
      error(e.what());
    }
  });

  m.def("mpi_initialized", &mpi_ready);
  m.def(
      "init_mpi", [] { gradcomm::init(); }, "MPI_Init_thread unless MPI is initialized");
  m.def("algorithm_names", &collectives::algorithm_names);
  m.def("_gpu_unavailable_reason", &collectives::nccl_unavailable_reason,
        "why gradcomm's GPU path (NCCL) cannot run in this process; empty when it can");

  py::class_<PyCommunicator, std::shared_ptr<PyCommunicator>>(m, "Communicator")
      .def(py::init(&PyCommunicator::from_mpi4py), py::arg("mpi4py_comm"),
           "Wraps (duplicates) an mpi4py communicator")
      .def_static("world", [] { return std::make_shared<PyCommunicator>(MPI_COMM_WORLD); })
      .def("rank", &PyCommunicator::rank)
      .def("size", &PyCommunicator::size)
      .def("local_rank", &PyCommunicator::local_rank)
      .def("local_size", &PyCommunicator::local_size)
      .def("node", &PyCommunicator::node)
      .def("node_count", &PyCommunicator::node_count)
      .def("free", &PyCommunicator::free)
      .def("allreduce", &PyCommunicator::allreduce, py::arg("array"), py::arg("op") = "average",
           py::arg("algorithm") = py::none(), py::arg("out") = py::none())
      .def("grouped_allreduce", &PyCommunicator::grouped_allreduce, py::arg("arrays"),
           py::arg("op") = "average", py::arg("algorithm") = py::none(),
           py::arg("fusion_threshold") = py::none())
      .def("broadcast", &PyCommunicator::broadcast, py::arg("array"), py::arg("root") = 0)
      .def("reduce_scatter", &PyCommunicator::reduce_scatter, py::arg("array"),
           py::arg("op") = "average", py::arg("algorithm") = py::none(),
           py::arg("out") = py::none())
      .def("allreduce_async", &PyCommunicator::allreduce_async, py::arg("array"),
           py::arg("op") = "average", py::arg("algorithm") = py::none(),
           py::arg("out") = py::none())
      .def("_allreduce_ptr", &PyCommunicator::allreduce_ptr)
      .def("_allreduce_async_ptr", &PyCommunicator::allreduce_async_ptr)
      .def("_grouped_allreduce_ptrs", &PyCommunicator::grouped_allreduce_ptrs)
      .def("_broadcast_ptr", &PyCommunicator::broadcast_ptr)
      .def("_barrier", &PyCommunicator::barrier_)
      .def("_fail_next_call", &PyCommunicator::fail_next_call)
      .def("_allgather_bytes_ptr", &PyCommunicator::allgather_bytes_ptr)
      .def("_allgatherv_bytes_ptr", &PyCommunicator::allgatherv_bytes_ptr)
      .def("_broadcast_bytes_ptr", &PyCommunicator::broadcast_bytes_ptr)
      .def("_grouped_allreduce_async_ptrs", &PyCommunicator::grouped_allreduce_async_ptrs)
      .def("_broadcast_async_ptr", &PyCommunicator::broadcast_async_ptr)
      .def(
          "_negotiator", [](PyCommunicator& self) { return make_negotiator(self.get()); },
          "A negotiator over this communicator (collective): gradcomm.torch's calls by name")
      .def("_bench_allreduce", &PyCommunicator::bench_allreduce, py::arg("array"),
           py::arg("iterations"), py::arg("op") = "sum", py::arg("algorithm") = py::none());

  bind_negotiation(m);
  py::class_<PyRequest>(m, "Request")
      .def("wait", &PyRequest::wait, "Blocks (GIL released) until done; returns the result")
      .def("done", &PyRequest::done, "True once finished; never blocks");

  py::class_<PyReducer>(m, "_Reducer", py::buffer_protocol())
      .def(py::init<PyCommunicator&, const std::vector<std::uintptr_t>&,
                    const std::vector<std::size_t>&, const std::vector<std::string>&,
                    const std::string&, const std::optional<std::string>&, std::size_t, std::size_t,
                    const std::string&, const std::vector<std::size_t>&,
                    const std::vector<std::vector<std::size_t>>&, bool, bool, bool>(),
           py::arg("comm"), py::arg("ptrs"), py::arg("counts"), py::arg("dtypes"), py::arg("op"),
           py::arg("algorithm"), py::arg("bucket_cap_bytes"), py::arg("first_bucket_bytes"),
           py::arg("compression"), py::arg("order"), py::arg("groups"), py::arg("rebuild_buckets"),
           py::arg("overlap"), py::arg("divide_before_sum") = false)
      .def("mark_ready", &PyReducer::mark_ready, py::arg("index"), py::arg("data") = py::none())
      .def("finish", &PyReducer::finish)
      .def("fail_iteration", &PyReducer::fail_iteration, py::arg("why"))
      .def("view_offset", &PyReducer::view_offset)
      .def("buckets", &PyReducer::buckets)
      .def("iterations", &PyReducer::iterations)
      .def("rebuilt", &PyReducer::rebuilt)
      .def_buffer(&PyReducer::buffer);

  // packing::plan_reducer_buckets, for a reducer whose buckets live elsewhere (gradcomm.torch's
  // CUDA gradients, reduced on the GPU): (dtype, wire dtype, tensor indices, element offsets,
  // element count) per bucket, in launch order. An empty order is reverse index order.
  m.def(
      "_plan_reducer_buckets",
      [](const std::vector<std::size_t>& counts, const std::vector<std::string>& dtypes,
         std::size_t bucket_cap_bytes, std::size_t first_bucket_bytes,
         const std::string& compression, const std::vector<std::size_t>& order,
         const std::vector<std::vector<std::size_t>>& groups, const std::string& call, int rank) {
        if (counts.size() != dtypes.size())
          invalid(call, "counts and dtypes differ in length", rank);
        if (bucket_cap_bytes == 0 || first_bucket_bytes == 0) {
          invalid(call, "bucket_cap_bytes and first_bucket_bytes must be positive", rank);
        }
        packing::ReducerOptions o;
        o.bucket_cap_bytes = bucket_cap_bytes;
        o.first_bucket_bytes = first_bucket_bytes;
        o.compression = parse_compression(compression, call, rank);
        o.groups = groups;
        std::vector<packing::TensorDesc> tensors;
        for (std::size_t i = 0; i < counts.size(); ++i)
          tensors.push_back({nullptr, counts[i], parse_dtype(dtypes[i], call, rank)});
        const std::vector<std::size_t> checked =
            packing::checked_reducer_order(order, counts.size(), groups, call, rank);
        py::list out;
        for (const packing::ReducerBucket& b : packing::plan_reducer_buckets(tensors, checked, o)) {
          out.append(py::make_tuple(std::string(to_string(b.dtype)), std::string(to_string(b.wire)),
                                    b.tensors, b.offsets, b.count));
        }
        return out;
      },
      py::arg("counts"), py::arg("dtypes"), py::arg("bucket_cap_bytes"),
      py::arg("first_bucket_bytes"), py::arg("compression"), py::arg("order"), py::arg("groups"),
      py::arg("call"), py::arg("rank"));
  m.def(
      "_timeline_start", [](const std::string& path, int rank) { timeline::start(path, rank); },
      py::arg("path"), py::arg("rank"));
  m.def("_timeline_stop", [] { timeline::stop(); });
  m.def("_timeline_path", [] { return timeline::path(); });

  py::class_<PyPacker>(m, "GradientPacker")
      .def(py::init<const py::list&, int>(), py::arg("arrays"), py::arg("num_split") = 8)
      .def_property_readonly("declined", &PyPacker::declined)
      .def_property_readonly("decline_reason", &PyPacker::decline_reason)
      .def("pack", &PyPacker::pack)
      .def("unpack", &PyPacker::unpack)
      .def(
          "buffers",
          [](py::object self) {
            PyPacker& p = self.cast<PyPacker&>();
            py::list out;
            for (const auto& packed : p.get().packed()) {
              out.append(py::array(numpy_dtype(packed.dtype),
                                   {static_cast<py::ssize_t>(packed.count)}, {}, packed.data,
                                   self));
            }
            return out;
          },
          "NumPy views of the packed buffers (one per dtype); they keep the packer alive");
}
