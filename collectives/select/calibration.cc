#include "collectives/select/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "collectives/allreduce_halving_doubling.h"
#include "collectives/allreduce_shm.h"
#include "collectives/p2p.h"
#include "collectives/registry.h"
#include "collectives/shm/segment.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "topology/host.h"

namespace gradcomm::collectives {
namespace {

constexpr int kCalibrationTag = 105;

// Ping-pong between rank 0 and `peer`: {alpha, beta}. Other ranks do nothing.
CostModel::Link ping_pong(Communicator& comm, int peer) {
  constexpr int kSmallRounds = 20, kLargeRounds = 4;
  constexpr std::size_t kLarge = std::size_t{1} << 20;
  std::vector<std::byte> buffer(kLarge);
  const MPI_Comm mpi = comm.mpi_comm();
  constexpr const char* kSend = "auto calibration: MPI_Send";
  constexpr const char* kRecv = "auto calibration: MPI_Recv";
  // The median round trip's half: one slow trip (a scheduler tick while processes that started
  // on one CPU spread out) moved a mean of 20 to 10.8 us under Intel MPI on a 2-CPU Intel Xeon,
  // where the trips take about 0.3 us, and auto then never tried shm above its latency path.
  std::vector<double> trips;
  auto round_trips = [&](std::size_t bytes, int rounds) {
    const int count = static_cast<int>(bytes);
    trips.assign(static_cast<std::size_t>(rounds), 0.0);
    for (int i = 0; i < rounds; ++i) {
      const double t0 = MPI_Wtime();
      if (comm.rank() == 0) {
        check_mpi(MPI_Send(buffer.data(), count, MPI_BYTE, peer, kCalibrationTag, mpi), kSend,
                  comm.rank());
        check_mpi(
            MPI_Recv(buffer.data(), count, MPI_BYTE, peer, kCalibrationTag, mpi, MPI_STATUS_IGNORE),
            kRecv, comm.rank());
      } else {
        check_mpi(
            MPI_Recv(buffer.data(), count, MPI_BYTE, 0, kCalibrationTag, mpi, MPI_STATUS_IGNORE),
            kRecv, comm.rank());
        check_mpi(MPI_Send(buffer.data(), count, MPI_BYTE, 0, kCalibrationTag, mpi), kSend,
                  comm.rank());
      }
      trips[static_cast<std::size_t>(i)] = MPI_Wtime() - t0;
    }
    const auto middle = trips.begin() + rounds / 2;
    std::nth_element(trips.begin(), middle, trips.end());
    return *middle / 2;  // one way
  };
  round_trips(8, 2);  // warm up the path
  const double small = round_trips(8, kSmallRounds);
  const double large = round_trips(kLarge, kLargeRounds);
  return {small, std::max(1e-12, (large - small) / static_cast<double>(kLarge))};
}

}  // namespace

std::string broadcast_string(Communicator& comm, std::string text) {
  unsigned long long length = text.size();
  check_mpi(MPI_Bcast(&length, 1, MPI_UNSIGNED_LONG_LONG, 0, comm.mpi_comm()),
            "auto: MPI_Bcast of a length", comm.rank());
  text.resize(length);
  check_mpi(MPI_Bcast(text.data(), static_cast<int>(length), MPI_CHAR, 0, comm.mpi_comm()),
            "auto: MPI_Bcast of a text", comm.rank());
  return text;
}

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
  check_mpi(MPI_Bcast(values, 6, MPI_DOUBLE, 0, comm.mpi_comm()), "auto calibration: MPI_Bcast",
            comm.rank());
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
    AllreduceShm shm_algorithm;
    AllreduceHalvingDoubling hd_algorithm;
    AllreduceAlgorithm* shm = &shm_algorithm;
    AllreduceAlgorithm* hd = &hd_algorithm;
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
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, medians, 2, MPI_DOUBLE, MPI_MAX, comm.mpi_comm()),
              "auto calibration: MPI_Allreduce", comm.rank());
    int group_size = 1;
    for (const auto& g : topo.groups)
      group_size = std::max(group_size, static_cast<int>(g.size()));
    const std::optional<double> hd_model = AllreduceHalvingDoubling().predicted_seconds(
        model, {8, comm.size(), static_cast<int>(topo.groups.size()), group_size});
    model.flag_alpha =
        hd_model && medians[1] > 0 ? medians[0] * *hd_model / medians[1] : medians[0];
  }
  return model;
}

void set_placement(Communicator& comm, const topology::Topology& topo, CostModel& model) {
  const std::string& form = comm.config().hierarchical_intra;
  // Whether every group may run shm, and shm's latency-path limit (the smallest rank's): agreed,
  // so that every rank's model predicts alike.
  const bool group_on_this_host =
      topology::ranks_on_this_host(comm) >= static_cast<int>(topo.my_group().size());
  long agreed[2] = {(form == "auto" || form == "shm") && group_on_this_host ? 1L : 0L,
                    static_cast<long>(shm_small_own_cpu_bytes_here())};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, agreed, 2, MPI_LONG, MPI_MIN, comm.mpi_comm()),
            "auto: MPI_Allreduce of the group view", comm.rank());
  model.group_shm = agreed[0] != 0;
  model.shm_small_own_cpu = static_cast<std::size_t>(agreed[1]);
  model.crowded = topology::machine_oversubscribed(comm);
}

