// gradcomm-bench: all-reduce timings in the style of nccl-tests' all_reduce_perf, with
// MPI_Allreduce measured in the same run as the baseline.
//
//   mpirun -np 4 gradcomm-bench -b 8 -e 256M -f 4 -a ring,halving_doubling -n 20 -w 5 -c 1
//
// Method: for each size, every algorithm is warmed up, then timed in rounds that alternate the
// algorithms (this machine's speed drifts, so only interleaved measurements are compared). A
// round is, for each algorithm, a barrier followed by a batch of back-to-back calls, the same
// count for every algorithm at a size, sized so the fastest one's batch lasts at least ~200 us
// (small messages would otherwise measure the timer and the barrier); each round runs them in
// a fresh random order (the same on every rank), since what ran just before changes the caches
// and the scheduler's state: rotating one order would leave every algorithm after the same one
// (on 4 ranks sharing 2 cores, that alone moved one algorithm against another by up to 18%).
// The time of a round is the slowest rank's per-call average; statistics are over rounds. vs_mpi is
// MPI_Allreduce's median time divided by the algorithm's median time (> 1: faster than
// MPI_Allreduce). vs_best pairs the rounds: the median over rounds of (the best fixed algorithm's
// time in that round / this algorithm's time in that round), the best fixed one being the gradcomm
// algorithm other than auto with the lowest median (1: as fast; below 1: slower). Pairing cancels
// the drift between rounds, which a ratio of two medians keeps; both are reported for auto after
// the sweep.

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

namespace {

using gradcomm::Communicator;
using gradcomm::DataType;
using gradcomm::ReduceOp;

// "hierarchical/shm" (also /direct, /ring): hierarchical with that intra-group form
// (Config::hierarchical_intra); "shm/streamed" (also /cached, /auto): shm with those stores
// (Config::shm_stores). Each runs on a communicator of its own so the forms interleave.
std::string base_algorithm(const std::string& name) {
  return name.substr(0, name.find('/'));
}

std::map<std::string, std::unique_ptr<Communicator>>& variant_comms() {
  static std::map<std::string, std::unique_ptr<Communicator>> comms;
  return comms;
}

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

const char kUsage[] =
    "usage: mpirun -np N gradcomm-bench [options]\n"
    "  -b, --minbytes SIZE   smallest message (default 8; K/M/G suffixes)\n"
    "  -e, --maxbytes SIZE   largest message (default 64M)\n"
    "  -f, --stepfactor F    size multiplier between rows (default 2)\n"
    "  -a, --algorithms L    comma-separated names (default ring,halving_doubling,flat,auto);\n"
    "                        hierarchical/direct, /ring, /shm: hierarchical with that\n"
    "                        intra-group form (GRADCOMM_HIERARCHICAL_INTRA);\n"
    "                        shm/auto, /cached, /streamed: shm with those stores to its\n"
    "                        segment (GRADCOMM_SHM_STORES);\n"
    "                        MPI_Allreduce ('mpi') is always measured as the baseline\n"
    "  -d, --datatype T      float32 float64 float16 bfloat16 int32 int64 (default float32)\n"
    "  -o, --op OP           sum avg min max prod (default sum)\n"
    "  -n, --iters N         timed rounds per size and algorithm (default 20)\n"
    "  -w, --warmup N        untimed calls first (default 5)\n"
    "  --explore S           auto: after the warm-up, untimed calls until it has settled at\n"
    "                        the size (no duel between algorithms under way), at most S\n"
    "                        seconds (default 2; 0 times auto's exploration too)\n"
    "  -c, --check 0|1       check results against an MPI float64 reference (default 1)\n"
    "      --inplace         in-place calls (send == recv)\n"
    "      --csv | --json    machine-readable output on rank 0's stdout\n"
    "      --list            print the registered algorithm names, one per line, with why an\n"
    "                        algorithm cannot run here (nccl without a GPU)\n"
    "      --device cpu|gpu  where the buffers live (default cpu). gpu: cudaMalloc'ed buffers on\n"
    "                        the device pick_device gives (GRADCOMM_DEVICE), algorithms nccl and\n"
    "                        hierarchical by default, and nccl (not MPI) as the baseline; a batch\n"
    "                        of calls is enqueued asynchronously and synchronised once, as\n"
    "                        nccl-tests does\n"
    "      --workload W      per-step time of all-reducing a model's gradients (W: resnet50,\n"
    "                        mobilenet_v2, bert_base, vgg16, or a path to a workload file):\n"
    "                        one MPI_Allreduce per tensor, grouped_allreduce, one MPI_Allreduce\n"
    "                        of a pre-concatenated buffer, and pack+unpack against memcpy\n"
    "      --fusion-threshold B  bucket size for --workload (default GRADCOMM_FUSION_THRESHOLD)\n"
    "      --registered      send/recv buffers in registered memory (comm.allocate), for every\n"
    "                        algorithm and MPI_Allreduce alike\n"
    "      --stream          measure STREAM copy/triad on all ranks at once first, and report "
    "each\n"
    "                        row's busbw as a fraction of the bound set by reading every input\n"
    "                        once and writing every output once (2*n*S bytes at STREAM speed)\n"
    "      --tune FILE       sweep every registered algorithm (and MPI_Allreduce) and write the\n"
    "                        fastest per size as a decision table for auto\n"
    "                        (GRADCOMM_TUNING_FILE=FILE)\n";

[[noreturn]] void usage_error(const std::string& message) {
  throw gradcomm::InvalidArgument("gradcomm-bench: " + message + "\n" + kUsage);
}

std::size_t parse_size(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k")
    scale = 1 << 10;
  else if (suffix == "M" || suffix == "m")
    scale = 1 << 20;
  else if (suffix == "G" || suffix == "g")
    scale = 1 << 30;
  else if (!suffix.empty())
    usage_error("bad size '" + text + "'");
  if (end == text.c_str() || value < 0) usage_error("bad size '" + text + "'");
  return static_cast<std::size_t>(value * scale);
}

int parse_int(const std::string& text, int lo) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (*end != '\0' || end == text.c_str() || value < lo) usage_error("bad number '" + text + "'");
  return static_cast<int>(value);
}

