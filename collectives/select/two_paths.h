#pragma once

// Which of two ways to run a collective is faster here, measured: shm's reduce-scatter against
// shm's all-reduce of the whole input, shm's all-gather against MPI_Allgather. Which one wins
// depends on the machine and on where the ranks run: between two CPUs that share no cache, the
// reduce-scatter's and the all-gather's staged lines, which the peers only read, are slow to
// write again (AMD EPYC VM, 2 ranks, 16 MiB: shm's reduce-scatter 0.56 of the all-reduce's time
// in one spell, 1.6-2.1x in another; docs/results/reduce_scatter.md). So per size class (powers
// of two of the call's bytes) the first calls alternate between the two ways, the ranks agree on
// each way's time with one MPI_Allreduce, and the class keeps the faster way, measuring again
// after kRemeasureEvery calls. Every rank makes the same calls, so every rank takes the same way.

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"

namespace gradcomm::collectives {

class TwoPaths {
 public:
  static constexpr int kTrials = 3;                // timed calls per way per measuring window
  static constexpr int kWindow = 2 + 2 * kTrials;  // a first, untimed call of each way, then those
  static constexpr int kRemeasureEvery = 1024;     // calls of a class between windows

  // The way the next call of `bytes` takes: 0 or 1.
  int pick(std::size_t bytes) {
    Class& c = classes_[class_of(bytes)];
    if (c.calls >= kWindow) return c.chosen;
    return c.calls % 2;  // 0, 1, 0, 1, ... while measuring
  }

  // After the call that pick() chose, once it has completed on every rank: its time on this
  // rank. Each way's first call in a window is not counted (it pays for memory touched for the
  // first time, the segment's first use); each way's time is its fastest timed call on this
  // rank. At the end of a window, collective on `comm` (every rank ends the window at the same
  // call; `call` and `rank` name it in an MPI error), the ranks agree on the slowest rank's time
  // of each way and keep the faster way.
  void took(std::size_t bytes, double seconds, MPI_Comm comm, std::string_view call, int rank) {
    Class& c = classes_[class_of(bytes)];
    if (c.calls >= 2 && c.calls < kWindow) {
      double& best = c.best[static_cast<std::size_t>(c.calls % 2)];
      best = c.calls < 4 ? seconds : std::min(best, seconds);
    }
    if (++c.calls == kWindow) {
      double best[2] = {c.best[0], c.best[1]};
      check_mpi(MPI_Allreduce(MPI_IN_PLACE, best, 2, MPI_DOUBLE, MPI_MAX, comm),
                std::string(call) + ": MPI_Allreduce of the two ways' times", rank);
      c.chosen = best[1] < best[0] ? 1 : 0;
    } else if (c.calls == kWindow + kRemeasureEvery) {
      c = Class{};
    }
  }

 private:
  struct Class {
    int calls = 0, chosen = 0;
    double best[2] = {0, 0};
  };
  static std::size_t class_of(std::size_t bytes) {
    std::size_t b = 0;
    while (b + 1 < kClasses && (std::size_t{1} << (b + 1)) <= bytes)
      ++b;
    return b;
  }
  static constexpr std::size_t kClasses = 48;
  std::array<Class, kClasses> classes_{};
};

}  // namespace gradcomm::collectives