int probe_batch_calls(double predicted, double warm) {
  const double call = std::max(predicted, warm);
  return static_cast<int>(std::clamp(std::ceil(kProbeWindow / call), 1.0, 256.0));
}

Corrections probe_algorithms(Communicator& comm, const CostModel& model, int groups, int group_size,
                             const CallContext& call) {
  Corrections c;
  std::vector<AllreduceAlgorithm*> algorithms;
  AlgorithmCache& cache = comm.attachment<AlgorithmCache>();
  for (const AlgorithmEntry& entry : registered_algorithms()) {
    if (entry.prototype->predicted_seconds(model, {8, comm.size(), groups, group_size})) {
      c.algorithms.push_back(entry.name);
      algorithms.push_back(cache.find(entry.name));
    }
  }
  const std::size_t na = c.algorithms.size();
  auto predicted = [&](std::size_t a, std::size_t bytes) {
    return *algorithms[a]->predicted_seconds(model, {bytes, comm.size(), groups, group_size});
  };
  auto calls_for = [&](std::size_t a, std::size_t bytes, double warm) {
    return probe_batch_calls(predicted(a, bytes), warm);
  };
  // Probing must not show in the byte counters the user reads.
  TrafficCounters& counters = comm.attachment<Traffic>().counters();
  const TrafficCounters saved = counters;
  std::vector<float> buffer(kProbeBytes[std::size(kProbeBytes) - 1] / sizeof(float), 1.0f);
  double spent = 0;  // estimated from the agreed times, so every rank stops at the same probe
  for (std::size_t bytes : kProbeBytes) {
    const std::size_t count = std::max<std::size_t>(1, bytes / sizeof(float));
    std::vector<std::vector<double>> rounds(na);
    auto run = [&](std::size_t a) {
      AllreduceArgs args{buffer.data(),     buffer.data(), count,
                         DataType::float32, ReduceOp::max, comm.next_sequence()};
      args.call = call;
      algorithms[a]->run(args, comm);
    };
    // Warm-up: two calls of each, the second timed; the slowest rank's times size the batches
    // (the same on every rank, so that every rank makes the same calls).
    std::vector<double> warm(na);
    for (std::size_t a = 0; a < na; ++a) {
      run(a);
      const double t0 = MPI_Wtime();
      run(a);
      warm[a] = MPI_Wtime() - t0;
    }
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, warm.data(), static_cast<int>(na), MPI_DOUBLE, MPI_MAX,
                            comm.mpi_comm()),
              "auto probes: MPI_Allreduce", comm.rank());
    for (int round = 0; round < kProbeRounds; ++round) {
      for (std::size_t a = 0; a < na; ++a) {
        const int calls = calls_for(a, bytes, warm[a]);
        check_mpi(MPI_Barrier(comm.mpi_comm()), "auto probes: MPI_Barrier", comm.rank());
        const double t0 = MPI_Wtime();
        for (int i = 0; i < calls; ++i)
          run(a);
        rounds[a].push_back((MPI_Wtime() - t0) / calls);
      }
    }
    std::vector<double> measured(na);
    for (std::size_t a = 0; a < na; ++a) {
      std::sort(rounds[a].begin(), rounds[a].end());
      measured[a] = rounds[a][rounds[a].size() / 2];
    }
    // The slowest rank's times, so that every rank holds the same numbers.
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, measured.data(), static_cast<int>(na), MPI_DOUBLE,
                            MPI_MAX, comm.mpi_comm()),
              "auto probes: MPI_Allreduce", comm.rank());
    c.last_extra.assign(na, 0.0);
    for (std::size_t a = 0; a < na; ++a) {
      c.log_factor.push_back(std::log(std::max(measured[a], 1e-9) / predicted(a, bytes)));
      c.last_extra[a] = measured[a] - predicted(a, bytes);
      spent += measured[a] * (kProbeRounds * calls_for(a, bytes, warm[a]) + 2);
    }
    if (bytes == kProbeBytes[std::size(kProbeBytes) - 1]) c.complete = true;
    // Stop before a probe that would overrun the budget (tiny test segments or slow links make
    // big calls slow); see Corrections::apply for the sizes past the last probe.
    const std::size_t next = bytes * 8;
    double upcoming = 0;
    for (std::size_t a = 0; a < na; ++a) {
      // (Batches sized by the model alone: at least as many calls as the warm-up will allow.)
      upcoming += measured[a] * 8 * (kProbeRounds * calls_for(a, next, 0) + 2);
    }
    if (spent + upcoming > kProbeBudget) break;
  }
  counters = saved;
  return c;
}

double Corrections::apply(std::string_view algorithm, std::size_t bytes, double predicted) const {
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

}  // namespace gradcomm::collectives
