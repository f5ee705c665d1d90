#include "bench/bench.h"

namespace gradcomm::bench {

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
      if (o.lead_in) modes[m].step();  // untimed: the timed step follows its own mode's
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
    std::printf("# per step, slowest rank, %d interleaved rounds%s\n", o.iters,
                o.lead_in ? ", each step after an untimed one of its own mode" : "");
    print_malloc_line(o);
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

}  // namespace gradcomm::bench
