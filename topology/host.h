#pragma once

// Which ranks of a communicator share a host, and whether a machine runs more ranks than it has
// hardware threads. Each answer is the same on every rank; the first query on a communicator is
// collective (one node split and one 8-byte allgather), later ones are cached on it.

#include "core/communicator.h"

namespace gradcomm::topology {

// How many ranks of `comm` share this rank's host (MPI_COMM_TYPE_SHARED).
int ranks_on_this_host(Communicator& comm);

// How many ranks of `comm` run under this rank's kernel (same boot id), which share its CPUs:
// ranks_on_this_host on real clusters, more on hosts emulated in namespaces or containers of one
// machine.
int ranks_on_this_machine(Communicator& comm);

// True on every rank when all ranks of `comm` share one host.
bool shares_one_host(Communicator& comm);

// True on every rank when some machine runs more of `comm`'s ranks than it has hardware threads
// (ranks_on_this_machine against hwloc's count; collective: one MPI_Allreduce).
bool machine_oversubscribed(Communicator& comm);

// CPUs this process may run on (its affinity mask; at least 1).
int usable_cores();

}  // namespace gradcomm::topology
