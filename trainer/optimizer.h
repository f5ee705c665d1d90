#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/model.h"

namespace gradcomm::trainer {

enum class OptimizerKind { sgd, momentum, adam };
std::string_view to_string(OptimizerKind kind);
std::optional<OptimizerKind> parse_optimizer_kind(std::string_view name);

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::sgd;
  float momentum = 0.9f;      // momentum: buffer = momentum * buffer + grad
  bool nesterov = false;      // momentum: step along grad + momentum * buffer
  float beta1 = 0.9f;         // adam
  float beta2 = 0.999f;       // adam
  float epsilon = 1e-8f;      // adam
  float weight_decay = 0.0f;  // L2: grad += weight_decay * parameter, before the update
};

// SGD, SGD with momentum (PyTorch's form, optionally Nesterov) and Adam (Kingma & Ba, with bias
// correction). The update of each element depends only on that element, in a fixed order, so
// replicas given the same gradients stay bit-identical.
class Optimizer {
 public:
  // Allocates the state (zeros) shaped like `parameters`.
  Optimizer(OptimizerOptions options, std::span<const Parameter> parameters);

  const OptimizerOptions& options() const { return options_; }
  // "sgd", "momentum" or "adam".
  std::string_view name() const { return to_string(options_.kind); }

  // parameter -= update(parameter.grad) with learning rate `lr`; counts one step.
  void step(std::span<Parameter> parameters, float lr);

  // The state tensors in a fixed order (momentum: one buffer per parameter; adam: the first
  // moments of every parameter, then the second moments), for broadcast, averaging and
  // checkpoints. Empty for sgd.
  std::vector<std::span<float>> state();
  std::vector<std::span<const float>> state() const;
  // Steps taken (Adam's bias correction depends on it).
  std::uint64_t steps() const { return steps_; }
  void set_steps(std::uint64_t steps) { steps_ = steps; }

 private:
  OptimizerOptions options_;
  std::vector<std::vector<float>> first_;   // momentum buffers / Adam's m
  std::vector<std::vector<float>> second_;  // Adam's v
  std::uint64_t steps_ = 0;
};

// The learning rate at each step: an optional linear warm-up, then constant or cosine decay.
// With scale_with_batch, the rate is lr * global_batch / base_batch (Goyal et al. 2017: "when
// the minibatch size is multiplied by k, multiply the learning rate by k"), and warm-up starts
// from the unscaled lr as in that paper; without it, warm-up starts at lr / warmup_steps.
struct LearningRateSchedule {
  double lr = 0.1;
  std::uint64_t warmup_steps = 0;
  bool scale_with_batch = false;
  std::uint64_t base_batch = 256;
  bool cosine = false;            // cosine decay to 0 over the steps after warm-up
  std::uint64_t total_steps = 0;  // for cosine decay

  // Throws InvalidArgument naming the field for a non-positive lr or base_batch, or cosine
  // decay without total_steps.
  void validate() const;
  double at(std::uint64_t step, std::uint64_t global_batch) const;
};

}  // namespace gradcomm::trainer
