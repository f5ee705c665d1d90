// DataParallelTrainer against independent references. The reference for "N ranks with batch
// B/N" is one process with batch B: every rank also trains a private replica over MPI_COMM_SELF
// and compares. Also: replicas bit-identical after every step, model averaging, uneven and
// dropped shards, loss/metric/prediction reduction, checkpoints (exact resume; corrupt and
// mismatched files rejected on every rank), divergence detection and disagreeing options.

#include <gmock/gmock.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/registry.h"
#include "collectives/select/auto_select.h"
#include "core/error.h"
#include "tests/mpi_test.h"
#include "trainer/checkpoint.h"
#include "trainer/data_parallel_trainer.h"

namespace gradcomm::testing {
namespace {

using namespace gradcomm::trainer;
using ::testing::HasSubstr;

const Dataset& data() {
  static const Dataset d =
      Dataset::synthetic({.samples = 2400, .features = 16, .classes = 5, .noise = 1.0, .seed = 4});
  return d;
}

// One model + optimizer + trainer. The model starts from `init_seed` on every rank (a
// different seed per rank where a test wants to see the broadcast at work).
struct Replica {
  std::unique_ptr<Model> model;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<DataParallelTrainer> trainer;

  Replica(Communicator& comm, OptimizerKind kind, TrainerOptions options,
          std::uint64_t init_seed = 3, std::vector<std::size_t> hidden = {24, 16}) {
    model = make_mlp(16, std::move(hidden), 5);
    model->initialize(init_seed);
    OptimizerOptions o;
    o.kind = kind;
    optimizer = std::make_unique<Optimizer>(o, model->parameters());
    trainer = std::make_unique<DataParallelTrainer>(comm, *model, *optimizer, std::move(options));
  }
  std::vector<float> flat() const {
    std::vector<float> out;
    for (const Parameter& p : std::as_const(*model).parameters())
      out.insert(out.end(), p.value.begin(), p.value.end());
    return out;
  }
};

Communicator& self() {
  static Communicator c(MPI_COMM_SELF);
  return c;
}

double lr_for(OptimizerKind kind) {
  return kind == OptimizerKind::adam ? 0.003 : 0.1;
}

// ||a - b|| / ||b||
double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    n += double{b[i]} * b[i];
  }
  return std::sqrt(d / n);
}

// The replicas differ from one process only in the order in which per-sample gradients are
// summed (each rank sums its shard, then the all-reduce sums the ranks, in float32): each
// gradient element then carries a relative rounding difference of at most ~B * 2^-24 ~ 1e-5 for
// B = 120 (typically ~sqrt(B) * 2^-24 ~ 1e-7), and 20 steps of a stable optimization do not
// amplify it by more than a small factor. Adam divides by sqrt(v), which magnifies differences in
// tiny gradient elements, hence its looser bound. Measured: 3e-8 to 1e-7 at 2-8 ranks.
double tolerance_for(OptimizerKind kind) {
  return kind == OptimizerKind::adam ? 2e-5 : 1e-5;
}

class Equivalence : public MpiTestWithParam<std::tuple<OptimizerKind, std::string>> {};

TEST_P(Equivalence, NRanksWithBatchBOverNEqualOneProcessWithBatchB) {
  const auto [kind, algorithm] = GetParam();
  TrainerOptions o;
  o.global_batch = 120;  // divides by 1, 2, 3, 4, 5 and 8
  o.algorithm = algorithm;
  o.fusion_threshold = 1024;  // several buckets, and tensors reduced in place
  o.lr.lr = lr_for(kind);
  // Each rank starts from its own seed: only the broadcast makes them agree.
  Replica dp(world(), kind, o, 100 + static_cast<std::uint64_t>(world().rank()));
  o.algorithm = "";
  Replica reference(self(), kind, o, 100);  // rank 0's initial weights
  for (int step = 0; step < 20; ++step) {
    const StepStats a = dp.trainer->step(data());
    const StepStats b = reference.trainer->step(data());
    ASSERT_EQ(a.step, b.step);
    EXPECT_NEAR(a.loss, b.loss, 1e-4 * b.loss) << "step " << step;
    EXPECT_NEAR(a.accuracy, b.accuracy, 1.5 / 120) << "step " << step;
    EXPECT_EQ(a.samples, 120u);
    // Bit-identical replicas after every step.
    ASSERT_TRUE(same_on_all_ranks(world().mpi_comm(), dp.trainer->replica_hash()))
        << "replicas differ after step " << step;
  }
  const double distance = relative_distance(dp.flat(), reference.flat());
  EXPECT_LE(distance, tolerance_for(kind));
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", distance);
  RecordProperty("relative_distance", text);
  const Evaluation ea = dp.trainer->evaluate(data());
  const Evaluation eb = reference.trainer->evaluate(data());
  EXPECT_EQ(ea.samples, data().rows());
  EXPECT_NEAR(ea.loss, eb.loss, 1e-3 * eb.loss);
}

