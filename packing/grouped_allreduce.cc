#include "packing/grouped_allreduce.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "collectives/allreduce.h"
#include "collectives/check/consistency.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/gpu_runtime.h"
#include "core/reduce_kernels.h"
#include "topology/host.h"

namespace gradcomm {
namespace {

using packing::Bucket;
using packing::FusionPlan;
using packing::TensorDesc;

constexpr int kFusionScratchSlot = 1;  // slot 0 belongs to the algorithms
constexpr std::size_t kMaxCachedPlans = 32;

std::uint64_t compression_tag(Compression c) {
  return static_cast<std::uint64_t>(c) + 1;
}

// Plans of one communicator, by hash of (tensors, threshold, order, compression), and the
// fused buffer: registered memory when the ranks share one host, so that packing a bucket is
// already the copy-in of `shm` (it reads peers' fused buffers in place).
class PlanCache : public Attachment {
 public:
  explicit PlanCache(Communicator&) {}

  // Collective on first use (the host count) and when it grows the registered buffer: called
  // after the call's check, every rank holding the same plan. (Not in the constructor: the cache
  // is made before the call's scope, where ranks that called on different communicators would
  // wait for each other unseen by the watchdog.)
  std::byte* fused_buffer(Communicator& comm, std::size_t bytes) {
    if (!use_registered) use_registered = comm.size() > 1 && topology::shares_one_host(comm);
    if (!*use_registered) return comm.scratch(bytes, kFusionScratchSlot);
    if (registered.size() < bytes) {
      registered = RegisteredBuffer();
      try {
        registered = comm.allocate(bytes);
      } catch (const CommError& e) {  // thrown on every rank alike: fall back together
        comm.log(LogLevel::warn,
                 std::string("grouped_allreduce: private fused buffers: ") + e.what());
        use_registered = false;
        return comm.scratch(bytes, kFusionScratchSlot);
      }
    }
    return registered.data();
  }

