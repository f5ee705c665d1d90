#include "trainer/data_parallel_trainer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>

#include "collectives/allgather.h"
#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/select/auto_select.h"
#include "collectives/select/tuning_table.h"
#include "core/error.h"
#include "core/timeline.h"
#include "trainer/checkpoint.h"
#include "trainer/random.h"

namespace gradcomm::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Four independent multiply-rotate lanes over 8-byte words: fast (memory-bound) and sensitive to
// every bit; not meant to resist deliberate collisions.
class Hasher {
 public:
  void add(const void* data, std::size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    std::size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
      for (int l = 0; l < 4; ++l) {
        std::uint64_t w;
        std::memcpy(&w, p + i + 8 * l, 8);
        mix(lanes_[l], w);
      }
    }
    for (; i < bytes; ++i)
      mix(lanes_[0], p[i]);
    mix(lanes_[1], bytes);
  }
  std::uint64_t value() const {
    std::uint64_t h = lanes_[0];
    for (int l = 1; l < 4; ++l)
      mix(h, lanes_[l]);
    return h;
  }

 private:
  static void mix(std::uint64_t& h, std::uint64_t w) {
    h = (h ^ w) * 0x9e3779b97f4a7c15ull;
    h = (h << 31) | (h >> 33);
  }
  std::uint64_t lanes_[4] = {1, 2, 3, 4};
};

// Rows [first, first + count) of `rows` that rank r of n takes when the first rows % n ranks
// take one row more (the uneven policy, evaluation and prediction).
DataParallelTrainer::Shard uneven_shard(std::size_t rows, std::size_t n, std::size_t r) {
  const std::size_t base = rows / n, extra = rows % n;
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

// Rank `root` passes its `message` (empty: success) to every rank; returns it.
std::string share_outcome(Communicator& comm, std::string message, int root = 0) {
  std::int64_t length = static_cast<std::int64_t>(message.size());
  broadcast(comm, &length, 1, DataType::int64, root);
  message.resize(static_cast<std::size_t>(length));
  broadcast_bytes(comm, message.data(), message.size(), root);
  return message;
}

}  // namespace

