// gradcomm-nonblocking-bench: what the progress engine costs and gives, measured alternately in
// one run (docs/results/overlap.md).
//   latency   per size: a blocking allreduce, iallreduce + wait, and the submission alone
//             (iallreduce's return), each the median of --iters calls, the three alternating;
//   compute   a fixed compute kernel timed alone, then while a --overlap-bytes iallreduce runs
//             on the engine (every rank does both), then compute followed by the blocking call:
//             the slowdown the engine's waits and transfers cause, and the time overlap saves.
// usage: mpirun -np N gradcomm-nonblocking-bench [--algorithm A] [--iters N]
//            [--overlap-bytes B] [--mpi-threads serialized|multiple] [--blocking-only 1]
// --blocking-only 1 times the blocking calls alone (no engine is ever started): with
// --mpi-threads, what the thread level costs a blocking call.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "core/communicator.h"
#include "core/error.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// About `reps` x 1 MFLOP of dependent FMAs over a cache-resident array: compute that needs a core
// and little memory bandwidth, like a tiled matmul.
float compute(std::vector<float>& a, int reps) {
  float acc = 0;
  for (int r = 0; r < reps; ++r) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i] = a[i] * 0.999f + 0.001f;
      acc += a[i];
    }
  }
  return acc;
}

}  // namespace

