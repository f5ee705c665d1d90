#include "bindings/python/negotiation.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "packing/negotiator.h"
#include "packing/tensor.h"

namespace py = pybind11;

namespace gradcomm::python {
namespace {

NegotiatedKind parse_kind(const std::string& kind, int rank) {
  static const std::pair<const char*, NegotiatedKind> kinds[] = {
      {"allreduce", NegotiatedKind::allreduce},
      {"broadcast", NegotiatedKind::broadcast},
      {"allgather", NegotiatedKind::allgather},
      {"alltoall", NegotiatedKind::alltoall},
      {"barrier", NegotiatedKind::barrier},
      {"join", NegotiatedKind::join},
      {"reducescatter", NegotiatedKind::reducescatter},
      {"failed", NegotiatedKind::failed}};
  for (const auto& [name, value] : kinds) {
    if (kind == name) return value;
  }
  throw InvalidArgument(error_message("negotiation", rank, "unknown operation kind " + kind));
}

// One submitted operation: done() and wait() raise its error; the result (allgather, alltoall,
// a broadcast sized by its root) is this object's buffer, which torch.frombuffer can wrap.
class PyNegotiated {
 public:
  PyNegotiated(std::shared_ptr<Negotiator> owner, std::shared_ptr<NegotiatedState> state)
      : owner_(std::move(owner)), state_(std::move(state)) {}

  bool done() { return Negotiator::test(*state_); }
  void wait() {
    py::gil_scoped_release release;
    owner_->wait(*state_);
  }
  std::vector<std::uint64_t> counts() const { return state_->counts; }
  int last_joined() const { return state_->last_joined; }
  std::size_t nbytes() const { return state_->result.size(); }
  py::buffer_info buffer() {
    if (!state_->done.load(std::memory_order_acquire)) {
      throw InvalidArgument("negotiation: the result of '" + state_->call.name +
                            "' was read before the operation finished");
    }
    return py::buffer_info(state_->result.data(), 1, py::format_descriptor<std::uint8_t>::format(),
                           static_cast<py::ssize_t>(state_->result.size()));
  }

 private:
  std::shared_ptr<Negotiator> owner_;
  std::shared_ptr<NegotiatedState> state_;
};

class PyNegotiator {
 public:
  explicit PyNegotiator(const std::shared_ptr<Communicator>& parent)
      : negotiator_(std::make_shared<Negotiator>(*parent)) {}

  PyNegotiated submit(const std::string& name, const std::string& kind,
                      const std::string& signature, std::uintptr_t data, std::uint64_t count,
                      std::optional<std::string> dtype, std::optional<std::string> op, int root,
                      bool sized_by_root, std::vector<std::uint64_t> splits, double prescale,
                      double postscale, std::string algorithm, std::size_t fusion_threshold,
                      bool device, std::uintptr_t ready_event, int gpu) {
    const int rank = negotiator_->rank();
    NegotiatedCall call;
    call.name = name;
    call.kind = parse_kind(kind, rank);
    call.signature = signature;
    call.data = reinterpret_cast<void*>(data);
    call.count = count;
    if (dtype) {
      const auto d = parse_data_type(*dtype);
      if (!d) throw InvalidArgument(error_message(name, rank, "unknown dtype " + *dtype));
      call.dtype = *d;
    }
    if (op) {
      const auto o = parse_reduce_op(*op);
      if (!o) throw InvalidArgument(error_message(name, rank, "unknown op " + *op));
      call.op = *o;
    }
    call.root = root;
    call.sized_by_root = sized_by_root;
    call.splits = std::move(splits);
    call.prescale = prescale;
    call.postscale = postscale;
    call.algorithm = std::move(algorithm);
    call.fusion_threshold = fusion_threshold;
    call.device = device;
    call.ready_event = reinterpret_cast<void*>(ready_event);
    call.gpu = gpu;
    return PyNegotiated(negotiator_, negotiator_->submit(std::move(call)));
  }

  void close() {
    py::gil_scoped_release release;
    negotiator_->close();
  }

 private:
  std::shared_ptr<Negotiator> negotiator_;
};

}  // namespace

void bind_negotiation(py::module_& m) {
  py::class_<PyNegotiated>(m, "_Negotiated", py::buffer_protocol())
      .def("done", &PyNegotiated::done)
      .def("wait", &PyNegotiated::wait)
      .def("counts", &PyNegotiated::counts)
      .def("last_joined", &PyNegotiated::last_joined)
      .def("nbytes", &PyNegotiated::nbytes)
      .def_buffer(&PyNegotiated::buffer);
  py::class_<PyNegotiator>(m, "_Negotiator")
      .def("submit", &PyNegotiator::submit, py::arg("name"), py::arg("kind"), py::arg("signature"),
           py::arg("data") = 0, py::arg("count") = 0, py::arg("dtype") = py::none(),
           py::arg("op") = py::none(), py::arg("root") = -1, py::arg("sized_by_root") = false,
           py::arg("splits") = std::vector<std::uint64_t>{}, py::arg("prescale") = 1.0,
           py::arg("postscale") = 1.0, py::arg("algorithm") = "", py::arg("fusion_threshold") = 0,
           py::arg("device") = false, py::arg("ready_event") = 0, py::arg("gpu") = -1)
      .def("close", &PyNegotiator::close);
  // packing::validate_tensors for a front end that submits a list's tensors one by one:
  // (address, count, dtype name) each; InvalidArgument naming `call`, `rank` and the tensor.
  m.def(
      "_validate_tensors",
      [](const std::vector<std::tuple<std::uintptr_t, std::size_t, std::string>>& tensors,
         const std::string& call, int rank) {
        std::vector<packing::TensorDesc> descs;
        for (const auto& [address, count, dtype] : tensors) {
          const auto d = parse_data_type(dtype);
          if (!d) throw InvalidArgument(error_message(call, rank, "unknown dtype " + dtype));
          descs.push_back({reinterpret_cast<void*>(address), count, *d});
        }
        packing::validate_tensors(descs, call, rank);
      },
      py::arg("tensors"), py::arg("call"), py::arg("rank"));
}

py::object make_negotiator(const std::shared_ptr<Communicator>& parent) {
  std::optional<PyNegotiator> made;
  {
    py::gil_scoped_release release;  // collective: other threads may need the GIL meanwhile
    made.emplace(parent);
  }
  return py::cast(std::move(*made));
}

}  // namespace gradcomm::python
