// FSDP's two halves on the host: reduce_scatter against the all-reduce of the same buffers and
// against the MPI's own MPI_Reduce_scatter_block (float32 sum), and the all-gather of the blocks
// back (allgather_bytes) against MPI_Allgather; timed in turn, round after round, each round
// starting at the next variant, so the machine's drift and each call's effect on the next fall
// on all alike. Each time is the slowest rank's, each figure the median
// over rounds; every result is checked against the serial sum (the gathered input) once per
// size. Sizes are the reduce-scatter's input, the all-gather's output.
// malloc is set as gradcomm-bench sets it (docs/benchmarking.md: the MPI reuses its buffers).
// usage: mpirun -np N gradcomm-scatter-gather-bench [-n ROUNDS] [-a ALGORITHM] [-s BYTES]
// (-s: that input size alone)

#include <gradcomm/gradcomm.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check(int ok, const char* what) {
  if (ok != MPI_SUCCESS) {
    std::fprintf(stderr, "%s failed\n", what);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  gradcomm::init(&argc, &argv);
  int rounds = 21;
  std::string algorithm = "auto";
  std::size_t only = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "-n") == 0) rounds = std::max(3, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "-a") == 0) algorithm = argv[i + 1];
    if (std::strcmp(argv[i], "-s") == 0) only = std::strtoull(argv[i + 1], nullptr, 10);
  }
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    const int n = comm.size(), me = comm.rank();
    const auto nn = static_cast<std::size_t>(n);
    if (me == 0) {
      std::printf(
          "# reduce_scatter(%s), %d ranks, float32 sum, median of %d rounds (slowest rank)\n",
          algorithm.c_str(), n, rounds);
      std::printf("# %10s %14s %14s %14s %9s %9s %12s %12s %9s\n", "bytes", "reduce_scatter",
                  "allreduce", "MPI_Red_sc_bl", "rs/ar", "rs/mpi", "allgather", "MPI_Allgath",
                  "ag/mpi");
    }
    std::vector<std::size_t> sizes;
    for (std::size_t bytes = std::size_t{4} << 10; bytes <= (std::size_t{64} << 20); bytes *= 4)
      sizes.push_back(bytes);
    if (only != 0) sizes = {only};
    for (std::size_t bytes : sizes) {
      const std::size_t total = bytes / sizeof(float), count = total / nn;
      std::vector<float> send(count * nn), all(count * nn), block(count);
      for (std::size_t i = 0; i < send.size(); ++i)
        send[i] = static_cast<float>((static_cast<std::size_t>(me) * 7 + i * 13) % 97);
      const gradcomm::AllreduceOptions options{.algorithm = algorithm};
      auto rs = [&] {
        gradcomm::reduce_scatter(comm, send.data(), block.data(), count,
                                 gradcomm::DataType::float32, gradcomm::ReduceOp::sum, options);
      };
      auto ar = [&] {
        gradcomm::allreduce(comm, send.data(), all.data(), count * nn, gradcomm::DataType::float32,
                            gradcomm::ReduceOp::sum, options);
      };
      auto mpi = [&] {
        check(MPI_Reduce_scatter_block(send.data(), block.data(), static_cast<int>(count),
                                       MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Reduce_scatter_block");
      };
      std::vector<float> gathered(count * nn);
      auto ag = [&] {
        gradcomm::allgather_bytes(comm, send.data() + static_cast<std::size_t>(me) * count,
                                  gathered.data(), count * sizeof(float));
      };
      auto mpi_ag = [&] {
        check(MPI_Allgather(send.data() + static_cast<std::size_t>(me) * count,
                            static_cast<int>(count), MPI_FLOAT, gathered.data(),
                            static_cast<int>(count), MPI_FLOAT, MPI_COMM_WORLD),
              "MPI_Allgather");
      };
      const std::function<void()> variants[] = {rs, ar, mpi, ag, mpi_ag};
      // Checked once: every variant's block against the serial sum.
      for (int v = 0; v < 3; ++v) {
        std::fill(block.begin(), block.end(), -1.0f);
        variants[v]();
        const float* got =
            v == 1 ? all.data() + static_cast<std::size_t>(me) * count : block.data();
        for (std::size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int r = 0; r < n; ++r)
            want += static_cast<float>((static_cast<std::size_t>(r) * 7 +
                                        (static_cast<std::size_t>(me) * count + i) * 13) %
                                       97);
          if (got[i] != want) {
            std::fprintf(stderr, "rank %d: variant %d, %zu bytes: element %zu is %g, not %g\n", me,
                         v, bytes, i, static_cast<double>(got[i]), static_cast<double>(want));
            MPI_Abort(MPI_COMM_WORLD, 1);
          }
        }
      }
      for (int v = 3; v < 5; ++v) {
        std::fill(gathered.begin(), gathered.end(), -1.0f);
        variants[v]();
        for (int r = 0; r < n; ++r) {
          for (std::size_t i = 0; i < count; ++i) {
            const std::size_t at = static_cast<std::size_t>(r) * count + i;
            const auto want = static_cast<float>((static_cast<std::size_t>(r) * 7 + at * 13) % 97);
            if (gathered[at] != want) {
              std::fprintf(stderr, "rank %d: variant %d, %zu bytes: element %zu is %g, not %g\n",
                           me, v, bytes, at, static_cast<double>(gathered[at]),
                           static_cast<double>(want));
              MPI_Abort(MPI_COMM_WORLD, 1);
            }
          }
        }
      }
      std::vector<double> times[5];
      const int calls = bytes <= (std::size_t{1} << 20) ? 20 : 3;
      // Each round starts at the next variant: a call runs faster or slower after some others
      // (4 MiB on 2 ranks: either all-gather took 1.4-2x as long right after
      // MPI_Reduce_scatter_block), so every variant takes every place in turn.
      for (int round = 0; round < rounds; ++round) {
        for (int place = 0; place < 5; ++place) {
          const int v = (round + place) % 5;
          check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
          const auto t0 = std::chrono::steady_clock::now();
          for (int c = 0; c < calls; ++c)
            variants[v]();
          double us =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                  .count() /
              calls;
          check(MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
                "MPI_Allreduce");
          times[v].push_back(us);
        }
      }
      if (me == 0) {
        const double a = median(times[0]), b = median(times[1]), c = median(times[2]);
        const double d = median(times[3]), e = median(times[4]);
        std::printf("%12zu %14.1f %14.1f %14.1f %9.2f %9.2f %12.1f %12.1f %9.2f\n", bytes, a, b, c,
                    a / b, a / c, d, e, d / e);
        std::fflush(stdout);
      }
    }
  }
  gradcomm::finalize();
  return 0;
}
