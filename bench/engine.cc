#include "bench/bench.h"

namespace gradcomm::bench {

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

// A round's order of n items: a random permutation, the same on every rank (every rank seeds
// `generator` alike and draws from it in the same sequence).
std::vector<std::size_t> round_order(std::size_t n, std::mt19937_64& generator) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), generator);
  return order;
}

// A round lasts at least kRoundSeconds for the fastest algorithm; the estimate of each
// algorithm's time per call comes from calls that last at least kEstimateSeconds.
constexpr double kRoundSeconds = 200e-6;
// Back to back, a round is also at least this many calls, as long as the slowest algorithm's
// batch stays within kMinCallsSeconds: with one call per round (every size from 16 MiB on 2
// ranks), the figure was the first call after another algorithm's round, with the caches holding
// that algorithm's buffers, which is neither back to back nor a training step (--cycle measures
// that). The cap keeps slow links (0.5 s per 64 MiB call at 1 Gbit/s) and valgrind affordable.
constexpr int kMinBackToBackCalls = 8;
constexpr double kMinCallsSeconds = 1.0;
constexpr double kEstimateSeconds = 50e-6;

// Calls of `per_call` seconds each that last at least `seconds`.
int calls_for(double seconds, double per_call) {
  return static_cast<int>(std::clamp(std::ceil(seconds / std::max(per_call, 1e-9)), 1.0, 4096.0));
}

