// Running a model over a whole data set: evaluation (loss, AUC, accuracy) and prediction
// (one score per sample), shared by `kiln train --eval-every`, `kiln eval` and `kiln predict`.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tools/model_session.h"

namespace kiln::cli {

struct EvalDataOptions {
  std::vector<std::string> paths;  // {"synthetic"} or files
  int64_t batch = 256;
  int64_t synthetic_samples = 16384;  // synthetic: samples of the held-out stream
  uint64_t seed = 0;                  // synthetic: the run's seed
  bool strict = false;
};

struct EvalResult {
  double loss = 0;      // mean over samples (NaN when the model has no loss)
  double auc = 0;       // ROC AUC of sigmoid(prediction) against the labels
  double accuracy = 0;  // at threshold 0.5
  int64_t samples = 0;
  int64_t malformed = 0;  // TSV lines skipped
};

// Runs @forward over the data; `on_scores` (optional) receives each batch's scores in order.
Expected<EvalResult> evaluateModel(ModelSession& s, const EvalDataOptions& o,
                                   const std::function<Status(const std::vector<float>&)>& on_scores = {});

// Loads `DIR/checkpoint.safetensors` (or a file path) into the session's parameters.
Status loadCheckpointInto(ModelSession& s, const std::string& dir_or_file);

}  // namespace kiln::cli