DataParallelTrainer::DataParallelTrainer(Communicator& comm, Model& model, Optimizer& optimizer,
                                         TrainerOptions options)
    : comm_(comm), model_(model), optimizer_(optimizer), options_(std::move(options)) {
  // Overlap runs the all-reduces on a progress thread, which needs MPI_THREAD_MULTIPLE; a program
  // that initialized MPI lower gets the same buckets reduced after backward instead.
  if (options_.overlap && options_.mode == SyncMode::gradients) {
    int level = MPI_THREAD_SINGLE;
    check_mpi(MPI_Query_thread(&level), "DataParallelTrainer: MPI_Query_thread", comm_.rank());
    if (level < MPI_THREAD_MULTIPLE) {
      options_.overlap = false;
      comm_.log(LogLevel::warn,
                "DataParallelTrainer: MPI runs below MPI_THREAD_MULTIPLE, so gradients are "
                "all-reduced after backward (no overlap); initialize MPI with "
                "MPI_THREAD_MULTIPLE (gradcomm::init does) to overlap");
    }
  }
  // Local checks first, but raised only after the ranks have compared notes: a rank whose
  // options differ must not throw alone and leave the others waiting in a collective.
  std::string problem;
  const auto n = static_cast<std::size_t>(comm_.size());
  const std::size_t b = options_.global_batch;
  if (b == 0) {
    problem = "global_batch must be positive";
  } else if (options_.shard_policy == ShardPolicy::strict && b % n != 0) {
    problem = "global batch " + std::to_string(b) + " does not divide by " + std::to_string(n) +
              " ranks; use a multiple of " + std::to_string(n) +
              " or a shard policy (drop_remainder, uneven)";
  } else if (options_.shard_policy == ShardPolicy::drop_remainder && b < n) {
    problem = "global batch " + std::to_string(b) + " is smaller than the " + std::to_string(n) +
              " ranks, so drop_remainder leaves every shard empty";
  } else if (options_.interval_steps == 0) {
    problem = "interval_steps must be at least 1";
  } else if (options_.checkpoint_every > 0 && options_.checkpoint_dir.empty()) {
    problem = "checkpoint_every is " + std::to_string(options_.checkpoint_every) +
              " but checkpoint_dir is empty";
  } else if (options_.mode == SyncMode::model_averaging && options_.checkpoint_every > 0 &&
             options_.checkpoint_every % options_.interval_steps != 0) {
    problem = "with model averaging, checkpoint_every (" +
              std::to_string(options_.checkpoint_every) +
              ") must be a multiple of interval_steps (" + std::to_string(options_.interval_steps) +
              "): only right after averaging are the replicas identical";
  } else if (optimizer_.options().kind != OptimizerKind::sgd &&
             optimizer_.state().size() !=
                 model_.parameters().size() *
                     (optimizer_.options().kind == OptimizerKind::adam ? 2 : 1)) {
    problem = "the optimizer was built for another parameter list";
  } else {
    try {
      options_.lr.validate();
    } catch (const InvalidArgument& e) {
      problem = e.what();
    }
  }

  // Every rank must have built the same trainer: compare a fingerprint of what shapes the
  // collective calls (its min and max in one all-reduce), and whether any rank found a problem.
  Hasher h;
  const std::string arch = model_.describe() + "|" + std::string(optimizer_.name());
  h.add(arch.data(), arch.size());
  const std::uint64_t fields[] = {b,
                                  static_cast<std::uint64_t>(options_.shard_policy),
                                  static_cast<std::uint64_t>(options_.gradient_reduction),
                                  static_cast<std::uint64_t>(options_.mode),
                                  options_.interval_steps,
                                  static_cast<std::uint64_t>(options_.compression),
                                  options_.data_seed,
                                  options_.shuffle ? 1u : 0u,
                                  options_.overlap ? 1u : 0u,
                                  options_.fusion_threshold.value_or(0)};
  h.add(fields, sizeof fields);
  const auto fp = static_cast<std::int64_t>(h.value() >> 1);
  std::int64_t agreed[3] = {fp, -fp, problem.empty() ? 0 : -1};
  allreduce(comm_, agreed, agreed, 3, DataType::int64, ReduceOp::min);
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message("DataParallelTrainer", comm_.rank(), detail));
  };
  if (!problem.empty()) invalid(problem);
  if (agreed[2] < 0) invalid("another rank rejected its options (see that rank's error)");
  if (agreed[0] != -agreed[1]) {
    invalid("the ranks built different trainers (model " + model_.describe() + ", optimizer " +
            std::string(optimizer_.name()) + ", batch " + std::to_string(b) +
            " here): every rank must pass the same model, optimizer and options");
  }
  broadcast_state(0);
  if (options_.mode == SyncMode::gradients) {
    packing::ReducerOptions r;
    if (options_.fusion_threshold) {
      r.bucket_cap_bytes = std::max<std::size_t>(1, *options_.fusion_threshold);
      r.first_bucket_bytes = std::min(r.first_bucket_bytes, r.bucket_cap_bytes);
    }
    r.op =
        options_.gradient_reduction == GradientReduction::average ? ReduceOp::avg : ReduceOp::sum;
    r.algorithm = options_.algorithm;
    r.compression = options_.compression;
    r.overlap = options_.overlap;
    reducer_ = std::make_unique<packing::Reducer>(comm_, gradient_tensors(), std::move(r));
  }
}

DataParallelTrainer::Shard DataParallelTrainer::shard(std::size_t rows) const {
  const auto n = static_cast<std::size_t>(comm_.size());
  const auto r = static_cast<std::size_t>(comm_.rank());
  const std::size_t base = rows / n, extra = rows % n;
  switch (options_.shard_policy) {
    case ShardPolicy::strict:
      if (extra != 0) {
        throw InvalidArgument(error_message("DataParallelTrainer::step", comm_.rank(),
                                            "a batch of " + std::to_string(rows) +
                                                " rows does not divide by " + std::to_string(n) +
                                                " ranks (shard policy strict)"));
      }
      return {r * base, base};
    case ShardPolicy::drop_remainder:
      return {r * base, base};
    case ShardPolicy::uneven:
      return uneven_shard(rows, n, r);
  }
  return {};
}

std::size_t DataParallelTrainer::used_rows(std::size_t rows) const {
  const auto n = static_cast<std::size_t>(comm_.size());
  return options_.shard_policy == ShardPolicy::drop_remainder ? rows / n * n : rows;
}

std::vector<packing::TensorDesc> DataParallelTrainer::gradient_tensors() {
  std::vector<packing::TensorDesc> out;
  for (Parameter& p : model_.parameters())
    out.push_back({p.grad.data(), p.size(), DataType::float32});
  return out;
}

std::vector<packing::TensorDesc> DataParallelTrainer::state_tensors() {
  std::vector<packing::TensorDesc> out;
  for (Parameter& p : model_.parameters())
    out.push_back({p.value.data(), p.size(), DataType::float32});
  for (std::span<float> s : optimizer_.state())
    out.push_back({s.data(), s.size(), DataType::float32});
  return out;
}