std::vector<std::tuple<OptimizerKind, std::string>> equivalence_cases() {
  std::vector<std::tuple<OptimizerKind, std::string>> cases;
  for (OptimizerKind k : {OptimizerKind::sgd, OptimizerKind::momentum, OptimizerKind::adam}) {
    for (const std::string& a : collectives::host_algorithm_names())
      cases.emplace_back(k, a);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OptimizersTimesAlgorithms, Equivalence,
                         ::testing::ValuesIn(equivalence_cases()), [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) + "_" +
                                  std::get<1>(info.param);
                         });

class Trainer : public MpiTest {};

TEST_F(Trainer, UnevenShardsWeighSamplesEquallyAndDropRemainderUsesTheRest) {
  const auto n = static_cast<std::size_t>(world().size());
  for (std::size_t batch : {std::size_t{1}, std::size_t{7}, std::size_t{13}}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    TrainerOptions o;
    o.global_batch = batch;
    o.shard_policy = ShardPolicy::uneven;
    Replica dp(world(), OptimizerKind::momentum, o);
    Replica reference(self(), OptimizerKind::momentum, o);
    for (std::size_t step = 0; step < 10; ++step) {
      const Batch rows = data().rows(step * batch, batch);
      const StepStats a = dp.trainer->step(rows);
      const StepStats b = reference.trainer->step(rows);
      EXPECT_NEAR(a.loss, b.loss, 1e-4 * b.loss);
    }
    EXPECT_LE(relative_distance(dp.flat(), reference.flat()), 1e-5);

    TrainerOptions d = o;
    d.shard_policy = ShardPolicy::drop_remainder;
    if (batch < n) {
      EXPECT_THROW(Replica(world(), OptimizerKind::sgd, d), InvalidArgument);
      continue;
    }
    const std::size_t used = batch / n * n;
    Replica dropped(world(), OptimizerKind::sgd, d);
    TrainerOptions r = o;
    r.global_batch = used;
    Replica dropped_reference(self(), OptimizerKind::sgd, r);
    for (std::size_t step = 0; step < 10; ++step) {
      const StepStats a = dropped.trainer->step(data().rows(step * batch, batch));
      EXPECT_EQ(a.samples, used);
      dropped_reference.trainer->step(data().rows(step * batch, used));
    }
    EXPECT_LE(relative_distance(dropped.flat(), dropped_reference.flat()), 1e-5);
  }
}

TEST_F(Trainer, StrictShardingRejectsAnIndivisibleBatchNamingBoth) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "every batch divides by 1 rank";
  TrainerOptions o;
  o.global_batch = static_cast<std::size_t>(n) * 10 + 1;
  try {
    Replica r(world(), OptimizerKind::sgd, o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("global batch " + std::to_string(n * 10 + 1) +
                                    " does not divide by " + std::to_string(n) + " ranks"));
  }
}

TEST_F(Trainer, SumReductionIsSizeTimesAverageAndLossSumIsReported) {
  TrainerOptions avg;
  avg.global_batch = 40;
  avg.shard_policy = ShardPolicy::uneven;
  avg.lr.lr = 0.05;
  TrainerOptions sum = avg;
  sum.gradient_reduction = GradientReduction::sum;
  sum.loss_reduction = LossReduction::sum;
  sum.lr.lr = 0.05 / world().size();  // the same update as averaging with lr 0.05
  Replica a(world(), OptimizerKind::sgd, avg);
  Replica s(world(), OptimizerKind::sgd, sum);
  for (int step = 0; step < 5; ++step) {
    const StepStats x = a.trainer->step(data());
    const StepStats y = s.trainer->step(data());
    EXPECT_NEAR(y.loss, x.loss * 40, 1e-3 * y.loss);
  }
  EXPECT_LE(relative_distance(s.flat(), a.flat()), 1e-5);
}

