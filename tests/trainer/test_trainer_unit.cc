// The trainer's local pieces against independent references: analytic gradients against central
// finite differences in float64 arithmetic, the dense kernels against naive loops, optimizer
// steps against their formulas written out, the learning-rate schedule, data sets and the CSV
// loader, and the checkpoint format (round trip; truncated, bit-flipped, foreign and
// wrong-version files rejected with a message saying which).

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "trainer/checkpoint.h"
#include "trainer/dataset.h"
#include "trainer/dense_kernels.h"
#include "trainer/model.h"
#include "trainer/optimizer.h"
#include "trainer/random.h"

namespace gradcomm::trainer {
namespace {

using ::testing::HasSubstr;

std::filesystem::path temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("gradcomm_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// --- dense kernels ---------------------------------------------------------------------------

TEST(DenseKernels, MatchNaiveLoopsOnOddShapes) {
  Random rng(7);
  for (auto [m, k, n] : {std::tuple<std::size_t, std::size_t, std::size_t>{1, 1, 1},
                         {3, 5, 7},
                         {4, 8, 16},
                         {9, 13, 1030},
                         {17, 600, 3}}) {
    std::vector<float> a(m * k), b(k * n), c(m * n, 0.5f), at(k * m), bt(m * n), ct(k * n, 0.25f);
    for (float& x : a)
      x = static_cast<float>(rng.normal());
    for (float& x : b)
      x = static_cast<float>(rng.normal());
    for (float& x : bt)
      x = static_cast<float>(rng.normal());
    // C += A B
    std::vector<double> ref(m * n, 0.5);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t p = 0; p < k; ++p)
        for (std::size_t j = 0; j < n; ++j)
          ref[i * n + j] += double{a[i * k + p]} * b[p * n + j];
    matmul_add(a.data(), b.data(), c.data(), m, k, n);
    for (std::size_t i = 0; i < m * n; ++i)
      ASSERT_NEAR(c[i], ref[i], 1e-4 * (1 + k)) << i;
    // C[k x n] += A[m x k]^T B[m x n]
    std::vector<double> ref2(k * n, 0.25);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t p = 0; p < k; ++p)
        for (std::size_t j = 0; j < n; ++j)
          ref2[p * n + j] += double{a[i * k + p]} * bt[i * n + j];
    matmul_at_b_add(a.data(), bt.data(), ct.data(), m, k, n);
    for (std::size_t i = 0; i < k * n; ++i)
      ASSERT_NEAR(ct[i], ref2[i], 1e-4 * (1 + m)) << i;
    // C[m x k] = A[m x n] B[k x n]^T
    std::vector<float> bk(k * n), out(m * k, 99.0f);
    for (float& x : bk)
      x = static_cast<float>(rng.normal());
    matmul_a_bt(bt.data(), bk.data(), out.data(), m, k, n);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t p = 0; p < k; ++p) {
        double s = 0;
        for (std::size_t j = 0; j < n; ++j)
          s += double{bt[i * n + j]} * bk[p * n + j];
        ASSERT_NEAR(out[i * k + p], s, 1e-4 * (1 + n)) << i << "," << p;
      }
  }
}

// --- gradients by finite differences ---------------------------------------------------------

