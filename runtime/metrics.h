// Training and evaluation metrics: exact ROC AUC, accuracy, a running mean, and the JSON-lines
// metrics file written by `--metrics FILE`.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/json.h"

namespace kiln::runtime {

// The exact area under the ROC curve: the probability that a random positive scores above a
// random negative, ties counting one half (the Mann-Whitney U statistic, by sorting:
// O(n log n)). Labels are 0 or 1 (> 0.5 counts as positive). NaN when one class is absent.
double rocAuc(std::span<const float> scores, std::span<const float> labels);

// The fraction of samples whose score falls on the label's side of `threshold` (score >=
// threshold predicts 1). Scores are probabilities; for logits pass threshold 0.
double accuracy(std::span<const float> scores, std::span<const float> labels, float threshold = 0.5f);

// Collects (score, label) pairs over many batches for one AUC at the end of an evaluation.
class AucAccumulator {
 public:
  void add(std::span<const float> scores, std::span<const float> labels);
  double auc() const { return rocAuc(scores_, labels_); }
  double accuracy(float threshold = 0.5f) const { return runtime::accuracy(scores_, labels_, threshold); }
  size_t size() const { return scores_.size(); }
  void clear();

 private:
  std::vector<float> scores_, labels_;
};

// A weighted running mean in double (per-step losses over a logging interval or an eval pass).
class RunningMean {
 public:
  void add(double value, double weight = 1.0) {
    sum_ += value * weight;
    weight_ += weight;
  }
  double mean() const { return weight_ > 0 ? sum_ / weight_ : 0.0; }
  double weight() const { return weight_; }
  void reset() { sum_ = weight_ = 0; }

 private:
  double sum_ = 0, weight_ = 0;
};

// One logged step. Optional fields are left out of the line when absent.
struct MetricsRecord {
  int64_t step = 0;
  double loss = 0;
  double samples_per_s = 0;
  std::optional<double> auc;       // when evaluated at this step
  std::optional<double> eval_loss;
  std::optional<double> accuracy;
  std::optional<double> lr;
  json::Json extra = json::Json::object();  // any further fields
  json::Json toJson() const;
};

// Appends one JSON object per line to a file, flushed per line so a crash loses nothing logged.
class MetricsWriter {
 public:
  ~MetricsWriter();
  // Creates (truncates) the file; with `append` continues an existing one (a resumed run).
  static Expected<std::unique_ptr<MetricsWriter>> open(const std::string& path, bool append = false);
  Status write(const MetricsRecord& r);
  Status write(const json::Json& line);

 private:
  MetricsWriter() = default;
  std::string path_;
  std::FILE* fp_ = nullptr;
};

}  // namespace kiln::runtime
