// The cost of the consistency check (GRADCOMM_CHECK): one communicator per mode (off, default,
// full), the same all-reduce timed on each in turn, round after round, so the machine's drifting
// speed falls on all modes alike; medians per size and algorithm, and the median over rounds of
// each mode's time over `off`'s.
// usage: mpirun -np N gradcomm-check-cost-bench [-a ring,shm,auto] [-n ROUNDS]

#include <gradcomm/gradcomm.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  std::vector<std::string> algorithms = {"auto", "ring", "shm"};
  int rounds = 31;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "-a") == 0) {
      algorithms.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string name; std::getline(list, name, ',');)
        algorithms.push_back(name);
    } else if (std::strcmp(argv[i], "-n") == 0) {
      rounds = std::max(3, std::atoi(argv[i + 1]));
    }
  }
  {
    const gradcomm::CheckMode modes[] = {gradcomm::CheckMode::off, gradcomm::CheckMode::normal,
                                         gradcomm::CheckMode::full};
    std::vector<std::unique_ptr<gradcomm::Communicator>> comms;
    for (gradcomm::CheckMode mode : modes) {
      gradcomm::Config config = gradcomm::Config::from_environment();
      config.check = mode;
      comms.push_back(std::make_unique<gradcomm::Communicator>(MPI_COMM_WORLD, config));
    }
    const int rank = comms[0]->rank();
    if (rank == 0) {
      std::printf("# consistency check cost, %d ranks, float32 sum in place, median of %d rounds\n",
                  comms[0]->size(), rounds);
      std::printf("# %10s %-18s %12s %12s %12s %9s %9s\n", "bytes", "algorithm", "off us",
                  "default us", "full us", "default", "full");
    }
    for (std::size_t bytes :
         {std::size_t{8}, std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{64} << 20}) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<float> data(count, 1.0f);
      const int calls = bytes <= (std::size_t{64} << 10) ? 200 : bytes <= (1 << 20) ? 20 : 2;
      for (const std::string& algorithm : algorithms) {
        const gradcomm::AllreduceOptions options{.algorithm = algorithm};
        std::vector<double> times[3];
        for (int r = -2; r < rounds; ++r) {  // two warm-up rounds
          for (int m = 0; m < 3; ++m) {
            gradcomm::Communicator& comm = *comms[static_cast<std::size_t>(m)];
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = MPI_Wtime();
            for (int c = 0; c < calls; ++c) {
              // max keeps the values bounded over many calls
              gradcomm::allreduce(comm, data.data(), data.data(), count,
                                  gradcomm::DataType::float32, gradcomm::ReduceOp::max, options);
            }
            double t = (MPI_Wtime() - t0) / calls;
            MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (r >= 0) times[m].push_back(t);
          }
        }
        if (rank == 0) {
          // Ratios per round (each mode next to the `off` run just before it), then the median.
          std::vector<double> normal_ratio, full_ratio;
          for (std::size_t r = 0; r < times[0].size(); ++r) {
            normal_ratio.push_back(times[1][r] / times[0][r]);
            full_ratio.push_back(times[2][r] / times[0][r]);
          }
          std::printf("  %10zu %-18s %12.2f %12.2f %12.2f %8.3fx %8.3fx\n", bytes,
                      algorithm.c_str(), median(times[0]) * 1e6, median(times[1]) * 1e6,
                      median(times[2]) * 1e6, median(normal_ratio), median(full_ratio));
          std::fflush(stdout);
        }
      }
    }
  }
  gradcomm::finalize();
  return 0;
}
