// gradcomm-topo: prints the layout gradcomm sees (run it under mpirun, with the same
// GRADCOMM_* settings as the job). Human text by default, --json for machines.

#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "topology/topology.h"

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  int rc = 0;
  try {
    const bool json = argc > 1 && std::strcmp(argv[1], "--json") == 0;
    if (argc > 1 && !json) {
      throw gradcomm::InvalidArgument("usage: mpirun -np N gradcomm-topo [--json]");
    }
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    const gradcomm::topology::Topology& t = gradcomm::topology::topology_of(comm);
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    gradcomm::check_mpi(MPI_Get_processor_name(name, &length),
                        "gradcomm-topo: MPI_Get_processor_name", comm.rank());
    std::vector<char> all(static_cast<std::size_t>(comm.size()) * MPI_MAX_PROCESSOR_NAME);
    gradcomm::check_mpi(MPI_Gather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(),
                                   MPI_MAX_PROCESSOR_NAME, MPI_CHAR, 0, comm.mpi_comm()),
                        "gradcomm-topo: MPI_Gather of the host names", comm.rank());
    if (comm.rank() == 0) {
      std::vector<std::string> hosts;
      for (int r = 0; r < comm.size(); ++r)
        hosts.emplace_back(&all[r * MPI_MAX_PROCESSOR_NAME]);
      std::fputs(json ? gradcomm::topology::to_json(t, hosts).c_str()
                      : gradcomm::topology::describe(t).c_str(),
                 stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    rc = 2;
  }
  gradcomm::finalize();
  return rc;
}