double parse_double(const std::string& text, double lo) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (*end != '\0' || end == text.c_str() || !(value >= lo))
    usage_error("bad number '" + text + "'");
  return value;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ',');) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// Returns nullopt when the program should exit successfully (--help, --list).
std::optional<Options> parse(int argc, char** argv, int rank) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-b" || arg == "--minbytes")
      o.min_bytes = parse_size(value());
    else if (arg == "-e" || arg == "--maxbytes")
      o.max_bytes = parse_size(value());
    else if (arg == "-f" || arg == "--stepfactor")
      o.factor = std::strtod(value().c_str(), nullptr);
    else if (arg == "-a" || arg == "--algorithms") {
      o.algorithms = split_list(value());
      o.algorithms_given = true;
    } else if (arg == "--device") {
      const std::string where = value();
      if (where != "cpu" && where != "gpu") usage_error("--device takes cpu or gpu");
      o.gpu = where == "gpu";
    } else if (arg == "-n" || arg == "--iters")
      o.iters = parse_int(value(), 1);
    else if (arg == "-w" || arg == "--warmup")
      o.warmup = parse_int(value(), 0);
    else if (arg == "--explore")
      o.explore_seconds = parse_double(value(), 0);
    else if (arg == "-c" || arg == "--check")
      o.check = parse_int(value(), 0) != 0;
    else if (arg == "--inplace")
      o.in_place = true;
    else if (arg == "--workload")
      o.workload = value();
    else if (arg == "--tune")
      o.tune_file = value();
    else if (arg == "--fusion-threshold")
      o.fusion_threshold = parse_size(value());
    else if (arg == "--registered")
      o.registered = true;
    else if (arg == "--stream")
      o.stream = true;
    else if (arg == "--csv")
      o.format = Options::Format::csv;
    else if (arg == "--json")
      o.format = Options::Format::json;
    else if (arg == "-d" || arg == "--datatype") {
      const std::string name = value();
      const auto dtype = gradcomm::parse_data_type(name);
      if (!dtype) usage_error("unknown datatype '" + name + "'");
      o.dtype = *dtype;
    } else if (arg == "-o" || arg == "--op") {
      const std::string name = value();
      const auto op = gradcomm::parse_reduce_op(name);
      if (!op) usage_error("unknown op '" + name + "'");
      o.op = *op;
    } else if (arg == "--list") {
      if (rank == 0) {
        for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
          const std::string why_not =
              entry.name == "nccl" ? gradcomm::collectives::nccl_unavailable_reason() : "";
          std::printf("%-18.*s %s%.*s\n", static_cast<int>(entry.name.size()), entry.name.data(),
                      why_not.empty() ? "" : ("unavailable: " + why_not + "  -- ").c_str(),
                      static_cast<int>(entry.summary.size()), entry.summary.data());
        }
      }
      return std::nullopt;
    } else if (arg == "-h" || arg == "--help") {
      if (rank == 0) std::printf("%s", kUsage);
      return std::nullopt;
    } else {
      usage_error("unknown option '" + arg + "'");
    }
  }
  if (o.factor <= 1) usage_error("--stepfactor must be > 1");
  if (o.min_bytes > o.max_bytes) usage_error("--minbytes is larger than --maxbytes");
  for (const std::string& name : o.algorithms) {
    const std::string form =
        name.find('/') == std::string::npos ? "" : name.substr(name.find('/') + 1);
    if (base_algorithm(name) == "hierarchical" && !form.empty()) {
      if (form != "direct" && form != "ring" && form != "shm")
        usage_error("unknown intra-group form in '" + name + "'; valid: direct, ring, shm");
    } else if (base_algorithm(name) == "shm" && !form.empty()) {
      if (form != "auto" && form != "cached" && form != "streamed")
        usage_error("unknown shm stores in '" + name + "'; valid: auto, cached, streamed");
    } else if (!gradcomm::collectives::is_algorithm_name(name)) {
      usage_error("unknown algorithm '" + name +
                  "'; valid: " + gradcomm::collectives::algorithm_names_joined());
    }
  }
  if (!o.tune_file.empty()) {  // every registered algorithm competes
    o.algorithms.clear();
    for (const auto& entry : gradcomm::collectives::registered_algorithms()) {
      if (entry.prototype->capabilities().host_buffers) o.algorithms.emplace_back(entry.name);
    }
  }
  if (o.gpu) {
    if (!o.tune_file.empty() || o.registered || o.stream || !o.workload.empty())
      usage_error("--device gpu does not combine with --tune, --registered, --stream, --workload");
    if (!o.algorithms_given) o.algorithms = {"hierarchical", "auto"};
  }
  // The baseline is always measured, listed last: MPI_Allreduce for host buffers, NCCL
  // for device buffers (MPI here is not CUDA-aware).
  const std::string baseline = o.gpu ? "nccl" : "mpi";
  o.algorithms.erase(std::remove(o.algorithms.begin(), o.algorithms.end(), baseline),
                     o.algorithms.end());
  o.algorithms.push_back(baseline);
  return o;
}

// Small integers, exact in every dtype and under every op (products of +-1 stay +-1).
double check_value(ReduceOp op, int rank, std::size_t i) {
  if (op == ReduceOp::prod) return ((rank + i) % 3 == 0) ? -1.0 : 1.0;
  return static_cast<double>(static_cast<long long>((rank * 5 + i) % 13) - 6);
}