  std::map<std::uint64_t, FusionPlan> plans;
  std::optional<bool> use_registered;
  RegisteredBuffer registered;
};

packing::FusionOptions fusion_options(const Communicator& comm,
                                      const GroupedAllreduceOptions& options) {
  packing::FusionOptions fusion;
  fusion.threshold_bytes = options.fusion_threshold.value_or(comm.config().fusion_threshold);
  fusion.order = options.order;
  return fusion;
}

// The cache key and plan fingerprint: the fusion inputs and the compression.
std::uint64_t plan_key(std::uint64_t fusion_hash, Compression compression) {
  return (fusion_hash ^ compression_tag(compression)) * 1099511628211ull;
}

FusionPlan make_plan(const Communicator& comm, std::span<const TensorDesc> tensors,
                     const GroupedAllreduceOptions& options) {
  FusionPlan plan = packing::plan_fusion(tensors, fusion_options(comm, options));
  plan.hash = plan_key(plan.hash, options.compression);
  return plan;
}

// Called when the ranks' plan hashes differ: finds the first tensor where this rank's list
// differs from rank 0's and throws on every rank with the same message.
[[noreturn]] void report_mismatch(Communicator& comm, std::span<const TensorDesc> tensors) {
  const MPI_Comm mpi = comm.mpi_comm();
  const int me = comm.rank();
  constexpr const char* kBcast = "grouped_allreduce: MPI_Bcast of the tensor lists";
  constexpr const char* kAllreduce = "grouped_allreduce: MPI_Allreduce of the first difference";
  unsigned long long n0 = tensors.size();
  check_mpi(MPI_Bcast(&n0, 1, MPI_UNSIGNED_LONG_LONG, 0, mpi), kBcast, me);
  std::vector<unsigned long long> reference(2 * n0);
  if (comm.rank() == 0) {
    for (std::size_t i = 0; i < n0; ++i) {
      reference[2 * i] = tensors[i].count;
      reference[2 * i + 1] = static_cast<unsigned long long>(tensors[i].dtype);
    }
  }
  check_mpi(MPI_Bcast(reference.data(), static_cast<int>(2 * n0), MPI_UNSIGNED_LONG_LONG, 0, mpi),
            kBcast, me);
  // First index where this rank differs (n0 and size both count as "the list ends here").
  unsigned long long first = std::max<unsigned long long>(n0, tensors.size()) + 1;
  for (std::size_t i = 0; i < std::max<std::size_t>(n0, tensors.size()); ++i) {
    const bool differs = i >= n0 || i >= tensors.size() || reference[2 * i] != tensors[i].count ||
                         reference[2 * i + 1] != static_cast<unsigned long long>(tensors[i].dtype);
    if (differs) {
      first = i;
      break;
    }
  }
  // The lowest differing index, and the lowest rank differing there. Every value stays small
  // (a rank that does not differ there offers the size): MPICH 4.0's MPI_MIN compares unsigned
  // 64-bit integers as signed, so ~0 would win.
  unsigned long long key[2] = {first, static_cast<unsigned long long>(comm.rank())};
  unsigned long long global[2] = {0, 0};
  check_mpi(MPI_Allreduce(&key[0], &global[0], 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, mpi), kAllreduce,
            me);
  if (key[0] != global[0]) key[1] = static_cast<unsigned long long>(comm.size());
  check_mpi(MPI_Allreduce(&key[1], &global[1], 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, mpi), kAllreduce,
            me);
  const std::size_t index = global[0];
  const int culprit = static_cast<int>(global[1]);
  auto describe = [](bool present, unsigned long long count, unsigned long long dtype) {
    return present ? std::to_string(count) + " x " +
                         std::string(to_string(static_cast<DataType>(dtype)))
                   : std::string("no tensor");
  };
  // What the differing rank has at that index.
  unsigned long long mine[3] = {
      index < tensors.size() ? 1ull : 0ull, index < tensors.size() ? tensors[index].count : 0,
      index < tensors.size() ? static_cast<unsigned long long>(tensors[index].dtype) : 0};
  if (culprit >= 0 && culprit < comm.size()) {
    check_mpi(MPI_Bcast(mine, 3, MPI_UNSIGNED_LONG_LONG, culprit, mpi), kBcast, me);
  }
  const bool on_zero = index < n0;
  std::string detail = "ranks passed different tensor lists: tensor " + std::to_string(index) +
                       " is " +
                       describe(on_zero, on_zero ? reference[2 * index] : 0,
                                on_zero ? reference[2 * index + 1] : 0) +
                       " on rank 0 but " + describe(mine[0] != 0, mine[1], mine[2]) + " on rank " +
                       std::to_string(culprit);
  if (index > std::max<std::size_t>(n0, tensors.size())) {
    detail =
        "ranks passed the same tensors but different fusion options (threshold, order or "
        "compression)";
  }
  throw MismatchError(error_message("grouped_allreduce", comm.rank(), detail));
}

}  // namespace

DataType wire_dtype(DataType dtype, Compression compression) {
  if (dtype != DataType::float32) return dtype;
  switch (compression) {
    case Compression::float16:
      return DataType::float16;
    case Compression::bfloat16:
      return DataType::bfloat16;
    case Compression::none:
      break;
  }
  return dtype;
}

packing::FusionPlan grouped_allreduce_plan(const Communicator& comm,
                                           std::span<const TensorDesc> tensors,
                                           const GroupedAllreduceOptions& options) {
  return make_plan(comm, tensors, options);
}

namespace {

// Everything local about a call (a bad call fails here, before any message and before a non-
// blocking call is submitted). Returns the algorithm's registry-owned name.
std::string_view validate(const char* call, const Communicator& comm,
                          std::span<const TensorDesc> tensors, ReduceOp op,
                          const GroupedAllreduceOptions& options) {
  require_mpi_alive(call, comm.rank());
  packing::validate_tensors(tensors, call, comm.rank());
  if (!is_valid(op)) {
    throw InvalidArgument(error_message(
        call, comm.rank(), "invalid reduce op " + std::to_string(static_cast<int>(op))));
  }
  // The buckets' algorithm, checked here rather than by the first bucket's all-reduce (after the
  // comparison and the fused buffer's allocation).
  const std::string_view requested =
      options.algorithm.empty() ? std::string_view(comm.config().algorithm) : options.algorithm;
  if (!collectives::is_algorithm_name(requested)) {
    throw InvalidArgument(error_message(
        call, comm.rank(), collectives::unknown_algorithm(requested, options.algorithm.empty())));
  }
  if (!options.order.empty())
    packing::check_order(options.order, tensors.size(), call, comm.rank());
  if (gpu::Runtime* runtime = gpu::active_runtime()) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].count == 0) continue;
      if (runtime->classify(tensors[i].data).kind == gpu::MemoryKind::device) {
        throw Unsupported(error_message(
            call, comm.rank(),
            "tensor " + std::to_string(i) +
                " is device memory; grouped_allreduce fuses on the host. For GPU tensors, pack "
                "them with a GradientPacker (device buffers) and allreduce the packed buffers"));
      }
      break;  // one packer-like check: the first non-empty tensor decides
    }
  }
  return collectives::algorithm_name_at(collectives::algorithm_index(requested));
}

