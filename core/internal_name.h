#pragma once

#include <mpi.h>

namespace gradcomm {

// The name (MPI_Comm_set_name) of every communicator gradcomm makes. libgradcomm_mpi.so passes
// calls on communicators so named straight to MPI: they belong to another copy of gradcomm in
// the same process (the Python module in a program run under the preload), and their traffic is
// gradcomm's already.
inline constexpr char kInternalCommName[] = "gradcomm internal";

// Gives `comm` that name. Best effort, on purpose: a name MPI could not set only means that the
// preload, if any, routes this copy's calls through gradcomm a second time, and throwing from
// the constructors that call this would leak the communicator they just made.
inline void name_internal(MPI_Comm comm) {
  (void)MPI_Comm_set_name(comm, kInternalCommName);
}

}  // namespace gradcomm