std::vector<Row> measure_size(Communicator& comm, Communicator& baseline, const Options& o,
                              std::size_t count, std::byte* send, std::byte* recv,
                              std::vector<double>& ref_in, std::vector<double>& ref_out,
                              const std::function<void()>& between_rounds) {
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
      explored = explore_auto(comm_for(o.algorithms[a]), {nullptr, nullptr, count, o.dtype, o.op},
                              o.explore_seconds, [&] { call(o.algorithms[a]); });
    }
    const double one = time_calls(o.algorithms[a], 1);  // includes the barrier's exit skew
    per_call[a] = time_calls(o.algorithms[a], calls_for(kEstimateSeconds, one));
  }
  // Every algorithm runs the same number of calls per round: a round's fixed costs (the barrier's
  // exit skew, the first call's wake-up: several us on this machine) are then shared out over the
  // same count. Per-algorithm batches sized from one call each ranged from 2 to 63 calls at 512 B
  // on 2 ranks: a batch of 2 charged each call half a round's fixed cost, one of 63 a 63rd.
  const int min_calls =
      o.cycle ? 1
              : std::min(kMinBackToBackCalls,
                         calls_for(kMinCallsSeconds,
                                   *std::max_element(per_call.begin(), per_call.end())) -
                             1);
  const int round_calls =
      std::max({1, min_calls,
                calls_for(kRoundSeconds, *std::min_element(per_call.begin(), per_call.end()))});

  // Interleaved rounds, each in a fresh random order (see the top of the file).
  const std::size_t algorithms = o.algorithms.size();
  std::vector<std::vector<double>> times(algorithms, std::vector<double>(o.iters));
  std::vector<std::vector<double>> cycles(algorithms, std::vector<double>(o.iters));
  std::mt19937_64 shuffle(bytes);
  // --cycle: a training step's use of the buffers around each call. Every rank rewrites its
  // input (as backward writes gradients) and afterwards reads its whole result (as the optimizer
  // does); the call's own time is taken apart from the cycle's.
  unsigned long long consumed = 0;
  auto rewrite = [&](int b) { std::memset(send, 0x3c + (b & 1), bytes); };
  auto consume = [&] {
    const std::byte* result = out;
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
      std::uint64_t word;
      std::memcpy(&word, result + i, 8);
      sum += word;
    }
    consumed += sum;
  };
  for (int it = 0; it < o.iters; ++it) {
    for (const std::size_t a : round_order(algorithms, shuffle)) {
      // The lead-in: one untimed call (with --cycle, a whole cycle) so that every timed call
      // follows a call of its own algorithm, never another's. A call right after another
      // algorithm's round starts from caches full of that algorithm's buffers, and random orders
      // gave the algorithms different shares of such calls (see the method).
      if (o.lead_in) {
        if (o.cycle) rewrite(1);
        call(o.algorithms[a]);
        sync();
        if (o.cycle) consume();
      }
      MPI_Barrier(mpi);
      const double t0 = MPI_Wtime();
      if (o.cycle) {
        double in_calls = 0;
        for (int b = 0; b < round_calls; ++b) {
          rewrite(b);
          const double c0 = MPI_Wtime();
          call(o.algorithms[a]);
          in_calls += MPI_Wtime() - c0;
          consume();
        }
        times[a][static_cast<std::size_t>(it)] = in_calls / round_calls;
        cycles[a][static_cast<std::size_t>(it)] = (MPI_Wtime() - t0) / round_calls;
        continue;
      }
      for (int b = 0; b < round_calls; ++b)
        call(o.algorithms[a]);
      sync();
      times[a][static_cast<std::size_t>(it)] = (MPI_Wtime() - t0) / round_calls;
    }
    if (between_rounds) between_rounds();
  }
  if (consumed == 42) std::printf(" ");  // keeps the reads

  std::vector<Row> rows;
  const double bus_factor = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  for (std::size_t a = 0; a < o.algorithms.size(); ++a) {
    std::vector<double>& t = times[a];
    MPI_Allreduce(MPI_IN_PLACE, t.data(), o.iters, MPI_DOUBLE, MPI_MAX, mpi);
    if (o.cycle) {
      MPI_Allreduce(MPI_IN_PLACE, cycles[a].data(), o.iters, MPI_DOUBLE, MPI_MAX, mpi);
    }
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
    if (o.cycle) row.cycle_p50_us = percentile(cycles[a], 0.5) * 1e6;
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
  const double mpi_p50 = o.no_baseline ? 0 : rows.back().p50_us;
  const double mpi_cycle_p50 = o.no_baseline ? 0 : rows.back().cycle_p50_us;
  for (Row& row : rows) {
    row.vs_mpi = row.p50_us > 0 ? mpi_p50 / row.p50_us : 0;
    row.cycle_vs_mpi = row.cycle_p50_us > 0 ? mpi_cycle_p50 / row.cycle_p50_us : 0;
  }
  // The best fixed algorithm: gradcomm's own, auto and the baseline aside.
  std::size_t best = algorithms;
  for (std::size_t a = 0; a < algorithms; ++a) {
    const std::string base = base_algorithm(o.algorithms[a]);
    if (base == "auto" || base == "mpi" || (a + 1 == algorithms && !o.no_baseline)) continue;
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

// How glibc's malloc is set (gradcomm_bench.cc's main sets it before MPI starts).
void print_malloc_line(const Options& o) {
  if (o.default_malloc) {
    std::printf(
        "# malloc: glibc's defaults (--default-malloc): from ~32 MiB MPI_Allreduce maps its "
        "temporary buffer\n#   fresh on every call, which this machine pays ~3.4 ms per MiB "
        "for; vs_mpi there measures glibc\n");
  } else {
    std::printf(
        "# malloc: mmap and trimming off (M_MMAP_MAX=0, M_TRIM_THRESHOLD=1e12) so MPI_Allreduce "
        "reuses its\n#   temporary buffers, a fair baseline (--default-malloc: glibc's "
        "defaults)\n");
  }
}

void print_header(const Options& o, int n) {
  if (o.format == Options::Format::csv) {
    std::printf(
        "algorithm,size,count,type,redop,inplace,ranks,time_us,min_us,max_us,p50_us,"
        "p99_us,algbw,busbw,wrong,vs_mpi,intra_bytes,inter_bytes,of_bound,model_us,picks,vs_best,"
        "explore_calls,explore_ms,settled,round_calls,bound_busbw,state,cycle_p50_us,"
        "cycle_vs_mpi\n");
  } else if (o.format == Options::Format::table) {
    std::printf("# gradcomm-bench: %d ranks, %s %s, %s, %d rounds, %d warm-up calls, check %s\n", n,
                std::string(to_string(o.dtype)).c_str(), std::string(to_string(o.op)).c_str(),
                o.in_place ? "in-place" : "out-of-place", o.iters, o.warmup,
                o.check ? "on" : "off");
    print_malloc_line(o);
    if (o.cycle) {
      std::printf(
          "# --cycle: before each call every rank rewrites its input, after it reads its whole "
          "result;\n#   time_us..p99_us and busbw are the call's own time, cycle_us the whole "
          "cycle's median,\n#   cyc_vs_mpi MPI_Allreduce's cycle median / this one\n");
    } else {
      std::printf(
          "# back-to-back calls (nobody touches the buffers between calls; --cycle times a "
          "training step's use)\n");
    }
    if (o.bound) {
      std::printf(
          "# bound: busbw bound, the best of probes before, during and after the row (GB/s): the "
          "library's reduction on each rank's own data%s;\n#   of_bound = busbw / bound; state: "
          "far or near, from the "
          "cross-core rate at 1 MiB\n",
          !o.registered
              ? ", or half the cross-core fetch of the slices a call reduces where slower "
                "(private buffers cross twice)"
          : o.cycle ? ", or the cross-core fetch of the slices a call reduces where slower"
                    : "");
    }
    std::printf(
        "# time: per call, slowest rank, over rounds (a round: the same number of calls of "
        "each\n#   algorithm, >= 200 us for the fastest); algbw = size / mean time (GB/s); "
        "busbw = algbw * 2(n-1)/n\n");
    std::printf(o.lead_in
                    ? "# rounds: each algorithm's timed calls follow an untimed call of its own "
                      "(the lead-in)\n"
                    : "# rounds: no lead-in (--no-lead-in): a round's first timed call "
                      "follows another algorithm's round\n");
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
    if (o.cycle) std::printf(" %10s %10s", "cycle_us", "cyc_vs_mpi");
    if (o.bound) std::printf(" %7s %8s %5s", "bound", "of_bound", "state");
    std::printf(" %10s  %s\n", "model_us", "picks");
  }
}

void print_row(const Options& o, const Row& r, int n, bool first_json) {
  const std::string type(to_string(o.dtype));
  const std::string op(to_string(o.op));
  if (o.format == Options::Format::csv) {
    std::printf(
        "%s,%zu,%zu,%s,%s,%d,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.3f,%.3f,%lld,%.3f,%llu,%llu,%.3f,%.2f,"
        "%s,%.3f,%d,%.3f,%d,%d,%.3f,%s,%.2f,%.3f\n",
        r.algorithm.c_str(), r.bytes, r.count, type.c_str(), op.c_str(), o.in_place ? 1 : 0, n,
        r.mean_us, r.min_us, r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, r.wrong, r.vs_mpi,
        r.intra_bytes, r.inter_bytes, r.of_bound, r.model_us, r.picks.c_str(), r.vs_best,
        r.explored.calls, r.explored.seconds * 1e3, r.explored.settled ? 1 : 0, r.round_calls,
        r.bound_busbw, r.state.empty() ? "-" : r.state.c_str(), r.cycle_p50_us, r.cycle_vs_mpi);
  } else if (o.format == Options::Format::json) {
    std::printf(
        "%s    {\"algorithm\": \"%s\", \"size\": %zu, \"count\": %zu, \"time_us\": %.2f, "
        "\"min_us\": %.2f, \"max_us\": %.2f, \"p50_us\": %.2f, \"p99_us\": %.2f, "
        "\"algbw\": %.3f, \"busbw\": %.3f, \"wrong\": %lld, \"vs_mpi\": %.3f, "
        "\"intra_bytes\": %llu, \"inter_bytes\": %llu, \"of_bound\": %.3f, "
        "\"model_us\": %.2f, \"picks\": \"%s\", \"vs_best\": %.3f, \"explore_calls\": %d, "
        "\"explore_ms\": %.3f, \"settled\": %s, \"round_calls\": %d, \"bound_busbw\": %.3f, "
        "\"state\": \"%s\", \"cycle_p50_us\": %.2f, \"cycle_vs_mpi\": %.3f}",
        first_json ? "" : ",\n", r.algorithm.c_str(), r.bytes, r.count, r.mean_us, r.min_us,
        r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, r.wrong, r.vs_mpi, r.intra_bytes,
        r.inter_bytes, r.of_bound, r.model_us, r.picks.c_str(), r.vs_best, r.explored.calls,
        r.explored.seconds * 1e3, r.explored.settled ? "true" : "false", r.round_calls,
        r.bound_busbw, r.state.c_str(), r.cycle_p50_us, r.cycle_vs_mpi);
  } else {
    const std::string wrong = r.wrong < 0 ? "N/A" : std::to_string(r.wrong);
    std::printf(
        "  %10zu %11zu %8s %5s %-16s %10.2f %10.2f %10.2f %10.2f %10.2f %7.3f %7.3f %6s "
        "%6.2f %7.2f %10.3f",
        r.bytes, r.count, type.c_str(), op.c_str(), r.algorithm.c_str(), r.mean_us, r.min_us,
        r.max_us, r.p50_us, r.p99_us, r.algbw, r.busbw, wrong.c_str(), r.vs_mpi, r.vs_best,
        static_cast<double>(r.inter_bytes) / 1e6);
    if (o.cycle) std::printf(" %10.2f %10.2f", r.cycle_p50_us, r.cycle_vs_mpi);
    if (o.bound) std::printf(" %7.2f %8.2f %5s", r.bound_busbw, r.of_bound, r.state.c_str());
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

}  // namespace gradcomm::bench