void DataParallelTrainer::broadcast_state(int root) {
  for (const packing::TensorDesc& t : state_tensors())
    broadcast(comm_, t.data, t.count, t.dtype, root);
  std::int64_t counters[2] = {static_cast<std::int64_t>(optimizer_.steps()),
                              static_cast<std::int64_t>(step_)};
  broadcast(comm_, counters, 2, DataType::int64, root);
  optimizer_.set_steps(static_cast<std::uint64_t>(counters[0]));
  step_ = static_cast<std::uint64_t>(counters[1]);
}

void DataParallelTrainer::average_replicas() {
  const auto tensors = state_tensors();
  GroupedAllreduceOptions o;
  o.algorithm = options_.algorithm;
  o.fusion_threshold = options_.fusion_threshold;
  grouped_allreduce(comm_, tensors, ReduceOp::avg, o);
}

StepStats DataParallelTrainer::step(const Batch& batch) {
  if (batch.rows == 0) {
    throw InvalidArgument(
        error_message("DataParallelTrainer::step", comm_.rank(), "the batch is empty"));
  }
  const Shard s = shard(batch.rows);
  if (used_rows(batch.rows) == 0) {
    throw InvalidArgument(error_message(
        "DataParallelTrainer::step", comm_.rank(),
        "a batch of " + std::to_string(batch.rows) + " rows leaves every shard empty on " +
            std::to_string(comm_.size()) + " ranks (shard policy drop_remainder)"));
  }
  const Batch local{batch.features ? batch.features + s.first * batch.dim : nullptr,
                    batch.labels ? batch.labels + s.first : nullptr, s.count, batch.dim};
  return run_step(local, used_rows(batch.rows));
}

StepStats DataParallelTrainer::step(const Dataset& data) {
  const std::size_t b = options_.global_batch;
  if (data.rows() < b) {
    throw InvalidArgument(error_message("DataParallelTrainer::step", comm_.rank(),
                                        "the global batch (" + std::to_string(b) +
                                            ") is larger than the data set (" +
                                            std::to_string(data.rows()) + " rows)"));
  }
  if (expected_data_rows_ != 0 && expected_data_rows_ != data.rows()) {
    throw InvalidArgument(
        error_message("DataParallelTrainer::step", comm_.rank(),
                      "the checkpoint was written while training on " +
                          std::to_string(expected_data_rows_) + " rows, this data set has " +
                          std::to_string(data.rows()) + " (the data position would not continue)"));
  }
  expected_data_rows_ = 0;
  const std::size_t per_epoch = data.rows() / b;  // the last partial batch of an epoch is skipped
  const std::uint64_t epoch = step_ / per_epoch;
  const std::size_t index = step_ % per_epoch;
  if (epoch != order_epoch_ || &data != order_data_ || order_.size() != data.rows()) {
    order_.resize(data.rows());
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    if (options_.shuffle) {
      Random rng(options_.data_seed * 0x9e3779b97f4a7c15ull + epoch);
      for (std::size_t i = order_.size(); i > 1; --i)
        std::swap(order_[i - 1], order_[rng.below(i)]);
    }
    order_epoch_ = epoch;
    order_data_ = &data;
  }
  const Shard s = shard(b);
  const Batch local =
      data.gather(order_.data() + index * b + s.first, s.count, shard_features_, shard_labels_);
  return run_step(local, used_rows(b));
}