TEST_F(Trainer, ModelAveragingWithIntervalOneEqualsGradientAveragingForSgd) {
  TrainerOptions g;
  g.global_batch = 120;
  TrainerOptions m = g;
  m.mode = SyncMode::model_averaging;
  m.interval_steps = 1;
  Replica grads(world(), OptimizerKind::sgd, g);
  Replica averaged(world(), OptimizerKind::sgd, m);
  for (int step = 0; step < 15; ++step) {
    grads.trainer->step(data());
    const StepStats st = averaged.trainer->step(data());
    EXPECT_TRUE(st.averaged);
  }
  EXPECT_LE(relative_distance(averaged.flat(), grads.flat()), 1e-5);
  EXPECT_TRUE(same_on_all_ranks(world().mpi_comm(), averaged.trainer->replica_hash()));
}

TEST_F(Trainer, ModelAveragingMakesReplicasIdenticalRightAfterEachAveraging) {
  TrainerOptions m;
  m.global_batch = 120;
  m.mode = SyncMode::model_averaging;
  m.interval_steps = 3;
  m.verify_every = 1;  // checked on averaging steps only
  Replica r(world(), OptimizerKind::adam, m);
  for (int step = 1; step <= 12; ++step) {
    const StepStats st = r.trainer->step(data());
    EXPECT_EQ(st.averaged, step % 3 == 0);
    const bool same = same_on_all_ranks(world().mpi_comm(), r.trainer->replica_hash());
    if (st.averaged) {
      EXPECT_TRUE(same) << "after averaging at step " << step;
    } else if (world().size() > 1) {
      EXPECT_FALSE(same) << "local step " << step << " should differ across shards";
    }
  }
}

TEST_F(Trainer, PredictionsAreGatheredInRankOrder) {
  TrainerOptions o;
  o.global_batch = 120;
  Replica r(world(), OptimizerKind::sgd, o);
  for (int step = 0; step < 3; ++step)
    r.trainer->step(data());
  for (std::size_t rows : {std::size_t{1}, std::size_t{37}, std::size_t{120}}) {
    const std::vector<float> gathered = r.trainer->predict(data().rows(5, rows));
    std::vector<float> local(rows);
    r.model->predict(data().rows(5, rows), local);  // every replica holds the same model
    EXPECT_EQ(gathered, local) << rows << " rows";
  }
}

std::string shared_temp_dir(const std::string& name) {
  std::int64_t pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT64_T, 0, world().mpi_comm());
  const auto dir =
      std::filesystem::temp_directory_path() / ("gradcomm_" + name + "_" + std::to_string(pid));
  MPI_Barrier(world().mpi_comm());
  return dir.string();
}

