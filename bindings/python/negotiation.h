#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "core/communicator.h"

namespace gradcomm::python {

// Registers _Negotiator and _Negotiated (packing/negotiator.h for Python: gradcomm.torch's
// Horovod-style calls are matched by name through them).
void bind_negotiation(pybind11::module_& m);

// A negotiator over `parent` (collective over it), as the Python object _Negotiator.
pybind11::object make_negotiator(const std::shared_ptr<Communicator>& parent);

}  // namespace gradcomm::python
