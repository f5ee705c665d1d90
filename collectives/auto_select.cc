#include "collectives/auto_select.h"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/allreduce_halving_doubling.h"
#include "collectives/allreduce_hierarchical.h"
#include "collectives/allreduce_shm.h"
#include "collectives/consistency.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "topology/topology.h"

namespace gradcomm::collectives {
namespace {

constexpr int kCalibrationTag = 105;

std::string broadcast_string(Communicator& comm, std::string text) {
  unsigned long long length = text.size();
  MPI_Bcast(&length, 1, MPI_UNSIGNED_LONG_LONG, 0, comm.mpi_comm());
  text.resize(length);
  MPI_Bcast(text.data(), static_cast<int>(length), MPI_CHAR, 0, comm.mpi_comm());
  return text;
}

// Ping-pong between rank 0 and `peer`: {alpha, beta}. Other ranks do nothing.
CostModel::Link ping_pong(Communicator& comm, int peer) {
  constexpr int kSmallRounds = 20, kLargeRounds = 4;
  constexpr std::size_t kLarge = std::size_t{1} << 20;
  std::vector<std::byte> buffer(kLarge);
  const MPI_Comm mpi = comm.mpi_comm();
  auto round_trips = [&](std::size_t bytes, int rounds) {
    const int count = static_cast<int>(bytes);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < rounds; ++i) {
      if (comm.rank() == 0) {
        MPI_Send(buffer.data(), count, MPI_BYTE, peer, kCalibrationTag, mpi);
        MPI_Recv(buffer.data(), count, MPI_BYTE, peer, kCalibrationTag, mpi, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(buffer.data(), count, MPI_BYTE, 0, kCalibrationTag, mpi, MPI_STATUS_IGNORE);
        MPI_Send(buffer.data(), count, MPI_BYTE, 0, kCalibrationTag, mpi);
      }
    }
    return (MPI_Wtime() - t0) / rounds / 2;  // one way
  };
  round_trips(8, 2);  // warm up the path
  const double small = round_trips(8, kSmallRounds);
  const double large = round_trips(kLarge, kLargeRounds);
  return {small, std::max(1e-12, (large - small) / static_cast<double>(kLarge))};
}

// Measures the links and the reduction rate on rank 0 and its peers; every rank gets rank 0's
// values, so every rank's model is the same. Well under a second (a few ms here).
CostModel calibrate(Communicator& comm, const topology::Topology& topo) {
  CostModel model;
  const int my_group = topo.group_of_rank[0];
  int intra_peer = -1, inter_peer = -1;
  for (int r = 1; r < comm.size(); ++r) {
    const bool same = topo.group_of_rank[static_cast<std::size_t>(r)] == my_group;
    if (same && intra_peer < 0) intra_peer = r;
    if (!same && inter_peer < 0) inter_peer = r;
  }
  double values[6] = {model.intra.alpha, model.intra.beta, model.inter.alpha,
                      model.inter.beta,  model.gamma,      model.copy_beta};
  if (intra_peer > 0 && (comm.rank() == 0 || comm.rank() == intra_peer)) {
    const CostModel::Link link = ping_pong(comm, intra_peer);
    values[0] = link.alpha;
    values[1] = link.beta;
  }
  if (inter_peer > 0 && (comm.rank() == 0 || comm.rank() == inter_peer)) {
    const CostModel::Link link = ping_pong(comm, inter_peer);
    values[2] = link.alpha;
    values[3] = link.beta;
  } else if (inter_peer < 0) {
    values[2] = values[0];  // one group: every link is intra-group
    values[3] = values[1];
  }
  if (comm.rank() == 0) {
    constexpr std::size_t kCount = 1 << 16;  // 256 KiB of float32
    std::vector<float> a(kCount, 1.0f), b(kCount, 2.0f);
    reduce_into(a.data(), b.data(), kCount, DataType::float32, ReduceOp::sum);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < 8; ++i)
      reduce_into(a.data(), b.data(), kCount, DataType::float32, ReduceOp::sum);
    values[4] = (MPI_Wtime() - t0) / 8 / static_cast<double>(kCount * sizeof(float));
    const double t1 = MPI_Wtime();
    for (int i = 0; i < 8; ++i) {
      std::memcpy(a.data(), b.data(), kCount * sizeof(float));
      b[static_cast<std::size_t>(i)] = a[static_cast<std::size_t>(i) + 1];  // keep the copies
    }
    values[5] = (MPI_Wtime() - t1) / 8 / static_cast<double>(kCount * sizeof(float));
  }
  MPI_Bcast(values, 6, MPI_DOUBLE, 0, comm.mpi_comm());
  model.intra = {values[0], values[1]};
  model.inter = {values[2], values[3]};
  model.gamma = values[4];
  model.copy_beta = values[5];
  if (shm_available(comm)) {
    // shm's flag round, measured against halving_doubling: 8-byte calls of both, interleaved
    // (16 each, medians, slowest rank), and the flag round set so that the model's ratio of the
    // two is the measured one. A plain time would compare a whole call against the model's bare
    // message latency (the ping-pong above), and the two are often measured in different
    // scheduler states (processes start on one CPU and spread later).
    AlgorithmCache& cache = comm.attachment<AlgorithmCache>();
    AllreduceAlgorithm* shm = cache.find("shm");
    AllreduceAlgorithm* hd = cache.find("halving_doubling");
    float in[2] = {1.0f, 2.0f}, out[2] = {};
    const AllreduceArgs args{in, out, 2, DataType::float32, ReduceOp::sum};
    for (int i = 0; i < 3; ++i) {
      shm->run(args, comm);
      hd->run(args, comm);
    }
    std::vector<double> shm_times(16), hd_times(16);
    for (std::size_t i = 0; i < shm_times.size(); ++i) {
      double t0 = MPI_Wtime();
      shm->run(args, comm);
      shm_times[i] = MPI_Wtime() - t0;
      t0 = MPI_Wtime();
      hd->run(args, comm);
      hd_times[i] = MPI_Wtime() - t0;
    }
    std::nth_element(shm_times.begin(), shm_times.begin() + 8, shm_times.end());
    std::nth_element(hd_times.begin(), hd_times.begin() + 8, hd_times.end());
    double medians[2] = {shm_times[8], hd_times[8]};
    MPI_Allreduce(MPI_IN_PLACE, medians, 2, MPI_DOUBLE, MPI_MAX, comm.mpi_comm());
    int group_size = 1;
    for (const auto& g : topo.groups)
      group_size = std::max(group_size, static_cast<int>(g.size()));
    const std::optional<double> hd_model = model.predict(
        "halving_doubling", 8, comm.size(), static_cast<int>(topo.groups.size()), group_size);
    model.flag_alpha =
        hd_model && medians[1] > 0 ? medians[0] * *hd_model / medians[1] : medians[0];
  }
  return model;
}

std::string milliseconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g ms", seconds * 1e3);
  return text;
}