void store(DataType dtype, void* buf, std::size_t i, double v) {
  switch (dtype) {
    case DataType::float32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DataType::float64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DataType::float16:
      static_cast<gradcomm::float16_t*>(buf)[i] = gradcomm::to_float16(static_cast<float>(v));
      break;
    case DataType::bfloat16:
      static_cast<gradcomm::bfloat16_t*>(buf)[i] = gradcomm::to_bfloat16(static_cast<float>(v));
      break;
    case DataType::int32:
      static_cast<std::int32_t*>(buf)[i] = static_cast<std::int32_t>(v);
      break;
    case DataType::int64:
      static_cast<std::int64_t*>(buf)[i] = static_cast<std::int64_t>(v);
      break;
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::prod:
      return MPI_PROD;
    case ReduceOp::min:
      return MPI_MIN;
    case ReduceOp::max:
      return MPI_MAX;
    default:
      return MPI_SUM;
  }
}

// Runs one call on check data and counts elements that differ from a float64 MPI_Allreduce
// reference converted to the dtype. Returns the total over all ranks.
long long count_wrong(Communicator& comm, const Options& o, const std::string& algorithm,
                      std::size_t count, std::byte* send, std::byte* recv,
                      std::vector<double>& ref_in, std::vector<double>& ref_out) {
  const std::size_t es = gradcomm::element_size(o.dtype);
  ref_in.resize(count);
  ref_out.resize(count);
  // Device buffers are filled and read through a host copy.
  gradcomm::gpu::Runtime* gpu = o.gpu ? gradcomm::gpu::runtime() : nullptr;
  std::vector<std::byte> staged(gpu ? count * es : 0);
  std::byte* device_send = send;
  if (gpu) send = staged.data();
  for (std::size_t i = 0; i < count; ++i) {
    ref_in[i] = check_value(o.op, comm.rank(), i);
    store(o.dtype, send, i, ref_in[i]);
  }
  if (gpu) {
    gpu->copy_async(device_send, send, count * es, nullptr);
    gpu->stream_synchronize(nullptr);
  }
  for (std::size_t offset = 0; offset < count; offset += std::size_t{1} << 30) {
    const int len = static_cast<int>(std::min(count - offset, std::size_t{1} << 30));
    MPI_Allreduce(ref_in.data() + offset, ref_out.data() + offset, len, MPI_DOUBLE, mpi_op(o.op),
                  comm.mpi_comm());
  }
  std::byte* out = o.in_place ? send : recv;
  if (gpu) {
    std::byte* device_out = o.in_place ? device_send : recv;
    gradcomm::allreduce(comm, device_send, device_out, count, o.dtype, o.op,
                        {.algorithm = algorithm});
    gpu->copy_async(staged.data(), device_out, count * es, nullptr);
    gpu->stream_synchronize(nullptr);
    out = staged.data();
  } else {
    gradcomm::allreduce(comm, send, out, count, o.dtype, o.op, {.algorithm = algorithm});
  }
  std::vector<std::byte> expected(es);
  long long wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double v = ref_out[i];
    if (o.op == ReduceOp::avg) {
      v = gradcomm::is_floating(o.dtype) ? v / comm.size() : std::trunc(v / comm.size());
    }
    store(o.dtype, expected.data(), 0, v);
    if (std::memcmp(expected.data(), out + i * es, es) != 0) ++wrong;
  }
  long long total = 0;
  MPI_Allreduce(&wrong, &total, 1, MPI_LONG_LONG, MPI_SUM, comm.mpi_comm());
  return total;
}

double percentile(std::vector<double> sorted, double p) {
  std::sort(sorted.begin(), sorted.end());
  const double position = p * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(position));
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (position - static_cast<double>(lo));
}

// STREAM (McCalpin) copy and triad on every rank at once: the memory bandwidth the node gives
// all ranks together, counted as STREAM counts it (bytes read + bytes written per element).
constexpr std::size_t kStreamBytes = std::size_t{64} << 20;  // per array, far above the caches

struct Stream {
  double copy = 0, triad = 0;  // bytes per second, sum over ranks
  // An all-reduce must read every input once and write every output once: 2*n*S bytes at the
  // STREAM copy rate, so algbw <= copy / (2n); busbw scales it by 2(n-1)/n.
  double bound_busbw(int n) const { return n > 1 ? copy / (2.0 * n) * 2.0 * (n - 1) / n : 0.0; }
};

Stream measure_stream(Communicator& comm) {
  const std::size_t count = kStreamBytes / sizeof(double);
  std::vector<double> a(count, 1.0), b(count, 2.0), c(count, 0.0);
  const MPI_Comm mpi = comm.mpi_comm();
  auto best_rate = [&](auto&& kernel, double bytes) {
    double best = 1e30;
    for (int trial = 0; trial < 5; ++trial) {
      MPI_Barrier(mpi);
      const double t0 = MPI_Wtime();
      kernel();
      double elapsed = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, mpi);
      best = std::min(best, elapsed);
    }
    return bytes * comm.size() / best;
  };
  Stream s;
  s.copy = best_rate(
      [&] {
        for (std::size_t i = 0; i < count; ++i)
          c[i] = a[i];
      },
      2.0 * kStreamBytes);
  s.triad = best_rate(
      [&] {
        for (std::size_t i = 0; i < count; ++i)
          a[i] = b[i] + 3.0 * c[i];
      },
      3.0 * kStreamBytes);
  if (a[count / 2] == 42.0) std::printf(" ");  // keep the loops
  return s;
}

// A round's order of n items: a random permutation, the same on every rank (every rank seeds
// `generator` alike and draws from it in the same sequence).
std::vector<std::size_t> round_order(std::size_t n, std::mt19937_64& generator) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), generator);
  return order;
}

// Calls auto until it has settled at this size (gradcomm::collectives::auto_settled: the same on
// every rank), for at most Options::explore_seconds (the slowest rank's clock decides, so every
// rank stops at the same call).
template <class Call>
Exploration explore_auto(Communicator& comm, const Options& o, std::size_t count, Call call) {
  const gradcomm::collectives::AllreduceArgs args{nullptr, nullptr, count, o.dtype, o.op};
  const MPI_Comm mpi = comm.mpi_comm();
  Exploration e;
  MPI_Barrier(mpi);
  const double t0 = MPI_Wtime();
  while (!gradcomm::collectives::auto_settled(args, comm)) {
    for (int i = 0; i < 8; ++i, ++e.calls)
      call();
    double elapsed = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, mpi);
    e.seconds = elapsed;
    if (elapsed > o.explore_seconds) {
      e.settled = gradcomm::collectives::auto_settled(args, comm);
      break;
    }
  }
  return e;
}