int main(int argc, char** argv) {
  std::string algorithm = "auto";
  int iters = 200;
  std::size_t overlap_bytes = std::size_t{16} << 20;
  std::string threads = "multiple";
  bool blocking_only = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--algorithm") {
      algorithm = argv[i + 1];
    } else if (flag == "--iters") {
      iters = std::atoi(argv[i + 1]);
    } else if (flag == "--overlap-bytes") {
      overlap_bytes = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--blocking-only") {
      blocking_only = std::atoi(argv[i + 1]) != 0;
    } else if (flag == "--mpi-threads") {
      threads = argv[i + 1];
    }
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv,
                  threads == "serialized" ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);
    const bool root = comm.rank() == 0;
    const gradcomm::AllreduceOptions o{.algorithm = algorithm};
    if (root) {
      std::printf(
          "# gradcomm-nonblocking-bench: %d ranks, algorithm %s, MPI thread level %s\n",
          comm.size(), algorithm.c_str(),
          provided == MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "MPI_THREAD_SERIALIZED");
      std::printf("# %10s %12s %12s %12s %12s\n", "bytes", "blocking_us", "iwait_us", "submit_us",
                  "iwait/block");
    }
    const bool multiple = provided == MPI_THREAD_MULTIPLE && !blocking_only;
    for (std::size_t bytes : {std::size_t{8}, std::size_t{4096}, std::size_t{65536},
                              std::size_t{1} << 20, std::size_t{4} << 20}) {
      std::vector<float> buf(std::max<std::size_t>(1, bytes / 4), 1.0f);
      const std::size_t n = bytes / 4 ? bytes / 4 : 2;
      std::vector<double> blocking, iwait, submit;
      const int rounds = bytes >= (std::size_t{1} << 20) ? std::max(10, iters / 10) : iters;
      for (int it = 0; it < rounds + 5; ++it) {
        MPI_Barrier(MPI_COMM_WORLD);
        auto t0 = Clock::now();
        gradcomm::allreduce(comm, buf.data(), buf.data(), n, gradcomm::DataType::float32,
                            gradcomm::ReduceOp::max, o);
        auto t1 = Clock::now();
        if (it >= 5) blocking.push_back(seconds(t0, t1));
        if (!multiple) continue;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = Clock::now();
        gradcomm::Request r =
            gradcomm::iallreduce(comm, buf.data(), buf.data(), n, gradcomm::DataType::float32,
                                 gradcomm::ReduceOp::max, o);
        t1 = Clock::now();
        r.wait();
        const auto t2 = Clock::now();
        if (it >= 5) {
          submit.push_back(seconds(t0, t1));
          iwait.push_back(seconds(t0, t2));
        }
      }
      if (root) {
        const double b = median(blocking) * 1e6, w = median(iwait) * 1e6;
        std::printf("  %10zu %12.2f %12.2f %12.2f %12.2f\n", bytes, b, w, median(submit) * 1e6,
                    multiple ? w / b : 0.0);
      }
    }
    if (multiple) {
      // Submission while the engine is busy: bursts of 16 requests of 64 KiB; the first of a
      // burst wakes the idle engine, the others find it working.
      std::vector<std::vector<float>> bufs(16, std::vector<float>(16384, 1.0f));
      std::vector<double> first, rest;
      for (int round = 0; round < 40; ++round) {
        MPI_Barrier(MPI_COMM_WORLD);
        std::vector<gradcomm::Request> burst;
        for (auto& b : bufs) {
          const auto t0 = Clock::now();
          burst.push_back(gradcomm::iallreduce(comm, b.data(), b.data(), b.size(),
                                               gradcomm::DataType::float32, gradcomm::ReduceOp::max,
                                               o));
          (burst.size() == 1 ? first : rest).push_back(seconds(t0, Clock::now()));
        }
        gradcomm::Request::wait_all(burst);
      }
      if (root) {
        std::printf(
            "# submission of a 64 KiB request: %.2f us to an idle engine (wakes its thread),"
            " %.2f us to a busy one (medians)\n",
            median(first) * 1e6, median(rest) * 1e6);
      }
      // Compute alone, compute under a request, compute then the blocking call; alternating.
      std::vector<float> work(16384, 1.0f);
      std::vector<float> big(overlap_bytes / 4, 1.0f);
      int reps = 50;
      {  // about 100 ms of compute
        const auto t0 = Clock::now();
        compute(work, reps);
        const double s = seconds(t0, Clock::now());
        double mine = s;
        MPI_Allreduce(&s, &mine, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        reps = std::max(1, static_cast<int>(reps * 0.1 / mine));
      }
      std::vector<double> alone, under, comm_after, step_overlap, step_serial;
      volatile float sink = 0;
      for (int it = 0; it < 7; ++it) {
        MPI_Barrier(MPI_COMM_WORLD);
        auto t0 = Clock::now();
        sink = sink + compute(work, reps);
        alone.push_back(seconds(t0, Clock::now()));

        MPI_Barrier(MPI_COMM_WORLD);
        t0 = Clock::now();
        gradcomm::Request r =
            gradcomm::iallreduce(comm, big.data(), big.data(), big.size(),
                                 gradcomm::DataType::float32, gradcomm::ReduceOp::max, o);
        sink = sink + compute(work, reps);
        const auto t1 = Clock::now();
        r.wait();
        under.push_back(seconds(t0, t1));
        step_overlap.push_back(seconds(t0, Clock::now()));

        MPI_Barrier(MPI_COMM_WORLD);
        t0 = Clock::now();
        sink = sink + compute(work, reps);
        const auto t2 = Clock::now();
        gradcomm::allreduce(comm, big.data(), big.data(), big.size(), gradcomm::DataType::float32,
                            gradcomm::ReduceOp::max, o);
        comm_after.push_back(seconds(t2, Clock::now()));
        step_serial.push_back(seconds(t0, Clock::now()));
      }
      if (root) {
        std::printf(
            "# compute %.1f ms alone, %.1f ms while a %zu-byte iallreduce runs (+%.1f%%); "
            "the blocking call takes %.1f ms\n# compute + all-reduce: %.1f ms overlapped, "
            "%.1f ms one after the other (ratio %.2f); medians of 7\n",
            median(alone) * 1e3, median(under) * 1e3, overlap_bytes,
            100.0 * (median(under) / median(alone) - 1.0), median(comm_after) * 1e3,
            median(step_overlap) * 1e3, median(step_serial) * 1e3,
            median(step_overlap) / median(step_serial));
      }
    }
  }
  MPI_Finalize();
  return rc;
}
