#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "trainer/model.h"

namespace gradcomm::trainer {

// Options of the embedded synthetic data sets.
struct SyntheticOptions {
  std::size_t samples = 16384;
  std::size_t features = 32;
  std::size_t classes = 10;         // 0: a regression set (labels are real targets)
  std::size_t modes_per_class = 2;  // Gaussian blobs per class (2+ make it non-linear)
  double noise = 2.0;               // per-feature standard deviation around a blob's center
  double separation = 1.5;          // standard deviation of the blob centers
  std::uint64_t seed = 1;
};

// Samples held in memory: features row-major [rows x dim] and one label per row.
class Dataset {
 public:
  Dataset() = default;
  Dataset(std::size_t dim, std::size_t classes, std::vector<float> features,
          std::vector<float> labels);

  // A deterministic classification set (a mixture of Gaussian blobs, several per class) or, with
  // classes == 0, a regression set (target = w.x + b + noise) generated from options.seed.
  static Dataset synthetic(const SyntheticOptions& options);
  // Reads "label,f1,f2,..." lines (an optional header line whose first field is not a number
  // is skipped). With classes > 0 labels must be integers in [0, classes); classes == 0 reads a
  // regression set; classes < 0 infers the class count as max label + 1. Throws InvalidArgument
  // naming the file and line for unreadable files, ragged rows and bad numbers.
  static Dataset load_csv(const std::string& path, long classes = -1);

  std::size_t rows() const { return labels_.size(); }
  std::size_t dim() const { return dim_; }
  // 0 for a regression set.
  std::size_t classes() const { return classes_; }
  const std::vector<float>& features() const { return features_; }
  const std::vector<float>& labels() const { return labels_; }

  // Rows [first, first + count) as a new set (for a held-out split of i.i.d. rows).
  Dataset slice(std::size_t first, std::size_t count) const;

  // Rows [first, first + count).
  Batch rows(std::size_t first, std::size_t count) const;
  // Copies the rows with the given indices into `features` and `labels` (resized) and returns a
  // batch over them.
  Batch gather(const std::size_t* indices, std::size_t count, std::vector<float>& features,
               std::vector<float>& labels) const;

 private:
  std::size_t dim_ = 0;
  std::size_t classes_ = 0;
  std::vector<float> features_;
  std::vector<float> labels_;
};

}  // namespace gradcomm::trainer
