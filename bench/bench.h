#pragma once

// gradcomm-bench's shared engine: options, the timing rounds, the correctness check, the bound,
// and the output formats (table, CSV, JSON). One file per mode uses it: sweep.cc (size sweeps,
// --tune, --device gpu), workload_mode.cc (--workload). Method: gradcomm_bench.cc's header and
// docs/benchmarking.md.

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/explore.h"
#include "collectives/allreduce.h"
#include "collectives/allreduce_nccl.h"
#include "collectives/registry.h"
#include "collectives/select/auto_select.h"
#include "collectives/select/tuning_table.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/half.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"
#include "packing/workload.h"
#include "topology/topology.h"

namespace gradcomm::bench {

using gradcomm::Communicator;
using gradcomm::DataType;
using gradcomm::ReduceOp;

struct Options {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{64} << 20;
  double factor = 2;
  std::vector<std::string> algorithms = {"ring", "halving_doubling", "flat", "auto"};
  DataType dtype = DataType::float32;
  ReduceOp op = ReduceOp::sum;
  int iters = 20;
  int warmup = 5;
  double explore_seconds = 2;  // auto's exploration of a size before it is timed, at most
  bool check = true;
  bool in_place = false;
  enum class Format { table, csv, json } format = Format::table;
  std::string workload;                         // --workload: per-step mode comparison
  std::optional<std::size_t> fusion_threshold;  // --fusion-threshold, for --workload
  std::string tune_file;                        // --tune: write auto's decision table here
  bool registered = false;                      // --registered: buffers from comm.allocate
  bool bound = false;                           // --bound: a measured bound per row
  bool cycle = false;  // --cycle: rewrite the input before and read the result after each call
  bool default_malloc = false;  // --default-malloc: leave glibc's malloc as it is
  bool no_baseline = false;     // --no-baseline: MPI_Allreduce is not measured
  bool lead_in = true;          // --no-lead-in: no untimed call before each round's timed ones
  bool gpu = false;             // --device gpu: device buffers, nccl baseline
  bool algorithms_given = false;
};

struct Row {
  std::string algorithm;
  std::size_t bytes = 0;
  std::size_t count = 0;
  double mean_us = 0, min_us = 0, max_us = 0, p50_us = 0, p99_us = 0;
  double algbw = 0, busbw = 0;
  long long wrong = -1;  // -1: not checked
  double vs_mpi = 0;
  double vs_best = 0;  // paired against the best fixed gradcomm algorithm (see above); 0: none
  std::string best;    // that algorithm
  double best_p50_us = 0;
  double of_bound = 0;     // busbw / bound_busbw (--bound), 0 when not measured
  double bound_busbw = 0;  // the row's measured bound (GB/s of busbw), 0 when not measured
  std::string state;       // the machine state the bound's probe saw (far, near)
  // --cycle: the whole cycle (rewrite the input, call, read the result), median over rounds, and
  // MPI_Allreduce's cycle median / this one.
  double cycle_p50_us = 0, cycle_vs_mpi = 0;
  // Bytes one call sent inside / across hierarchical groups, largest over ranks (gradcomm's own
  // algorithms; 0 for mpi, whose internals are not visible).
  unsigned long long intra_bytes = 0, inter_bytes = 0;
  // auto's cost model: predicted time of this algorithm (of its pick, for auto), 0 where it has
  // none (mpi, nccl); and what auto picks at this size (auto's row only).
  double model_us = 0;
  std::string picks;
  Exploration explored;  // auto's row only
  int round_calls = 1;   // calls per round, the same for every algorithm at a size
};

// Options (options.cc): parses the command line; nullopt after --help or --list (printed).
std::optional<Options> parse(int argc, char** argv, int rank);
[[noreturn]] void usage_error(const std::string& message);
// "hierarchical/shm" -> "hierarchical" (see options.cc), and the communicators of the variants.
std::string base_algorithm(const std::string& name);
std::map<std::string, std::unique_ptr<Communicator>>& variant_comms();

// Engine (engine.cc).
void store(DataType dtype, void* buf, std::size_t i, double v);
double percentile(std::vector<double> sorted, double p);
inline constexpr std::size_t kStreamBytes = std::size_t{64} << 20;  // per array, above caches

// The bound on busbw (--bound), measured in the same run right before each row, once per part
// after each of its rounds, and right after it (this machine's speed drifts; each part the best
// of them), the smaller of:
//   - local: the reduction a call must do, on data of this rank's alone: every rank at once runs
//     the library's own kernels over n arrays of S/n (S = the row's size, at most kStreamBytes),
//     reducing all n into every one, in 8 KiB blocks as shm does. The arrays lie in the rows'
//     own receive buffer (`arrays`; bound_arrays_bytes() of it), the memory of the kind and
//     pages the calls use: a private region of the probe's own ran at half speed on one rank in
//     some launches on AMD EPYC, where the call's memory did not. With --cycle every rank first
//     rewrites the arrays (as the cycle rewrites the input), then times one pass; back to back
//     the arrays stay as the last pass left them and a trial times 2-64 passes in a row after an
//     untimed one (the steady rate of back-to-back calls). A call does this work and more (its
//     sources lie in other ranks' caches), so it takes at least that long, T:
//     busbw <= 2(n-1)/n * S / T. From the caches the row fits in, or from DRAM.
//   - cross-core: every rank writes a region of the row's size S (at most kProbeBytes), then all
//     ranks at once fetch what a call must bring in: from every peer's region, the slice of
//     S/n this rank reduces (lines another core has just written). A call cannot take less
//     time, T, so busbw <= 2(n-1)/n * S / T. (Its owner reading the result back moves as much
//     again, which --cycle's cycle pays outside the call.)
// Back-to-back calls on registered buffers can beat the cross-core bound: nobody reads the
// results, which then stay in the reducer's cache for its next call. Private buffers (rows
// without --registered) cross twice in either timing: no other process can read or write them,
// so the (n-1)/n * S of input that peers reduce must come over through shared memory, and the
// (n-1)/n * S of results peers reduced must come back, both lines another core has just written
// (reducing everything on every rank instead reads (n-1) * S, as much at 2 ranks and more
// beyond). Their bound is the smaller of local and half the cross-core bound.
// The state: "far" or "near", from the rate at which every rank reads the next rank's whole region
// of kStateProbeBytes (docs/benchmarking.md).
inline constexpr std::size_t kProbeBytes = std::size_t{16} << 20;
// The local bound's arrays at rows up to `max_bytes` on `ranks` ranks: the row's bytes (at least
// 4 KiB, at most kStreamBytes) and 1 KiB + a line between arrays.
inline constexpr std::size_t kBoundArrayGap = (std::size_t{1} << 10) + 64;
inline std::size_t bound_arrays_bytes(std::size_t max_bytes, int ranks) {
  return std::clamp<std::size_t>(max_bytes, 4096, kStreamBytes) +
         static_cast<std::size_t>(ranks) * kBoundArrayGap;
}
inline constexpr std::size_t kStateProbeBytes = std::size_t{1} << 20;
inline constexpr double kNearCrossCore = 50e9;  // bytes/s: far reads 25-35, near 70-90

struct Bound {
  double local_busbw = 0;       // the local bound (bytes/s of busbw)
  double cross_core_busbw = 0;  // the cross-core bound at the row's size (0: not one host)
  double state_rate = 0;        // bytes/s per reader of a peer's kStateProbeBytes region
  double busbw = 0;             // the bound (bytes/s)
  std::string state() const;
};

class BoundProbe {
 public:
  // `cycle`: the row is timed in the training-like cycle (--cycle). `private_buffers`: the rows'
  // buffers are the process's own (not --registered). `arrays`: the local bound's arrays, at
  // least bound_arrays_bytes(max row bytes, ranks) (a buffer the rows overwrite anyway: their
  // output, or an unused one).
  BoundProbe(Communicator& comm, bool cycle, bool private_buffers, std::byte* arrays,
             std::size_t arrays_bytes);
  ~BoundProbe();
  BoundProbe(const BoundProbe&) = delete;
  BoundProbe& operator=(const BoundProbe&) = delete;
  Bound measure(std::size_t bytes);  // collective
  // One trial of each part (no state), between a row's rounds: collective.
  Bound sample(std::size_t bytes);
  // The better of two measurements of one row (before, during and after it): each part's higher
  // rate, the state of `first`.
  Bound best_of(const Bound& first, const Bound& second) const;

