// The C++ API from an installed gradcomm (find_package(gradcomm), target gradcomm::gradcomm).
#include <gradcomm/gradcomm.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  int bad = 0;
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    std::vector<float> v(1000, 1.0f);
    gradcomm::allreduce<float>(comm, v, gradcomm::ReduceOp::sum);
    bad = v[999] != static_cast<float>(comm.size());
    if (comm.rank() == 0) std::printf("c++ api: %s\n", bad ? "FAILED" : "ok");
  }
  gradcomm::finalize();
  return bad;
}
