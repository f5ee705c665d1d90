#include "trainer/dataset.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string_view>

#include "core/error.h"
#include "trainer/random.h"

namespace gradcomm::trainer {
namespace {

[[noreturn]] void invalid(const std::string& call, const std::string& detail) {
  throw InvalidArgument(error_message(call, -1, detail));
}

// Parses one CSV field as a float; false when it is not entirely a finite number.
bool parse_float(std::string_view field, float& value) {
  while (!field.empty() && (field.front() == ' ' || field.front() == '\t'))
    field.remove_prefix(1);
  while (!field.empty() && (field.back() == ' ' || field.back() == '\t' || field.back() == '\r'))
    field.remove_suffix(1);
  if (field.empty()) return false;
  const std::string text(field);
  char* end = nullptr;
  errno = 0;
  const float v = std::strtof(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(v)) return false;
  value = v;
  return true;
}

}  // namespace

Dataset::Dataset(std::size_t dim, std::size_t classes, std::vector<float> features,
                 std::vector<float> labels)
    : dim_(dim), classes_(classes), features_(std::move(features)), labels_(std::move(labels)) {
  if (dim_ == 0 && !labels_.empty()) invalid("Dataset", "samples need at least one feature");
  if (features_.size() != labels_.size() * dim_) {
    invalid("Dataset", std::to_string(features_.size()) + " feature values for " +
                           std::to_string(labels_.size()) + " rows of " + std::to_string(dim_));
  }
}

Dataset Dataset::synthetic(const SyntheticOptions& o) {
  if (o.samples == 0 || o.features == 0)
    invalid("Dataset::synthetic", "samples and features must be positive");
  if (o.classes == 1)
    invalid("Dataset::synthetic", "a classification set needs 2+ classes (0: regression)");
  if (o.classes > 0 && o.modes_per_class == 0)
    invalid("Dataset::synthetic", "modes_per_class must be positive");
  Random rng(o.seed);
  std::vector<float> features(o.samples * o.features);
  std::vector<float> labels(o.samples);
  if (o.classes == 0) {
    std::vector<double> w(o.features);
    for (double& x : w)
      x = rng.normal();
    const double b = rng.normal();
    for (std::size_t i = 0; i < o.samples; ++i) {
      double y = b;
      for (std::size_t j = 0; j < o.features; ++j) {
        const double x = rng.normal();
        features[i * o.features + j] = static_cast<float>(x);
        y += w[j] * x;
      }
      labels[i] = static_cast<float>(y + o.noise * rng.normal());
    }
    return Dataset(o.features, 0, std::move(features), std::move(labels));
  }
  const std::size_t blobs = o.classes * o.modes_per_class;
  std::vector<double> centers(blobs * o.features);
  for (double& c : centers)
    c = o.separation * rng.normal();
  for (std::size_t i = 0; i < o.samples; ++i) {
    const std::size_t blob = rng.below(blobs);
    for (std::size_t j = 0; j < o.features; ++j) {
      features[i * o.features + j] =
          static_cast<float>(centers[blob * o.features + j] + o.noise * rng.normal());
    }
    labels[i] = static_cast<float>(blob % o.classes);
  }
  return Dataset(o.features, o.classes, std::move(features), std::move(labels));
}

Dataset Dataset::load_csv(const std::string& path, long classes) {
  const std::string call = "Dataset::load_csv(" + path + ")";
  std::ifstream in(path);
  if (!in) invalid(call, "cannot open the file");
  std::vector<float> features, labels;
  std::size_t dim = 0;
  std::string line;
  std::size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::vector<float> row;
    std::size_t start = 0;
    bool bad = false;
    std::size_t bad_field = 0;
    while (true) {
      const std::size_t comma = line.find(',', start);
      const std::string_view field(line.data() + start,
                                   (comma == std::string::npos ? line.size() : comma) - start);
      float v = 0;
      if (!parse_float(field, v)) {
        bad = true;
        bad_field = row.size() + 1;
        break;
      }
      row.push_back(v);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    if (bad) {
      if (labels.empty() && features.empty() && bad_field == 1) continue;  // a header line
      invalid(call, "line " + std::to_string(line_no) + ", field " + std::to_string(bad_field) +
                        ": not a finite number");
    }
    if (row.size() < 2)
      invalid(call, "line " + std::to_string(line_no) + ": needs a label and at least one feature");
    if (dim == 0) dim = row.size() - 1;
    if (row.size() - 1 != dim) {
      invalid(call, "line " + std::to_string(line_no) + " has " + std::to_string(row.size() - 1) +
                        " features, earlier lines have " + std::to_string(dim));
    }
    labels.push_back(row[0]);
    features.insert(features.end(), row.begin() + 1, row.end());
  }
  if (labels.empty()) invalid(call, "no data rows");
  std::size_t n_classes = 0;
  if (classes != 0) {
    float max_label = 0;
    for (std::size_t i = 0; i < labels.size(); ++i) {
      const float y = labels[i];
      if (y < 0 || y != std::floor(y) || y > 1e7f) {
        invalid(call, "row " + std::to_string(i + 1) + ": label " + std::to_string(y) +
                          " is not a class index");
      }
      max_label = std::max(max_label, y);
    }
    n_classes =
        classes > 0 ? static_cast<std::size_t>(classes) : static_cast<std::size_t>(max_label) + 1;
    if (static_cast<std::size_t>(max_label) >= n_classes) {
      invalid(call, "label " + std::to_string(static_cast<long>(max_label)) + " is outside [0, " +
                        std::to_string(n_classes) + ")");
    }
    if (n_classes < 2) n_classes = 2;
  }
  return Dataset(dim, n_classes, std::move(features), std::move(labels));
}

Dataset Dataset::slice(std::size_t first, std::size_t count) const {
  const Batch b = rows(first, count);
  return Dataset(dim_, classes_, std::vector<float>(b.features, b.features + count * dim_),
                 std::vector<float>(b.labels, b.labels + count));
}

Batch Dataset::rows(std::size_t first, std::size_t count) const {
  if (first > rows() || count > rows() - first) {
    invalid("Dataset::rows", "rows [" + std::to_string(first) + ", " +
                                 std::to_string(first + count) + ") outside a set of " +
                                 std::to_string(rows()));
  }
  return Batch{features_.data() + first * dim_, labels_.data() + first, count, dim_};
}

Batch Dataset::gather(const std::size_t* indices, std::size_t count, std::vector<float>& features,
                      std::vector<float>& labels) const {
  features.resize(count * dim_);
  labels.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t r = indices[i];
    if (r >= rows())
      invalid("Dataset::gather",
              "row " + std::to_string(r) + " outside a set of " + std::to_string(rows()));
    std::copy_n(features_.data() + r * dim_, dim_, features.data() + i * dim_);
    labels[i] = labels_[r];
  }
  return Batch{features.data(), labels.data(), count, dim_};
}

}  // namespace gradcomm::trainer
