// The driver's Trainer (docs/architecture.md): the training loop over a Session. It resumes from
// a checkpoint of either form, runs the steps (the data, the pipelined step, the cross-rank loss,
// the stop signals of runtime/stop_signals.h), evaluates, writes the metrics file, keeps the MoE
// load window, publishes updates for kiln serve --watch, saves checkpoints and writes the trace.
// It prints nothing: a TrainObserver sees what happens (kiln train's console, tools/cmd_train.cc),
// and run() returns the summary or the error.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "driver/evaluator.h"
#include "driver/moe_stats.h"
#include "driver/session.h"

namespace kiln::runtime {
class Tracer;
}

namespace kiln::driver {

// What `kiln train`'s flags ask of the loop (the session's own options are SessionOptions).
struct TrainOptions {
  std::vector<std::string> data{"synthetic"}, eval_data;
  int64_t steps = 0;   // 0: run by epochs
  int64_t epochs = 0;  // 0 with steps: repeat the data as often as needed
  int64_t batch = 256;  // the global batch (the session's is this rank's share)
  int64_t eval_every = 0;
  int64_t eval_samples = 16384;
  int64_t log_every = 0;  // 0: about once a second
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  bool resume_anyway = false;  // resume even where the run's inputs differ from the checkpoint's
  std::string metrics_path;
  bool strict = false;
  std::string token_dtype;  // token files: "u16", "u32" or "" (by name)
  bool profile = false;
  // --trace FILE: the timeline of this run's steps trace_first..trace_last (1 = the first step
  // this process runs: it compiles and warms up, so the default 2:4 leaves it out).
  std::string trace_path;
  int64_t trace_first = 2, trace_last = 4;
  int64_t ep = 1;  // --ep: MoE experts over groups of this many ranks
  // --publish DIR: every publish_every steps (and at the end) the changed rows and the dense
  // weights, as update files kiln serve --watch applies (runtime/serving/update_file.h).
  std::string publish_dir;
  int64_t publish_every = 100;
  // The session's seed (SessionOptions::seed): the synthetic data's, and a checkpoint records it.
  uint64_t seed = 0;
};

// A resumed run's checkpoint.
struct ResumeInfo {
  std::string path;     // the checkpoint file, or a sharded checkpoint's index
  int64_t step = 0;     // the step it holds, where the run continues
  int saved_ranks = 0;  // a sharded checkpoint: the ranks that saved it (0: one file)
  int ranks = 1;        // the ranks resuming it
};

// The sharding plan a run on several ranks uses, as the shard pass recorded it (kiln.shard).
struct ShardPlanInfo {
  std::string source;  // "automatic", "proposed" (the planner's over the data's ids), a plan file, ...
  std::vector<std::pair<std::string, std::string>> tables;  // each table and its type, ranks, hot rows
};

// What a run trains on, once its checkpoint is resumed and its metrics file open.
struct TrainStart {
  std::string device;  // "cpu" or "cuda"
  int threads = 1;
  int ranks = 1;
  std::optional<ShardPlanInfo> plan;  // on several ranks
};

// The last evaluation's figures: a language model's loss and perplexity, other models' loss and
// AUC (each task's for several), the model's own metrics and the MoE balancing losses. Each stays
// until an evaluation gives it again (a model without a prediction has no AUC).
struct TrainEvaluation {
  std::optional<double> loss, auc, perplexity;
  std::vector<TaskResult> tasks;
  std::vector<std::pair<std::string, double>> metrics;    // the model's metric.<name> statistics
  std::vector<std::pair<std::string, double>> balancing;  // the MoE layers' balancing losses
};

// One progress report: every log_every steps (or about once a second), after each evaluation, at
// --steps and at a stop signal, and once more at the end.
struct TrainProgress {
  int64_t step = 0;
  int64_t steps = 0;  // --steps (0: by epochs)
  double samples_per_s = 0;  // the global batch's, over the window since the report before
  int ranks = 1;
  // On several ranks: what a step sends, and the window's share of time spent in collectives.
  double comm_bytes_per_step = 0, comm_wait_fraction = 0;
  // The mean loss over the window's steps (docs/runtime.md, "One loss per progress line").
  double loss = 0;
  // `loss = [a, b]`: each task's loss over the window, named as the label's columns name them.
  std::vector<std::pair<std::string, double>> task_losses;
  std::vector<MoeLayerStats> moe;  // the window's MoE load (none without MoE layers)
  TrainEvaluation evaluation;
  double elapsed = 0;          // seconds since the first step began
  std::optional<double> left;  // seconds to --steps, once known (0 at the end)
  // The report after the run's final evaluation; `repeated` when the last window's report was of
  // this same step.
  bool final = false;
  bool repeated = false;
};

// How a run ended (run() returns it on every rank).
struct TrainSummary {
  std::string model;
  int64_t step = 0;        // the step the model holds, counted from the start of training
  int64_t start_step = 0;  // where this run began (a resumed checkpoint's step, else 0)
  int64_t samples = 0;     // the samples this run trained on
  double seconds = 0;
  double final_loss = NAN;      // the last step's loss (of the global batch)
  TrainEvaluation evaluation;   // the last evaluation's (empty when none ran)
  std::optional<double> entropy_floor;  // synthetic tokens: the loss no model can beat
  bool data_exhausted = false;
  int stopped_by = 0;           // the signal that ended the run after a step, or 0
  std::string checkpoint;       // the file (one rank) or index (several) written; "" without one
  int64_t checkpoint_step = -1;  // the step the checkpoint directory holds
  std::string profile;          // --profile: the training step's time per op
  // Nothing was trained: the checkpoint resumed holds --steps already, or the data ended before.
  bool trained() const { return step > start_step; }
};

// What kiln train's console (or any other client) sees of a run. Only rank 0 is told: the
// figures are the global batch's. Every hook does nothing unless overridden.
class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  // Something the run goes on regardless of: a stale lock taken over, --resume-anyway's
  // differences, a last batch left out, --trace-steps past the run's end.
  virtual void onWarning(const std::string& text) {}
  virtual void onResumed(const ResumeInfo& resume) {}
  virtual void onStart(const TrainStart& start) {}
  // Synthetic tokens: the per-token loss no model can beat, once the data is open.
  virtual void onEntropyFloor(double nats) {}
  virtual void onProgress(const TrainProgress& progress) {}
  virtual void onEvaluation(int64_t step, const EvalResult& result) {}
  // SIGINT / SIGTERM: the run stops after `step`, its checkpoint saved.
  virtual void onStopping(int signal, int64_t step) {}
  virtual void onCheckpoint(int64_t step, const std::string& path) {}
  virtual void onPublish(int64_t step) {}
  // The malformed data lines the run skipped (without --strict), once its steps are done.
  virtual void onSkippedLines(int64_t count) {}
  // The run is done (its trace not yet written); run() returns the same summary.
  virtual void onFinish(const TrainSummary& summary) {}
  // --trace: written, with the steps of this run it holds (first > last: none).
  virtual void onTraceWritten(const std::string& path, int64_t first, int64_t last) {}
  // The steps began and an error ends the run; run() returns it.
  virtual void onAbort(int64_t step) {}
};

// One rank's training loop (the only one on one rank). On N ranks every rank runs it in step:
// rank r trains on samples [r*b, (r+1)*b) of every global batch of N*b samples, and the losses
// and evaluations are the global batch's.
class Trainer {
 public:
  // `observer` may be null. The session's tracer (SessionOptions::tracer) records the trace
  // window; `peer_tracers`: on rank 0 of in-process ranks, the other ranks' tracers, written
  // with its own.
  Trainer(Session& session, TrainOptions options, TrainObserver* observer = nullptr,
          const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Trains to --steps or the data's end, or until a stop signal (runtime::stopSignal) after the
  // step under way, and saves the checkpoint. Every rank must call it.
  Expected<TrainSummary> run();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::driver
