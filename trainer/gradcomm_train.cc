// gradcomm-train: data-parallel training on N ranks (mpirun -np N gradcomm-train [options]).
// --batch is the global batch, split across the ranks, so the same command trains the same
// model at any rank count. Rank 0 prints progress and a summary; --json writes the history.

#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/broadcast.h"
#include "collectives/registry.h"
#include "core/communicator.h"
#include "core/error.h"
#include "trainer/data_parallel_trainer.h"

namespace {

using namespace gradcomm;
using namespace gradcomm::trainer;

const char* const kUsage =
    "usage: mpirun -np N gradcomm-train [options]\n"
    "model:\n"
    "  --model mlp|softmax|linear  (default mlp)\n"
    "  --hidden W1,W2,...          MLP hidden widths (default 128,128)\n"
    "data:\n"
    "  --data synthetic|FILE.csv   embedded synthetic set (default) or CSV lines label,f1,f2,...\n"
    "  --samples N --features D --classes C --noise X\n"
    "                              synthetic set: rows, width, classes (0: regression; default\n"
    "                              16384, 32, 10, 2.0; linear regression defaults to 0 classes)\n"
    "  --validation F              hold out the last fraction F of the rows (default 0.1)\n"
    "training:\n"
    "  --batch B                   global batch, split across ranks (default 240: divides by\n"
    "                              1-6 and 8 ranks)\n"
    "  --steps S | --epochs E      length (default 500 steps)\n"
    "  --shard strict|drop|uneven  batch not divisible by N: error (default), drop the\n"
    "                              remainder, or uneven shards with weighted averaging\n"
    "  --optimizer sgd|momentum|adam  (default momentum)\n"
    "  --lr X                      learning rate (default 0.05; adam 0.001)\n"
    "  --momentum X --nesterov --weight-decay X\n"
    "  --warmup-steps K            linear warm-up (default 0)\n"
    "  --lr-scaling none|linear    linear: lr x batch / --base-batch (Goyal et al. 2017)\n"
    "  --base-batch B              (default 256)\n"
    "  --cosine                    cosine decay to 0 over the run\n"
    "communication:\n"
    "  --algorithm NAME            all-reduce algorithm (default GRADCOMM_ALGORITHM / auto)\n"
    "  --fusion-threshold BYTES    gradient bucket size (default 25 MiB, the first 1 MiB)\n"
    "  --overlap on|off            all-reduce each bucket while backward goes on (default on)\n"
    "  --compression none|float16|bfloat16  gradients on the wire (default none)\n"
    "  --reduction average|sum     gradient reduction (default average)\n"
    "  --loss-reduction mean|sum   reported loss (default mean)\n"
    "  --averaging gradients|model gradient all-reduce every step (default) or model averaging\n"
    "  --interval K                model averaging: steps between averagings (default 1)\n"
    "  --verify-every K            check replicas are bit-identical every K steps (default 0)\n"
    "checkpoints:\n"
    "  --checkpoint-dir DIR --checkpoint-every K\n"
    "  --resume                    continue from DIR/checkpoint.bin when it exists\n"
    "other:\n"
    "  --seed S                    seed of data, initial weights and shuffling (default 1)\n"
    "  --log-every K               progress line every K steps (default: about 10 lines)\n"
    "  --json FILE                 write {\"history\": [...per step...], \"summary\": {...}}\n";

[[noreturn]] void usage_error(const std::string& message) {
  throw InvalidArgument("gradcomm-train: " + message + "\n" + kUsage);
}

double parse_double(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !std::isfinite(v)) {
    usage_error(flag + ": bad number '" + text + "'");
  }
  return v;
}

std::uint64_t parse_count(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  double scale = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k")
    scale = 1 << 10;
  else if (suffix == "M" || suffix == "m")
    scale = 1 << 20;
  else if (!suffix.empty())
    usage_error(flag + ": bad count '" + text + "'");
  if (end == text.c_str() || v < 0 || v != std::floor(v) || v * scale > 1e18) {
    usage_error(flag + ": bad count '" + text + "'");
  }
  return static_cast<std::uint64_t>(v * scale);
}

