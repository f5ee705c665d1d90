// Fuzz target: the workload-file parser (packing/workload.h) that benchmarks, tests and the
// trainer's --workload read. Properties: parse_workload either returns a workload or throws
// InvalidArgument; a workload it returns has a model name, and every tensor's count is the
// product of its non-negative shape, with the total computed without overflow.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "packing/workload.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  gradcomm::packing::Workload w;
  try {
    w = gradcomm::packing::parse_workload(text, "fuzz input");
  } catch (const gradcomm::InvalidArgument&) {
    return 0;
  }
  std::size_t total = 0;
  for (const auto& t : w.tensors) {
    std::size_t count = 1;
    for (std::int64_t d : t.shape) {
      if (d < 0) std::abort();
      count *= static_cast<std::size_t>(d);
    }
    if (count != t.count) std::abort();
    total += t.count;
  }
  if (total != w.total_elements()) std::abort();
  return 0;
}
