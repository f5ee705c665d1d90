#include "trainer/optimizer.h"

#include <cmath>
#include <string>

#include "core/error.h"

namespace gradcomm::trainer {

std::string_view to_string(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::sgd:
      return "sgd";
    case OptimizerKind::momentum:
      return "momentum";
    case OptimizerKind::adam:
      return "adam";
  }
  return "invalid";
}

std::optional<OptimizerKind> parse_optimizer_kind(std::string_view name) {
  for (OptimizerKind k : {OptimizerKind::sgd, OptimizerKind::momentum, OptimizerKind::adam}) {
    if (name == to_string(k)) return k;
  }
  return std::nullopt;
}

Optimizer::Optimizer(OptimizerOptions options, std::span<const Parameter> parameters)
    : options_(options) {
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message("Optimizer(" + std::string(name()) + ")", -1, detail));
  };
  if (!(options_.momentum >= 0.0f && options_.momentum < 1.0f))
    invalid("momentum must be in [0, 1)");
  if (!(options_.beta1 >= 0.0f && options_.beta1 < 1.0f)) invalid("beta1 must be in [0, 1)");
  if (!(options_.beta2 >= 0.0f && options_.beta2 < 1.0f)) invalid("beta2 must be in [0, 1)");
  if (!(options_.epsilon > 0.0f)) invalid("epsilon must be positive");
  if (!(options_.weight_decay >= 0.0f)) invalid("weight_decay must be non-negative");
  if (options_.kind == OptimizerKind::sgd) return;
  for (const Parameter& p : parameters) {
    first_.emplace_back(p.size(), 0.0f);
    if (options_.kind == OptimizerKind::adam) second_.emplace_back(p.size(), 0.0f);
  }
}

void Optimizer::step(std::span<Parameter> parameters, float lr) {
  if (options_.kind != OptimizerKind::sgd && parameters.size() != first_.size()) {
    throw InvalidArgument(error_message("Optimizer::step", -1,
                                        "built for " + std::to_string(first_.size()) +
                                            " parameters, given " +
                                            std::to_string(parameters.size())));
  }
  ++steps_;
  const float wd = options_.weight_decay;
  for (std::size_t t = 0; t < parameters.size(); ++t) {
    float* w = parameters[t].value.data();
    const float* g = parameters[t].grad.data();
    const std::size_t n = parameters[t].size();
    switch (options_.kind) {
      case OptimizerKind::sgd:
        for (std::size_t i = 0; i < n; ++i)
          w[i] -= lr * (g[i] + wd * w[i]);
        break;
      case OptimizerKind::momentum: {
        float* buf = first_[t].data();
        const float mu = options_.momentum;
        for (std::size_t i = 0; i < n; ++i) {
          const float gi = g[i] + wd * w[i];
          buf[i] = mu * buf[i] + gi;
          w[i] -= lr * (options_.nesterov ? gi + mu * buf[i] : buf[i]);
        }
        break;
      }
      case OptimizerKind::adam: {
        float* m = first_[t].data();
        float* v = second_[t].data();
        const float b1 = options_.beta1, b2 = options_.beta2, eps = options_.epsilon;
        const auto k = static_cast<double>(steps_);
        const auto c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), k)));
        const auto c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), k)));
        for (std::size_t i = 0; i < n; ++i) {
          const float gi = g[i] + wd * w[i];
          m[i] = b1 * m[i] + (1.0f - b1) * gi;
          v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
          w[i] -= lr * (m[i] * c1) / (std::sqrt(v[i] * c2) + eps);
        }
        break;
      }
    }
  }
}

std::vector<std::span<float>> Optimizer::state() {
  std::vector<std::span<float>> out;
  for (auto& s : first_)
    out.emplace_back(s);
  for (auto& s : second_)
    out.emplace_back(s);
  return out;
}

std::vector<std::span<const float>> Optimizer::state() const {
  std::vector<std::span<const float>> out;
  for (const auto& s : first_)
    out.emplace_back(s);
  for (const auto& s : second_)
    out.emplace_back(s);
  return out;
}

void LearningRateSchedule::validate() const {
  auto invalid = [](const std::string& detail) {
    throw InvalidArgument(error_message("LearningRateSchedule", -1, detail));
  };
  if (!(lr > 0.0) || !std::isfinite(lr)) invalid("lr must be positive, got " + std::to_string(lr));
  if (scale_with_batch && base_batch == 0) invalid("base_batch must be positive");
  if (cosine && total_steps <= warmup_steps) {
    invalid("cosine decay needs total_steps (" + std::to_string(total_steps) +
            ") greater than warmup_steps (" + std::to_string(warmup_steps) + ")");
  }
}

double LearningRateSchedule::at(std::uint64_t step, std::uint64_t global_batch) const {
  const double target =
      scale_with_batch ? lr * static_cast<double>(global_batch) / static_cast<double>(base_batch)
                       : lr;
  if (step < warmup_steps) {
    const double start = scale_with_batch ? lr : lr / static_cast<double>(warmup_steps);
    return start + (target - start) * static_cast<double>(step) / static_cast<double>(warmup_steps);
  }
  if (!cosine) return target;
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) /
                                            static_cast<double>(total_steps - warmup_steps));
  return 0.5 * target * (1.0 + std::cos(3.141592653589793 * progress));
}

}  // namespace gradcomm::trainer