// Checks d(loss sum)/d(theta) of every parameter element (or every k-th of a big tensor)
// against the central difference (L(theta + h) - L(theta - h)) / 2h. Activations are float32, so
// the loss carries ~1e-7 relative rounding: h = 1e-2 keeps that below 1e-4 of the difference,
// and the truncation error (h^2 L'''/6) is smaller still. A ReLU kink between theta - h and
// theta + h breaks the difference, not the gradient: such an element is recognised by the
// estimates with h, h/2 and h/4 disagreeing, and skipped (the test requires most elements checked).
void check_gradients(Model& model, const Dataset& data, std::size_t rows) {
  const Batch batch = data.rows(0, rows);
  const float scale = 0.5f;  // the scale must multiply the gradient exactly
  model.forward_backward(batch, scale);
  std::vector<std::vector<float>> analytic;
  for (const Parameter& p : model.parameters())
    analytic.push_back(p.grad);
  std::size_t checked = 0, skipped = 0;
  for (std::size_t t = 0; t < model.parameters().size(); ++t) {
    Parameter& p = model.parameters()[t];
    const std::size_t stride = std::max<std::size_t>(1, p.size() / 40);
    for (std::size_t i = 0; i < p.size(); i += stride) {
      const float saved = p.value[i];
      auto difference = [&](float h) {
        p.value[i] = saved + h;
        const double up = model.evaluate(batch).loss;
        p.value[i] = saved - h;
        const double down = model.evaluate(batch).loss;
        p.value[i] = saved;
        return scale * (up - down) / (2.0 * static_cast<double>(h));
      };
      const double numeric = difference(1e-2f);
      const double half = difference(5e-3f);
      const double quarter = difference(2.5e-3f);
      if (std::fabs(numeric - half) > 5e-4 * (1.0 + std::fabs(numeric)) ||
          std::fabs(numeric - quarter) > 1e-3 * (1.0 + std::fabs(numeric))) {
        ++skipped;  // a kink inside [theta - h, theta + h]
        continue;
      }
      EXPECT_NEAR(analytic[t][i], numeric, 2e-3 * (1.0 + std::fabs(numeric)))
          << model.describe() << " " << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 5u);
  EXPECT_LE(skipped * 5, checked) << "too many kinks to trust the check";
}

TEST(Gradients, LinearRegressionMatchesFiniteDifferences) {
  const Dataset data = Dataset::synthetic({.samples = 64, .features = 5, .classes = 0, .seed = 3});
  auto model = make_linear_regression(5);
  model->initialize(11);
  check_gradients(*model, data, 16);
}

TEST(Gradients, SoftmaxClassifierMatchesFiniteDifferences) {
  const Dataset data = Dataset::synthetic({.samples = 64, .features = 6, .classes = 4, .seed = 4});
  auto model = make_softmax_classifier(6, 4);
  model->initialize(12);
  check_gradients(*model, data, 16);
}

TEST(Gradients, MlpMatchesFiniteDifferences) {
  const Dataset data = Dataset::synthetic(
      {.samples = 64, .features = 7, .classes = 3, .noise = 0.5, .separation = 1.0, .seed = 5});
  auto model = make_mlp(7, {9, 5}, 3);
  model->initialize(13);
  check_gradients(*model, data, 13);
}

TEST(Gradients, ScaleMultipliesAndEmptyBatchGivesZero) {
  const Dataset data = Dataset::synthetic({.samples = 32, .features = 4, .classes = 3});
  auto model = make_mlp(4, {6}, 3);
  model->forward_backward(data.rows(0, 8), 1.0f);
  const std::vector<float> g1 = model->parameters()[0].grad;
  model->forward_backward(data.rows(0, 8), 0.25f);
  for (std::size_t i = 0; i < g1.size(); ++i)
    EXPECT_FLOAT_EQ(model->parameters()[0].grad[i], g1[i] * 0.25f);
  const LossSums s = model->forward_backward(data.rows(0, 0), 1.0f);
  EXPECT_EQ(s.loss, 0.0);
  for (const Parameter& p : model->parameters())
    for (float g : p.grad)
      EXPECT_EQ(g, 0.0f);
}

TEST(Models, RejectBadBatchesWithAClearMessage) {
  auto model = make_mlp(4, {6}, 3);
  const Dataset wide = Dataset::synthetic({.samples = 8, .features = 5, .classes = 3});
  try {
    model->forward_backward(wide.rows(0, 4), 1.0f);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("5 features per sample, the model takes 4"));
  }
  std::vector<float> x(4, 0.0f), y = {3.0f};
  try {
    model->forward_backward(Batch{x.data(), y.data(), 1, 4}, 1.0f);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("label 3"));
    EXPECT_THAT(e.what(), HasSubstr("[0, 3)"));
  }
  EXPECT_THROW(make_mlp(4, {0}, 3), InvalidArgument);
  EXPECT_THROW(make_softmax_classifier(4, 1), InvalidArgument);
}