// Measured corrections to the model, for hosts with more ranks than hardware threads. The
// alpha-beta-gamma model gets each algorithm's cost right while every rank has a core (auto is
// within 1.10x of the best on 2 ranks here), but not the scheduler's part when ranks share
// cores: an algorithm whose every step needs a descheduled partner (halving_doubling) then loses
// to one whose senders need not wait for each other (flat) by 1.3-1.6x at 512 B - 32 KiB on 4
// ranks over 2 cores, where the model calls them even. So on such hosts every modelled
// algorithm is timed at a few sizes on first use (interleaved rounds, median, slowest rank), and
// predictions are scaled by measured / predicted, interpolated in log(size) between the probes.
// Elsewhere the probes would only add their noise to a model that is right.
constexpr std::size_t kProbeBytes[] = {8, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 8 << 20};
constexpr int kProbeRounds = 5;
constexpr double kProbeWindow = 300e-6;  // seconds per timed batch: well above barrier skew
constexpr double kProbeBudget = 0.3;     // seconds for all probes

struct Corrections {
  std::vector<std::string_view> algorithms;
  std::vector<double> log_factor;  // [probe][algorithm]
  std::vector<double> last_extra;  // [algorithm]: measured - predicted seconds at the last probe
  bool complete = false;           // every probe size was timed (not stopped by the budget)

  // The prediction scaled by measured / predicted, interpolated in log(size) between probes.
  // Past the last probe: the same factor when every probe ran (the largest is 8 MiB); when the
  // budget stopped them early (slow links), the last probe's excess as a fixed per-call cost,
  // so that at sizes no probe reached the link model decides, not a factor measured where
  // latency dominated.
  double apply(std::string_view algorithm, std::size_t bytes, double predicted) const {
    const auto a = std::find(algorithms.begin(), algorithms.end(), algorithm);
    if (a == algorithms.end()) return predicted;
    const std::size_t col = static_cast<std::size_t>(a - algorithms.begin());
    const std::size_t probes = log_factor.size() / algorithms.size();
    auto at = [&](std::size_t p) { return log_factor[p * algorithms.size() + col]; };
    if (bytes <= kProbeBytes[0]) return predicted * std::exp(at(0));
    for (std::size_t p = 1; p < probes; ++p) {
      if (bytes <= kProbeBytes[p]) {
        const double lo = std::log(static_cast<double>(kProbeBytes[p - 1]));
        const double hi = std::log(static_cast<double>(kProbeBytes[p]));
        const double t = (std::log(static_cast<double>(bytes)) - lo) / (hi - lo);
        return predicted * std::exp(at(p - 1) + t * (at(p) - at(p - 1)));
      }
    }
    if (complete) return predicted * std::exp(at(probes - 1));
    return std::max(predicted + last_extra[col], 0.5 * predicted);
  }
};

// CostModel::group_shm and crowded, agreed by every rank.
void set_hierarchical_view(Communicator& comm, const topology::Topology& topo, CostModel& model) {
  const std::string& form = comm.config().hierarchical_intra;
  int group_shm = (form == "auto" || form == "shm") &&
                          ranks_on_this_host(comm) >= static_cast<int>(topo.my_group().size())
                      ? 1
                      : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &group_shm, 1, MPI_INT, MPI_MIN, comm.mpi_comm()),
            "auto: MPI_Allreduce", comm.rank());
  model.group_shm = group_shm != 0;
  model.crowded = machine_oversubscribed(comm);
}

