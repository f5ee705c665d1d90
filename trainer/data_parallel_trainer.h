#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/communicator.h"
#include "packing/grouped_allreduce.h"
#include "packing/reducer.h"
#include "trainer/dataset.h"
#include "trainer/model.h"
#include "trainer/optimizer.h"

namespace gradcomm::trainer {

// How a global batch that does not divide by the rank count is split.
enum class ShardPolicy {
  strict,          // an error naming the batch and the rank count
  drop_remainder,  // every rank takes batch / size rows; the last batch % size rows are unused
  uneven,          // the first batch % size ranks take one row more; gradients, losses and
                   // metrics are weighted by shard size, so the result equals one process
};
enum class GradientReduction { average, sum };  // sum = size x average (Horovod's op=Sum)
enum class LossReduction { mean, sum };         // of per-sample losses over the global batch
enum class SyncMode {
  gradients,        // all-reduce gradients every step; replicas identical after every step
  model_averaging,  // local steps on the local mean gradient; every interval_steps the
                    // parameters and optimizer state are averaged, each rank weighing the same
};

struct TrainerOptions {
  std::size_t global_batch = 128;  // rows per step over all ranks
  ShardPolicy shard_policy = ShardPolicy::strict;
  GradientReduction gradient_reduction = GradientReduction::average;
  LossReduction loss_reduction = LossReduction::mean;
  SyncMode mode = SyncMode::gradients;
  std::size_t interval_steps = 1;  // model_averaging: steps between averagings
  // The gradients go through a packing::Reducer: buckets of fusion_threshold bytes (default
  // 25 MiB, the first 1 MiB), in the order backward produces them. With overlap, each bucket is
  // all-reduced (non-blocking) as soon as backward has produced it, while backward goes on;
  // without, the same buckets are all-reduced after backward, blocking. Both give bit-identical
  // results. Model averaging averages the parameters with grouped_allreduce, blocking.
  bool overlap = true;
  std::string algorithm = {};  // empty: the communicator's Config::algorithm
  std::optional<std::size_t> fusion_threshold = std::nullopt;
  Compression compression = Compression::none;
  LearningRateSchedule lr;
  // Every verify_every steps (0: never) check that all replicas are bit-identical (parameters,
  // optimizer state and step); in model_averaging mode only on steps that averaged.
  std::size_t verify_every = 0;
  // Data order of step(const Dataset&): one shuffle per epoch drawn from data_seed.
  std::uint64_t data_seed = 1;
  bool shuffle = true;
  // Every checkpoint_every steps (0: never) rank 0 writes checkpoint_dir/checkpoint.bin.
  std::string checkpoint_dir = {};
  std::size_t checkpoint_every = 0;
};

// What one step did, the same on every rank.
struct StepStats {
  std::uint64_t step = 0;  // steps done after this one
  double loss = 0;         // mean (or sum) of per-sample losses over the global batch
  double accuracy = 0;     // classifiers: correct / samples over the global batch
  std::size_t samples = 0;
  double lr = 0;
  bool averaged = false;  // model_averaging: this step averaged the replicas
  // This rank's wall time in the forward/backward pass (with overlap, including packing and
  // launching buckets), waiting for communication after it (gradients, parameter averaging, the
  // loss reduction: the exposed communication) and in the optimizer.
  double compute_seconds = 0, allreduce_seconds = 0, optimizer_seconds = 0;
};

struct Evaluation {
  double loss = 0;  // mean per-sample loss
  double accuracy = 0;
  std::size_t samples = 0;
};

// Synchronous data-parallel training of one Model replica per rank. Every public function is
// collective over the communicator: all ranks call it in the same order with the same
// arguments (the same global batch or data set; each rank uses its own shard).
class DataParallelTrainer {
 public:
  // Validates the options, then broadcasts rank 0's parameters and optimizer state so the
  // replicas start identical. The model, optimizer and communicator must outlive the trainer.
  DataParallelTrainer(Communicator& comm, Model& model, Optimizer& optimizer,
                      TrainerOptions options);

  const TrainerOptions& options() const { return options_; }
  std::uint64_t steps_done() const { return step_; }

  // The rows [first, first + count) of a global batch of `rows` rows this rank trains on.
  struct Shard {
    std::size_t first = 0, count = 0;
  };
  Shard shard(std::size_t rows) const;
  // Rows of a global batch of `rows` that take part (rows, or less with drop_remainder).
  std::size_t used_rows(std::size_t rows) const;

  // One step on `batch`, the global batch (every rank passes the same rows).
  StepStats step(const Batch& batch);
  // One step on the next global batch of `data` (options.global_batch rows, shuffled per epoch
  // from data_seed; the position follows from the step count, so a resumed run continues on the
  // same rows).
  StepStats step(const Dataset& data);

  // Loss and accuracy of the current model on all of `data`, split across the ranks.
  Evaluation evaluate(const Dataset& data);
  // Predictions for the global batch, computed shard by shard and gathered in rank order.
  std::vector<float> predict(const Batch& batch);

  // Throws gradcomm::Error on every rank, naming the step and the ranks, when some replica's
  // parameters, optimizer state or step differ from rank 0's.
  void verify_replicas();
  // A 64-bit hash of this rank's parameters, optimizer state and step.
  std::uint64_t replica_hash() const;

  // Rank 0 writes the state atomically; every rank returns or throws together.
  void save_checkpoint(const std::string& path);
  // Rank 0 reads the file, every rank decodes it and takes its state. Throws InvalidArgument on
  // every rank for a missing, corrupt or mismatched checkpoint (another model, optimizer, batch
  // or data set); the trainer is unchanged then.
  void load_checkpoint(const std::string& path);
  // checkpoint_dir/checkpoint.bin
  std::string checkpoint_path() const;

 private:
  void broadcast_state(int root);
  void average_replicas();
  StepStats run_step(const Batch& local, std::size_t used);
  std::vector<packing::TensorDesc> gradient_tensors();
  std::vector<packing::TensorDesc> state_tensors();

  Communicator& comm_;
  Model& model_;
  Optimizer& optimizer_;
  TrainerOptions options_;
  std::uint64_t step_ = 0;
  // step(const Dataset&): the current epoch's permutation and this rank's gathered rows.
  std::uint64_t order_epoch_ = ~std::uint64_t{0};
  const Dataset* order_data_ = nullptr;
  std::vector<std::size_t> order_;
  std::vector<float> shard_features_, shard_labels_;
  std::uint64_t expected_data_rows_ = 0;       // from a loaded checkpoint, checked on the next step
  std::unique_ptr<packing::Reducer> reducer_;  // gradients mode
};

}  // namespace gradcomm::trainer