struct Options {
  std::string model = "mlp";
  std::vector<std::size_t> hidden = {128, 128};
  std::string data = "synthetic";
  SyntheticOptions synthetic;
  bool classes_given = false;
  std::uint64_t steps = 500;
  double validation = 0.1;
  std::uint64_t epochs = 0;
  OptimizerOptions optimizer{OptimizerKind::momentum};
  bool lr_given = false;
  TrainerOptions trainer;
  bool resume = false;
  std::uint64_t seed = 1;
  std::uint64_t log_every = 0;
  std::string json;
};

// nullopt: --help was printed.
std::optional<Options> parse(int argc, char** argv, int rank) {
  Options o;
  o.trainer.global_batch = 240;
  o.trainer.lr.lr = 0.05;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string inline_value;
    bool has_inline = false;
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline = true;
    }
    auto value = [&]() -> std::string {
      if (has_inline) return inline_value;
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "-h" || flag == "--help") {
      if (rank == 0) std::fputs(kUsage, stdout);
      return std::nullopt;
    } else if (flag == "--model") {
      o.model = value();
      if (o.model != "mlp" && o.model != "softmax" && o.model != "linear") {
        usage_error("--model: unknown model '" + o.model + "' (mlp, softmax, linear)");
      }
    } else if (flag == "--hidden") {
      o.hidden.clear();
      std::stringstream s(value());
      for (std::string part; std::getline(s, part, ',');) {
        const std::uint64_t w = parse_count(flag, part);
        if (w == 0) usage_error("--hidden: widths must be positive");
        o.hidden.push_back(w);
      }
    } else if (flag == "--data") {
      o.data = value();
    } else if (flag == "--samples") {
      o.synthetic.samples = parse_count(flag, value());
    } else if (flag == "--features") {
      o.synthetic.features = parse_count(flag, value());
    } else if (flag == "--classes") {
      o.synthetic.classes = parse_count(flag, value());
      o.classes_given = true;
    } else if (flag == "--noise") {
      o.synthetic.noise = parse_double(flag, value());
    } else if (flag == "--validation") {
      o.validation = parse_double(flag, value());
      if (!(o.validation >= 0 && o.validation < 1)) usage_error("--validation must be in [0, 1)");
    } else if (flag == "--batch") {
      o.trainer.global_batch = parse_count(flag, value());
    } else if (flag == "--steps") {
      o.steps = parse_count(flag, value());
    } else if (flag == "--epochs") {
      o.epochs = parse_count(flag, value());
    } else if (flag == "--shard") {
      const std::string v = value();
      if (v == "strict")
        o.trainer.shard_policy = ShardPolicy::strict;
      else if (v == "drop")
        o.trainer.shard_policy = ShardPolicy::drop_remainder;
      else if (v == "uneven")
        o.trainer.shard_policy = ShardPolicy::uneven;
      else
        usage_error("--shard: '" + v + "' (strict, drop, uneven)");
    } else if (flag == "--optimizer") {
      const std::string v = value();
      const auto kind = parse_optimizer_kind(v);
      if (!kind) usage_error("--optimizer: unknown optimizer '" + v + "' (sgd, momentum, adam)");
      o.optimizer.kind = *kind;
    } else if (flag == "--lr") {
      o.trainer.lr.lr = parse_double(flag, value());
      o.lr_given = true;
    } else if (flag == "--momentum") {
      o.optimizer.momentum = static_cast<float>(parse_double(flag, value()));
    } else if (flag == "--nesterov") {
      o.optimizer.nesterov = true;
    } else if (flag == "--weight-decay") {
      o.optimizer.weight_decay = static_cast<float>(parse_double(flag, value()));
    } else if (flag == "--warmup-steps") {
      o.trainer.lr.warmup_steps = parse_count(flag, value());
    } else if (flag == "--lr-scaling") {
      const std::string v = value();
      if (v != "none" && v != "linear") usage_error("--lr-scaling: '" + v + "' (none, linear)");
      o.trainer.lr.scale_with_batch = v == "linear";
    } else if (flag == "--base-batch") {
      o.trainer.lr.base_batch = parse_count(flag, value());
    } else if (flag == "--cosine") {
      o.trainer.lr.cosine = true;
    } else if (flag == "--algorithm") {
      o.trainer.algorithm = value();
      if (!collectives::is_algorithm_name(o.trainer.algorithm)) {
        usage_error("--algorithm: unknown algorithm '" + o.trainer.algorithm +
                    "'; valid names: " + collectives::algorithm_names_joined());
      }
    } else if (flag == "--overlap") {
      const std::string v = value();
      if (v != "on" && v != "off") usage_error("--overlap: expected on or off, got '" + v + "'");
      o.trainer.overlap = v == "on";
    } else if (flag == "--fusion-threshold") {
      o.trainer.fusion_threshold = parse_count(flag, value());
    } else if (flag == "--compression") {
      const std::string v = value();
      if (v == "none")
        o.trainer.compression = Compression::none;
      else if (v == "float16")
        o.trainer.compression = Compression::float16;
      else if (v == "bfloat16")
        o.trainer.compression = Compression::bfloat16;
      else
        usage_error("--compression: '" + v + "' (none, float16, bfloat16)");
    } else if (flag == "--reduction") {
      const std::string v = value();
      if (v != "average" && v != "sum") usage_error("--reduction: '" + v + "' (average, sum)");
      o.trainer.gradient_reduction =
          v == "sum" ? GradientReduction::sum : GradientReduction::average;
    } else if (flag == "--loss-reduction") {
      const std::string v = value();
      if (v != "mean" && v != "sum") usage_error("--loss-reduction: '" + v + "' (mean, sum)");
      o.trainer.loss_reduction = v == "sum" ? LossReduction::sum : LossReduction::mean;
    } else if (flag == "--averaging") {
      const std::string v = value();
      if (v != "gradients" && v != "model")
        usage_error("--averaging: '" + v + "' (gradients, model)");
      o.trainer.mode = v == "model" ? SyncMode::model_averaging : SyncMode::gradients;
    } else if (flag == "--interval") {
      o.trainer.interval_steps = parse_count(flag, value());
    } else if (flag == "--verify-every") {
      o.trainer.verify_every = parse_count(flag, value());
    } else if (flag == "--checkpoint-dir") {
      o.trainer.checkpoint_dir = value();
    } else if (flag == "--checkpoint-every") {
      o.trainer.checkpoint_every = parse_count(flag, value());
    } else if (flag == "--resume") {
      o.resume = true;
    } else if (flag == "--seed") {
      o.seed = parse_count(flag, value());
    } else if (flag == "--log-every") {
      o.log_every = parse_count(flag, value());
    } else if (flag == "--json") {
      o.json = value();
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  if (o.model == "linear" && !o.classes_given) o.synthetic.classes = 0;
  if (o.optimizer.kind == OptimizerKind::adam && !o.lr_given) o.trainer.lr.lr = 0.001;
  if (o.resume && o.trainer.checkpoint_dir.empty()) usage_error("--resume needs --checkpoint-dir");
  if (o.trainer.checkpoint_every > 0 && o.trainer.checkpoint_dir.empty()) {
    usage_error("--checkpoint-every needs --checkpoint-dir");
  }
  o.synthetic.seed = o.seed;
  o.trainer.data_seed = o.seed;
  return o;
}