Corrections probe_algorithms(Communicator& comm, const CostModel& model, int groups,
                             int group_size) {
  Corrections c;
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (model.predict(entry.name, 8, comm.size(), groups, group_size)) {
      c.algorithms.push_back(entry.name);
    }
  }
  const std::size_t na = c.algorithms.size();
  auto predicted = [&](std::size_t a, std::size_t bytes) {
    return *model.predict(c.algorithms[a], bytes, comm.size(), groups, group_size);
  };
  // Enough back-to-back calls per batch to fill the window (by the model's estimate).
  auto calls_for = [&](std::size_t a, std::size_t bytes) {
    return static_cast<int>(std::clamp(std::ceil(kProbeWindow / predicted(a, bytes)), 1.0, 256.0));
  };
  // Probing must not show in the byte counters the user reads.
  TrafficCounters& counters = comm.attachment<Traffic>().counters();
  const TrafficCounters saved = counters;
  std::vector<float> buffer(kProbeBytes[std::size(kProbeBytes) - 1] / sizeof(float), 1.0f);
  double spent = 0;  // estimated from the agreed times, so every rank stops at the same probe
  for (std::size_t bytes : kProbeBytes) {
    const std::size_t count = std::max<std::size_t>(1, bytes / sizeof(float));
    std::vector<std::vector<double>> rounds(na);
    for (std::size_t a = 0; a < na; ++a) {  // warm-up
      allreduce(comm, buffer.data(), buffer.data(), count, DataType::float32, ReduceOp::max,
                {.algorithm = c.algorithms[a]});
    }
    for (int round = 0; round < kProbeRounds; ++round) {
      for (std::size_t a = 0; a < na; ++a) {
        const int calls = calls_for(a, bytes);
        MPI_Barrier(comm.mpi_comm());
        const double t0 = MPI_Wtime();
        for (int i = 0; i < calls; ++i) {
          allreduce(comm, buffer.data(), buffer.data(), count, DataType::float32, ReduceOp::max,
                    {.algorithm = c.algorithms[a]});
        }
        rounds[a].push_back((MPI_Wtime() - t0) / calls);
      }
    }
    std::vector<double> measured(na);
    for (std::size_t a = 0; a < na; ++a) {
      std::sort(rounds[a].begin(), rounds[a].end());
      measured[a] = rounds[a][rounds[a].size() / 2];
    }
    // The slowest rank's times, so that every rank holds the same numbers.
    MPI_Allreduce(MPI_IN_PLACE, measured.data(), static_cast<int>(na), MPI_DOUBLE, MPI_MAX,
                  comm.mpi_comm());
    c.last_extra.assign(na, 0.0);
    for (std::size_t a = 0; a < na; ++a) {
      c.log_factor.push_back(std::log(std::max(measured[a], 1e-9) / predicted(a, bytes)));
      c.last_extra[a] = measured[a] - predicted(a, bytes);
      spent += measured[a] * (kProbeRounds * calls_for(a, bytes) + 1);
    }
    if (bytes == kProbeBytes[std::size(kProbeBytes) - 1]) c.complete = true;
    // Stop before a probe that would overrun the budget (tiny test segments or slow links make
    // big calls slow); see Corrections::apply for the sizes past the last probe.
    const std::size_t next = bytes * 8;
    double upcoming = 0;
    for (std::size_t a = 0; a < na; ++a) {
      upcoming += measured[a] * 8 * (kProbeRounds * calls_for(a, next) + 1);
    }
    if (spent + upcoming > kProbeBudget) break;
  }
  counters = saved;
  return c;
}

