#pragma once

#include <string_view>

#include "collectives/allreduce_algorithm.h"

namespace gradcomm::collectives {

// The policy behind algorithm "auto": the registered algorithm to use for this call. Depends only
// on values equal on all ranks (count, dtype, rank count), so every rank picks the same one.
std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm);

}  // namespace gradcomm::collectives
