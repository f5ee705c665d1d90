// gradcomm::init / finalize own MPI only when they started it. Two modes, one per CTest entry:
//   owned: gradcomm::init starts MPI, so gradcomm::finalize ends it;
//   user:  the program starts MPI itself; gradcomm::init and finalize leave it alone, and a
//          Communicator wrapping the user's MPI_Comm works (how other frameworks link us).
// Prints "N passed, N failed" and exits non-zero on failure.

#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "collectives/allreduce.h"
#include "core/communicator.h"

namespace {

int g_passed = 0;
int g_failed = 0;

void expect(bool ok, const char* what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::fprintf(stderr, "FAILED: %s\n", what);
  }
}

bool finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

void use(MPI_Comm user_comm) {
  gradcomm::Communicator comm(user_comm);
  int world = 0;
  MPI_Comm_size(user_comm, &world);
  std::vector<double> v(5, 2.0);
  gradcomm::allreduce(comm, v.data(), v.data(), v.size(), gradcomm::DataType::float64,
                      gradcomm::ReduceOp::sum, {.algorithm = "ring"});
  expect(v[4] == 2.0 * world, "allreduce on the wrapped communicator");
  expect(comm.mpi_comm() != user_comm, "the communicator is a duplicate, not the user's");
}

}  // namespace

int main(int argc, char** argv) {
  const bool user_mode = argc > 1 && std::strcmp(argv[1], "user") == 0;
  int rank = 0;
  if (user_mode) {
    MPI_Init(&argc, &argv);
    gradcomm::init(&argc, &argv);  // must not initialize again
    use(MPI_COMM_WORLD);
    gradcomm::finalize();  // must not finalize the user's MPI
    expect(!finalized(), "gradcomm::finalize left the user's MPI running");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int dummy = 1;
    expect(MPI_Allreduce(MPI_IN_PLACE, &dummy, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS,
           "MPI still usable after gradcomm::finalize");
    MPI_Finalize();
  } else {
    gradcomm::init(&argc, &argv);
    gradcomm::init(&argc, &argv);  // idempotent
    expect(gradcomm::mpi_ready(), "gradcomm::init initialized MPI");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    use(MPI_COMM_WORLD);
    gradcomm::finalize();
    expect(finalized(), "gradcomm::finalize finalized the MPI it initialized");
    gradcomm::finalize();  // idempotent
  }
  if (rank == 0 || g_failed) std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