 private:
  // Both parts and the bound from them; `once`: one trial each (a sample), else the best of 5-40.
  Bound parts(std::size_t bytes, bool once);
  double local_busbw(std::size_t bytes, bool once);
  template <class Read>
  double after_peers_wrote(std::size_t floats, bool once, Read&& read);
  double state_rate();
  double slice_fetch_busbw(std::size_t bytes, bool once);
  // The bound from its parts: see the comment above the class.
  double combined(const Bound& b) const;
  Communicator& comm_;
  bool cycle_;
  bool private_;
  float* local_;  // the local bound's n arrays (in the rows' buffer)
  std::size_t local_floats_;
  MPI_Comm node_ = MPI_COMM_NULL;
  MPI_Win window_ = MPI_WIN_NULL;
  float* mine_ = nullptr;
  std::vector<const float*> regions_;  // every rank's region, in this process
  double sink_ = 0;                    // keeps the probes' loops
};
std::vector<std::size_t> round_order(std::size_t n, std::mt19937_64& generator);
// Every algorithm of o.algorithms at `count` elements, interleaved in rounds (see the method).
// `between_rounds`, where given, runs after each round of all the algorithms (--bound's samples).
std::vector<Row> measure_size(Communicator& comm, Communicator& baseline, const Options& o,
                              std::size_t count, std::byte* send, std::byte* recv,
                              std::vector<double>& ref_in, std::vector<double>& ref_out,
                              const std::function<void()>& between_rounds = {});
void model_row(Communicator& comm, const Options& o, Row& row);
void print_malloc_line(const Options& o);
void print_header(const Options& o, int n);
void print_row(const Options& o, const Row& r, int n, bool first_json);

// Modes.
int run_sweep(Communicator& comm, const Options& o);     // sweep.cc
int run_workload(Communicator& comm, const Options& o);  // workload_mode.cc

}  // namespace gradcomm::bench
