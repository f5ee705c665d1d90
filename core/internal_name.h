#pragma once

#include <mpi.h>

#include <string>
#include <string_view>

#include "core/error.h"

namespace gradcomm {

// The name (MPI_Comm_set_name) of every communicator gradcomm makes. libgradcomm_mpi.so passes
// calls on communicators so named straight to MPI: they belong to another copy of gradcomm in
// the same process (the Python module in a program run under the preload), and their traffic is
// gradcomm's already.
inline constexpr char kInternalCommName[] = "gradcomm internal";

// Gives `comm` that name; `call` and `rank` name the caller in the error.
inline void name_internal(MPI_Comm comm, std::string_view call, int rank) {
  check_mpi(MPI_Comm_set_name(comm, kInternalCommName), std::string(call) + ": MPI_Comm_set_name",
            rank);
}

}  // namespace gradcomm