StepStats DataParallelTrainer::run_step(const Batch& local, std::size_t used) {
  StepStats st;
  st.samples = used;
  st.lr = options_.lr.at(step_, used);
  const auto n = static_cast<float>(comm_.size());
  const Clock::time_point t0 = Clock::now();
  LossSums sums;
  if (options_.mode == SyncMode::gradients) {
    // Every sample's gradient is weighted n / used before the all-reduce averages over n ranks:
    // the result is the mean over the global batch however the rows were split.
    // Each gradient goes to the reducer as soon as backward has produced it (last layer first);
    // without overlap the reducer only packs, in the same order, and reduces in finish().
    packing::Reducer& reducer = *reducer_;
    sums = model_.forward_backward(local, n / static_cast<float>(used),
                                   [&reducer](std::size_t i) { reducer.mark_ready(i); });
    st.compute_seconds = seconds_since(t0);
    const Clock::time_point t1 = Clock::now();
    reducer.finish();  // an empty shard produced no gradient: finish() takes them as they are
    st.allreduce_seconds = seconds_since(t1);
  } else {
    sums =
        model_.forward_backward(local, local.rows ? 1.0f / static_cast<float>(local.rows) : 0.0f);
    st.compute_seconds = seconds_since(t0);
  }
  const Clock::time_point t2 = Clock::now();
  {
    timeline::Span span("optimizer step", "trainer");
    optimizer_.step(model_.parameters(), static_cast<float>(st.lr));
  }
  st.optimizer_seconds = seconds_since(t2);
  ++step_;
  st.step = step_;

  const Clock::time_point t3 = Clock::now();
  if (options_.mode == SyncMode::model_averaging && step_ % options_.interval_steps == 0) {
    average_replicas();
    st.averaged = true;
  }
  double totals[3] = {sums.loss, sums.correct, static_cast<double>(local.rows)};
  allreduce(comm_, totals, totals, 3, DataType::float64, ReduceOp::sum);
  st.allreduce_seconds += seconds_since(t3);
  st.loss = options_.loss_reduction == LossReduction::mean ? totals[0] / totals[2] : totals[0];
  st.accuracy = totals[1] / totals[2];

  const bool synced = options_.mode == SyncMode::gradients || st.averaged;
  if (options_.verify_every > 0 && step_ % options_.verify_every == 0 && synced) verify_replicas();
  if (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0) {
    save_checkpoint(checkpoint_path());
  }
  return st;
}

Evaluation DataParallelTrainer::evaluate(const Dataset& data) {
  const auto [first, count] = uneven_shard(data.rows(), static_cast<std::size_t>(comm_.size()),
                                           static_cast<std::size_t>(comm_.rank()));
  constexpr std::size_t kChunk = 1024;  // bounds the activations held at once
  double totals[3] = {0, 0, static_cast<double>(count)};
  for (std::size_t i = 0; i < count; i += kChunk) {
    const LossSums s = model_.evaluate(data.rows(first + i, std::min(kChunk, count - i)));
    totals[0] += s.loss;
    totals[1] += s.correct;
  }
  allreduce(comm_, totals, totals, 3, DataType::float64, ReduceOp::sum);
  Evaluation e;
  e.samples = static_cast<std::size_t>(totals[2]);
  if (e.samples > 0) {
    e.loss = totals[0] / totals[2];
    e.accuracy = totals[1] / totals[2];
  }
  return e;
}

std::vector<float> DataParallelTrainer::predict(const Batch& batch) {
  const auto n = static_cast<std::size_t>(comm_.size());
  std::vector<std::size_t> counts(n);
  for (std::size_t r = 0; r < n; ++r)
    counts[r] = uneven_shard(batch.rows, n, r).count;
  const auto [first, count] = uneven_shard(batch.rows, n, static_cast<std::size_t>(comm_.rank()));
  std::vector<float> local(count);
  const Batch mine{batch.features ? batch.features + first * batch.dim : nullptr,
                   batch.labels ? batch.labels + first : nullptr, count, batch.dim};
  model_.predict(mine, local);
  return allgatherv<float>(comm_, local, counts);
}

std::uint64_t DataParallelTrainer::replica_hash() const {
  Hasher h;
  for (const Parameter& p : std::as_const(model_).parameters())
    h.add(p.value.data(), p.size() * sizeof(float));
  for (std::span<const float> s : std::as_const(optimizer_).state())
    h.add(s.data(), s.size_bytes());
  const std::uint64_t counters[2] = {optimizer_.steps(), step_};
  h.add(counters, sizeof counters);
  return h.value();
}

void DataParallelTrainer::verify_replicas() {
  const auto mine = static_cast<std::int64_t>(replica_hash());
  const std::vector<std::size_t> ones(static_cast<std::size_t>(comm_.size()), 1);
  const std::vector<std::int64_t> all = allgatherv<std::int64_t>(comm_, std::span(&mine, 1), ones);
  std::string differing;
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (differing.empty()) return;
  throw Error(ErrorCode::internal,
              error_message("DataParallelTrainer::verify_replicas", comm_.rank(),
                            "replicas diverged at step " + std::to_string(step_) + ": rank(s) " +
                                differing + " differ from rank 0 (parameters, optimizer state " +
                                "or step)"));
}

std::string DataParallelTrainer::checkpoint_path() const {
  return options_.checkpoint_dir + "/checkpoint.bin";
}