std::unique_ptr<Model> build_model(const Options& o, const Dataset& data) {
  if (o.model == "linear") {
    if (data.classes() != 0) usage_error("--model linear needs a regression set (--classes 0)");
    return make_linear_regression(data.dim());
  }
  if (data.classes() == 0) usage_error("--model " + o.model + " needs a classification set");
  if (o.model == "softmax") return make_softmax_classifier(data.dim(), data.classes());
  return make_mlp(data.dim(), o.hidden, data.classes());
}

std::string with_commas(std::uint64_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

int run(int argc, char** argv) {
  int world_rank = 0;
  gradcomm::check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "gradcomm-train: MPI_Comm_rank");
  const std::optional<Options> parsed = parse(argc, argv, world_rank);
  if (!parsed) return 0;
  Options o = *parsed;
  Communicator comm(MPI_COMM_WORLD);
  const bool root = comm.rank() == 0;

  const Dataset all = o.data == "synthetic"
                          ? Dataset::synthetic(o.synthetic)
                          : Dataset::load_csv(o.data, o.model == "linear" ? 0 : -1);
  const auto held_out = static_cast<std::size_t>(o.validation * static_cast<double>(all.rows()));
  const Dataset data = all.slice(0, all.rows() - held_out);
  const Dataset validation = all.slice(all.rows() - held_out, held_out);
  std::unique_ptr<Model> model = build_model(o, data);
  model->initialize(o.seed);
  Optimizer optimizer(o.optimizer, model->parameters());
  if (o.epochs > 0)
    o.steps = o.epochs * (data.rows() / std::max<std::size_t>(1, o.trainer.global_batch));
  if (o.trainer.lr.cosine) o.trainer.lr.total_steps = o.steps;
  DataParallelTrainer trainer(comm, *model, optimizer, o.trainer);

  if (o.resume) {
    std::int32_t exists = root && std::filesystem::exists(trainer.checkpoint_path()) ? 1 : 0;
    broadcast(comm, &exists, 1, DataType::int32, 0);
    if (exists) {
      trainer.load_checkpoint(trainer.checkpoint_path());
      if (root)
        std::printf("resumed from %s at step %llu\n", trainer.checkpoint_path().c_str(),
                    static_cast<unsigned long long>(trainer.steps_done()));
    } else if (root) {
      std::printf("no checkpoint at %s: starting at step 0\n", trainer.checkpoint_path().c_str());
    }
  }

  const std::size_t b = o.trainer.global_batch;
  const auto shard = trainer.shard(b);
  if (root) {
    std::printf("gradcomm-train: %d ranks, model %s (%s parameters), %s data %zu x %zu%s\n",
                comm.size(), model->describe().c_str(),
                with_commas(model->parameter_count()).c_str(),
                o.data == "synthetic" ? "synthetic" : o.data.c_str(), data.rows(), data.dim(),
                data.classes() ? (", " + std::to_string(data.classes()) + " classes").c_str()
                               : ", regression");
    std::printf(
        "  batch %zu (%zu per rank on rank 0), %llu steps, %s lr %g%s%s, %s, algorithm %s\n", b,
        shard.count, static_cast<unsigned long long>(o.steps),
        std::string(optimizer.name()).c_str(), o.trainer.lr.lr,
        o.trainer.lr.scale_with_batch ? " x batch/base" : "",
        o.trainer.lr.warmup_steps
            ? (", warm-up " + std::to_string(o.trainer.lr.warmup_steps)).c_str()
            : "",
        o.trainer.mode == SyncMode::gradients
            ? (o.trainer.overlap ? "gradient averaging overlapped with backward"
                                 : "gradient averaging after backward")
            : ("model averaging every " + std::to_string(o.trainer.interval_steps) + " steps")
                  .c_str(),
        o.trainer.algorithm.empty() ? comm.config().algorithm.c_str()
                                    : o.trainer.algorithm.c_str());
    std::fflush(stdout);
  }

  const std::uint64_t log_every =
      o.log_every ? o.log_every : std::max<std::uint64_t>(1, o.steps / 10);
  nlohmann::json history = nlohmann::json::array();
  // Exposed communication: step time minus compute (forward, backward, optimizer), i.e. the
  // time spent waiting for communication that backward did not hide.
  double interval_loss = 0, interval_acc = 0, interval_wall = 0, interval_comm = 0,
         interval_compute = 0, interval_exposed = 0;
  std::uint64_t interval_steps = 0, interval_samples = 0;
  double total_wall = 0, total_comm = 0, total_compute = 0, total_exposed = 0;
  std::uint64_t total_samples = 0;
  const std::uint64_t first_step = trainer.steps_done();
  while (trainer.steps_done() < o.steps) {
    const auto t0 = std::chrono::steady_clock::now();
    const StepStats st = trainer.step(data);
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double exposed = std::max(0.0, wall - st.compute_seconds - st.optimizer_seconds);
    interval_exposed += exposed;
    total_exposed += exposed;
    interval_loss += st.loss;
    interval_acc += st.accuracy;
    interval_wall += wall;
    interval_comm += st.allreduce_seconds;
    interval_compute += st.compute_seconds;
    interval_samples += st.samples;
    ++interval_steps;
    total_wall += wall;
    total_comm += st.allreduce_seconds;
    total_compute += st.compute_seconds;
    total_samples += st.samples;
    if (root && !o.json.empty()) {
      history.push_back({{"step", st.step},
                         {"loss", st.loss},
                         {"accuracy", st.accuracy},
                         {"lr", st.lr},
                         {"samples", st.samples},
                         {"seconds", wall},
                         {"compute_seconds", st.compute_seconds},
                         {"allreduce_seconds", st.allreduce_seconds},
                         {"optimizer_seconds", st.optimizer_seconds},
                         {"exposed_comm_seconds", exposed},
                         {"averaged", st.averaged}});
    }
    if (root && (st.step % log_every == 0 || st.step == o.steps)) {
      const double n = static_cast<double>(interval_steps);
      std::printf(
          "step %6llu  loss %.4f  accuracy %.3f  lr %.4g  %9.0f samples/s  "
          "exposed comm %4.1f%%  compute %4.1f%%  (%.2f ms/step)\n",
          static_cast<unsigned long long>(st.step), interval_loss / n, interval_acc / n, st.lr,
          static_cast<double>(interval_samples) / interval_wall,
          100.0 * interval_exposed / interval_wall, 100.0 * interval_compute / interval_wall,
          1e3 * interval_wall / n);
      std::fflush(stdout);
      interval_loss = interval_acc = interval_wall = interval_comm = interval_compute =
          interval_exposed = 0;
      interval_steps = interval_samples = 0;
    }
  }

  const Evaluation eval = trainer.evaluate(data);
  const Evaluation valid = trainer.evaluate(validation);
  const std::uint64_t hash = trainer.replica_hash();
  const std::uint64_t run_steps = trainer.steps_done() - first_step;
  if (root) {
    std::printf(
        "done: %llu steps in %.2f s, %.0f samples/s, exposed comm %.1f%% and compute %.1f%% "
        "of step time\n  training set: loss %.4f, accuracy %.4f (%zu samples); validation set: "
        "loss %.4f, accuracy %.4f (%zu samples); model hash %016llx\n",
        static_cast<unsigned long long>(run_steps), total_wall,
        total_wall > 0 ? static_cast<double>(total_samples) / total_wall : 0.0,
        total_wall > 0 ? 100.0 * total_exposed / total_wall : 0.0,
        total_wall > 0 ? 100.0 * total_compute / total_wall : 0.0, eval.loss, eval.accuracy,
        eval.samples, valid.loss, valid.accuracy, valid.samples,
        static_cast<unsigned long long>(hash));
    if (!o.json.empty()) {
      nlohmann::json out;
      out["history"] = std::move(history);
      out["summary"] = {{"ranks", comm.size()},
                        {"model", model->describe()},
                        {"parameters", model->parameter_count()},
                        {"steps", trainer.steps_done()},
                        {"steps_run", run_steps},
                        {"global_batch", b},
                        {"seconds", total_wall},
                        {"samples_per_second",
                         total_wall > 0 ? static_cast<double>(total_samples) / total_wall : 0.0},
                        {"overlap", o.trainer.overlap},
                        {"allreduce_share", total_wall > 0 ? total_comm / total_wall : 0.0},
                        {"exposed_comm_share", total_wall > 0 ? total_exposed / total_wall : 0.0},
                        {"compute_share", total_wall > 0 ? total_compute / total_wall : 0.0},
                        {"loss", eval.loss},
                        {"accuracy", eval.accuracy},
                        {"validation_loss", valid.loss},
                        {"validation_accuracy", valid.accuracy}};
      std::ofstream f(o.json);
      f << out.dump(1) << "\n";
      if (!f) throw InvalidArgument("gradcomm-train: cannot write --json file " + o.json);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);
  try {
    const int rc = run(argc, argv);
    gradcomm::finalize();
    return rc;
  } catch (const std::exception& e) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    // gradcomm's errors are raised on every rank alike; let rank 0 speak for them all, and the
    // others only when rank 0 did not fail (its abort would have ended them first).
    if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::fprintf(stderr, "%s%s\n", rank == 0 ? "" : ("rank " + std::to_string(rank) + ": ").c_str(),
                 e.what());
    std::fflush(stderr);
    if (size == 1) {
      gradcomm::finalize();
      return 2;
    }
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  }
}