// What auto knows about one communicator, set up on its first auto call.
class AutoState : public Attachment {
 public:
  explicit AutoState(Communicator& comm) {
    const topology::Topology& topo = topology::topology_of(comm);
    groups = static_cast<int>(topo.groups.size());
    for (const auto& g : topo.groups)
      group_size = std::max(group_size, static_cast<int>(g.size()));
    const Config& config = comm.config();
    // The table: rank 0 reads it, everyone parses rank 0's text.
    std::string text;
    bool have_file = !config.tuning_file.empty();
    if (have_file && comm.rank() == 0) {
      std::ifstream in(config.tuning_file);
      std::ostringstream content;
      content << in.rdbuf();
      text = in ? content.str() : std::string();
    }
    if (have_file) {
      text = broadcast_string(comm, text);
      if (text.empty()) {
        throw InvalidArgument(error_message(
            "auto", comm.rank(), "cannot read GRADCOMM_TUNING_FILE '" + config.tuning_file + "'"));
      }
      TuningTable parsed = TuningTable::parse(text, config.tuning_file);
      if (parsed.ranks == comm.size() && parsed.groups == groups) {
        table = std::move(parsed);
      } else {
        comm.log(LogLevel::info, "auto: tuning table " + config.tuning_file + " is for " +
                                     std::to_string(parsed.ranks) + " ranks in " +
                                     std::to_string(parsed.groups) +
                                     " groups; using the cost model");
      }
    }
    measuring = config.auto_measure && !table;
    if (config.calibrate) model = calibrate(comm, topo);
    model.one_host = shm_available(comm);
    set_hierarchical_view(comm, topo, model);
    if (config.calibrate) {
      // Probing times the algorithms themselves; in the reproducible mode they all run the same
      // schedule, and with a table the model is not used.
      if (!table && !config.deterministic && model.crowded) {
        corrections = probe_algorithms(comm, model, groups, group_size);
        if (comm.log_enabled(LogLevel::debug)) {
          const std::size_t probes = corrections.log_factor.size() /
                                     std::max<std::size_t>(1, corrections.algorithms.size());
          comm.log(LogLevel::debug,
                   "auto: more ranks than hardware threads on one machine; timed " +
                       std::to_string(probes) + " probe size(s) up to " +
                       std::to_string(probes ? kProbeBytes[probes - 1] : 0) + " bytes");
        }
      }
    }
    if (comm.log_enabled(LogLevel::debug)) {
      comm.log(LogLevel::debug,
               "auto: model intra alpha " + std::to_string(model.intra.alpha * 1e6) + " us, " +
                   std::to_string(1e-9 / model.intra.beta) + " GB/s; inter alpha " +
                   std::to_string(model.inter.alpha * 1e6) + " us, " +
                   std::to_string(1e-9 / model.inter.beta) + " GB/s; reduce " +
                   std::to_string(1e-9 / model.gamma) + " GB/s; shm flag round " +
                   std::to_string(model.flag_alpha * 1e6) + " us" +
                   (config.calibrate ? " (calibrated)" : " (defaults)"));
    }
  }

  // The model's prediction for `algorithm`, scaled by the probes when there are any.
  std::optional<double> predict(std::string_view algorithm, std::size_t bytes, int ranks) const {
    const auto p = model.predict(algorithm, bytes, ranks, groups, group_size);
    if (!p) return p;
    return corrections.apply(algorithm, bytes, *p);
  }

  // The modelled algorithms' predictions for `bytes`, in the registry's order.
  void predictions(std::size_t bytes, int ranks, std::vector<std::string_view>& names,
                   std::vector<double>& seconds) const {
    names.clear();
    seconds.clear();
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      // hierarchical over one group is the ring (the same model; measuring it twice is waste)
      if (entry.name == "hierarchical" && (groups <= 1 || group_size <= 1)) continue;
      if (const auto p = predict(entry.name, bytes, ranks)) {
        names.push_back(entry.name);
        seconds.push_back(*p);
      }
    }
  }

  // One size class of measured choices: sizes [2^(b-1), 2^b) bytes for b = bit_width(bytes).
  struct SizeClass {
    bool set_up = false;
    std::optional<MeasuredChoice> choice;  // empty: the model decides alone (see size_class)
    std::string_view pending;              // the algorithm of the timed call under way
    std::size_t last_bytes = 0;            // the prediction of last_name for last_bytes
    std::string_view last_name;
    double last_predicted = 0;
    // What a window's end costs: the model's two 8-byte calls at first, then what the ends
    // measured (the slowest rank's, averaged: on oversubscribed cores the agreement waits for
    // every rank to be scheduled, 10x the model's figure)
    double decision = 0;
    double last_end = 0;  // this rank's seconds in the previous window's end
  };

  std::optional<TuningTable> table;
  CostModel model;
  Corrections corrections;
  int groups = 1;
  int group_size = 1;
  bool measuring = false;  // Config::auto_measure, and the model decides
  std::string_view last;   // the model's or table's latest choice, made for last_bytes
  std::size_t last_bytes = 0;
  std::unordered_map<std::size_t, std::string_view> decisions;  // bytes -> registry name (table)
  std::array<SizeClass, 65> classes;                            // by bit_width(bytes) (model)
  std::vector<std::pair<std::string_view, double>> test_scale;
};

}  // namespace

