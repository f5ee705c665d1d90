// _c10d_torch<major>_<minor>: the gradcomm backend of torch.distributed, built against one torch
// (bindings/torch/CMakeLists.txt builds one module per torch it is given). gradcomm.torch
// imports the one that matches the running torch and registers the backend.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // c10::intrusive_ptr as a pybind11 holder

#include "bindings/torch/process_group.h"
#include "core/progress_engine.h"

namespace py = pybind11;
using gradcomm::torch_backend::BackendBase;
using gradcomm::torch_backend::ProcessGroupGradcomm;

PYBIND11_MODULE(GRADCOMM_TORCH_MODULE_NAME, m) {
  m.doc() = "gradcomm's torch.distributed backend (compiled against one torch version)";
  // torch.distributed registers c10d's types (ProcessGroup or Backend, Store) with pybind11.
  py::module_::import("torch.distributed");
  m.attr("torch_version") = TORCH_VERSION;
  // Whether torch's DDP can take its host buckets from gradcomm's registered memory
  // (ProcessGroupGradcomm::allocateTensor; torch asks only where DDP_DISABLE_COMM_MEM=0).
  m.attr("allocates_buckets") = static_cast<bool>(GRADCOMM_TORCH_TENSOR_ALLOC);
  py::class_<ProcessGroupGradcomm, BackendBase, c10::intrusive_ptr<ProcessGroupGradcomm>>(
      m, "ProcessGroupGradcomm")
      .def("algorithm",
           [](ProcessGroupGradcomm& pg) { return pg.communicator().config().algorithm; })
      .def("mpi_rank", [](ProcessGroupGradcomm& pg) { return pg.communicator().rank(); });
  m.def(
      "drain",
      [] {
        py::gil_scoped_release release;  // the engines may need the GIL to release tensors
        gradcomm::drain_all_engines();
      },
      "Waits until every group's calls have run (at exit, before Python finalizes)");
  m.def(
      "create",
      [](int group_rank, int group_size, const std::vector<int64_t>& global_ranks,
         std::optional<double> timeout_seconds, const std::string& group_name) {
        py::gil_scoped_release release;  // collective: other threads may need the GIL meanwhile
        return gradcomm::torch_backend::create_process_group(group_rank, group_size, global_ranks,
                                                             timeout_seconds, group_name);
      },
      py::arg("group_rank"), py::arg("group_size"), py::arg("global_ranks"),
      py::arg("timeout_seconds") = py::none(), py::arg("group_name") = "",
      "The backend of a group: the world (empty global_ranks) or a new_group's members; "
      "timeout_seconds (torch's, where the caller gave one) replaces GRADCOMM_TIMEOUT for it; "
      "group_name, torch's name of the group (the same on every rank for one new_group call)");
}