// A round lasts at least kRoundSeconds for the fastest algorithm; the estimate of each
// algorithm's time per call comes from calls that last at least kEstimateSeconds.
constexpr double kRoundSeconds = 200e-6;
constexpr double kEstimateSeconds = 50e-6;

// Calls of `per_call` seconds each that last at least `seconds`.
int calls_for(double seconds, double per_call) {
  return static_cast<int>(std::clamp(std::ceil(seconds / std::max(per_call, 1e-9)), 1.0, 4096.0));
}

std::vector<Row> measure_size(Communicator& comm, Communicator& baseline, const Options& o,
                              std::size_t count, std::byte* send, std::byte* recv,
                              std::vector<double>& ref_in, std::vector<double>& ref_out) {
  const std::size_t es = gradcomm::element_size(o.dtype);
  const std::size_t bytes = count * es;
  const int n = comm.size();
  const MPI_Comm mpi = comm.mpi_comm();
  std::byte* out = o.in_place ? send : recv;
  // The baseline is MPI_Allreduce itself, also when GRADCOMM_DETERMINISTIC reroutes gradcomm.
  auto comm_for = [&](const std::string& algorithm) -> Communicator& {
    if (algorithm == "mpi") return baseline;
    const auto variant = variant_comms().find(algorithm);
    return variant == variant_comms().end() ? comm : *variant->second;
  };
  // GPU calls are enqueued asynchronously and synchronised once per batch (nccl-tests' way).
  auto call = [&](const std::string& algorithm) {
    gradcomm::allreduce(comm_for(algorithm), send, out, count, o.dtype, o.op,
                        {.algorithm = base_algorithm(algorithm), .asynchronous = o.gpu});
  };
  auto sync = [&] {
    if (o.gpu) gradcomm::gpu::runtime()->stream_synchronize(nullptr);
  };

  // Warm up, and estimate each algorithm's time per call (slowest rank) from a batch of calls.
  // auto first explores each size (it times its pick, and duels other algorithms that might be
  // faster: see collectives/select/auto_select.h); the rounds time its steady state, what a
  // training job's repeated buckets see, and the exploration is reported apart (calls, time).
  std::vector<double> per_call(o.algorithms.size(), 0.0);
  Exploration explored;
  auto time_calls = [&](const std::string& algorithm, int calls) {
    MPI_Barrier(mpi);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < calls; ++i)
      call(algorithm);
    sync();
    double elapsed = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, mpi);
    return elapsed / calls;
  };
  for (std::size_t a = 0; a < o.algorithms.size(); ++a) {
    for (int w = 0; w < o.warmup; ++w)
      call(o.algorithms[a]);
    sync();
    if (base_algorithm(o.algorithms[a]) == "auto" && !o.gpu && o.explore_seconds > 0) {
      explored = explore_auto(comm_for(o.algorithms[a]), o, count, [&] { call(o.algorithms[a]); });
    }
    const double one = time_calls(o.algorithms[a], 1);  // includes the barrier's exit skew
    per_call[a] = time_calls(o.algorithms[a], calls_for(kEstimateSeconds, one));
  }
  // Every algorithm runs the same number of calls per round: a round's fixed costs (the barrier's
  // exit skew, the first call's wake-up: several us on this machine) are then shared out over the
  // same count. Per-algorithm batches sized from one call each ranged from 2 to 63 calls at 512 B
  // on 2 ranks: a batch of 2 charged each call half a round's fixed cost, one of 63 a 63rd.
  const int round_calls =
      calls_for(kRoundSeconds, *std::min_element(per_call.begin(), per_call.end()));

  // Interleaved rounds, each in a fresh random order (see the top of the file).
  const std::size_t algorithms = o.algorithms.size();
  std::vector<std::vector<double>> times(algorithms, std::vector<double>(o.iters));
  std::mt19937_64 shuffle(bytes);
  for (int it = 0; it < o.iters; ++it) {
    for (const std::size_t a : round_order(algorithms, shuffle)) {
      MPI_Barrier(mpi);
      const double t0 = MPI_Wtime();
      for (int b = 0; b < round_calls; ++b)
        call(o.algorithms[a]);
      sync();
      times[a][static_cast<std::size_t>(it)] = (MPI_Wtime() - t0) / round_calls;
    }
  }

  std::vector<Row> rows;
  const double bus_factor = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  for (std::size_t a = 0; a < o.algorithms.size(); ++a) {
    std::vector<double>& t = times[a];
    MPI_Allreduce(MPI_IN_PLACE, t.data(), o.iters, MPI_DOUBLE, MPI_MAX, mpi);
    Row row;
    row.algorithm = o.algorithms[a];
    row.round_calls = round_calls;
    row.bytes = bytes;
    row.count = count;
    double sum = 0;
    for (double v : t)
      sum += v;
    row.mean_us = sum / o.iters * 1e6;
    row.min_us = *std::min_element(t.begin(), t.end()) * 1e6;
    row.max_us = *std::max_element(t.begin(), t.end()) * 1e6;
    row.p50_us = percentile(t, 0.5) * 1e6;
    row.p99_us = percentile(t, 0.99) * 1e6;
    row.algbw = row.mean_us > 0 ? static_cast<double>(bytes) / (row.mean_us * 1e-6) / 1e9 : 0;
    row.busbw = row.algbw * bus_factor;
    gradcomm::reset_traffic(comm_for(row.algorithm));
    call(row.algorithm);
    sync();
    const gradcomm::TrafficReport traffic = gradcomm::traffic(comm_for(row.algorithm));
    unsigned long long sent[2] = {traffic.intra_bytes, traffic.inter_bytes};
    MPI_Allreduce(MPI_IN_PLACE, sent, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX, mpi);
    row.intra_bytes = sent[0];
    row.inter_bytes = sent[1];
    if (base_algorithm(row.algorithm) == "auto") row.explored = explored;
    if (o.check)
      row.wrong = count_wrong(comm_for(row.algorithm), o, base_algorithm(row.algorithm), count,
                              send, recv, ref_in, ref_out);
    rows.push_back(row);
  }
  const double mpi_p50 = rows.back().p50_us;
  for (Row& row : rows)
    row.vs_mpi = row.p50_us > 0 ? mpi_p50 / row.p50_us : 0;
  // The best fixed algorithm: gradcomm's own, auto and the baseline aside.
  std::size_t best = algorithms;
  for (std::size_t a = 0; a < algorithms; ++a) {
    const std::string base = base_algorithm(o.algorithms[a]);
    if (base == "auto" || base == "mpi" || a + 1 == algorithms) continue;
    if (best == algorithms || rows[a].p50_us < rows[best].p50_us) best = a;
  }
  if (best < algorithms) {
    for (std::size_t a = 0; a < algorithms; ++a) {
      std::vector<double> paired(static_cast<std::size_t>(o.iters));
      for (std::size_t it = 0; it < paired.size(); ++it)
        paired[it] = times[a][it] > 0 ? times[best][it] / times[a][it] : 0;
      rows[a].vs_best = percentile(paired, 0.5);
      rows[a].best = o.algorithms[best];
      rows[a].best_p50_us = rows[best].p50_us;
    }
  }
  return rows;
}

