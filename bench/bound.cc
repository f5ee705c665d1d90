// The bound each row's busbw is reported against (--bound), measured in the same run, right
// before and right after the row: see bench.h (Bound) and docs/benchmarking.md.

#include "bench/bench.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "core/reduce_kernels.h"

namespace gradcomm::bench {
namespace {

// A probe is the best of 5 trials, or of as many as cover kTrialBytes (at most 40): at 1-4 MiB a
// best of 5 read as little as 0.6 of the rate the calls reached on AMD EPYC.
constexpr int kMinTrials = 5, kMaxTrials = 40;
constexpr std::size_t kTrialBytes = std::size_t{128} << 20;
int trials_for(std::size_t bytes) {
  return static_cast<int>(std::clamp<std::size_t>(kTrialBytes / std::max<std::size_t>(bytes, 1),
                                                  kMinTrials, kMaxTrials));
}
// Back to back, the local bound's timed passes cover at least this many bytes (2 to 64 passes).
constexpr std::size_t kWarmPassBytes = std::size_t{16} << 20;

// The slowest rank's time of `kernel`, all ranks starting together; the best of `trials`. Each
// trial first runs `prepare(trial)` untimed, before the barrier.
template <class Prepare, class Kernel>
double best_of_trials(MPI_Comm mpi, int trials, Prepare&& prepare, Kernel&& kernel) {
  double best = 1e30;
  for (int trial = 0; trial < trials; ++trial) {
    prepare(trial);
    check_mpi(MPI_Barrier(mpi), "gradcomm-bench: MPI_Barrier");
    const double t0 = MPI_Wtime();
    kernel();
    double elapsed = MPI_Wtime() - t0;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, mpi),
              "gradcomm-bench: MPI_Allreduce");
    best = std::min(best, elapsed);
  }
  return best;
}

// Reads n floats as fast as the core can (integer adds vectorize; a float sum would be one
// dependent chain), with AVX2 where the CPU has it, as the library's kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADCOMM_BENCH_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GRADCOMM_BENCH_CLONES
#endif

GRADCOMM_BENCH_CLONES double checksum(const float* p, std::size_t n) {
  const auto* words = reinterpret_cast<const std::uint64_t*>(p);
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < n / 2; ++i)
    sum += words[i];
  return static_cast<double>(sum);
}

// GRADCOMM_BENCH_BOUND_PARTS: both parts of every probe and sample, on stderr (rank 0).
void print_parts(int rank, std::size_t bytes, const Bound& b) {
  static const bool wanted = std::getenv("GRADCOMM_BENCH_BOUND_PARTS") != nullptr;
  if (wanted && rank == 0) {
    std::fprintf(stderr, "# bound at %zu B: local %.1f GB/s, cross-core %.1f GB/s\n", bytes,
                 b.local_busbw / 1e9, b.cross_core_busbw / 1e9);
  }
}

}  // namespace

BoundProbe::BoundProbe(Communicator& comm, bool cycle, bool private_buffers, std::byte* arrays,
                       std::size_t arrays_bytes)
    : comm_(comm),
      cycle_(cycle),
      private_(private_buffers),
      local_(reinterpret_cast<float*>(arrays)),
      local_floats_(arrays_bytes / sizeof(float)) {
  // The cross-core probe needs memory every rank maps: one host only.
  int shared_size = 0;
  check_mpi(MPI_Comm_split_type(comm.mpi_comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node_),
            "gradcomm-bench: MPI_Comm_split_type");
  check_mpi(MPI_Comm_size(node_, &shared_size), "gradcomm-bench: MPI_Comm_size");
  if (shared_size != comm.size()) return;
  void* base = nullptr;
  check_mpi(MPI_Win_allocate_shared(static_cast<MPI_Aint>(kProbeBytes), 1, MPI_INFO_NULL, node_,
                                    &base, &window_),
            "gradcomm-bench: MPI_Win_allocate_shared");
  mine_ = static_cast<float*>(base);
  for (int j = 0; j < comm.size(); ++j) {
    MPI_Aint size = 0;
    int unit = 0;
    void* region = nullptr;
    check_mpi(MPI_Win_shared_query(window_, j, &size, &unit, &region),
              "gradcomm-bench: MPI_Win_shared_query");
    regions_.push_back(static_cast<const float*>(region));
  }
  std::fill(mine_, mine_ + kProbeBytes / sizeof(float), 1.0f);  // touched once
}

BoundProbe::~BoundProbe() {
  if (window_ != MPI_WIN_NULL) MPI_Win_free(&window_);
  if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
}

