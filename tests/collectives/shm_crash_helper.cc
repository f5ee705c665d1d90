// Helper of shm_crash_test.sh: registered buffers and shm all-reduces in a loop; the last rank
// kills itself (SIGKILL) part-way, while the others are inside the algorithm.

#include <gradcomm/gradcomm.h>
#include <signal.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    gradcomm::RegisteredBuffer registered = comm.allocate(std::size_t{1} << 22);
    std::vector<float> data(std::size_t{1} << 20, 1.0f);
    for (int i = 0; i < 1000; ++i) {
      if (i == 50 && comm.rank() == comm.size() - 1) raise(SIGKILL);
      float* buffer = i % 2 ? registered.as<float>() : data.data();
      gradcomm::allreduce(comm, buffer, buffer, data.size(), gradcomm::DataType::float32,
                          gradcomm::ReduceOp::max, {.algorithm = "shm"});
    }
    std::printf("rank %d: no rank was killed\n", comm.rank());
  }
  gradcomm::finalize();
  return 0;
}