// Runs a validated call.
void execute(Communicator& comm, std::span<const TensorDesc> tensors, ReduceOp op,
             const GroupedAllreduceOptions& options, std::string_view requested) {
  require_mpi_alive("grouped_allreduce", comm.rank());
  // The call's fingerprint; its sequence number is taken right before its scope opens.
  collectives::CallInfo info;
  info.kind = collectives::CallKind::grouped_allreduce;
  info.op = static_cast<int>(op);
  info.algorithm = collectives::algorithm_index(requested);
  info.algorithm_name = collectives::algorithm_name_at(info.algorithm);
  if (tensors.empty()) {  // still one call, compared like any other
    info.sequence = comm.next_sequence();
    collectives::CallScope scope(comm, info, "grouped_allreduce");
    scope.check_now();
    return scope.finish();
  }

  // The plan is cached by a hash of its inputs, computed in one pass over the tensor list; the
  // buckets are planned only on a miss.
  const std::uint64_t key =
      plan_key(packing::fusion_hash(tensors, fusion_options(comm, options)), options.compression);
  PlanCache& state = comm.attachment<PlanCache>();
  auto& cache = state.plans;
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxCachedPlans) cache.clear();
    it = cache.emplace(key, make_plan(comm, tensors, options)).first;
  }
  const FusionPlan& plan = it->second;

  // Every rank must hold the same plan: its hash is part of the call's fingerprint, compared
  // before anything is reduced (whatever GRADCOMM_CHECK says: the buckets depend on it).
  info.sequence = comm.next_sequence();
  info.detail = plan.hash;
  for (const TensorDesc& t : tensors)
    info.count += t.count;
  collectives::CallScope scope(comm, info, "grouped_allreduce");
  scope.on_detail_mismatch([&] { report_mismatch(comm, tensors); });
  if (comm.config().check == CheckMode::off && comm.size() > 1) {
    unsigned long long local[2] = {plan.hash, ~plan.hash};
    unsigned long long global[2] = {0, 0};
    check_mpi(MPI_Allreduce(local, global, 2, MPI_UNSIGNED_LONG_LONG, MPI_MIN, comm.mpi_comm()),
              "grouped_allreduce: MPI_Allreduce", comm.rank());
    if (global[0] != ~global[1]) report_mismatch(comm, tensors);
  }
  scope.check_now();

  // One fused buffer for the largest bucket, sized before the first (collective) call.
  std::size_t fused_bytes = 0;
  for (const Bucket& bucket : plan.buckets) {
    const DataType wire = wire_dtype(bucket.dtype, options.compression);
    if (!bucket.in_place() || wire != bucket.dtype)
      fused_bytes = std::max(fused_bytes, bucket.count * element_size(wire));
  }
  std::byte* fused = fused_bytes > 0 ? state.fused_buffer(comm, fused_bytes) : nullptr;

  const AllreduceOptions call{.algorithm = options.algorithm};
  for (const Bucket& bucket : plan.buckets) {
    const DataType wire = wire_dtype(bucket.dtype, options.compression);
    if (bucket.in_place() && wire == bucket.dtype) {
      const TensorDesc& t = tensors[bucket.tensors.front()];
      collectives::allreduce_within(scope.context(), comm, t.data, t.data, t.count, t.dtype, op,
                                    call);
      continue;
    }
    const std::size_t wire_es = element_size(wire);
    std::size_t offset = 0;
    for (std::size_t index : bucket.tensors) {
      const TensorDesc& t = tensors[index];
      convert(fused + offset * wire_es, wire, t.data, t.dtype, t.count);
      offset += t.count;
    }
    collectives::allreduce_within(scope.context(), comm, fused, fused, bucket.count, wire, op,
                                  call);
    offset = 0;
    for (std::size_t index : bucket.tensors) {
      const TensorDesc& t = tensors[index];
      convert(t.data, t.dtype, fused + offset * wire_es, wire, t.count);
      offset += t.count;
    }
  }
  scope.finish();
}

}  // namespace

void grouped_allreduce(Communicator& comm, std::span<const TensorDesc> tensors, ReduceOp op,
                       const GroupedAllreduceOptions& options) {
  comm.settle();
  const collectives::KeepInStep in_step(comm, collectives::CallKind::grouped_allreduce,
                                        "grouped_allreduce");
  const std::string_view requested = validate("grouped_allreduce", comm, tensors, op, options);
  execute(comm, tensors, op, options, requested);
}

Request igrouped_allreduce(Communicator& comm, std::span<const TensorDesc> tensors, ReduceOp op,
                           const GroupedAllreduceOptions& options) {
  const char* call = "igrouped_allreduce";
  const collectives::KeepInStep in_step(comm, collectives::CallKind::grouped_allreduce, call,
                                        /*queued=*/true);
  const std::string_view requested = validate(call, comm, tensors, op, options);
  require_thread_multiple(call, comm.rank());
  auto state = std::make_shared<detail::RequestState>();
  state->call = call;
  // The lists are the caller's: the request keeps copies.
  std::vector<TensorDesc> kept(tensors.begin(), tensors.end());
  std::vector<std::size_t> order(options.order.begin(), options.order.end());
  state->work = [&comm, kept = std::move(kept), order = std::move(order), op, options, requested] {
    GroupedAllreduceOptions o = options;
    o.algorithm = requested;
    o.order = order;
    execute(comm, kept, op, o, requested);
  };
  comm.engine().submit(state);
  collectives::KeepInStep::began();
  return Request(std::move(state));
}

}  // namespace gradcomm