// auto's view of a row: its model's prediction and, for auto, its pick. Every rank calls it (the
// model is set up collectively on first use).
void model_row(Communicator& comm, const Options& o, Row& row) {
  if (row.algorithm == "auto" && comm.size() > 1) {
    const gradcomm::collectives::AllreduceArgs args{nullptr, nullptr, row.count, o.dtype, o.op};
    row.picks = gradcomm::collectives::select_allreduce_algorithm(args, comm);
  }
  const auto predicted = gradcomm::collectives::predicted_allreduce_seconds(
      comm, row.picks.empty() ? base_algorithm(row.algorithm) : row.picks, row.bytes);
  row.model_us = predicted ? *predicted * 1e6 : 0;
}

void print_header(const Options& o, int n) {
  if (o.format == Options::Format::csv) {
    std::printf(
        "algorithm,size,count,type,redop,inplace,ranks,time_us,min_us,max_us,p50_us,"
        "p99_us,algbw,busbw,wrong,vs_mpi,intra_bytes,inter_bytes,of_bound,model_us,picks,vs_best,"
        "explore_calls,explore_ms,settled,round_calls\n");
  } else if (o.format == Options::Format::table) {
    std::printf("# gradcomm-bench: %d ranks, %s %s, %s, %d rounds, %d warm-up calls, check %s\n", n,
                std::string(to_string(o.dtype)).c_str(), std::string(to_string(o.op)).c_str(),
                o.in_place ? "in-place" : "out-of-place", o.iters, o.warmup,
                o.check ? "on" : "off");
    std::printf(
        "# time: per call, slowest rank, over rounds (a round: the same number of calls of "
        "each\n#   algorithm, >= 200 us for the fastest); algbw = size / mean time (GB/s); "
        "busbw = algbw * 2(n-1)/n\n");
    std::printf(
        "# vs_mpi: MPI_Allreduce median / this median, same run, interleaved (> 1 is "
        "faster)\n");
    std::printf(
        "# vs_best: median over rounds of (best fixed algorithm's time / this time), same "
        "round\n");
    std::printf(
        "# xgroup_MB: bytes one call sends across hierarchical groups (nodes), largest "
        "rank\n");
    std::printf(
        "# model_us: auto's cost model (calibrated) for this algorithm, or for auto's pick\n#\n");
    std::printf("# %10s %11s %8s %5s %-16s %10s %10s %10s %10s %10s %7s %7s %6s %6s %7s %10s",
                "size", "count", "type", "redop", "algorithm", "time_us", "min_us", "max_us",
                "p50_us", "p99_us", "algbw", "busbw", "#wrong", "vs_mpi", "vs_best", "xgroup_MB");
    if (o.stream) std::printf(" %8s", "of_bound");
    std::printf(" %10s  %s\n", "model_us", "picks");
  }
}

