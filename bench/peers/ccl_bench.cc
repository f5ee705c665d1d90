// oneCCL beside gradcomm, in one launch: ccl::allreduce and gradcomm::allreduce (auto) of float32
// sums from 8 B to 64 MiB, alternating call by call, every result checked against the sum every
// rank computes itself. Two timings: back to back (the same buffer again at once), and a
// training-like cycle (the send buffer rewritten before each call, as backward writes gradients).
// A call's time is its slowest rank's; medians and ranges over the iterations. Before a size's
// timed calls, gradcomm's auto is called until it has settled there (at most 2 s), as
// gradcomm-bench --explore does (bench/explore.h).
// Built by bench/peers/run.sh against the oneCCL wheel's Intel MPI, launched with its mpiexec.
#include <mpi.h>

#include <gradcomm/gradcomm.h>
#include <malloc.h>
#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "bench/explore.h"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Stats {
  double median, low, high;
};

Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

}  // namespace

int main(int argc, char** argv) {
  // As gradcomm-bench: malloc keeps its memory, so no library pays for fresh pages per call.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  ccl::init();
  gradcomm::init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::size_t max_bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 64u << 20;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;

  ccl::shared_ptr_class<ccl::kvs> kvs;
  ccl::kvs::address_type address;
  if (rank == 0) {
    kvs = ccl::create_main_kvs();
    address = kvs->get_address();
  }
  MPI_Bcast(address.data(), static_cast<int>(address.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank != 0) kvs = ccl::create_kvs(address);
  auto ccl_comm = ccl::create_communicator(size, rank, kvs);
  int failures = 0;
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    std::vector<float> send(max_bytes / 4 + 1), recv(send.size());
    if (rank == 0) {
      std::printf(
          "# oneCCL %d.%d.%d beside gradcomm (auto), %d ranks, float32 sum; %d iterations "
          "per size and timing; times in us, slowest rank, median [min-max]\n",
          CCL_MAJOR_VERSION, CCL_MINOR_VERSION, CCL_UPDATE_VERSION, size, iters);
      std::printf("%10s %6s %26s %26s %8s\n", "bytes", "timing", "oneCCL", "gradcomm", "ratio");
    }
    // 8 B, then by factors of 4, and the largest size itself (64 MiB is not a power of 4 times 8).
    std::vector<std::size_t> sizes;
    for (std::size_t b = 8; b <= max_bytes; b *= 4)
      sizes.push_back(b);
    if (sizes.empty() || sizes.back() != max_bytes) sizes.push_back(max_bytes);
    for (const std::size_t bytes : sizes) {
      const std::size_t count = bytes / 4;
      const gradcomm::bench::Exploration explored = gradcomm::bench::explore_auto(
          comm, {nullptr, nullptr, count, gradcomm::DataType::float32, gradcomm::ReduceOp::sum},
          2.0, [&] {
            gradcomm::allreduce(comm, send.data(), recv.data(), count, gradcomm::DataType::float32,
                                gradcomm::ReduceOp::sum);
          });
      if (rank == 0 && explored.calls > 0) {
        std::printf("# %zu bytes: auto explored %d untimed calls first\n", bytes, explored.calls);
      }
      for (int cycle = 0; cycle < 2; ++cycle) {
        std::vector<double> t_ccl, t_gc;
        for (int it = -2; it < iters; ++it) {
          for (int lib = 0; lib < 2; ++lib) {
            // Inputs that are exact in float32: small integers that differ per rank and step.
            const auto value = [&](std::size_t i, int r) {
              return static_cast<float>(
                  (i * 7 + static_cast<std::size_t>(r) * 3 + static_cast<std::size_t>(it + 2)) %
                  13);
            };
            if (cycle || it == -2) {
              for (std::size_t i = 0; i < count; ++i)
                send[i] = value(i, rank);
            }
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = now();
            if (lib == 0) {
              ccl::allreduce(send.data(), recv.data(), count, ccl::reduction::sum, ccl_comm).wait();
            } else {
              gradcomm::allreduce(comm, send.data(), recv.data(), count,
                                  gradcomm::DataType::float32, gradcomm::ReduceOp::sum);
            }
            double t = now() - t0;
            MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= 0) (lib == 0 ? t_ccl : t_gc).push_back(t * 1e6);
            const int step = (cycle || it == -2) ? it : -2;
            for (std::size_t i = 0; i < count; i += 1 + count / 97) {
              float expected = 0;
              for (int r = 0; r < size; ++r) {
                expected += static_cast<float>(
                    (i * 7 + static_cast<std::size_t>(r) * 3 + static_cast<std::size_t>(step + 2)) %
                    13);
              }
              if (recv[i] != expected) {
                if (failures++ < 5) {
                  std::fprintf(stderr, "rank %d: %s, %zu bytes: element %zu is %g, not %g\n", rank,
                               lib == 0 ? "oneCCL" : "gradcomm", bytes, i, recv[i], expected);
                }
              }
            }
          }
        }
        if (rank == 0) {
          const Stats a = stats(t_ccl), b = stats(t_gc);
          std::printf("%10zu %6s %9.1f [%6.1f-%8.1f] %9.1f [%6.1f-%8.1f] %8.2f\n", bytes,
                      cycle ? "cycle" : "b2b", a.median, a.low, a.high, b.median, b.low, b.high,
                      b.median / a.median);
          std::fflush(stdout);
        }
      }
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("# results checked: %s\n", failures ? "WRONG" : "all correct");
  gradcomm::finalize();
  return failures ? 1 : 0;
}