TEST_F(Trainer, ResumedRunEndsBitIdenticalToAnUninterruptedOne) {
  const std::string dir = shared_temp_dir("resume");
  for (OptimizerKind kind : {OptimizerKind::momentum, OptimizerKind::adam}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    TrainerOptions o;
    // Both runs must reduce with the same algorithm (README, Checkpoints): auto measures its
    // picks and may switch between the two on a machine whose speed drifts.
    o.algorithm = "ring";
    o.global_batch = 200;  // 12 steps per epoch of 2400 rows: the run crosses an epoch
    o.shard_policy = ShardPolicy::uneven;
    o.lr.lr = lr_for(kind);
    o.lr.warmup_steps = 5;
    Replica straight(world(), kind, o);
    for (int step = 0; step < 16; ++step)
      straight.trainer->step(data());

    TrainerOptions c = o;
    c.checkpoint_dir = dir;
    c.checkpoint_every = 7;
    {
      Replica first(world(), kind, c);
      for (int step = 0; step < 9; ++step)
        first.trainer->step(data());  // saved at step 7
    }
    Replica resumed(world(), kind, c, /*init_seed=*/999);
    resumed.trainer->load_checkpoint(resumed.trainer->checkpoint_path());
    EXPECT_EQ(resumed.trainer->steps_done(), 7u);
    while (resumed.trainer->steps_done() < 16)
      resumed.trainer->step(data());
    EXPECT_EQ(resumed.trainer->replica_hash(), straight.trainer->replica_hash());
    EXPECT_EQ(resumed.flat(), straight.flat());
  }
  MPI_Barrier(world().mpi_comm());
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// The reducer all-reduces each bucket while backward goes on (overlap) or after it: the same
// buckets, so bit-identical replicas either way, with ring (whose rounding depends on where an
// element sits in its bucket) and shm, and several buckets (a 2 KiB cap).
TEST_F(Trainer, OverlapOnEndsBitIdenticalToOverlapOff) {
  for (const char* algorithm : {"ring", "shm"}) {
    SCOPED_TRACE(algorithm);
    TrainerOptions o;
    o.algorithm = algorithm;
    o.global_batch = 120;
    o.shard_policy = ShardPolicy::uneven;
    o.fusion_threshold = 2048;
    o.lr.lr = lr_for(OptimizerKind::momentum);
    TrainerOptions off = o;
    off.overlap = false;
    Replica overlapped(world(), OptimizerKind::momentum, o);
    Replica after(world(), OptimizerKind::momentum, off);
    for (int step = 0; step < 6; ++step) {
      overlapped.trainer->step(data());
      after.trainer->step(data());
    }
    EXPECT_EQ(overlapped.flat(), after.flat());
    EXPECT_EQ(overlapped.trainer->replica_hash(), after.trainer->replica_hash());
    overlapped.trainer->verify_replicas();
  }
}

// Under plain auto (measuring its picks): a run resumed from a checkpoint ends bit-identical to
// the run that wrote it and went on. The writer fixes auto's decisions when it saves them, the
// resumed run adopts them, so both reduce every later bucket with the same algorithm.
TEST_F(Trainer, ResumedRunUnderAutoEndsBitIdenticalToTheRunThatWroteIt) {
  const std::string dir = shared_temp_dir("resume_auto");
  TrainerOptions o;
  o.algorithm = "auto";
  o.global_batch = 200;
  o.shard_policy = ShardPolicy::uneven;
  o.lr.lr = lr_for(OptimizerKind::adam);
  o.checkpoint_dir = dir;
  o.checkpoint_every = 5;
  // Communicators of their own: each run's auto starts from nothing, as in separate jobs.
  Communicator writer_comm(MPI_COMM_WORLD);
  Replica writer(writer_comm, OptimizerKind::adam, o);
  for (int step = 0; step < 5; ++step)
    writer.trainer->step(data());  // saved at step 5
  const std::string saved = dir + "/at5.bin";
  if (world().rank() == 0) {
    std::filesystem::copy_file(writer.trainer->checkpoint_path(), saved);
  }
  MPI_Barrier(world().mpi_comm());
  const collectives::TuningTable fixed = collectives::auto_decisions(writer_comm);
  if (world().size() > 1) {
    EXPECT_FALSE(fixed.rows.empty()) << "auto made no decision to save";
  }
  while (writer.trainer->steps_done() < 14)
    writer.trainer->step(data());

  Communicator resumed_comm(MPI_COMM_WORLD);
  Replica resumed(resumed_comm, OptimizerKind::adam, o, /*init_seed=*/999);
  resumed.trainer->load_checkpoint(saved);
  EXPECT_EQ(resumed.trainer->steps_done(), 5u);
  // The writer's decisions, not new ones: the same table on both communicators.
  EXPECT_EQ(collectives::auto_decisions(resumed_comm).to_json(), fixed.to_json());
  while (resumed.trainer->steps_done() < 14)
    resumed.trainer->step(data());
  EXPECT_EQ(resumed.trainer->replica_hash(), writer.trainer->replica_hash());
  EXPECT_EQ(resumed.flat(), writer.flat());
  MPI_Barrier(world().mpi_comm());
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST_F(Trainer, CorruptOrMismatchedCheckpointsAreRejectedOnEveryRank) {
  const std::string dir = shared_temp_dir("corrupt");
  TrainerOptions o;
  o.global_batch = 120;
  Replica r(world(), OptimizerKind::momentum, o);
  r.trainer->step(data());
  const std::string good = dir + "/good.bin";
  r.trainer->save_checkpoint(good);
  const std::uint64_t before = r.trainer->replica_hash();

  // Damaged copies, made by rank 0 only (the only reader).
  auto variant = [&](const std::string& name, auto damage) {
    const std::string path = dir + "/" + name;
    if (world().rank() == 0) {
      std::vector<std::byte> bytes = read_file(good);
      damage(bytes);
      write_file_atomically(path, bytes);
    }
    MPI_Barrier(world().mpi_comm());
    return path;
  };
  auto expect_rejected = [&](Replica& target, const std::string& path, const std::string& text) {
    try {
      target.trainer->load_checkpoint(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text)) << path;
    }
  };
  expect_rejected(r, variant("truncated.bin", [](auto& b) { b.resize(b.size() / 2); }),
                  "truncated");
  expect_rejected(r, variant("flipped.bin", [](auto& b) { b[b.size() / 2] ^= std::byte{4}; }),
                  "checksum mismatch");
  expect_rejected(r, variant("version.bin", [](auto& b) { b[8] = std::byte{9}; }),
                  "format version 9");
  expect_rejected(r, dir + "/missing.bin", "could not read");
  EXPECT_EQ(r.trainer->replica_hash(), before) << "a rejected checkpoint changed the trainer";

  Replica wider(world(), OptimizerKind::momentum, o, 3, {32, 16});
  expect_rejected(wider, good, "holds model 'mlp 16-24-16-5', this run builds 'mlp 16-32-16-5'");
  Replica adam(world(), OptimizerKind::adam, o);
  expect_rejected(adam, good, "holds optimizer 'momentum' state, this run uses 'adam'");
  TrainerOptions other = o;
  other.global_batch = 240;
  Replica batch(world(), OptimizerKind::momentum, other);
  expect_rejected(batch, good, "global batch 120, this run uses 240");

  // Still usable after the rejections.
  r.trainer->step(data());
  EXPECT_TRUE(same_on_all_ranks(world().mpi_comm(), r.trainer->replica_hash()));
  MPI_Barrier(world().mpi_comm());
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST_F(Trainer, VerificationNamesTheStepAndTheDivergedRank) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "one replica cannot diverge";
  TrainerOptions o;
  o.global_batch = 120;
  Replica r(world(), OptimizerKind::sgd, o);
  r.trainer->step(data());
  r.trainer->step(data());
  EXPECT_NO_THROW(r.trainer->verify_replicas());
  if (world().rank() == n - 1) r.model->parameters()[1].value[0] += 1e-6f;
  try {
    r.trainer->verify_replicas();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("replicas diverged at step 2: rank(s) " +
                                    std::to_string(n - 1) + " differ from rank 0"));
  }
}

