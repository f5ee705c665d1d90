// gradcomm::init / finalize own MPI only when they started it. Two modes, one per CTest entry:
//   owned: gradcomm::init starts MPI, so gradcomm::finalize ends it;
//   user:  the program starts MPI itself (MPI_Init: MPI_THREAD_SINGLE); gradcomm::init and
//          finalize leave it alone, a Communicator wrapping the user's MPI_Comm works (how other
//          frameworks link us), and a non-blocking call is refused, naming the thread level,
//          while the blocking calls go on working;
//   owned also checks that gradcomm::init asked for MPI_THREAD_MULTIPLE and non-blocking calls run.
// Prints "N passed, N failed" and exits non-zero on failure.

#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include <string>

#include "collectives/allreduce.h"
#include "core/communicator.h"
#include "core/error.h"

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
  int level = 0;
  MPI_Query_thread(&level);
  std::vector<double> w(5, 1.0);
  if (level == MPI_THREAD_MULTIPLE) {
    gradcomm::iallreduce(comm, w.data(), w.data(), w.size(), gradcomm::DataType::float64,
                         gradcomm::ReduceOp::sum, {.algorithm = "ring"})
        .wait();
    expect(w[4] == 1.0 * world, "iallreduce at MPI_THREAD_MULTIPLE");
    return;
  }
  bool refused = false;
  try {
    gradcomm::iallreduce(comm, w.data(), w.data(), w.size(), gradcomm::DataType::float64,
                         gradcomm::ReduceOp::sum);
  } catch (const gradcomm::Unsupported& e) {
    const std::string what = e.what();
    refused = what.find("iallreduce(") != std::string::npos &&
              what.find("MPI_THREAD_SINGLE") != std::string::npos &&
              what.find("MPI_THREAD_MULTIPLE") != std::string::npos;
    if (!refused) std::fprintf(stderr, "unexpected message: %s\n", e.what());
  }
  expect(refused, "iallreduce refused below MPI_THREAD_MULTIPLE, naming the level");
  gradcomm::allreduce(comm, w.data(), w.data(), w.size(), gradcomm::DataType::float64,
                      gradcomm::ReduceOp::sum);
  expect(w[4] == 1.0 * world, "blocking calls still work after the refusal");
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
    int level = 0;
    MPI_Query_thread(&level);
    expect(level == MPI_THREAD_MULTIPLE, "gradcomm::init asked for MPI_THREAD_MULTIPLE");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    use(MPI_COMM_WORLD);
    gradcomm::finalize();
    expect(finalized(), "gradcomm::finalize finalized the MPI it initialized");
    gradcomm::finalize();  // idempotent
  }
  if (rank == 0 || g_failed) std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