std::optional<double> CostModel::predict(std::string_view algorithm, std::size_t bytes, int n,
                                         int groups, int group_size) const {
  const double S = static_cast<double>(bytes);
  const Link link = groups > 1 ? inter : intra;  // flat algorithms are as slow as their worst link
  // A group's ranks share its link to the other groups (one NIC per node, which the calibration
  // measures with one stream): when `streams` of them cross at once, each gets 1/streams of it.
  auto shared = [&](int streams) {
    Link l = inter;
    l.beta *= std::max(1, streams);
    return l;
  };
  if (algorithm == "ring") {
    // One rank per group sends across (to the next group's first rank) in each step; every step
    // waits for its slowest link.
    return 2.0 * (n - 1) * (link.alpha + S / n * link.beta) + (n - 1.0) / n * S * gamma;
  }
  if (algorithm == "halving_doubling") {
    int p = 1;
    while (p * 2 <= n)
      p *= 2;
    // The step at distance d pairs ranks d apart: inside a group while d < group_size (ranks
    // placed group by group), else across, with every rank of a group crossing at once.
    auto step = [&](int distance) {
      return groups > 1 && distance >= group_size ? shared(group_size) : intra;
    };
    const double fold = p == n ? 0.0 : 2 * (link.alpha + S * link.beta) + S * gamma;
    double t = fold;
    if (bytes <= kRecursiveDoublingMaxBytes) {
      for (int d = 1; d < p; d *= 2)
        t += step(d).alpha + S * step(d).beta + S * gamma;
      return t;
    }
    double piece = S;  // halves at every step of the reduce-scatter, nearest partner first
    for (int d = 1; d < p; d *= 2) {
      piece /= 2;
      t += 2 * (step(d).alpha + piece * step(d).beta);  // reduce-scatter and all-gather steps
    }
    return t + (p - 1.0) / p * S * gamma;
  }
  if (algorithm == "flat") {
    return 2 * link.alpha + 2.0 * (n - 1) * S * link.beta + (n - 1.0) * S * gamma;
  }
  if (algorithm == "hierarchical") {
    if (groups <= 1 || group_size <= 1) return predict("ring", bytes, n, 1, n);
    const double g = group_size;
    const double shard = S / g;
    const bool shm_phases =
        group_shm && hierarchical_intra_auto(bytes, group_size, true, crowded) == Intra::shm;
    // direct: one round of messages each way; shm: 4 flag waits per 256 KiB round, copies in of
    // the others' columns, out of the owner's, and out of the others'.
    const double rounds = std::max(1.0, std::ceil(S / static_cast<double>(kShmChunkBytes)));
    const double intra_phases =
        shm_phases ? 4 * rounds * flag_alpha + (2 * (g - 1) / g + 1 / g) * S * copy_beta +
                         (g - 1) / g * S * gamma
                   : 2 * (g - 1) * intra.alpha + 2 * (g - 1) / g * S * intra.beta +
                         (g - 1) / g * S * gamma;
    CostModel across = *this;
    across.intra = shared(group_size);  // every rank of a group crosses at once
    const std::string_view cross = shard < kHierarchicalRingFromBytes ? "halving_doubling" : "ring";
    return intra_phases +
           *across.predict(cross, static_cast<std::size_t>(shard), groups, 1, groups);
  }
  if (algorithm == "shm") {
    if (!one_host || groups > 1) return std::nullopt;  // emulated nodes count as nodes
    if (bytes <= kShmSmallBytes) return flag_alpha + S * copy_beta + n * S * gamma;
    const double rounds = std::ceil(S / static_cast<double>(kShmChunkBytes));
    return 3 * rounds * flag_alpha + 2 * S * copy_beta + S * gamma;
  }
  return std::nullopt;
}

std::string TuningTable::to_json() const {
  nlohmann::json doc;
  doc["version"] = 1;
  doc["ranks"] = ranks;
  doc["groups"] = groups;
  doc["rows"] = nlohmann::json::array();
  for (const Row& row : rows) {
    doc["rows"].push_back({{"max_bytes", row.max_bytes}, {"algorithm", row.algorithm}});
  }
  return doc.dump(2) + "\n";
}

TuningTable TuningTable::parse(const std::string& text, const std::string& origin) {
  auto bad = [&](const std::string& detail) {
    throw InvalidArgument(error_message("tuning table", -1, origin + ": " + detail));
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("invalid JSON: ") + e.what());
  }
  if (!doc.is_object()) bad("the top level must be an object {\"version\": 1, ...}");
  const auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_integer() || *version != 1) {
    bad("expected \"version\": 1");
  }
  // Integers only: a float or an out-of-range value is an error, not silently converted.
  auto rank_count = [&](const char* key) {
    const auto it = doc.find(key);
    if (it == doc.end()) bad(std::string("missing field '") + key + "'");
    if (!it->is_number_unsigned() || it->get<std::uint64_t>() < 1 ||
        it->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
      bad(std::string("field '") + key + "' must be an integer from 1 to " +
          std::to_string(std::numeric_limits<int>::max()));
    }
    return static_cast<int>(it->get<std::uint64_t>());
  };
  TuningTable table;
  table.ranks = rank_count("ranks");
  table.groups = rank_count("groups");
  const auto rows = doc.find("rows");
  if (rows == doc.end() || !rows->is_array()) bad("missing array field 'rows'");
  for (std::size_t i = 0; i < rows->size(); ++i) {
    const nlohmann::json& row = (*rows)[i];
    std::string where = "rows[";
    where.append(std::to_string(i)).push_back(']');
    if (!row.is_object())
      bad(where + " must be an object {\"max_bytes\": ..., \"algorithm\": ...}");
    const auto max_bytes = row.find("max_bytes");
    if (max_bytes == row.end() || !max_bytes->is_number_unsigned()) {
      bad(where + ".max_bytes must be a non-negative integer");
    }
    const auto algorithm = row.find("algorithm");
    if (algorithm == row.end() || !algorithm->is_string()) {
      bad(where + ".algorithm must be a string");
    }
    table.rows.push_back({max_bytes->get<std::size_t>(), algorithm->get<std::string>()});
  }
  if (table.rows.empty()) bad("no rows");
  for (const Row& row : table.rows) {
    if (row.algorithm == "auto" || !is_algorithm_name(row.algorithm)) {
      bad("unknown algorithm '" + row.algorithm + "'; valid: " + algorithm_names_joined());
    }
  }
  return table;
}