void DataParallelTrainer::save_checkpoint(const std::string& path) {
  // Under auto, its decisions are fixed from here on and saved, so that a run resumed from this
  // checkpoint reduces with the same algorithms as this one (collective: every rank adopts them).
  std::string decisions;
  const std::string_view algorithm =
      options_.algorithm.empty() ? std::string_view(comm_.config().algorithm) : options_.algorithm;
  if (algorithm == "auto" && !comm_.config().deterministic) {
    const collectives::TuningTable table = collectives::auto_decisions(comm_);
    collectives::use_auto_decisions(comm_, table);
    if (!table.rows.empty()) decisions = table.to_json();
  }
  std::string failure;
  if (comm_.rank() == 0) {
    try {
      CheckpointState s;
      s.model = model_.describe();
      for (const Parameter& p : std::as_const(model_).parameters()) {
        s.parameters.push_back({p.name, {p.shape.begin(), p.shape.end()}, p.value});
      }
      s.optimizer = optimizer_.name();
      s.optimizer_steps = optimizer_.steps();
      for (std::span<const float> t : std::as_const(optimizer_).state())
        s.optimizer_state.emplace_back(t.begin(), t.end());
      s.step = step_;
      s.global_batch = options_.global_batch;
      s.data_rows = order_data_ ? order_data_->rows() : 0;
      s.data_seed = options_.data_seed;
      s.auto_decisions = decisions;
      write_file_atomically(path, encode_checkpoint(s));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  failure = share_outcome(comm_, failure);
  if (!failure.empty()) {
    throw Error(ErrorCode::invalid_argument,
                error_message("DataParallelTrainer::save_checkpoint", comm_.rank(),
                              "rank 0 failed: " + failure));
  }
}

void DataParallelTrainer::load_checkpoint(const std::string& path) {
  std::vector<std::byte> bytes;
  std::string failure;
  if (comm_.rank() == 0) {
    try {
      bytes = read_file(path);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  failure = share_outcome(comm_, failure);
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(
        error_message("DataParallelTrainer::load_checkpoint(" + path + ")", comm_.rank(), detail));
  };
  if (!failure.empty()) invalid("rank 0 could not read it: " + failure);
  std::int64_t size = static_cast<std::int64_t>(bytes.size());
  broadcast(comm_, &size, 1, DataType::int64, 0);
  bytes.resize(static_cast<std::size_t>(size));
  broadcast_bytes(comm_, bytes.data(), bytes.size(), 0);

  // Every rank decodes the same bytes, so every rank accepts or rejects them alike.
  const CheckpointState s = decode_checkpoint(bytes, path);
  if (s.model != model_.describe()) {
    invalid("it holds model '" + s.model + "', this run builds '" + model_.describe() + "'");
  }
  const auto params = model_.parameters();
  if (s.parameters.size() != params.size()) invalid("parameter count differs");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& t = s.parameters[i];
    if (t.name != params[i].name || t.values.size() != params[i].size() ||
        !std::equal(t.shape.begin(), t.shape.end(), params[i].shape.begin(),
                    params[i].shape.end())) {
      invalid("parameter " + std::to_string(i) + " is '" + t.name + "' with " +
              std::to_string(t.values.size()) + " values, this model has '" + params[i].name +
              "' with " + std::to_string(params[i].size()));
    }
  }
  if (s.optimizer != optimizer_.name()) {
    invalid("it holds optimizer '" + s.optimizer + "' state, this run uses '" +
            std::string(optimizer_.name()) + "'");
  }
  const auto state = optimizer_.state();
  if (s.optimizer_state.size() != state.size()) invalid("optimizer state tensor count differs");
  for (std::size_t i = 0; i < state.size(); ++i) {
    if (s.optimizer_state[i].size() != state[i].size())
      invalid("optimizer state tensor " + std::to_string(i) + " has another size");
  }
  if (s.global_batch != options_.global_batch) {
    invalid("it was written with global batch " + std::to_string(s.global_batch) +
            ", this run uses " + std::to_string(options_.global_batch) +
            " (the data position depends on it)");
  }
  if (s.data_seed != options_.data_seed) {
    invalid("it was written with data seed " + std::to_string(s.data_seed) + ", this run uses " +
            std::to_string(options_.data_seed));
  }
  if (!s.auto_decisions.empty()) {
    collectives::use_auto_decisions(comm_, collectives::TuningTable::parse(s.auto_decisions, path));
  }
  for (std::size_t i = 0; i < params.size(); ++i)
    params[i].value = s.parameters[i].values;
  for (std::size_t i = 0; i < state.size(); ++i)
    std::copy(s.optimizer_state[i].begin(), s.optimizer_state[i].end(), state[i].begin());
  optimizer_.set_steps(s.optimizer_steps);
  step_ = s.step;
  order_epoch_ = ~std::uint64_t{0};
  expected_data_rows_ = s.data_rows;
}

}  // namespace gradcomm::trainer