void print_row(const Options& o, const Row& r, int n, bool first_json) {
  const std::string type(to_string(o.dtype));
  const std::string op(to_string(o.op));
  if (o.format == Options::Format::csv) {
    std::printf(
        "%s,%zu,%zu,%s,%s,%d,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.3f,%.3f,%lld,%.3f,%llu,%llu,%.3f,%.2f,"
        "%s,%.3f,%d,%.3f,%d,%d\n",
        r.algorithm.c_str(), r.bytes, r.count, type.c_str(), op.c_str(), o.in_place ? 1 : 0, n,
        r.mean_us, r.min_us, r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, r.wrong, r.vs_mpi,
        r.intra_bytes, r.inter_bytes, r.of_bound, r.model_us, r.picks.c_str(), r.vs_best,
        r.explored.calls, r.explored.seconds * 1e3, r.explored.settled ? 1 : 0, r.round_calls);
  } else if (o.format == Options::Format::json) {
    std::printf(
        "%s    {\"algorithm\": \"%s\", \"size\": %zu, \"count\": %zu, \"time_us\": %.2f, "
        "\"min_us\": %.2f, \"max_us\": %.2f, \"p50_us\": %.2f, \"p99_us\": %.2f, "
        "\"algbw\": %.3f, \"busbw\": %.3f, \"wrong\": %lld, \"vs_mpi\": %.3f, "
        "\"intra_bytes\": %llu, \"inter_bytes\": %llu, \"of_bound\": %.3f, "
        "\"model_us\": %.2f, \"picks\": \"%s\", \"vs_best\": %.3f, \"explore_calls\": %d, "
        "\"explore_ms\": %.3f, \"settled\": %s, \"round_calls\": %d}",
        first_json ? "" : ",\n", r.algorithm.c_str(), r.bytes, r.count, r.mean_us, r.min_us,
        r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, r.wrong, r.vs_mpi, r.intra_bytes,
        r.inter_bytes, r.of_bound, r.model_us, r.picks.c_str(), r.vs_best, r.explored.calls,
        r.explored.seconds * 1e3, r.explored.settled ? "true" : "false", r.round_calls);
  } else {
    const std::string wrong = r.wrong < 0 ? "N/A" : std::to_string(r.wrong);
    std::printf(
        "  %10zu %11zu %8s %5s %-16s %10.2f %10.2f %10.2f %10.2f %10.2f %7.3f %7.3f %6s "
        "%6.2f %7.2f %10.3f",
        r.bytes, r.count, type.c_str(), op.c_str(), r.algorithm.c_str(), r.mean_us, r.min_us,
        r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, wrong.c_str(), r.vs_mpi, r.vs_best,
        static_cast<double>(r.inter_bytes) / 1e6);
    if (o.stream) std::printf(" %8.2f", r.of_bound);
    std::string picks = r.picks;
    if (r.explored.calls > 0) {
      char text[96];
      std::snprintf(text, sizeof text, " (explored %d calls, %.1f ms%s)", r.explored.calls,
                    r.explored.seconds * 1e3, r.explored.settled ? "" : ", not settled");
      picks.append(text);
    }
    std::printf(" %10.2f  %s\n", r.model_us, picks.c_str());
  }
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// --workload: the modes of all-reducing one training step's gradients, timed in interleaved
// rounds like the size sweep.

gradcomm::packing::Workload find_workload(const std::string& name) {
  if (std::filesystem::exists(name)) return gradcomm::packing::load_workload(name);
  const std::string path = std::string(GRADCOMM_WORKLOAD_DIR) + "/" + name + ".json";
  if (!std::filesystem::exists(path)) {
    usage_error("no workload '" + name + "' (neither a file nor " + path + ")");
  }
  return gradcomm::packing::load_workload(path);
}

int run_workload(Communicator& comm, const Options& o) {
  using gradcomm::packing::TensorDesc;
  const gradcomm::packing::Workload w = find_workload(o.workload);
  const std::size_t total = w.total_elements();
  const std::size_t es = gradcomm::element_size(w.dtype);
  const MPI_Comm mpi = comm.mpi_comm();
  MPI_Datatype mpi_type = MPI_FLOAT;
  if (w.dtype == DataType::float64)
    mpi_type = MPI_DOUBLE;
  else if (w.dtype != DataType::float32)
    usage_error("--workload supports float32 and float64");

  // Tensors in one arena, each 64-byte aligned as an allocator would place them; zeros, so
  // repeated sums stay finite. Buffers are allocated and touched once.
  std::vector<TensorDesc> tensors;
  std::size_t offset = 0;
  for (const auto& t : w.tensors) {
    tensors.push_back({nullptr, t.count, w.dtype});
    offset += (t.count * es + 63) / 64 * 64;
  }
  std::vector<std::byte> arena(offset + 64), fused(total * es), copy(total * es);
  offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].data = arena.data() + offset;
    offset += (w.tensors[i].count * es + 63) / 64 * 64;
  }
  gradcomm::GroupedAllreduceOptions grouped_options;
  grouped_options.fusion_threshold = o.fusion_threshold;
  const auto plan = gradcomm::grouped_allreduce_plan(comm, tensors, grouped_options);
  gradcomm::packing::GradientPacker packer(tensors);

  struct Mode {
    const char* name;
    std::function<void()> step;
    bool local;  // no communication: timed per rank, then the slowest
  };
  const std::vector<Mode> modes = {
      {"per_tensor_mpi",
       [&] {
         for (std::size_t i = tensors.size(); i-- > 0;) {
           if (tensors[i].count == 0) continue;
           MPI_Allreduce(MPI_IN_PLACE, tensors[i].data, static_cast<int>(tensors[i].count),
                         mpi_type, MPI_SUM, mpi);
         }
       },
       false},
      {"grouped",
       [&] { gradcomm::grouped_allreduce(comm, tensors, ReduceOp::sum, grouped_options); }, false},
      {"fused_mpi",
       [&] {
         MPI_Allreduce(MPI_IN_PLACE, fused.data(), static_cast<int>(total), mpi_type, MPI_SUM, mpi);
       },
       false},
      {"pack_unpack",
       [&] {
         packer.pack();
         packer.unpack();
       },
       true},
      {"memcpy",
       [&] {
         std::memcpy(copy.data(), fused.data(), total * es);
         std::memcpy(fused.data(), copy.data(), total * es);
       },
       true},
  };
  if (packer.declined()) usage_error("the packer declined: " + packer.decline_reason());

  for (const Mode& m : modes) {
    for (int i = 0; i < o.warmup; ++i)
      m.step();
  }
  std::vector<std::vector<double>> times(modes.size(), std::vector<double>(o.iters));
  std::mt19937_64 shuffle(modes.size());
  for (int it = 0; it < o.iters; ++it) {
    for (const std::size_t m : round_order(modes.size(), shuffle)) {
      MPI_Barrier(mpi);
      const double t0 = MPI_Wtime();
      modes[m].step();
      times[m][static_cast<std::size_t>(it)] = MPI_Wtime() - t0;
    }
  }
  for (auto& t : times)
    MPI_Allreduce(MPI_IN_PLACE, t.data(), o.iters, MPI_DOUBLE, MPI_MAX, mpi);
  if (comm.rank() != 0) return 0;

  std::vector<double> p50(modes.size());
  for (std::size_t m = 0; m < modes.size(); ++m)
    p50[m] = percentile(times[m], 0.5) * 1e6;
  const double bytes = static_cast<double>(total * es);
  std::size_t fused_buckets = 0;
  for (const auto& b : plan.buckets)
    fused_buckets += b.in_place() ? 0 : 1;
  if (o.format == Options::Format::csv) {
    std::printf("mode,time_us,min_us,max_us,p50_us,p99_us,workload,tensors,bytes,ranks,buckets\n");
  } else {
    std::printf(
        "# gradcomm-bench --workload %s: %zu tensors, %zu %s elements (%.1f MB), %d ranks\n",
        w.model.c_str(), w.tensors.size(), total, std::string(gradcomm::to_string(w.dtype)).c_str(),
        bytes / 1e6, comm.size());
    std::printf(
        "# grouped_allreduce plan: threshold %zu bytes, %zu buckets (%zu fused, %zu in "
        "place), largest fused %zu bytes\n",
        grouped_options.fusion_threshold.value_or(comm.config().fusion_threshold),
        plan.buckets.size(), fused_buckets, plan.buckets.size() - fused_buckets,
        plan.max_fused_bytes);
    std::printf("# per step, slowest rank, %d interleaved rounds\n", o.iters);
    std::printf("# %-16s %12s %12s %12s %12s\n", "mode", "time_us", "p50_us", "min_us", "GB/s");
  }
  for (std::size_t m = 0; m < modes.size(); ++m) {
    const std::vector<double>& t = times[m];
    double sum = 0;
    for (double v : t)
      sum += v;
    const double mean = sum / o.iters * 1e6;
    const double lo = *std::min_element(t.begin(), t.end()) * 1e6;
    const double hi = *std::max_element(t.begin(), t.end()) * 1e6;
    // Local modes move the bytes twice (in and out); collective ones are reported as algbw.
    const double gbps = (modes[m].local ? 2 * bytes : bytes) / (p50[m] * 1e-6) / 1e9;
    if (o.format == Options::Format::csv) {
      std::printf("%s,%.2f,%.2f,%.2f,%.2f,%.2f,%s,%zu,%zu,%d,%zu\n", modes[m].name, mean, lo, hi,
                  p50[m], percentile(t, 0.99) * 1e6, w.model.c_str(), w.tensors.size(), total * es,
                  comm.size(), plan.buckets.size());
    } else {
      std::printf("  %-16s %12.1f %12.1f %12.1f %12.2f\n", modes[m].name, mean, p50[m], lo, gbps);
    }
  }
  if (o.format == Options::Format::table) {
    std::printf(
        "# grouped / fused_mpi = %.2f   per_tensor_mpi / grouped = %.2f   "
        "pack_unpack bandwidth / memcpy = %.2f (medians)\n",
        p50[1] / p50[2], p50[0] / p50[1], p50[4] / p50[3]);
  }
  return 0;
}