TEST_F(Trainer, RanksWithDifferentOptionsFailTogetherInsteadOfHanging) {
  if (world().size() == 1) GTEST_SKIP() << "needs two ranks to disagree";
  const auto n = static_cast<std::size_t>(world().size());
  TrainerOptions o;
  o.global_batch = world().rank() == 0 ? 20 * n : 10 * n;
  try {
    Replica r(world(), OptimizerKind::sgd, o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("the ranks built different trainers"));
  }
  // A rank-local problem (an indivisible batch on the last rank only) fails on every rank.
  o.global_batch = world().rank() == world().size() - 1 ? 10 * n + 1 : 10 * n;
  try {
    Replica r(world(), OptimizerKind::sgd, o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), ::testing::AnyOf(HasSubstr("does not divide"),
                                           HasSubstr("another rank rejected its options")));
  }
}

// The defaults of gradcomm-train (trainer/gradcomm_train.cc): MLP 32-128-128-10 on the embedded
// synthetic set with the last 10% held out, global batch 240, SGD with momentum 0.9 at lr 0.05,
// 500 steps. Measured: 94-95% validation accuracy at 1-4 ranks, against 85% for the softmax
// classifier (the classes are not linearly separable); the bar is 90%.
TEST_F(Trainer, DefaultRunLearnsTheSyntheticSet) {
  const Dataset all = Dataset::synthetic({});
  const std::size_t held_out = all.rows() / 10;
  const Dataset train = all.slice(0, all.rows() - held_out);
  const Dataset validation = all.slice(all.rows() - held_out, held_out);
  auto model = make_mlp(32, {128, 128}, 10);
  model->initialize(1);
  Optimizer optimizer({.kind = OptimizerKind::momentum}, model->parameters());
  TrainerOptions o;
  o.global_batch = 240;
  o.lr.lr = 0.05;
  DataParallelTrainer trainer(world(), *model, optimizer, o);
  const double initial = trainer.evaluate(train).loss;
  for (int step = 0; step < 500; ++step)
    trainer.step(train);
  const Evaluation after = trainer.evaluate(train);
  const Evaluation valid = trainer.evaluate(validation);
  EXPECT_LT(after.loss, initial / 4);
  EXPECT_GE(valid.accuracy, 0.90);
  RecordProperty("validation_accuracy", std::to_string(valid.accuracy));
  if (world().rank() == 0) {
    std::printf("default run: loss %.4f -> %.4f, validation accuracy %.4f\n", initial, after.loss,
                valid.accuracy);
  }
}

}  // namespace
}  // namespace gradcomm::testing