TEST(Models, PredictGivesClassesAndValues) {
  const Dataset data = Dataset::synthetic({.samples = 16, .features = 4, .classes = 3});
  auto model = make_mlp(4, {6}, 3);
  std::vector<float> out(16);
  model->predict(data.rows(0, 16), out);
  for (float v : out)
    EXPECT_TRUE(v == 0.0f || v == 1.0f || v == 2.0f);
  auto linear = make_linear_regression(4);
  for (float& w : linear->parameters()[0].value)
    w = 1.0f;
  linear->parameters()[1].value[0] = 0.5f;
  std::vector<float> x = {1, 2, 3, 4}, y = {0};
  std::vector<float> one(1);
  linear->predict(Batch{x.data(), y.data(), 1, 4}, one);
  EXPECT_FLOAT_EQ(one[0], 10.5f);
  EXPECT_EQ(model->describe(), "mlp 4-6-3");
  EXPECT_EQ(model->parameter_count(), 4u * 6 + 6 + 6 * 3 + 3);
}

// --- optimizers ------------------------------------------------------------------------------

std::vector<Parameter> one_parameter(std::vector<float> value, std::vector<float> grad) {
  std::vector<Parameter> p(1);
  p[0].name = "w";
  p[0].shape = {value.size()};
  p[0].value = std::move(value);
  p[0].grad = std::move(grad);
  return p;
}

TEST(Optimizers, SgdMomentumAndAdamFollowTheirFormulas) {
  {
    auto p = one_parameter({1.0f, -2.0f}, {0.5f, 0.25f});
    Optimizer sgd({.kind = OptimizerKind::sgd, .weight_decay = 0.1f}, p);
    sgd.step(p, 0.1f);
    EXPECT_FLOAT_EQ(p[0].value[0], 1.0f - 0.1f * (0.5f + 0.1f * 1.0f));
    EXPECT_FLOAT_EQ(p[0].value[1], -2.0f - 0.1f * (0.25f - 0.1f * 2.0f));
    EXPECT_TRUE(sgd.state().empty());
  }
  {
    auto p = one_parameter({1.0f}, {0.5f});
    Optimizer m({.kind = OptimizerKind::momentum, .momentum = 0.9f}, p);
    m.step(p, 0.1f);  // buf = 0.5
    m.step(p, 0.1f);  // buf = 0.95
    EXPECT_FLOAT_EQ(p[0].value[0], 1.0f - 0.1f * 0.5f - 0.1f * 0.95f);
    EXPECT_FLOAT_EQ(m.state()[0][0], 0.95f);
    auto q = one_parameter({1.0f}, {0.5f});
    Optimizer nesterov({.kind = OptimizerKind::momentum, .momentum = 0.9f, .nesterov = true}, q);
    nesterov.step(q, 0.1f);  // buf = 0.5, step along 0.5 + 0.9 * 0.5
    EXPECT_FLOAT_EQ(q[0].value[0], 1.0f - 0.1f * 0.95f);
  }
  {
    auto p = one_parameter({1.0f}, {0.5f});
    Optimizer adam({.kind = OptimizerKind::adam}, p);
    double w = 1.0, m = 0, v = 0;
    for (int t = 1; t <= 3; ++t) {
      p[0].grad[0] = 0.5f / static_cast<float>(t);
      const double g = p[0].grad[0];
      adam.step(p, 0.01f);
      m = 0.9 * m + 0.1 * g;
      v = 0.999 * v + 0.001 * g * g;
      w -= 0.01 * (m / (1 - std::pow(0.9, t))) / (std::sqrt(v / (1 - std::pow(0.999, t))) + 1e-8);
      EXPECT_NEAR(p[0].value[0], w, 1e-6) << "step " << t;
    }
    EXPECT_EQ(adam.steps(), 3u);
    EXPECT_EQ(adam.state().size(), 2u);
  }
  std::vector<Parameter> none;
  EXPECT_THROW(Optimizer({.kind = OptimizerKind::momentum, .momentum = 1.0f}, none),
               InvalidArgument);
  EXPECT_EQ(parse_optimizer_kind("adam"), OptimizerKind::adam);
  EXPECT_FALSE(parse_optimizer_kind("rmsprop"));
}

