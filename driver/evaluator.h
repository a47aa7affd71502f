// The driver's Evaluator (docs/architecture.md): a model run over a whole data set, evaluation
// (loss, AUC, accuracy; a language model's held-out cross entropy and perplexity) and prediction
// (one score per sample), shared by the Trainer's evaluations (`kiln train --eval-every`), `kiln
// eval`, `kiln predict` and the C API; and the checkpoint files they load.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "driver/session.h"
#include "runtime/checkpoint.h"
#include "runtime/data/batch.h"
#include "runtime/data/record_source.h"

namespace kiln::driver {

struct EvalDataOptions {
  std::vector<std::string> paths;  // {"synthetic"} or files
  int64_t batch = 256;
  int64_t synthetic_samples = 16384;  // synthetic: samples of the held-out stream
  uint64_t seed = 0;                  // synthetic: the run's seed
  bool strict = false;
  std::string token_dtype;       // token files: "u16", "u32" or "" (by name)
  data::DiagnosticSink on_skip;  // told about each malformed line skipped (default: stderr)
};

// One task of a multi-task model: a column of its label and of its prediction.
struct TaskResult {
  std::string name;  // the label's file column (or "task<j>")
  double auc = 0;
  double accuracy = 0;
  double loss = NAN;  // `loss = [a, b]`: this task's own loss (its statistic task_loss.<j>)
};

struct EvalResult {
  // The task loss, mean over samples (NaN when the model has no loss): the train block's loss
  // without the balancing losses of MoE layers (kiln.train's aux_losses), which `balancing` holds.
  double loss = 0;
  double auc = 0;       // ROC AUC of sigmoid(prediction) against the labels (the first task's)
  double accuracy = 0;  // at threshold 0.5 (the first task's)
  // A label of k > 1 columns (f32[B, k]) and a prediction of as many: each task's metrics.
  std::vector<TaskResult> tasks;
  // A model that reads tokens: exp(loss), the loss being the mean per-token cross entropy (and
  // AUC and accuracy NaN).
  double perplexity = NAN;
  std::optional<double> entropy_floor;  // synthetic tokens: the loss no model can beat
  int64_t samples = 0;
  int64_t malformed = 0;  // TSV lines skipped
  // On N ranks: the samples of an indivisible last batch that no rank evaluated.
  int64_t left_out = 0;
  // The model's own batch metrics (statistics named metric.<name>, e.g. in_batch_recall's
  // metric.recall@10), averaged over samples: (name, mean), in the model's order.
  std::vector<std::pair<std::string, double>> metrics;
  // The balancing losses (a MoE layer's NAME.aux_loss, NAME.seq_aux_loss, NAME.z_loss: each with
  // its coefficient applied) averaged over samples: (name, mean), in kiln.train's order.
  std::vector<std::pair<std::string, double>> balancing;
};

// The statistics a model reports as batch metrics: "metric.<name>"; the name, or empty.
std::string_view metricStatName(std::string_view stat);

// The names of the tasks of `spec`'s label: its file columns, or task0 .. task<k-1>; one entry for
// a label of one column (or none).
std::vector<std::string> taskNames(const data::BatchSpec& spec);

// A click model's score: the probability of its logit, as kiln predict writes and kiln serve answers.
inline float clickProbability(float logit) { return 1.0f / (1.0f + std::exp(-logit)); }

// The one file of a checkpoint: a directory's checkpoint.safetensors, or the file given. A sharded
// checkpoint (a directory with an index) is an error: merge it first.
Expected<std::string> checkpointFile(const std::string& dir_or_file);

// The checkpoint at `dir_or_file`: a directory's checkpoint.safetensors, the file given, or a
// sharded checkpoint merged in memory. `path` is set to the file read.
Expected<runtime::Checkpoint> readCheckpoint(const std::string& dir_or_file, std::string& path);

// The task j of a step statistic named `task_loss.<j>` (each task's own loss under `loss = [a,
// b]`); none for any other name, `task_loss.` followed by anything but a decimal number included.
std::optional<size_t> taskLossIndex(std::string_view stat_name);

// Receives each batch's scores in order, `columns` per sample, sample-major, with the malformed lines
// skipped among its samples (SkippedLine::before places each), and last, with no scores, the lines skipped
// after the last sample: together one entry per input line. The scores are k probabilities per sample for
// k tasks, or, for a prediction that is not one logit per sample and task (an embedding, a regression's
// [B, H]), its H values per sample as the model computed them.
using ScoreSink = std::function<Status(const std::vector<float>& scores, int64_t columns,
                                       const std::vector<data::SkippedLine>& skipped)>;

// Runs @forward over the data; `on_scores` (optional) receives the scores.
Expected<EvalResult> evaluateModel(Session& s, const EvalDataOptions& o,
                                   const ScoreSink& on_scores = {});

// Loads `DIR/checkpoint.safetensors` (or a file path, or a sharded checkpoint directory, merged in
// memory) into the session's parameters.
Status loadCheckpointInto(Session& s, const std::string& dir_or_file);

}  // namespace kiln::driver
