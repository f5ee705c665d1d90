#include "bench/bench.h"

namespace gradcomm::bench {

int run_sweep(Communicator& comm, const Options& o) {
  const int rank = comm.rank();
  // The baseline is MPI_Allreduce as an application calls it: no call check, no watchdog (the
  // check's fingerprint exchange alone costs ~0.4 us per call on 2 ranks here).
  gradcomm::Config plain = comm.config();
  plain.deterministic = false;
  plain.check = gradcomm::CheckMode::off;
  plain.watchdog = false;
  Communicator baseline(MPI_COMM_WORLD, plain);
  for (const std::string& name : o.algorithms) {
    if (name.find('/') == std::string::npos) continue;
    gradcomm::Config variant = comm.config();
    const std::string form = name.substr(name.find('/') + 1);
    variant.hierarchical_intra = form;
    variant_comms()[name] = std::make_unique<Communicator>(MPI_COMM_WORLD, variant);
  }
  const std::size_t es = gradcomm::element_size(o.dtype);
  const std::size_t max_count = o.max_bytes / es;
  // Buffers allocated and touched once, reused for every size.
  const std::size_t row_bytes = std::max<std::size_t>(max_count * es, 1);
  // With --bound, the receive buffer also holds the local bound's arrays (BoundProbe).
  const std::size_t probe_bytes = o.bound ? bound_arrays_bytes(row_bytes, comm.size()) : 0;
  const std::size_t buffer_bytes = std::max(row_bytes, probe_bytes);
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
  std::unique_ptr<BoundProbe> probe;
  if (o.bound)
    probe = std::make_unique<BoundProbe>(comm, o.cycle, !o.registered, recv, probe_bytes);

  if (rank == 0) {
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
    const Bound before = probe ? probe->measure(count * es) : Bound{};
    // The machine's speed drifts within a row, and on AMD EPYC it switched between spells of
    // rates 1.4x apart between a probe and the row: a row's bound is the best of a probe before
    // it, one trial of each part after each of its rounds (with the rounds, through the same
    // spells) and a probe after it.
    Bound during = before;
    const std::vector<Row> rows =
        measure_size(comm, baseline, o, count, send, recv, ref_in, ref_out, [&] {
          if (probe) during = probe->best_of(during, probe->sample(count * es));
        });
    const Bound bound = probe ? probe->best_of(during, probe->measure(count * es)) : Bound{};
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
      if (probe && bound.busbw > 0) {
        row.bound_busbw = bound.busbw / 1e9;
        row.of_bound = row.busbw / row.bound_busbw;
        row.state = bound.state();
      }
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
    const auto table =
        gradcomm::collectives::TuningTable::from_fastest(comm.size(), groups, winners);
    table.save(o.tune_file);
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

}  // namespace gradcomm::bench