TEST(LearningRate, WarmupScalingAndCosine) {
  LearningRateSchedule s{.lr = 0.1, .warmup_steps = 4};
  EXPECT_DOUBLE_EQ(s.at(0, 256), 0.025);
  EXPECT_DOUBLE_EQ(s.at(2, 256), 0.025 + 0.075 * 0.5);
  EXPECT_DOUBLE_EQ(s.at(4, 256), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1000, 256), 0.1);
  // Goyal et al.: k = 8 times the base batch, warm-up from the base rate to 8x.
  LearningRateSchedule g{
      .lr = 0.1, .warmup_steps = 10, .scale_with_batch = true, .base_batch = 256};
  EXPECT_DOUBLE_EQ(g.at(0, 2048), 0.1);
  EXPECT_DOUBLE_EQ(g.at(10, 2048), 0.8);
  EXPECT_NEAR(g.at(5, 2048), 0.45, 1e-12);
  LearningRateSchedule c{.lr = 1.0, .cosine = true, .total_steps = 100};
  EXPECT_DOUBLE_EQ(c.at(0, 1), 1.0);
  EXPECT_NEAR(c.at(50, 1), 0.5, 1e-12);
  EXPECT_NEAR(c.at(100, 1), 0.0, 1e-12);
  EXPECT_THROW((LearningRateSchedule{.lr = 0}.validate()), InvalidArgument);
  EXPECT_THROW((LearningRateSchedule{.lr = 1, .cosine = true}.validate()), InvalidArgument);
}

// --- data ------------------------------------------------------------------------------------

TEST(Data, SyntheticSetIsDeterministicPerSeed) {
  const Dataset a = Dataset::synthetic({.samples = 100, .features = 3, .classes = 4, .seed = 9});
  const Dataset b = Dataset::synthetic({.samples = 100, .features = 3, .classes = 4, .seed = 9});
  const Dataset c = Dataset::synthetic({.samples = 100, .features = 3, .classes = 4, .seed = 10});
  EXPECT_EQ(a.features(), b.features());
  EXPECT_EQ(a.labels(), b.labels());
  EXPECT_NE(a.features(), c.features());
  EXPECT_EQ(a.rows(), 100u);
  EXPECT_EQ(a.classes(), 4u);
  for (float y : a.labels())
    EXPECT_TRUE(y >= 0 && y < 4 && y == std::floor(y));
  const Dataset tail = a.slice(90, 10);
  EXPECT_EQ(tail.rows(), 10u);
  EXPECT_EQ(tail.labels()[0], a.labels()[90]);
  EXPECT_THROW(a.rows(95, 10), InvalidArgument);
}

TEST(Data, CsvLoaderReadsAndRejectsWithLineNumbers) {
  const auto dir = temp_dir("csv");
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  const Dataset d =
      Dataset::load_csv(write("ok.csv", "label,a,b\n1,0.5,2\n0, -1 ,3e0\n\n2,4,5\r\n"));
  EXPECT_EQ(d.rows(), 3u);
  EXPECT_EQ(d.dim(), 2u);
  EXPECT_EQ(d.classes(), 3u);
  EXPECT_EQ(d.features(), (std::vector<float>{0.5f, 2, -1, 3, 4, 5}));
  const Dataset r = Dataset::load_csv(write("reg.csv", "0.25,1\n-3.5,2\n"), 0);
  EXPECT_EQ(r.classes(), 0u);
  EXPECT_EQ(r.labels(), (std::vector<float>{0.25f, -3.5f}));
  auto expect_error = [&](const std::string& path, long classes, const std::string& text) {
    try {
      Dataset::load_csv(path, classes);
      ADD_FAILURE() << "no error for " << path;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr(text)) << path;
    }
  };
  expect_error(write("ragged.csv", "1,2,3\n0,1\n"), -1,
               "line 2 has 1 features, earlier lines have 2");
  expect_error(write("nan.csv", "1,2,3\n0,x,1\n"), -1, "line 2, field 2: not a finite number");
  expect_error(write("frac.csv", "1.5,2\n"), -1, "not a class index");
  expect_error(write("range.csv", "7,2\n"), 3, "outside [0, 3)");
  expect_error(write("empty.csv", "\n"), -1, "no data rows");
  expect_error((dir / "missing.csv").string(), -1, "cannot open");
  std::filesystem::remove_all(dir);
}

// --- checkpoints -----------------------------------------------------------------------------

CheckpointState sample_state() {
  CheckpointState s;
  s.model = "mlp 4-6-3";
  s.parameters = {{"layer0.weight", {4, 6}, std::vector<float>(24, 1.5f)},
                  {"layer0.bias", {6}, std::vector<float>(6, -2.0f)}};
  s.optimizer = "adam";
  s.optimizer_steps = 17;
  s.optimizer_state = {std::vector<float>(24, 0.1f), std::vector<float>(6, 0.2f)};
  s.step = 17;
  s.global_batch = 64;
  s.data_rows = 1000;
  s.data_seed = 5;
  s.auto_decisions = R"({"version": 1, "ranks": 2, "groups": 1, "rows": []})";
  return s;
}