double BoundProbe::local_busbw(std::size_t bytes, bool once) {
  const int ranks = comm_.size();
  const auto n = static_cast<std::size_t>(ranks);
  const std::size_t total = std::clamp<std::size_t>(bytes, 4096, kStreamBytes) / sizeof(float);
  // Each array's floats (a rank's slice of the row). The arrays lie 1 KiB + a line apart beyond
  // their size, so that no two streams alias on 4 KiB boundaries.
  const std::size_t pad = kBoundArrayGap / sizeof(float);
  const std::size_t m = std::min(total / n, local_floats_ / n - pad);
  std::vector<std::byte*> targets(n);
  std::vector<const std::byte*> sources(n);
  for (std::size_t j = 0; j < n; ++j) {
    targets[j] = reinterpret_cast<std::byte*>(local_ + j * (m + pad));
    sources[j] = targets[j];
  }
  const auto pass = [&] {
    reduce_to_all(targets, sources, m, DataType::float32, ReduceOp::sum, ranks);
  };
  double t = 0;
  if (cycle_) {
    // The cycle rewrites a call's input before it: every trial rewrites the arrays, then one pass.
    t = best_of_trials(
        comm_.mpi_comm(), once ? 1 : trials_for(m * n * sizeof(float)),
        [&](int trial) { std::memset(local_, 0x3c + trial, n * (m + pad) * sizeof(float)); }, pass);
  } else {
    // Back to back a call finds its data where its own last call left it: the arrays written once,
    // then each trial one pass untimed and `passes` timed, one after the other (a single pass
    // right after a memset read 0.6-1.0 of the steady rate on AMD EPYC, where registered rows
    // then beat it by up to 16%).
    const int passes = static_cast<int>(std::clamp<std::size_t>(
        kWarmPassBytes / std::max<std::size_t>(m * n * sizeof(float), 1), 2, 64));
    t = best_of_trials(
            comm_.mpi_comm(), once ? 1 : trials_for(passes * m * n * sizeof(float)),
            [&](int trial) {
              // A sample between rounds finds the arrays as the rows or earlier probes left them.
              if (trial == 0 && !once) std::memset(local_, 0x3c, n * (m + pad) * sizeof(float));
              pass();
            },
            [&] {
              for (int i = 0; i < passes; ++i)
                pass();
            }) /
        passes;
  }
  sink_ += local_[m / 2];
  return 2.0 * (ranks - 1) / ranks * static_cast<double>(m * n * sizeof(float)) / t;
}

// Every rank writes its region of `floats` (with memset, as --cycle rewrites a call's input),
// then `read` runs on every rank at once, reading lines other cores have just written.
template <class Read>
double BoundProbe::after_peers_wrote(std::size_t floats, bool once, Read&& read) {
  return best_of_trials(
      comm_.mpi_comm(), once ? 1 : trials_for(floats * sizeof(float)),
      [&](int trial) { std::memset(mine_, 0x3c + trial, floats * sizeof(float)); }, read);
}

double BoundProbe::state_rate() {
  const std::size_t n = kStateProbeBytes / sizeof(float);
  const float* next = regions_[static_cast<std::size_t>((comm_.rank() + 1) % comm_.size())];
  const double t = after_peers_wrote(n, false, [&] { sink_ += checksum(next, n); });
  return static_cast<double>(kStateProbeBytes) / t;
}

double BoundProbe::slice_fetch_busbw(std::size_t bytes, bool once) {
  const int ranks = comm_.size(), me = comm_.rank();
  const std::size_t n = std::clamp<std::size_t>(bytes, 4096, kProbeBytes) / sizeof(float);
  // This rank's slice of the region, as the all-reduce's slices (the last one shorter).
  const std::size_t slice =
      (n + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
  const std::size_t begin = std::min(n, slice * static_cast<std::size_t>(me));
  const std::size_t length = std::min(n, begin + slice) - begin;
  const double t = after_peers_wrote(n, once, [&] {
    for (int j = 1; j < ranks; ++j)
      sink_ += checksum(regions_[static_cast<std::size_t>((me + j) % ranks)] + begin, length);
  });
  return 2.0 * (ranks - 1) / ranks * static_cast<double>(n * sizeof(float)) / t;
}

Bound BoundProbe::parts(std::size_t bytes, bool once) {
  Bound b;
  if (comm_.size() < 2) return b;
  b.local_busbw = local_busbw(bytes, once);
  b.busbw = b.local_busbw;
  if (!mine_) return b;  // not one host: the local bound only
  b.cross_core_busbw = slice_fetch_busbw(bytes, once);
  b.busbw = combined(b);
  print_parts(comm_.rank(), bytes, b);
  return b;
}

Bound BoundProbe::measure(std::size_t bytes) {
  Bound b = parts(bytes, false);
  if (b.cross_core_busbw > 0) b.state_rate = state_rate();
  return b;
}

Bound BoundProbe::sample(std::size_t bytes) {
  return parts(bytes, true);
}

Bound BoundProbe::best_of(const Bound& first, const Bound& second) const {
  Bound b = first;
  b.local_busbw = std::max(first.local_busbw, second.local_busbw);
  b.cross_core_busbw = std::max(first.cross_core_busbw, second.cross_core_busbw);
  b.busbw = combined(b);
  return b;
}

double BoundProbe::combined(const Bound& b) const {
  if (b.cross_core_busbw <= 0) return b.local_busbw;  // not one host: the local bound only
  // Private buffers: inputs out and results back, two crossings in either timing. Registered,
  // back to back: a call's sources can stay where its own last call left them (in place, every
  // line a rank reads it wrote last), so only the local bound holds; in the cycle, one crossing.
  if (private_) return std::min(b.local_busbw, b.cross_core_busbw / 2);
  return cycle_ ? std::min(b.local_busbw, b.cross_core_busbw) : b.local_busbw;
}

std::string Bound::state() const {
  if (state_rate <= 0) return "-";
  return state_rate < kNearCrossCore ? "far" : "near";
}

}  // namespace gradcomm::bench
