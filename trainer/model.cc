#include "trainer/model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/timeline.h"
#include "trainer/dense_kernels.h"
#include "trainer/random.h"

namespace gradcomm::trainer {

std::size_t Model::parameter_count() const {
  std::size_t n = 0;
  for (const Parameter& p : parameters_)
    n += p.size();
  return n;
}

DenseNetwork::DenseNetwork(std::string kind, std::size_t inputs, std::vector<std::size_t> hidden,
                           std::size_t outputs, Loss loss)
    : kind_(std::move(kind)), loss_(loss) {
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message("make_" + kind_, -1, detail));
  };
  if (inputs == 0) invalid("the input width must be positive");
  if (outputs == 0) invalid("the output width must be positive");
  if (loss == Loss::softmax_cross_entropy && outputs < 2) invalid("a classifier needs 2+ classes");
  widths_.push_back(inputs);
  for (std::size_t h : hidden) {
    if (h == 0) invalid("hidden layer widths must be positive");
    widths_.push_back(h);
  }
  widths_.push_back(outputs);
  for (std::size_t l = 0; l < layers(); ++l) {
    const std::size_t in = widths_[l], out = widths_[l + 1];
    const std::string suffix = std::to_string(l);
    parameters_.push_back({"layer" + suffix + ".weight",
                           {in, out},
                           std::vector<float>(in * out),
                           std::vector<float>(in * out)});
    parameters_.push_back(
        {"layer" + suffix + ".bias", {out}, std::vector<float>(out), std::vector<float>(out)});
  }
  z_.resize(layers());
  a_.resize(layers());
  initialize(0);
}

std::string DenseNetwork::describe() const {
  std::string s = kind_ + " ";
  for (std::size_t l = 0; l < widths_.size(); ++l) {
    if (l) s += "-";
    s += std::to_string(widths_[l]);
  }
  return s;
}

void DenseNetwork::initialize(std::uint64_t seed) {
  Random rng(seed ^ 0x6d6f64656c696e69ull);
  for (std::size_t l = 0; l < layers(); ++l) {
    const std::size_t in = widths_[l];
    // He et al. 2015 for layers feeding a ReLU; variance 1/in for the output layer.
    const double stddev = std::sqrt((l + 1 < layers() ? 2.0 : 1.0) / static_cast<double>(in));
    for (float& w : parameters_[2 * l].value)
      w = static_cast<float>(rng.normal() * stddev);
    std::fill(parameters_[2 * l + 1].value.begin(), parameters_[2 * l + 1].value.end(), 0.0f);
  }
}

void DenseNetwork::check_batch(const Batch& batch, const char* call) const {
  auto invalid = [&](const std::string& detail) {
    throw InvalidArgument(error_message(std::string(call) + "(" + describe() + ")", -1, detail));
  };
  if (batch.rows == 0) return;
  if (batch.dim != widths_.front()) {
    invalid("the batch has " + std::to_string(batch.dim) +
            " features per sample, the model takes " + std::to_string(widths_.front()));
  }
  if (!batch.features || !batch.labels) invalid("the batch has null features or labels");
  if (is_classifier()) {
    const auto classes = static_cast<float>(widths_.back());
    for (std::size_t i = 0; i < batch.rows; ++i) {
      const float y = batch.labels[i];
      if (!(y >= 0.0f && y < classes) || y != std::floor(y)) {
        invalid("label " + std::to_string(y) + " of row " + std::to_string(i) +
                " is not a class index in [0, " + std::to_string(widths_.back()) + ")");
      }
    }
  }
}

void DenseNetwork::forward(const Batch& batch) {
  const std::size_t m = batch.rows;
  const float* input = batch.features;
  for (std::size_t l = 0; l < layers(); ++l) {
    const std::size_t in = widths_[l], out = widths_[l + 1];
    std::vector<float>& z = z_[l];
    z.resize(m * out);
    const std::vector<float>& bias = parameters_[2 * l + 1].value;
    for (std::size_t i = 0; i < m; ++i)
      std::copy(bias.begin(), bias.end(), z.begin() + i * out);
    matmul_add(input, parameters_[2 * l].value.data(), z.data(), m, in, out);
    if (l + 1 < layers()) {
      std::vector<float>& a = a_[l];
      a.resize(m * out);
      for (std::size_t i = 0; i < m * out; ++i)
        a[i] = z[i] > 0.0f ? z[i] : 0.0f;
      input = a.data();
    }
  }
}