// Recomputes the trailing checksum (64-bit FNV-1a of everything before it) after an edit.
void reseal(std::vector<std::byte>& bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i + 8 < bytes.size(); ++i)
    h = (h ^ static_cast<std::uint64_t>(bytes[i])) * 1099511628211ull;
  std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
}

std::string decode_error(const std::vector<std::byte>& bytes) {
  try {
    decode_checkpoint(bytes, "test.bin");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(Checkpoint, RoundTripsThroughAFile) {
  const auto dir = temp_dir("ckpt");
  const std::string path = (dir / "sub" / "checkpoint.bin").string();
  write_file_atomically(path, encode_checkpoint(sample_state()));
  const CheckpointState s = decode_checkpoint(read_file(path), path);
  EXPECT_EQ(s.model, "mlp 4-6-3");
  ASSERT_EQ(s.parameters.size(), 2u);
  EXPECT_EQ(s.parameters[0].shape, (std::vector<std::uint64_t>{4, 6}));
  EXPECT_EQ(s.parameters[1].values, std::vector<float>(6, -2.0f));
  EXPECT_EQ(s.optimizer_state[1], std::vector<float>(6, 0.2f));
  EXPECT_EQ(s.step, 17u);
  EXPECT_EQ(s.global_batch, 64u);
  EXPECT_EQ(s.data_rows, 1000u);
  EXPECT_EQ(s.data_seed, 5u);
  // Nothing but the checkpoint is left in the directory (the temporary file was renamed).
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir / "sub"))
    ++files;
  EXPECT_EQ(files, 1u);
  std::filesystem::remove_all(dir);
}

// Version 2 adds auto's decisions at the end; a version-1 file (without them) still reads.
TEST(Checkpoint, AutoDecisionsRoundTripAndVersionOneStillReads) {
  const CheckpointState s = sample_state();
  const CheckpointState back = decode_checkpoint(encode_checkpoint(s), "v2");
  EXPECT_EQ(back.auto_decisions, s.auto_decisions);
  EXPECT_EQ(back.step, s.step);
  CheckpointState plain = s;
  plain.auto_decisions.clear();
  std::vector<std::byte> v1 = encode_checkpoint(plain);
  // Drop the empty string (its u64 length) before the checksum, then mark the file version 1.
  v1.erase(v1.end() - 16, v1.end() - 8);
  std::uint32_t one = 1;
  std::memcpy(v1.data() + 8, &one, sizeof one);
  std::uint64_t payload = 0;
  std::memcpy(&payload, v1.data() + 16, sizeof payload);
  payload -= 8;
  std::memcpy(v1.data() + 16, &payload, sizeof payload);
  reseal(v1);
  const CheckpointState old = decode_checkpoint(v1, "v1");
  EXPECT_TRUE(old.auto_decisions.empty());
  EXPECT_EQ(old.data_seed, s.data_seed);
  EXPECT_EQ(old.parameters[1].values, s.parameters[1].values);
}

