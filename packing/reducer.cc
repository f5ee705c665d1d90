#include "packing/reducer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <string>

#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/check/consistency.h"
#include "collectives/registry.h"
#include "core/error.h"
#include "core/reduce_kernels.h"
#include "core/timeline.h"
#include "topology/host.h"

namespace gradcomm::packing {
namespace {

constexpr const char* kCall = "Reducer";
constexpr std::size_t kBucketAlignment = 64;

}  // namespace

std::vector<ReducerBucket> plan_reducer_buckets(std::span<const TensorDesc> tensors,
                                                std::span<const std::size_t> order,
                                                const ReducerOptions& options) {
  struct Open {
    ReducerBucket bucket;
    std::size_t bytes = 0;
    std::size_t first_position = 0;  // in `order`, of the bucket's first tensor
    bool closed_one = false;         // this dtype has closed a bucket (its cap is the full one)
  };
  // Open buckets by key: the dtype; with explicit groups, (group, dtype) as group * 16 + dtype,
  // where a tensor in no group is a group of its own (numbered after the groups).
  std::map<std::size_t, Open> open;
  std::vector<std::size_t> group_of;
  if (!options.groups.empty()) {
    group_of.assign(tensors.size(), std::size_t(-1));
    for (std::size_t g = 0; g < options.groups.size(); ++g) {
      for (const std::size_t index : options.groups[g])
        group_of[index] = g;
    }
    for (std::size_t index = 0, next = options.groups.size(); index < tensors.size(); ++index) {
      if (group_of[index] == std::size_t(-1)) group_of[index] = next++;
    }
  }
  std::vector<std::pair<std::size_t, ReducerBucket>> done;
  auto close = [&](Open& o) {
    done.emplace_back(o.first_position, std::move(o.bucket));
    o.bucket = ReducerBucket{};
    o.bytes = 0;
    o.closed_one = true;
  };
  for (std::size_t position = 0; position < order.size(); ++position) {
    const std::size_t index = order[position];
    const TensorDesc& t = tensors[index];
    const auto dtype_key = static_cast<std::size_t>(t.dtype);
    Open& o = open[group_of.empty() ? dtype_key : group_of[index] * 16 + dtype_key];
    if (o.bucket.tensors.empty()) {
      o.bucket.dtype = t.dtype;
      o.bucket.wire = wire_dtype(t.dtype, options.compression);
      o.first_position = position;
    }
    o.bucket.tensors.push_back(index);
    o.bucket.offsets.push_back(o.bucket.count);
    o.bucket.count += t.count;
    o.bytes += t.count * element_size(o.bucket.wire);
    const std::size_t cap = o.closed_one ? options.bucket_cap_bytes : options.first_bucket_bytes;
    if (group_of.empty() && o.bytes >= cap) close(o);
  }
  for (auto& [key, o] : open) {
    if (!o.bucket.tensors.empty()) close(o);
  }
  std::stable_sort(done.begin(), done.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<ReducerBucket> buckets;
  std::size_t offset = 0;
  for (auto& [position, bucket] : done) {
    bucket.byte_offset = offset;
    const std::size_t bytes = bucket.count * element_size(bucket.wire);
    offset += (bytes + kBucketAlignment - 1) / kBucketAlignment * kBucketAlignment;
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

std::vector<std::size_t> checked_reducer_order(std::vector<std::size_t> order, std::size_t n,
                                               const std::vector<std::vector<std::size_t>>& groups,
                                               std::string_view call, int rank) {
  if (order.empty()) {
    order.resize(n);
    std::iota(order.rbegin(), order.rend(), std::size_t{0});
  }
  check_order(order, n, call, rank);
  std::vector<char> grouped(n, 0);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const std::size_t index : groups[g]) {
      if (index >= n) {
        throw InvalidArgument(error_message(call, rank,
                                            "groups[" + std::to_string(g) + "] names tensor " +
                                                std::to_string(index) + " of " +
                                                std::to_string(n)));
      }
      if (grouped[index]++) {
        throw InvalidArgument(error_message(call, rank,
                                            "tensor " + std::to_string(index) +
                                                " is in more than one group (groups[" +
                                                std::to_string(g) + "])"));
      }
    }
  }
  return order;
}

Reducer::Reducer(Communicator& comm, std::vector<TensorDesc> tensors, ReducerOptions options)
    : comm_(comm), tensors_(std::move(tensors)), options_(std::move(options)) {
  comm.settle();
  require_mpi_alive(kCall, comm.rank());
  validate_tensors(tensors_, kCall, comm.rank());
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(kCall, comm.rank(), detail));
  };
  if (!is_valid(options_.op)) {
    invalid("invalid reduce op " + std::to_string(static_cast<int>(options_.op)));
  }
  if (options_.bucket_cap_bytes == 0 || options_.first_bucket_bytes == 0) {
    invalid("bucket_cap_bytes and first_bucket_bytes must be positive");
  }
  if (!options_.algorithm.empty() && !collectives::is_algorithm_name(options_.algorithm)) {
    invalid(collectives::unknown_algorithm(options_.algorithm, false));
  }
  const std::vector<std::size_t> order =
      checked_reducer_order(options_.order, tensors_.size(), options_.groups, kCall, comm.rank());
  if (options_.overlap) require_thread_multiple(kCall, comm.rank());
  plan(order);
}

