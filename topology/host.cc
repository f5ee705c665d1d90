#include "topology/host.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/node_comm.h"
#include "topology/topology.h"

namespace gradcomm::topology {
namespace {

// How many ranks of the communicator share this rank's host and its kernel (collective on first
// use).
class HostCount : public Attachment {
 public:
  explicit HostCount(Communicator& comm) {
    on_host = NodeComm(comm.mpi_comm(), comm.rank(), "host query").size();
    // Ranks under the same running kernel (boot id) share its CPUs even when MPI sees separate
    // nodes: the emulated hosts of scripts/hosts, containers. One allgather of 8 bytes.
    std::uint64_t mine = 0;
    std::ifstream id("/proc/sys/kernel/random/boot_id");
    std::string text;
    if (std::getline(id, text) && !text.empty()) mine = std::hash<std::string>{}(text) | 1;
    std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
    check_mpi(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm.mpi_comm()),
              "host query: MPI_Allgather of the boot ids", comm.rank());
    on_machine = mine == 0 ? on_host : static_cast<int>(std::count(all.begin(), all.end(), mine));
  }
  int on_host = 1;
  int on_machine = 1;  // >= on_host
};

}  // namespace

int ranks_on_this_host(Communicator& comm) {
  comm.settle();
  return comm.attachment<HostCount>().on_host;
}

int ranks_on_this_machine(Communicator& comm) {
  comm.settle();
  return comm.attachment<HostCount>().on_machine;
}

bool shares_one_host(Communicator& comm) {
  return ranks_on_this_host(comm) == comm.size();
}

bool machine_oversubscribed(Communicator& comm) {
  const int threads = std::max(1, topology_of(comm).hardware.hardware_threads);
  int crowded = ranks_on_this_machine(comm) > threads ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &crowded, 1, MPI_INT, MPI_MAX, comm.mpi_comm()),
            "host query: MPI_Allreduce of oversubscription", comm.rank());
  return crowded != 0;
}

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace gradcomm::topology