std::optional<double> predicted_allreduce_seconds(Communicator& comm, std::string_view algorithm,
                                                  std::size_t bytes) {
  return comm.attachment<AutoState>().predict(algorithm, bytes, comm.size());
}

namespace {

std::string explain(const AutoState& state, std::size_t bytes, int ranks,
                    const MeasuredChoice* measured) {
  std::vector<std::string_view> names;
  std::vector<double> predicted;
  state.predictions(bytes, ranks, names, predicted);
  std::string why;
  if (measured != nullptr) {
    for (std::size_t i = 0; i < measured->names().size(); ++i) {
      if (!measured->measured(i)) continue;
      const auto at = std::find(names.begin(), names.end(), measured->names()[i]);
      const double p = predicted[static_cast<std::size_t>(at - names.begin())];
      why += (why.empty() ? "measured " : ", ") + std::string(measured->names()[i]) + " " +
             milliseconds(measured->expected(i, p));
    }
    if (!why.empty()) why += "; ";
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    why +=
        (i == 0 ? "predicted " : ", ") + std::string(names[i]) + " " + milliseconds(predicted[i]);
  }
  return why;
}

// Calls shorter than this are timed one in several (two clock reads are ~40 ns).
constexpr double kTimedFromSeconds = 5e-6;
constexpr double kWindowSeconds = 1e-3;  // the shortest measuring window
constexpr int kMaxTimed = 64;            // timed calls a window needs at most

struct WindowShape {
  int stride, window, duel, challenger_calls;
};

// The windows of a size class whose choice takes `call` seconds (the model's prediction until
// measured, then the measurement) where a window's end costs about `decision` seconds. A window
// ends in a decision that costs a few small collectives (the call check, the agreement: 3-5 us on
// 2 ranks here): windows of at least 1 ms and 200 times the decision keep it below ~0.5%. Calls
// shorter than kTimedFromSeconds are timed one in `stride`, and so are calls of which a window
// would time more than kMaxTimed (a median of 64 is as good, and the clock reads cost less); a
// window has at least 4 timed calls, a duel 4 - 8 of the challenger.
WindowShape window_shape(double call, double decision) {
  const double seconds = std::max(kWindowSeconds, 200 * decision);
  const int calls = static_cast<int>(std::clamp(std::ceil(seconds / call), 4.0, 8192.0));
  const double by_time = std::ceil(kTimedFromSeconds / call);
  const double by_count = std::ceil(static_cast<double>(calls) / kMaxTimed);
  const int stride = static_cast<int>(std::clamp(std::max(by_time, by_count), 1.0, 256.0));
  const int window = std::max(4, (calls + stride - 1) / stride);  // timed calls
  const int challenger_calls = std::clamp(window / 4, 4, 8);
  return {stride, window, std::max(window, 2 * challenger_calls), challenger_calls};
}

// The size class of `bytes`, set up on its first call: measured when more than one algorithm is
// modelled.
AutoState::SizeClass& size_class(AutoState& state, Communicator& comm, std::size_t bytes) {
  AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
  if (c.set_up) return c;
  c.set_up = true;
  std::vector<std::string_view> names;
  std::vector<double> predicted;
  state.predictions(bytes, comm.size(), names, predicted);
  if (names.size() < 2) return c;
  std::vector<std::string_view> unused;
  std::vector<double> small;
  state.predictions(8, comm.size(), unused, small);
  c.decision = 2 * *std::min_element(small.begin(), small.end());
  const WindowShape shape =
      window_shape(*std::min_element(predicted.begin(), predicted.end()), c.decision);
  c.choice.emplace(std::move(names), predicted, shape.stride, shape.window, shape.duel,
                   shape.challenger_calls);
  return c;
}

}  // namespace

MeasuredChoice::MeasuredChoice(std::vector<std::string_view> names,
                               const std::vector<double>& predicted, int stride, int window,
                               int duel, int challenger_calls)
    : names_(std::move(names)),
      ratio_(names_.size(), 0.0),
      stride_(stride),
      window_(window),
      duel_(duel),
      challenger_calls_(challenger_calls) {
  choice_ = static_cast<std::size_t>(std::min_element(predicted.begin(), predicted.end()) -
                                     predicted.begin());
  challenger_ = choice_;
}

bool MeasuredChoice::record(double ratio) {
  samples_[challenger_turn() ? 1 : 0].push_back(ratio);
  ++timed_;
  return timed_ >= (dueling() ? duel_ : window_);
}

std::array<double, 2> MeasuredChoice::figures() {
  std::array<double, 2> medians{};
  for (std::size_t slot = 0; slot < 2; ++slot) {
    std::vector<double>& v = samples_[slot];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    const std::size_t half = v.size() / 2;
    medians[slot] = v.size() % 2 == 1 ? v[half] : (v[half - 1] + v[half]) / 2;
  }
  return medians;
}