Reducer::~Reducer() = default;  // requests_ goes first and waits

void Reducer::plan(std::span<const std::size_t> order) {
  buckets_ = plan_reducer_buckets(tensors_, order, options_);
  bucket_of_.assign(tensors_.size(), 0);
  position_of_.assign(tensors_.size(), 0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    for (std::size_t k = 0; k < buckets_[b].tensors.size(); ++k) {
      bucket_of_[buckets_[b].tensors[k]] = b;
      position_of_[buckets_[b].tensors[k]] = k;
    }
  }
  std::size_t bytes = 0;
  if (!buckets_.empty()) {
    const ReducerBucket& last = buckets_.back();
    bytes = last.byte_offset + last.count * element_size(last.wire);
  }
  // Every rank plans the same buckets, so every rank (re)allocates alike: the allocation is
  // collective where the buffer is registered.
  if (bytes > buffer_bytes_ || buffer_ == nullptr) {
    registered_ = RegisteredBuffer();
    private_ = AlignedBuffer();
    const std::size_t size = std::max<std::size_t>(bytes, 1);
    if (comm_.size() > 1 && topology::shares_one_host(comm_)) {
      try {
        registered_ = comm_.allocate(size);
      } catch (const CommError& e) {  // thrown on every rank alike: private buckets then
        comm_.log(LogLevel::warn, std::string("Reducer: private buckets: ") + e.what());
      }
    }
    if (registered_) {
      buffer_ = registered_.data();
    } else {
      private_ = AlignedBuffer(size);
      buffer_ = private_.data();
    }
    buffer_bytes_ = size;
  }
  ready_.assign(tensors_.size(), 0);
  data_.resize(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    data_[i] = tensors_[i].data;
  waiting_.resize(buckets_.size());
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    waiting_[b] = buckets_[b].tensors.size();
  next_launch_ = 0;
  observed_.clear();
  requests_.clear();
  requests_.resize(buckets_.size());
}

void* Reducer::bucket_view(std::size_t index) {
  if (index >= tensors_.size()) {
    throw InvalidArgument(error_message(
        "Reducer::bucket_view", comm_.rank(),
        "tensor " + std::to_string(index) + " of " + std::to_string(tensors_.size())));
  }
  const ReducerBucket& bucket = buckets_[bucket_of_[index]];
  if (bucket.wire != bucket.dtype) {
    throw Unsupported(error_message(
        "Reducer::bucket_view", comm_.rank(),
        "tensor " + std::to_string(index) + " travels compressed: its bucket holds another dtype"));
  }
  return slot_of(index);
}

std::byte* Reducer::slot_of(std::size_t index) {
  const ReducerBucket& bucket = buckets_[bucket_of_[index]];
  return bucket_data(bucket) + bucket.offsets[position_of_[index]] * element_size(bucket.wire);
}

void Reducer::mark_ready(std::size_t index) {
  mark_ready(index, index < tensors_.size() ? tensors_[index].data : nullptr);
}

void Reducer::mark_ready(std::size_t index, void* data) {
  const char* call = "Reducer::mark_ready";
  // A refusal fails this rank's iteration (fail_iteration), so that the other ranks learn of it
  // instead of waiting for this rank's buckets or reducing without its gradients.
  auto refuse = [&](const std::string& detail) {
    const std::string message = error_message(call, comm_.rank(), detail);
    fail_iteration(message);
    throw InvalidArgument(message);
  };
  if (index >= tensors_.size()) {
    refuse("tensor " + std::to_string(index) + " is out of range (" +
           std::to_string(tensors_.size()) + " tensors)");
  }
  if (ready_[index]) {
    refuse("tensor " + std::to_string(index) + " was already marked ready in this iteration");
  }
  const TensorDesc& t = tensors_[index];
  if (data == nullptr && t.count > 0) refuse("tensor " + std::to_string(index) + " has null data");
  ready_[index] = 1;
  data_[index] = data;
  observed_.push_back(index);
  const std::size_t b = bucket_of_[index];
  if (failed_) {  // its bucket is a stand-in: nothing to pack
    --waiting_[b];
    return;
  }
  const ReducerBucket& bucket = buckets_[b];
  void* slot = slot_of(index);
  {
    timeline::Span span("pack", "reducer");
    if (span.on()) {
      span.args("\"tensor\":" + std::to_string(index) + ",\"bucket\":" + std::to_string(b) +
                ",\"bytes\":" + std::to_string(t.bytes()));
    }
    if (data != slot) convert(slot, bucket.wire, data, t.dtype, t.count);
    if (divides_first(bucket)) divide_by(slot, t.count, bucket.wire, comm_.size());
  }
  --waiting_[b];
  launch_ready_buckets();
}

bool Reducer::divides_first(const ReducerBucket& bucket) const {
  return options_.divide_before_sum && options_.op == ReduceOp::avg && bucket.wire != bucket.dtype;
}

ReduceOp Reducer::op_of(const ReducerBucket& bucket) const {
  return divides_first(bucket) ? ReduceOp::sum : options_.op;
}

void Reducer::fail_iteration(std::string_view why) {
  if (!failed_) failed_why_ = why;
  failed_ = true;
  launch_ready_buckets();
}

std::string Reducer::stand_in_name(std::size_t bucket) const {
  return "Reducer: bucket " + std::to_string(bucket) + " of " + std::to_string(buckets_.size()) +
         " (this rank's iteration failed)";
}

void Reducer::launch_ready_buckets() {
  if (!options_.overlap) return;  // finish() reduces them
  const AllreduceOptions call{.algorithm = options_.algorithm};
  // The last bucket is complete only once every gradient is: nothing is left to overlap it with,
  // so finish() reduces it on the caller's thread, without the hand-off to the engine (a model
  // whose gradients fit one bucket then pays nothing for overlap). A failed iteration's stand-ins
  // need no gradients: they all go at once, the last one too.
  while (next_launch_ < buckets_.size() &&
         (failed_ || (next_launch_ + 1 < buckets_.size() && waiting_[next_launch_] == 0))) {
    if (failed_) {
      requests_[next_launch_] = collectives::ifailed_call(comm_, collectives::CallKind::allreduce,
                                                          stand_in_name(next_launch_));
    } else {
      const ReducerBucket& bucket = buckets_[next_launch_];
      std::byte* p = bucket_data(bucket);
      requests_[next_launch_] =
          iallreduce(comm_, p, p, bucket.count, bucket.wire, op_of(bucket), call);
    }
    ++next_launch_;
  }
}

void Reducer::finish() {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (!ready_[i]) mark_ready(i);
  }
  timeline::Span finishing("finish", "reducer");
  // After a MismatchError (ranks whose iterations differ, a rank whose iteration failed and sent
  // stand-ins) every bucket is still called, so that every rank makes one call per bucket and the
  // next iteration's calls pair up; any other error ends the iteration at once.
  std::exception_ptr mismatch;
  try {
    try {
      // Blocking calls queue behind the requests (settle), so buckets still run in order.
      Request::wait_all(requests_);
    } catch (const MismatchError&) {
      mismatch = std::current_exception();
    }
    const AllreduceOptions call{.algorithm = options_.algorithm};
    for (std::size_t b = options_.overlap ? next_launch_ : 0; b < buckets_.size(); ++b) {
      std::byte* p = bucket_data(buckets_[b]);
      try {
        if (failed_) {
          collectives::compare_failed_call(comm_, collectives::CallKind::allreduce,
                                           stand_in_name(b));
        } else {
          allreduce(comm_, p, p, buckets_[b].count, buckets_[b].wire, op_of(buckets_[b]), call);
        }
      } catch (const MismatchError&) {  // (a failed rank's: the other ranks' error, dropped)
        if (!mismatch) mismatch = std::current_exception();
      }
    }
  } catch (...) {
    start_iteration();  // the next iteration starts clean; the tensors keep their gradients
    throw;
  }
  if (failed_) {
    const std::string why = failed_why_;
    start_iteration();
    throw InvalidArgument(
        error_message("Reducer::finish", comm_.rank(),
                      "this rank's iteration failed (" + why + "); no gradient was written back"));
  }
  if (mismatch) {
    start_iteration();
    std::rethrow_exception(mismatch);
  }
  timeline::Span unpacking("unpack", "reducer");
  for (const ReducerBucket& bucket : buckets_) {
    for (std::size_t k = 0; k < bucket.tensors.size(); ++k) {
      const std::size_t index = bucket.tensors[k];
      const TensorDesc& t = tensors_[index];
      const std::byte* slot = bucket_data(bucket) + bucket.offsets[k] * element_size(bucket.wire);
      if (data_[index] != slot) convert(data_[index], t.dtype, slot, bucket.wire, t.count);
    }
  }
  ++iterations_;
  if (iterations_ == 1 && options_.rebuild_buckets && !tensors_.empty()) {
    // Rank 0's ready order, so every rank plans the same buckets.
    try {
      std::vector<std::int64_t> order(observed_.begin(), observed_.end());
      broadcast(comm_, order.data(), order.size(), DataType::int64, 0);
      const std::vector<std::size_t> agreed(order.begin(), order.end());
      plan(agreed);
    } catch (...) {
      start_iteration();  // the old buckets stay; the next iteration starts clean
      throw;
    }
    rebuilt_ = true;
    return;
  }
  start_iteration();
}

void Reducer::start_iteration() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    data_[i] = tensors_[i].data;
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    waiting_[b] = buckets_[b].tensors.size();
  next_launch_ = 0;
  observed_.clear();
  failed_ = false;
  failed_why_.clear();
  for (Request& r : requests_)
    r = Request();
}

}  // namespace gradcomm::packing