int run(int argc, char** argv) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::optional<Options> parsed = parse(argc, argv, rank);
  if (!parsed) return 0;
  const Options& o = *parsed;
  Communicator comm(MPI_COMM_WORLD);
  if (!o.workload.empty()) return run_workload(comm, o);
  gradcomm::Config plain = comm.config();
  plain.deterministic = false;
  Communicator baseline(MPI_COMM_WORLD, plain);
  for (const std::string& name : o.algorithms) {
    if (name.find('/') == std::string::npos) continue;
    gradcomm::Config variant = comm.config();
    const std::string form = name.substr(name.find('/') + 1);
    if (base_algorithm(name) == "shm") {
      variant.shm_stores = form;
    } else {
      variant.hierarchical_intra = form;
    }
    variant_comms()[name] = std::make_unique<Communicator>(MPI_COMM_WORLD, variant);
  }
  const std::size_t es = gradcomm::element_size(o.dtype);
  const std::size_t max_count = o.max_bytes / es;
  // Buffers allocated and touched once, reused for every size.
  const std::size_t buffer_bytes = std::max<std::size_t>(max_count * es, 1);
  std::vector<std::byte> send_private, recv_private;
  gradcomm::RegisteredBuffer send_registered, recv_registered;
  std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::shared_ptr<std::byte> send_device, recv_device;
  if (o.gpu) {
    std::string why_not;
    gradcomm::gpu::Runtime* gpu = gradcomm::gpu::runtime(&why_not);
    if (!gpu) throw gradcomm::Unsupported("gradcomm-bench --device gpu: " + why_not);
    const int device = gradcomm::gpu::pick_device(
        *gpu, comm.config().device, gradcomm::topology::topology_of(comm).local_rank());
    gpu->set_device(device);
    auto device_buffer = [&] {
      return std::shared_ptr<std::byte>(static_cast<std::byte*>(gpu->device_alloc(buffer_bytes)),
                                        [gpu](std::byte* p) { gpu->device_free(p); });
    };
    send_device = device_buffer();
    recv_device = device_buffer();
    send = send_device.get();
    recv = recv_device.get();
    std::vector<std::byte> host(buffer_bytes);
    for (std::size_t i = 0; i < max_count; ++i)
      store(o.dtype, host.data(), i, (i % 17) * 0.25);
    gpu->copy_async(send, host.data(), buffer_bytes, nullptr);
    gpu->copy_async(recv, host.data(), buffer_bytes, nullptr);
    gpu->stream_synchronize(nullptr);
    if (rank == 0 && o.format == Options::Format::table)
      std::printf("# --device gpu: %s; rank 0 on GPU %d; vs_mpi is against nccl\n",
                  gpu->describe().c_str(), device);
  } else if (o.registered) {
    send_registered = comm.allocate(buffer_bytes);
    recv_registered = comm.allocate(buffer_bytes);
    send = send_registered.data();
    recv = recv_registered.data();
    std::memset(recv, 0, buffer_bytes);
  } else {
    send_private.resize(buffer_bytes);
    recv_private.resize(buffer_bytes);
    send = send_private.data();
    recv = recv_private.data();
  }
  std::vector<double> ref_in, ref_out;
  if (!o.gpu) {
    for (std::size_t i = 0; i < max_count; ++i)
      store(o.dtype, send, i, (i % 17) * 0.25);
  }
  const Stream stream = o.stream ? measure_stream(comm) : Stream{};

  if (rank == 0) {
    if (o.stream && o.format == Options::Format::table) {
      std::printf(
          "# STREAM, all %d ranks at once, %zu MiB arrays each: copy %.1f GB/s, triad %.1f GB/s"
          " (sum over ranks)\n# bound: busbw <= copy / (2n) * 2(n-1)/n = %.2f GB/s; of_bound ="
          " busbw / bound\n",
          comm.size(), kStreamBytes >> 20, stream.copy / 1e9, stream.triad / 1e9,
          stream.bound_busbw(comm.size()) / 1e9);
    }
    print_header(o, comm.size());
    if (o.format == Options::Format::json) {
      std::printf(
          "{\"ranks\": %d, \"type\": \"%s\", \"redop\": \"%s\", \"inplace\": %s, "
          "\"results\": [\n",
          comm.size(), std::string(to_string(o.dtype)).c_str(),
          std::string(to_string(o.op)).c_str(), o.in_place ? "true" : "false");
    }
  }
  bool first = true;
  long long total_wrong = 0;
  std::vector<std::pair<std::size_t, std::string>> winners;  // for --tune: size, fastest
  struct {
    double paired = 0, of_medians = 0;  // auto's lowest vs_best, highest p50 / best p50
    std::size_t paired_bytes = 0, of_medians_bytes = 0;
    std::string best;             // the best fixed algorithm at paired_bytes
    std::vector<double> vs_best;  // every size's
  } auto_worst;
  for (double size = static_cast<double>(o.min_bytes); size <= static_cast<double>(o.max_bytes);
       size *= o.factor) {
    const std::size_t count = static_cast<std::size_t>(size) / es;
    const std::vector<Row> rows =
        measure_size(comm, baseline, o, count, send, recv, ref_in, ref_out);
    const auto fastest = std::min_element(
        rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.p50_us < b.p50_us; });
    if (fastest != rows.end()) winners.emplace_back(count * es, fastest->algorithm);
    for (Row row : rows) {
      if (row.algorithm == "auto" && row.vs_best > 0) {
        const double of_medians = row.best_p50_us > 0 ? row.p50_us / row.best_p50_us : 0;
        auto_worst.vs_best.push_back(row.vs_best);
        if (auto_worst.paired == 0 || row.vs_best < auto_worst.paired) {
          auto_worst.paired = row.vs_best;
          auto_worst.paired_bytes = row.bytes;
          auto_worst.best = row.best;
        }
        if (of_medians > auto_worst.of_medians) {
          auto_worst.of_medians = of_medians;
          auto_worst.of_medians_bytes = row.bytes;
        }
      }
      if (o.stream) row.of_bound = row.busbw * 1e9 / stream.bound_busbw(comm.size());
      if (!o.gpu) model_row(comm, o, row);
      if (rank == 0) print_row(o, row, comm.size(), first);
      first = false;
      total_wrong += std::max(row.wrong, 0LL);
    }
    if (o.min_bytes == 0) break;  // a size-0 sweep is one row
  }
  // Collective on first use, so every rank asks.
  const auto groups = static_cast<int>(gradcomm::topology::topology_of(comm).groups.size());
  if (!o.tune_file.empty() && rank == 0 && !winners.empty()) {
    // Each measured size decides up to the geometric midpoint to the next one.
    gradcomm::collectives::TuningTable table;
    table.ranks = comm.size();
    table.groups = groups;
    for (std::size_t i = 0; i < winners.size(); ++i) {
      const std::size_t limit =
          i + 1 < winners.size()
              ? static_cast<std::size_t>(std::sqrt(static_cast<double>(winners[i].first) *
                                                   static_cast<double>(winners[i + 1].first)))
              : std::numeric_limits<std::size_t>::max();
      if (!table.rows.empty() && table.rows.back().algorithm == winners[i].second) {
        table.rows.back().max_bytes = limit;
      } else {
        table.rows.push_back({limit, winners[i].second});
      }
    }
    std::ofstream out(o.tune_file);
    out << table.to_json();
    if (!out) throw gradcomm::InvalidArgument("gradcomm-bench: cannot write " + o.tune_file);
    std::printf("# tuning table for %d ranks, %d group(s) written to %s (GRADCOMM_TUNING_FILE):\n",
                table.ranks, table.groups, o.tune_file.c_str());
    for (const auto& row : table.rows) {
      std::printf("#   <= %zu bytes: %s\n", row.max_bytes, row.algorithm.c_str());
    }
  }
  if (rank == 0) {
    if (o.format == Options::Format::json) std::printf("\n]}\n");
    if (o.format == Options::Format::table && auto_worst.paired > 0) {
      const std::vector<double>& v = auto_worst.vs_best;
      const auto within = std::count_if(v.begin(), v.end(), [](double x) { return x >= 1 / 1.1; });
      std::printf(
          "# auto against the best fixed algorithm of each size: %td of %zu sizes within 1.1x "
          "(vs_best >= 0.91), median vs_best %.2f; worst vs_best %.2f (%zu bytes: auto takes "
          "%.2fx the time of %s, paired per round); worst ratio of medians %.2f (%zu bytes)\n",
          within, v.size(), percentile(v, 0.5), auto_worst.paired, auto_worst.paired_bytes,
          1 / auto_worst.paired, auto_worst.best.c_str(), auto_worst.of_medians,
          auto_worst.of_medians_bytes);
    }
    if (o.format == Options::Format::table) {
      std::printf("# Out of bounds values : %lld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
    }
  }
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::fprintf(stderr, "%s\n", e.what());
    rc = 2;
  }
  gradcomm::finalize();
  return rc;
}