bool MeasuredChoice::decide(const std::array<double, 2>& agreed,
                            const std::vector<double>& predicted) {
  const std::size_t before = choice_;
  const bool was_duel = dueling();
  ++windows_;
  timed_ = 0;
  samples_[0].clear();
  samples_[1].clear();
  if (!was_duel) {
    ratio_[choice_] = std::max(agreed[0], 1e-12);
  } else {
    // A contest is judged on the mean of its duel windows' figures.
    pooled_[0] += agreed[0];
    pooled_[1] += agreed[1];
    ++duel_windows_;
    ratio_[choice_] = std::max(pooled_[0] / duel_windows_, 1e-12);
    ratio_[challenger_] = std::max(pooled_[1] / duel_windows_, 1e-12);
    const double mine = expected(choice_, predicted[choice_]);
    const double theirs = expected(challenger_, predicted[challenger_]);
    if (duel_windows_ < kMaxDuelWindows && theirs < kClose * mine && mine < kClose * theirs) {
      return false;  // too close to call from 4 - 8 calls: another duel window, pooled
    }
    pooled_ = {0, 0};
    duel_windows_ = 0;
    if (theirs < kMargin * mine) {
      choice_ = challenger_;
      since_recheck_ = 0;
      solo_seconds_ = 0;
      confirmed_ = false;  // one duel decided it: confirmed by another kConfirmAfter windows on
    } else {
      if (!trying_) confirmed_ = true;  // a trial duel says nothing about the runner-up
      if (rechecking_) solo_seconds_ = 0;
    }
  }
  challenger_ = choice_;
  // The strongest other: the lowest expectation (never measured: the model's prediction).
  const double mine = expected(choice_, predicted[choice_]);
  std::size_t other = choice_;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (i != choice_ &&
        (other == choice_ || expected(i, predicted[i]) < expected(other, predicted[other]))) {
      other = i;
    }
  }
  // The most promising algorithm never measured here whose prediction is within
  // kRecheckFactor of the choice: the model is off by up to 2x for single algorithms on this
  // machine (shm on 4 ranks sharing 2 cores at 2 MiB), and the re-checks below only ever look at
  // the strongest other, so each such algorithm is tried once.
  std::size_t untried = choice_;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    if (i != choice_ && !measured(i) && predicted[i] <= kRecheckFactor * mine &&
        (untried == choice_ || predicted[i] < predicted[untried])) {
      untried = i;
    }
  }
  if (other != choice_) {
    const double theirs = expected(other, predicted[other]);
    rechecking_ = false;
    trying_ = false;
    if (theirs < kMargin * mine) {
      challenger_ = other;  // expected to win: find out
    } else if (untried != choice_) {
      challenger_ = untried;  // not expected to win, but never measured: try it once
      trying_ = true;
    } else if (!was_duel) {
      // Re-check the runner-up once what the duel would cost beyond the choice (its calls times
      // the expected difference) is within kRecheckBudget of the solo time since the last one: a
      // near tie is re-checked every few windows, so a change of the machine's state that turns
      // it is found soon; one expected twice as slow rarely.
      ++since_recheck_;
      solo_seconds_ += static_cast<double>(window_) * stride_ * mine;
      const bool confirm = !confirmed_ && since_recheck_ >= kConfirmAfter;
      const bool paid = since_recheck_ >= kMinRecheck &&
                        solo_seconds_ * kRecheckBudget >= challenger_calls_ * (theirs - mine);
      if (confirm || paid) {
        since_recheck_ = 0;
        solo_seconds_ = 0;
        if (theirs <= kRecheckFactor * mine) {
          challenger_ = other;
          rechecking_ = true;
        } else {
          confirmed_ = true;  // nothing close enough to doubt it
        }
      }
    }
  } else {
    confirmed_ = true;
  }
  return choice_ != before;
}

std::string_view select_allreduce_algorithm(const AllreduceArgs& args, Communicator& comm) {
  AutoState& state = comm.attachment<AutoState>();
  const std::size_t bytes = args.count * args.element_bytes();
  if (state.measuring) {
    AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
    if (!c.set_up && size_class(state, comm, bytes).choice && comm.log_enabled(LogLevel::debug)) {
      comm.log(LogLevel::debug,
               "auto: " + std::string(c.choice->choice()) + " for " + std::to_string(bytes) +
                   " bytes on " + std::to_string(comm.size()) + " ranks (" +
                   explain(state, bytes, comm.size(), nullptr) + "); measuring it");
    }
    if (c.choice) return c.choice->choice();
  }
  // Decisions are cached per size: this runs on every auto call, and small calls take ~1 us.
  if (bytes == state.last_bytes && !state.last.empty()) return state.last;
  if (const auto hit = state.decisions.find(bytes); hit != state.decisions.end()) {
    state.last_bytes = bytes;
    return state.last = hit->second;
  }
  std::string_view choice;
  if (state.table) {
    const auto& rows = state.table->rows;
    const auto it = std::find_if(rows.begin(), rows.end(),
                                 [&](const TuningTable::Row& r) { return bytes <= r.max_bytes; });
    const std::string& name = (it == rows.end() ? rows.back() : *it).algorithm;
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      if (entry.name == name) choice = entry.name;
    }
  } else {
    double best = 0;
    for (const AlgorithmEntry& entry : registered_algorithms()) {
      const auto predicted = state.predict(entry.name, bytes, comm.size());
      if (predicted && (choice.empty() || *predicted < best)) {
        best = *predicted;
        choice = entry.name;
      }
    }
  }
  if (state.decisions.size() >= 4096) state.decisions.clear();
  state.decisions.emplace(bytes, choice);
  if (state.last != choice && comm.log_enabled(LogLevel::debug)) {
    const std::string why = state.table ? "tuning table " + comm.config().tuning_file
                                        : explain(state, bytes, comm.size(), nullptr);
    comm.log(LogLevel::debug, "auto: " + std::string(choice) + " for " + std::to_string(bytes) +
                                  " bytes on " + std::to_string(comm.size()) + " ranks (" + why +
                                  ")");
  }
  state.last = choice;
  state.last_bytes = bytes;
  return choice;
}

