// gradcomm-learner-trace: records what every algorithm auto chooses between takes, call by call,
// all of them under the same machine state, for bench/learner_replay (docs/selection.md, "What
// each mechanism buys").
//
//   mpirun -np 2 gradcomm-learner-trace --sizes 8,4096,1048576 --seconds 20 > trace.csv
//
// For each size, rounds of calls run until --seconds have passed: one call of each modelled
// algorithm per round, in an order that rotates every round (so that no algorithm always follows
// the same one). A call's time is the slowest rank's. The machine's speed drifts by 2x within
// minutes here, and an algorithm timed long after another would compare the drift: within a round
// the algorithms see the same machine, so a learner replayed over the trace picks among the times
// it would really have met. The header gives the model's predictions and what a window's end
// costs (auto's own figures for this communicator).
#include <mpi.h>

#include <gradcomm/gradcomm.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/registry.h"
#include "collectives/select/auto_select.h"

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::size_t> parse_sizes(const char* text) {
  std::vector<std::size_t> sizes;
  std::string s(text);
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? s.npos : comma - start);
    char* end = nullptr;
    const unsigned long long v = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 4 || v % 4 != 0) {
      std::fprintf(stderr, "gradcomm-learner-trace: --sizes: '%s' is not a multiple of 4 bytes\n",
                   item.c_str());
      std::exit(2);
    }
    sizes.push_back(v);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return sizes;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes = {8, 4096, 65536, 1 << 20, 16 << 20};
  double budget = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) {
      sizes = parse_sizes(argv[++i]);
    } else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) {
      budget = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: gradcomm-learner-trace [--sizes B,B,...] [--seconds S]\n");
      return 2;
    }
  }
  gradcomm::init(&argc, &argv);
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    const int rank = comm.rank();
    std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
    std::vector<float> buffer(largest / 4, 0.0f);

    // What a window's end costs auto: two 8-byte calls of its fastest modelled algorithm.
    double decision = 0;
    for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
      const auto p = gradcomm::collectives::predicted_allreduce_seconds(comm, entry.name, 8);
      if (p && (decision == 0 || 2 * *p < decision)) decision = 2 * *p;
    }
    if (rank == 0) {
      std::printf("# gradcomm-learner-trace: %d ranks, %.0f s per size\n", comm.size(), budget);
      std::printf("# decision %.9g\n", decision);
      std::printf("bytes,round,algorithm,seconds\n");
    }

    for (const std::size_t bytes : sizes) {
      const std::size_t count = bytes / 4;
      std::vector<std::string_view> names;
      std::vector<double> predicted;
      for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
        const auto p = gradcomm::collectives::predicted_allreduce_seconds(comm, entry.name, bytes);
        if (!p) continue;
        names.push_back(entry.name);
        predicted.push_back(*p);
      }
      const std::size_t k = names.size();
      auto call = [&](std::size_t a) {
        gradcomm::AllreduceOptions options;
        options.algorithm = names[a];
        const auto t0 = Clock::now();
        gradcomm::allreduce(comm, buffer.data(), buffer.data(), count, gradcomm::DataType::float32,
                            gradcomm::ReduceOp::sum, options);
        return seconds_since(t0);
      };
      // Warm up, and size the run: rounds that fit the budget, by the slowest rank's round.
      double round = 0;
      for (int w = 0; w < 3; ++w) {
        const auto t0 = Clock::now();
        for (std::size_t a = 0; a < k; ++a)
          call(a);
        round = seconds_since(t0);
      }
      MPI_Allreduce(MPI_IN_PLACE, &round, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      const std::size_t rounds = std::clamp<std::size_t>(
          static_cast<std::size_t>(budget / std::max(round, 1e-9)), 16, std::size_t{1} << 18);
      std::vector<double> times(rounds * k);
      for (std::size_t r = 0; r < rounds; ++r) {
        for (std::size_t j = 0; j < k; ++j) {
          const std::size_t a = (j + r) % k;
          times[r * k + a] = call(a);
        }
      }
      MPI_Allreduce(MPI_IN_PLACE, times.data(), static_cast<int>(times.size()), MPI_DOUBLE, MPI_MAX,
                    MPI_COMM_WORLD);
      if (rank == 0) {
        std::printf("# predicted %zu", bytes);
        for (std::size_t a = 0; a < k; ++a)
          std::printf(" %.*s=%.9g", static_cast<int>(names[a].size()), names[a].data(),
                      predicted[a]);
        std::printf("\n");
        for (std::size_t r = 0; r < rounds; ++r) {
          for (std::size_t a = 0; a < k; ++a) {
            std::printf("%zu,%zu,%.*s,%.9g\n", bytes, r, static_cast<int>(names[a].size()),
                        names[a].data(), times[r * k + a]);
          }
        }
        std::fflush(stdout);
      }
    }
  }
  gradcomm::finalize();
  return 0;
}
