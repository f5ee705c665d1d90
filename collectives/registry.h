#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/allreduce_algorithm.h"
#include "core/communicator.h"

namespace gradcomm::collectives {

struct AlgorithmEntry {
  std::string_view name;
  std::string_view summary;  // one line, for --list and error messages
  std::function<std::unique_ptr<AllreduceAlgorithm>()> create;
  // One instance made at start-up, for what does not need a communicator: capabilities() and
  // predicted_seconds().
  std::shared_ptr<const AllreduceAlgorithm> prototype;
};

// Every algorithm this build has, in registry order (the order is for display only: `auto`
// decides by cost, never by position).
const std::vector<AlgorithmEntry>& registered_algorithms();

// The names a user may pass: the registered ones plus "auto".
std::vector<std::string> algorithm_names();
// "auto" and the algorithms that reduce host buffers (capabilities().host_buffers): what tests and
// sweeps over host memory iterate.
std::vector<std::string> host_algorithm_names();
// The registered algorithms that take GPU buffers (capabilities().device_buffers), joined by
// ", ": for error messages.
std::string device_algorithm_names_joined();
// The registered algorithm called `name` (its prototype); null for "auto" and unknown names.
const AllreduceAlgorithm* find_prototype(std::string_view name);
// "auto, flat, ring, ..." for error messages.
std::string algorithm_names_joined();
// The error detail for an unknown algorithm name: "unknown algorithm 'x' (from
// GRADCOMM_ALGORITHM); valid names: ..." (the parenthesis when it came from the environment).
std::string unknown_algorithm(std::string_view name, bool from_environment);
bool is_algorithm_name(std::string_view name);
// The position of `name` among algorithm_names() (-1 when it is none of them), and the name at a
// position in static storage (null when out of range): how call fingerprints carry algorithms.
int algorithm_index(std::string_view name);
const char* algorithm_name_at(int index);
// The prototype of the algorithm at that position (null for auto's 0 and out of range): what
// find_prototype gives for its name, without comparing names again.
const AllreduceAlgorithm* prototype_at(int index);

// The algorithm objects of one communicator, created on first use and reused.
class AlgorithmCache : public Attachment {
 public:
  explicit AlgorithmCache(Communicator&) {}
  // The algorithm called `name`; nullptr when no algorithm has that name.
  AllreduceAlgorithm* find(std::string_view name);

 private:
  std::vector<std::unique_ptr<AllreduceAlgorithm>> algorithms_;
};

}  // namespace gradcomm::collectives