std::string_view begin_auto_call(const AllreduceArgs& args, Communicator& comm, bool& timed) {
  timed = false;
  AutoState& state = comm.attachment<AutoState>();
  if (state.measuring) {
    const std::size_t bytes = args.count * args.element_bytes();
    AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
    if (!c.set_up) select_allreduce_algorithm(args, comm);  // sets it up
    if (c.choice) {
      const MeasuredChoice::Pick pick = c.choice->pick();
      timed = pick.timed;
      c.pending = pick.algorithm;
      return pick.algorithm;
    }
  }
  return select_allreduce_algorithm(args, comm);
}

void end_auto_call(const AllreduceArgs& args, Communicator& comm, double seconds) {
  AutoState& state = comm.attachment<AutoState>();
  const std::size_t bytes = args.count * args.element_bytes();
  AutoState::SizeClass& c = state.classes[std::bit_width(bytes)];
  const std::string_view algorithm = c.pending;
  for (const auto& [name, factor] : state.test_scale) {
    if (name == algorithm) seconds *= factor;
  }
  if (c.last_bytes != bytes || c.last_name != algorithm) {
    c.last_bytes = bytes;
    c.last_name = algorithm;
    c.last_predicted = state.predict(algorithm, bytes, comm.size()).value_or(1.0);
  }
  if (!c.choice->record(seconds / c.last_predicted)) return;
  // The window's figures: every rank's median of each algorithm's timed calls, the slowest
  // rank's (every rank then holds the same numbers), and what the previous window's end cost the
  // slowest rank (so every rank sizes the next windows alike). A rank whose peers made another
  // call must not wait here for them: the call's comparison first.
  const auto end_started = std::chrono::steady_clock::now();
  require_check();
  const std::array<double, 2> mine = c.choice->figures();
  std::array<double, 3> figures = {mine[0], mine[1], c.last_end};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, figures.data(), 3, MPI_DOUBLE, MPI_MAX, comm.mpi_comm()),
            "auto: MPI_Allreduce", comm.rank());
  c.last_end =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - end_started).count();
  if (figures[2] > 0) c.decision = (c.decision + figures[2]) / 2;
  const std::array<double, 2> agreed = {figures[0], figures[1]};
  std::vector<std::string_view> names;
  std::vector<double> all;
  state.predictions(bytes, comm.size(), names, all);
  std::vector<double> predicted;
  for (std::string_view name : c.choice->names()) {
    predicted.push_back(
        all[static_cast<std::size_t>(std::find(names.begin(), names.end(), name) - names.begin())]);
  }
  const bool changed = c.choice->decide(agreed, predicted);
  // The next windows are shaped by what the choice measured, not by the model's prediction
  // (which is off by up to 4x for short calls here).
  const WindowShape shape = window_shape(c.choice->expected_choice(predicted), c.decision);
  c.choice->reshape(shape.stride, shape.window, shape.duel, shape.challenger_calls);
  if ((changed || c.choice->dueling()) && comm.log_enabled(LogLevel::debug)) {
    const std::string what = changed ? std::string(c.choice->choice()) + " now"
                                     : "measuring " + std::string(c.choice->challenger()) +
                                           " against " + std::string(c.choice->choice());
    comm.log(LogLevel::debug, "auto: " + what + " for " + std::to_string(bytes) + " bytes on " +
                                  std::to_string(comm.size()) + " ranks (" +
                                  explain(state, bytes, comm.size(), &*c.choice) + ")");
  }
}

bool auto_settled(const AllreduceArgs& args, Communicator& comm) {
  // One rank and reproducible mode never reach the selection.
  if (comm.size() == 1 || comm.config().deterministic) return true;
  AutoState& state = comm.attachment<AutoState>();
  if (!state.measuring) return true;
  const AutoState::SizeClass& c = state.classes[std::bit_width(args.count * args.element_bytes())];
  if (!c.set_up) return false;
  return !c.choice || c.choice->settled();
}

void scale_auto_timing_for_testing(Communicator& comm, std::string_view algorithm, double factor) {
  AutoState& state = comm.attachment<AutoState>();
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.name == algorithm) state.test_scale.emplace_back(entry.name, factor);
  }
}

}  // namespace gradcomm::collectives
