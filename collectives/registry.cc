#include "collectives/registry.h"

#include "collectives/allreduce_flat.h"
#include "collectives/allreduce_halving_doubling.h"
#include "collectives/allreduce_hierarchical.h"
#include "collectives/allreduce_mpi.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/allreduce_ring.h"
#include "collectives/allreduce_shm.h"

namespace gradcomm::collectives {

template <class T>
std::unique_ptr<AllreduceAlgorithm> make() {
  return std::make_unique<T>();
}

std::vector<AlgorithmEntry> with_prototypes(std::vector<AlgorithmEntry> entries) {
  for (AlgorithmEntry& entry : entries)
    entry.prototype = entry.create();
  return entries;
}

const std::vector<AlgorithmEntry>& registered_algorithms() {
  // Adding an algorithm: its files, and one line here.
  static const std::vector<AlgorithmEntry> entries = with_prototypes({
      {"flat", "reduce to a rotating root, then broadcast from it", make<AllreduceFlat>, nullptr},
      {"ring", "pipelined ring reduce-scatter + all-gather", make<AllreduceRing>, nullptr},
      {"halving_doubling", "Rabenseifner recursive halving + doubling",
       make<AllreduceHalvingDoubling>, nullptr},
      {"hierarchical", "reduce-scatter in groups (nodes), all-reduce across, all-gather in groups",
       make<AllreduceHierarchical>, nullptr},
      {"shm", "shared memory inside one node: reduce slices from peers' slots, copy out",
       make<AllreduceShm>, nullptr},
      {"mpi", "MPI_Allreduce of the MPI library", make<AllreduceMpi>, nullptr},
      {"nccl", "ncclAllReduce on device buffers (GPU module libgradcomm_nccl.so)",
       make<AllreduceNccl>, nullptr},
  });
  return entries;
}

std::vector<std::string> algorithm_names() {
  std::vector<std::string> names = {"auto"};
  for (const AlgorithmEntry& entry : registered_algorithms())
    names.emplace_back(entry.name);
  return names;
}

std::vector<std::string> host_algorithm_names() {
  std::vector<std::string> names = {"auto"};
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.prototype->capabilities().host_buffers) names.emplace_back(entry.name);
  }
  return names;
}

std::string device_algorithm_names_joined() {
  std::string joined;
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (!entry.prototype->capabilities().device_buffers) continue;
    if (!joined.empty()) joined += ", ";
    joined.append(entry.name);
  }
  return joined;
}

const AllreduceAlgorithm* find_prototype(std::string_view name) {
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.name == name) return entry.prototype.get();
  }
  return nullptr;
}

std::string algorithm_names_joined() {
  std::string joined;
  for (const std::string& name : algorithm_names()) {
    if (!joined.empty()) joined += ", ";
    joined += name;
  }
  return joined;
}

std::string unknown_algorithm(std::string_view name, bool from_environment) {
  std::string detail = "unknown algorithm '";
  detail.append(name).push_back('\'');
  if (from_environment) detail.append(" (from GRADCOMM_ALGORITHM)");
  detail.append("; valid names: ").append(algorithm_names_joined());
  return detail;
}

bool is_algorithm_name(std::string_view name) {
  if (name == "auto") return true;
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.name == name) return true;
  }
  return false;
}

namespace {
const std::vector<std::string>& static_algorithm_names() {
  static const std::vector<std::string> names = algorithm_names();
  return names;
}
}  // namespace

int algorithm_index(std::string_view name) {
  const std::vector<std::string>& names = static_algorithm_names();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<int>(i);
  }
  return -1;
}

const char* algorithm_name_at(int index) {
  const std::vector<std::string>& names = static_algorithm_names();
  return index >= 0 && static_cast<std::size_t>(index) < names.size()
             ? names[static_cast<std::size_t>(index)].c_str()
             : nullptr;
}

const AllreduceAlgorithm* prototype_at(int index) {
  const std::vector<AlgorithmEntry>& entries = registered_algorithms();
  // algorithm_names() is "auto", then the registered algorithms in order.
  return index >= 1 && static_cast<std::size_t>(index) <= entries.size()
             ? entries[static_cast<std::size_t>(index) - 1].prototype.get()
             : nullptr;
}

AllreduceAlgorithm* AlgorithmCache::find(std::string_view name) {
  for (const auto& algorithm : algorithms_) {
    if (algorithm->name() == name) return algorithm.get();
  }
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.name == name) return algorithms_.emplace_back(entry.create()).get();
  }
  return nullptr;
}

}  // namespace gradcomm::collectives