LossSums DenseNetwork::output_loss(const Batch& batch, float* d_out, float scale) const {
  const std::size_t out = widths_.back();
  const std::vector<float>& logits = z_.back();
  LossSums sums;
  for (std::size_t i = 0; i < batch.rows; ++i) {
    const float* zi = logits.data() + i * out;
    if (loss_ == Loss::squared_error) {
      const double diff = static_cast<double>(zi[0]) - batch.labels[i];
      sums.loss += diff * diff;
      if (d_out) d_out[i] = static_cast<float>(2.0 * diff) * scale;
      continue;
    }
    const auto label = static_cast<std::size_t>(batch.labels[i]);
    std::size_t best = 0;
    for (std::size_t j = 1; j < out; ++j)
      best = zi[j] > zi[best] ? j : best;
    const double zmax = zi[best];
    double total = 0;
    for (std::size_t j = 0; j < out; ++j)
      total += std::exp(static_cast<double>(zi[j]) - zmax);
    sums.loss += std::log(total) + zmax - zi[label];
    sums.correct += best == label ? 1.0 : 0.0;
    if (d_out) {
      for (std::size_t j = 0; j < out; ++j) {
        const double p = std::exp(static_cast<double>(zi[j]) - zmax) / total;
        d_out[i * out + j] = static_cast<float>(p - (j == label ? 1.0 : 0.0)) * scale;
      }
    }
  }
  return sums;
}

LossSums DenseNetwork::forward_backward(const Batch& batch, float grad_scale,
                                        const GradientReady& ready) {
  check_batch(batch, "forward_backward");
  for (Parameter& p : parameters_)
    std::fill(p.grad.begin(), p.grad.end(), 0.0f);
  const std::size_t m = batch.rows;
  if (m == 0) return {};
  {
    timeline::Span span("forward", "trainer");
    forward(batch);
  }
  timeline::Span span("backward", "trainer");
  delta_.resize(m * widths_.back());
  const LossSums sums = output_loss(batch, delta_.data(), grad_scale);
  for (std::size_t l = layers(); l-- > 0;) {
    const std::size_t in = widths_[l], out = widths_[l + 1];
    const float* input = l == 0 ? batch.features : a_[l - 1].data();
    matmul_at_b_add(input, delta_.data(), parameters_[2 * l].grad.data(), m, in, out);
    std::vector<float>& db = parameters_[2 * l + 1].grad;
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < out; ++j)
        db[j] += delta_[i * out + j];
    }
    if (ready) {  // this layer's gradients are final
      ready(2 * l + 1);
      ready(2 * l);
    }
    if (l == 0) break;
    // delta of the layer below: (delta W^T) masked by the ReLU's derivative.
    delta_prev_.resize(m * in);
    matmul_a_bt(delta_.data(), parameters_[2 * l].value.data(), delta_prev_.data(), m, in, out);
    const std::vector<float>& z = z_[l - 1];
    for (std::size_t i = 0; i < m * in; ++i) {
      if (z[i] <= 0.0f) delta_prev_[i] = 0.0f;
    }
    delta_.swap(delta_prev_);
  }
  return sums;
}

LossSums DenseNetwork::evaluate(const Batch& batch) {
  check_batch(batch, "evaluate");
  if (batch.rows == 0) return {};
  forward(batch);
  return output_loss(batch, nullptr, 0.0f);
}

void DenseNetwork::predict(const Batch& batch, std::span<float> out) {
  if (out.size() != batch.rows) {
    throw InvalidArgument(error_message("predict(" + describe() + ")", -1,
                                        "out has " + std::to_string(out.size()) + " elements for " +
                                            std::to_string(batch.rows) + " rows"));
  }
  if (batch.rows == 0) return;
  const std::size_t dim = batch.dim;
  if (dim != widths_.front() || !batch.features) {
    throw InvalidArgument(error_message("predict(" + describe() + ")", -1,
                                        "the batch has " + std::to_string(dim) +
                                            " features per sample, the model takes " +
                                            std::to_string(widths_.front())));
  }
  forward(batch);
  const std::size_t width = widths_.back();
  const std::vector<float>& logits = z_.back();
  for (std::size_t i = 0; i < batch.rows; ++i) {
    const float* zi = logits.data() + i * width;
    if (!is_classifier()) {
      out[i] = zi[0];
      continue;
    }
    std::size_t best = 0;
    for (std::size_t j = 1; j < width; ++j)
      best = zi[j] > zi[best] ? j : best;
    out[i] = static_cast<float>(best);
  }
}

std::unique_ptr<Model> make_linear_regression(std::size_t inputs) {
  return std::make_unique<DenseNetwork>("linear", inputs, std::vector<std::size_t>{}, 1,
                                        DenseNetwork::Loss::squared_error);
}

std::unique_ptr<Model> make_softmax_classifier(std::size_t inputs, std::size_t classes) {
  return std::make_unique<DenseNetwork>("softmax", inputs, std::vector<std::size_t>{}, classes,
                                        DenseNetwork::Loss::softmax_cross_entropy);
}

std::unique_ptr<Model> make_mlp(std::size_t inputs, std::vector<std::size_t> hidden,
                                std::size_t classes) {
  return std::make_unique<DenseNetwork>("mlp", inputs, std::move(hidden), classes,
                                        DenseNetwork::Loss::softmax_cross_entropy);
}

}  // namespace gradcomm::trainer
