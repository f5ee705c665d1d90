#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gradcomm::trainer {

// One named parameter tensor and its gradient (same shape), float32, row-major.
struct Parameter {
  std::string name;
  std::vector<std::size_t> shape;
  std::vector<float> value;
  std::vector<float> grad;

  std::size_t size() const { return value.size(); }
};

// `rows` consecutive samples: features row-major [rows x dim], one label per row (a class index
// stored as float for classifiers, the target value for regression).
struct Batch {
  const float* features = nullptr;
  const float* labels = nullptr;
  std::size_t rows = 0;
  std::size_t dim = 0;
};

// Sums over the rows of a batch (not means: shards of different sizes combine by adding).
struct LossSums {
  double loss = 0;     // sum of per-sample losses
  double correct = 0;  // correctly classified samples (classifiers; 0 for regression)
};

// A model with named parameters and analytic gradients. Not thread-safe; one per rank.
class Model {
 public:
  virtual ~Model() = default;

  // "linear", "softmax" or "mlp".
  virtual std::string_view kind() const = 0;
  // The architecture, e.g. "mlp 32-64-64-10"; checkpoints refuse to load into another one.
  virtual std::string describe() const = 0;
  virtual bool is_classifier() const = 0;
  virtual std::size_t input_dim() const = 0;

  std::span<Parameter> parameters() { return parameters_; }
  std::span<const Parameter> parameters() const { return parameters_; }
  std::size_t parameter_count() const;

  // Draws fresh initial values from `seed` (He-normal weights for ReLU layers, scaled normal for
  // the output layer, zero biases).
  virtual void initialize(std::uint64_t seed) = 0;

  // Called with a parameter's index as soon as its gradient is final, while backward goes on
  // (last layer first): what lets communication overlap the rest of backward.
  using GradientReady = std::function<void(std::size_t parameter)>;

  // Sets every gradient to grad_scale * d(sum of the batch's per-sample losses)/d(parameter) and
  // returns the sums; `ready` (if set) hears of each gradient as soon as it is final (an empty
  // batch produces none). Throws InvalidArgument for a batch of the wrong width or a bad label.
  virtual LossSums forward_backward(const Batch& batch, float grad_scale,
                                    const GradientReady& ready) = 0;
  LossSums forward_backward(const Batch& batch, float grad_scale) {
    return forward_backward(batch, grad_scale, GradientReady());
  }
  // Loss and correct counts only, without touching gradients.
  virtual LossSums evaluate(const Batch& batch) = 0;
  // One prediction per row: the class index (classifiers) or the value (regression).
  virtual void predict(const Batch& batch, std::span<float> out) = 0;

 protected:
  std::vector<Parameter> parameters_;
};

// A fully connected network: input -> hidden layers (ReLU) -> output. With no hidden layers and
// a softmax output it is the softmax classifier; with one output and squared error it is linear
// regression. Per-sample losses: softmax cross-entropy -log p(label), or (prediction - target)^2.
class DenseNetwork : public Model {
 public:
  enum class Loss { softmax_cross_entropy, squared_error };

  DenseNetwork(std::string kind, std::size_t inputs, std::vector<std::size_t> hidden,
               std::size_t outputs, Loss loss);

  std::string_view kind() const override { return kind_; }
  std::string describe() const override;
  bool is_classifier() const override { return loss_ == Loss::softmax_cross_entropy; }
  std::size_t input_dim() const override { return widths_.front(); }
  void initialize(std::uint64_t seed) override;
  using Model::forward_backward;
  LossSums forward_backward(const Batch& batch, float grad_scale,
                            const GradientReady& ready) override;
  LossSums evaluate(const Batch& batch) override;
  void predict(const Batch& batch, std::span<float> out) override;

 private:
  void check_batch(const Batch& batch, const char* call) const;
  void forward(const Batch& batch);
  // Loss sums of the output layer; with d_out, also writes d(loss)/d(logits) * scale there.
  LossSums output_loss(const Batch& batch, float* d_out, float scale) const;
  std::size_t layers() const { return widths_.size() - 1; }

  std::string kind_;
  std::vector<std::size_t> widths_;  // inputs, hidden..., outputs
  Loss loss_;
  // Reused per batch: pre-activations z[l] and activations a[l] of each layer, and two
  // gradient buffers.
  std::vector<std::vector<float>> z_, a_;
  std::vector<float> delta_, delta_prev_;
};

// linear regression (one output, squared error), softmax classifier, and MLP.
std::unique_ptr<Model> make_linear_regression(std::size_t inputs);
std::unique_ptr<Model> make_softmax_classifier(std::size_t inputs, std::size_t classes);
std::unique_ptr<Model> make_mlp(std::size_t inputs, std::vector<std::size_t> hidden,
                                std::size_t classes);

}  // namespace gradcomm::trainer