TEST(Checkpoint, ASuccessfulWriteRemovesTemporariesOfDeadWritersOnThisHost) {
  const auto dir = temp_dir("ckpt_stale");
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  // A writer that died mid-write: a child process that has exited and been reaped.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const std::string prefix = std::string("checkpoint.bin.tmp.") + host + ".";
  const auto dead = dir / (prefix + std::to_string(child));
  const auto alive = dir / (prefix + std::to_string(::getppid()));  // a live process
  const auto other_host = dir / ("checkpoint.bin.tmp.some-other-host." + std::to_string(child));
  const auto other_file =
      dir / ("other.bin.tmp." + std::string(host) + "." + std::to_string(child));
  for (const auto& p : {dead, alive, other_host, other_file})
    std::ofstream(p) << "partial";
  write_file_atomically((dir / "checkpoint.bin").string(), encode_checkpoint(sample_state()));
  EXPECT_FALSE(std::filesystem::exists(dead)) << "the dead writer's temporary file was kept";
  EXPECT_TRUE(std::filesystem::exists(alive)) << "a live writer's temporary file was removed";
  EXPECT_TRUE(std::filesystem::exists(other_host)) << "another host's temporary file was removed";
  EXPECT_TRUE(std::filesystem::exists(other_file));
  EXPECT_EQ(decode_checkpoint(read_file((dir / "checkpoint.bin").string()), "x").step, 17u);
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, AFailedWriteNamesThePathAndLeavesNothingBehind) {
  const auto dir = temp_dir("ckpt_fail");
  std::ofstream(dir / "plain_file") << "x";
  const std::string under_a_file = (dir / "plain_file" / "checkpoint.bin").string();
  try {
    write_file_atomically(under_a_file, encode_checkpoint(sample_state()));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("write checkpoint " + under_a_file));
  }
  // A directory where the file should go: the rename fails and the temporary file is removed.
  std::filesystem::create_directories(dir / "taken" / "checkpoint.bin" / "inside");
  const std::string taken = (dir / "taken" / "checkpoint.bin").string();
  EXPECT_THROW(write_file_atomically(taken, encode_checkpoint(sample_state())), Error);
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir / "taken"))
    ++files;
  EXPECT_EQ(files, 1u) << "the temporary file was left behind";
  std::filesystem::remove_all(dir);
}

TEST(Checkpoint, RejectsTruncatedCorruptForeignAndNewerFiles) {
  const std::vector<std::byte> good = encode_checkpoint(sample_state());
  EXPECT_EQ(decode_error(good), "no error");
  for (std::size_t keep : {std::size_t{0}, std::size_t{10}, std::size_t{40}, good.size() - 1}) {
    std::vector<std::byte> cut(good.begin(), good.begin() + static_cast<long>(keep));
    EXPECT_THAT(decode_error(cut), HasSubstr("truncated")) << keep;
  }
  for (std::size_t at : {std::size_t{30}, good.size() / 2, good.size() - 9}) {
    std::vector<std::byte> flipped = good;
    flipped[at] ^= std::byte{0x10};
    EXPECT_THAT(decode_error(flipped), HasSubstr("checksum mismatch")) << at;
  }
  std::vector<std::byte> foreign = good;
  std::memcpy(foreign.data(), "PK\x03\x04", 4);
  EXPECT_THAT(decode_error(foreign), HasSubstr("not a gradcomm checkpoint"));
  std::vector<std::byte> newer = good;
  newer[8] = std::byte{3};
  EXPECT_THAT(decode_error(newer), HasSubstr("format version 3; this build reads versions 1 to 2"));
  // A length field that runs past the end (with a valid checksum) is caught, not trusted.
  CheckpointState odd = sample_state();
  odd.model = std::string(3, 'x');
  std::vector<std::byte> bad = encode_checkpoint(odd);
  const std::uint64_t huge = ~std::uint64_t{0} / 2;
  std::memcpy(bad.data() + 24, &huge, 8);
  reseal(bad);
  EXPECT_THAT(decode_error(bad), HasSubstr("runs past the end"));
  // The reserved header word must be 0, as gradcomm writes it.
  std::vector<std::byte> reserved = good;
  reserved[12] = std::byte{1};
  reseal(reserved);
  EXPECT_THAT(decode_error(reserved), HasSubstr("reserved header field is 1"));
  // A tensor whose shape disagrees with its value count (checksum intact) is rejected.
  CheckpointState mismatched = sample_state();
  mismatched.parameters[0].shape = {5, 6};
  EXPECT_THAT(decode_error(encode_checkpoint(mismatched)),
              HasSubstr("tensor 'layer0.weight': its shape holds 30 values, the file has 24"));
  mismatched.parameters[0].shape = {1ull << 40, 1ull << 40};
  EXPECT_THAT(decode_error(encode_checkpoint(mismatched)), HasSubstr("more than 2^64"));
  mismatched.parameters[0].shape = {1ull << 40, 1ull << 40, 0};  // a zero dimension: no values
  mismatched.parameters[0].values.clear();
  mismatched.optimizer_state[0].clear();
  EXPECT_EQ(decode_error(encode_checkpoint(mismatched)), "no error");
  EXPECT_THAT(decode_error(good), HasSubstr("no error"));
}

}  // namespace
}  // namespace gradcomm::trainer
