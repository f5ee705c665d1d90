#pragma once

// gradcomm-bench's shared engine: options, the timing rounds, the correctness check, STREAM,
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
  bool stream = false;                          // --stream: STREAM first, bound per row
  bool gpu = false;                             // --device gpu: device buffers, nccl baseline
  bool algorithms_given = false;
};

// auto's exploration of one size before its timed rounds (see measure_size).
struct Exploration {
  int calls = 0;
  double seconds = 0;
  bool settled = true;
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
  double of_bound = 0;  // busbw / the memory-traffic bound (--stream), 0 when not measured
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
struct Stream {
  double copy = 0, triad = 0;  // bytes per second, sum over ranks
  // The bound on busbw: every rank reads its input once and writes its output once, at STREAM
  // copy speed shared by all ranks.
  double bound_busbw(int n) const { return n > 1 ? copy / (2.0 * n) * 2.0 * (n - 1) / n : 0.0; }
};
Stream measure_stream(Communicator& comm);
std::vector<std::size_t> round_order(std::size_t n, std::mt19937_64& generator);
// Every algorithm of o.algorithms at `count` elements, interleaved in rounds (see the method).
std::vector<Row> measure_size(Communicator& comm, Communicator& baseline, const Options& o,
                              std::size_t count, std::byte* send, std::byte* recv,
                              std::vector<double>& ref_in, std::vector<double>& ref_out);
void model_row(Communicator& comm, const Options& o, Row& row);
void print_header(const Options& o, int n);
void print_row(const Options& o, const Row& r, int n, bool first_json);

// Modes.
int run_sweep(Communicator& comm, const Options& o);     // sweep.cc
int run_workload(Communicator& comm, const Options& o);  // workload_mode.cc

}  // namespace gradcomm::bench
