// Helper of watchdog_test.sh: ranks that stall on purpose, so the watchdog must report and abort.
//   missing R    every rank but R runs all-reduces; R sleeps in user code from call 3 on
//   unsubmitted R  the same with non-blocking all-reduces: R never submits call 3, the others
//                wait on its request
//   order        ranks disagree on the order of collectives inside shm (run with
//                GRADCOMM_CHECK=off, so that only the watchdog can see it)
//   communicators  rank 0 makes its first call on one communicator, the others theirs on
//                another: nothing matches (the first call's setup is collective)
// A run that is not aborted prints "not aborted" and exits 0, which the script counts as failure.

#include <gradcomm/gradcomm.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "missing";
  if (mode == "communicators") {
    gradcomm::Communicator a(MPI_COMM_WORLD), b(MPI_COMM_WORLD);
    std::vector<float> data(1000, 1.0f);
    gradcomm::allreduce(a.rank() == 0 ? a : b, data.data(), data.data(), data.size(),
                        gradcomm::DataType::float32, gradcomm::ReduceOp::sum);
    std::printf("rank %d: not aborted\n", a.rank());
    gradcomm::finalize();
    return 0;
  }
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    std::vector<float> data(1000, 1.0f);
    for (int i = 0; i < 6; ++i) {
      if ((mode == "missing" || mode == "unsubmitted") && i == 3 &&
          comm.rank() == std::atoi(argv[2])) {
        sleep(120);  // busy elsewhere: never arrives at call 3
      }
      if (mode == "unsubmitted") {
        gradcomm::iallreduce(comm, data.data(), data.data(), data.size(),
                             gradcomm::DataType::float32, gradcomm::ReduceOp::max,
                             {.algorithm = "ring"})
            .wait();
        continue;
      }
      if (mode == "order" && i == 3) {
        if (comm.rank() == 1) {
          gradcomm::broadcast(comm, data.data(), data.size(), gradcomm::DataType::float32, 0);
        }
        gradcomm::allreduce(comm, data.data(), data.data(), data.size(),
                            gradcomm::DataType::float32, gradcomm::ReduceOp::max,
                            {.algorithm = "shm"});
        if (comm.rank() != 1) {
          gradcomm::broadcast(comm, data.data(), data.size(), gradcomm::DataType::float32, 0);
        }
        continue;
      }
      gradcomm::allreduce(comm, data.data(), data.data(), data.size(), gradcomm::DataType::float32,
                          gradcomm::ReduceOp::max, {.algorithm = mode == "order" ? "shm" : "ring"});
    }
    std::printf("rank %d: not aborted\n", comm.rank());
  }
  gradcomm::finalize();
  return 0;
}
