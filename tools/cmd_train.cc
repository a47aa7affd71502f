// `kiln train MODEL.kiln`: compiles the model's training step and trains it, showing progress
// (step, samples/s, loss, last eval AUC, time left), evaluating, checkpointing and resuming.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <set>

#include "passes/lr_schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/comm/local_group.h"
#include "runtime/comm/mpi_communicator.h"
#include "runtime/data/batch_reader.h"
#include "runtime/data/prefetcher.h"
#include "runtime/dir_lock.h"
#include "runtime/metrics.h"
#include "runtime/run_inputs.h"
#include "runtime/sharded_checkpoint.h"
#include "runtime/stop_signals.h"
#include "runtime/serving/update_file.h"
#include "runtime/trace.h"
#include "tools/cli.h"
#include "tools/session_flags.h"
#include "tools/moe_stats.h"
#include "tools/run_data.h"

namespace kiln::cli {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct TrainFlags {
  std::vector<std::string> data, eval_data;
  int64_t steps = 0;   // 0: run by epochs
  int64_t epochs = 0;  // 0 with steps: repeat the data as often as needed
  int64_t batch = 256;
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
};

// One rank's training loop (the only one on one rank). On N ranks every rank runs it in step:
// rank r trains on samples [r*b, (r+1)*b) of every global batch of --batch = N*b samples, the
// losses and evaluations are the global batch's, and only rank 0 prints (a failing rank says
// why, naming itself).
class Trainer {
 public:
  // `peer_tracers`: on rank 0 of in-process ranks, every rank's tracer, written with its own.
  Trainer(driver::Session& session, const TrainFlags& flags, uint64_t seed, runtime::Tracer* tracer,
          const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers = nullptr)
      : s_(session),
        f_(flags),
        seed_(seed),
        tracer_(tracer),
        peer_tracers_(peer_tracers),
        comm_(session.communicator()),
        rank_(session.rank()),
        ranks_(session.ranks()),
        moe_window_(session.hasTrainBlock() ? session.trainConfig() : ir::AttrDict{}) {}
  int run();

 private:
  void absorbPeers() {
    if (peer_tracers_)
      for (const auto& t : *peer_tracers_) tracer_->absorb(*t);
  }
  bool loud() const { return rank_ == 0; }
  void warn(const std::string& message) const;
  void error(const Status& st) const;
  Status resumeSharded();
  Expected<runtime::RunInputs> sameRun(const std::string& path, const std::map<std::string, std::string>& meta);
  Status resumePosition(const std::string& path, const runtime::RunInputs& saved,
                        const std::map<std::string, std::string>& meta);
  // The data a step trains on: this rank's share of the global batch (sliced into `into` on
  // several ranks).
  Expected<const data::Batch*> share(const data::Batch& global, data::Batch& into);
  Status claimCheckpointDir();
  Status resume();
  Status saveCheckpoint(const data::StreamPosition& position);
  Expected<EvalResult> evaluate();
  void noteEvaluation(const EvalResult& ev);
  void progress(bool final_line);

  driver::Session& s_;
  const TrainFlags& f_;
  uint64_t seed_;
  runtime::Tracer* tracer_;
  const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers_;
  comm::Communicator* comm_;  // nullptr on one rank
  int rank_, ranks_;
  data::Batch share_;
  comm::CommStats window_comm_;
  double comm_bytes_per_step_ = 0, comm_fraction_ = 0;
  runtime::DirLock lock_;      // held from start to exit: one writer per checkpoint directory
  runtime::RunInputs inputs_;  // recorded in every checkpoint, checked on resume
  int64_t step_ = 0, start_step_ = 0;
  // The step the checkpoint directory holds (a resumed run's start, then each save): the end of
  // the run saves only past it. A sharded checkpoint cannot be rewritten at the step it holds.
  int64_t saved_step_ = -1;
  int64_t samples_ = 0;
  int stopped_by_ = 0;  // the signal that stopped the run after a step (runtime/stop_signals.h), or 0
  std::unique_ptr<serving::UpdatePublisher> publisher_;  // --publish
  Status publish();
  data::StreamPosition resume_position_;
  bool resumed_ = false;
  runtime::RunningMean window_loss_;
  MoeStatsWindow moe_window_;  // the global batch's MoE load over the logging window
  // `loss = [a, b]`: each task's train loss (statistic task_loss.<i>) over the logging window,
  // named as the label's columns name the tasks.
  std::vector<runtime::RunningMean> task_loss_window_;
  std::vector<double> task_losses_;  // the last window's means
  std::string taskLossText() const;
  void addTaskLosses(const std::vector<std::pair<std::string, std::vector<double>>>& stats);
  std::string moe_text_;       // its last summary, for the progress line
  double last_loss_ = NAN;
  std::optional<double> last_auc_, last_eval_loss_, last_perplexity_;
  std::vector<std::pair<std::string, double>> last_metrics_;  // the model's metric.<name> statistics
  std::vector<std::pair<std::string, double>> last_balancing_;  // the last evaluation's balancing losses
  std::vector<TaskResult> last_tasks_;   // a multi-task model's last evaluation, per task
  std::optional<double> entropy_floor_;  // synthetic tokens: the loss no model can beat
  Clock::time_point start_, window_start_;
  int64_t window_samples_ = 0;
  int64_t logged_step_ = -1;
  double window_rate_ = 0;
  bool tty_ = isatty(STDERR_FILENO);
  std::unique_ptr<runtime::MetricsWriter> metrics_;
};

// The sharding plan the run uses, as the shard pass recorded it (kiln.shard): where it came from,
// then each table's type, ranks, hot rows and de-duplication.
void printShardPlan(const ir::Module& m) {
  auto it = m.attrs().find("kiln.shard");
  if (it == m.attrs().end() || !it->second.isDict()) return;
  const ir::AttrDict& shard = it->second.asDict();
  std::string source = shard.count("source") ? shard.at("source").asString() : "automatic";
  if (source == "proposed") source = "the planner's proposal over the data's ids (kiln plan --data prints it)";
  std::fprintf(stderr, "plan: %s\n", source.c_str());
  for (const auto& [table, entry] : shard)
    if (table != "source" && table != "rank" && table != "ranks" && entry.isString())
      std::fprintf(stderr, "  %-16s %s\n", table.c_str(), entry.asString().c_str());
}

std::string checkpointFile(const std::string& dir) { return (std::filesystem::path(dir) / "checkpoint.safetensors").string(); }

void Trainer::warn(const std::string& message) const {
  if (loud()) std::fprintf(stderr, "kiln train: warning: %s\n", message.c_str());
}

void Trainer::error(const Status& st) const {
  if (ranks_ == 1) {
    printError("train", st);
    return;
  }
  printError(fmt::format("train: rank {}", rank_), st);
}

Expected<const data::Batch*> Trainer::share(const data::Batch& global, data::Batch& into) {
  if (ranks_ == 1) return &global;
  const int64_t b = global.size / ranks_;
  KILN_ASSIGN_OR_RETURN(into, data::sliceBatch(global, s_.trainSpec(), rank_ * b, b));
  return &into;
}

// Before any training: the directory exists, holds a checkpoint's worth of free space, and is
// this run's alone.
Status Trainer::claimCheckpointDir() {
  // On N ranks rank 0 holds the directory for the run; every rank writes its own shard file.
  if (rank_ != 0) return Status::ok();
  uint64_t bytes = 1 << 20;  // the header and its metadata, generously
  for (const std::string& name : s_.checkpointNames())
    bytes += static_cast<uint64_t>(s_.params().find(name)->view.bytes());
  KILN_RETURN_IF_ERROR(runtime::prepareCheckpointDir(f_.checkpoint_dir, bytes));
  std::vector<std::string> notes;
  KILN_ASSIGN_OR_RETURN(lock_, runtime::DirLock::acquire(f_.checkpoint_dir, &notes));
  for (const std::string& n : notes) warn(n);
  return Status::ok();
}

// Whether --resume should read DIR's sharded form. A directory holds both forms only where a save
// was cut short between the new form's rename and the old form's removal: the newer step wins
// (an unreadable side loses, and its error comes from the side that is read).
bool resumeFromShards(const std::string& dir) {
  if (!runtime::ShardedCheckpoint::isShardedDir(dir)) return false;
  const std::string file = checkpointFile(dir);
  if (!std::filesystem::exists(file)) return true;
  auto header = runtime::readCheckpointHeader(file);
  if (!header) return true;
  auto it = header->metadata.find("step");
  int64_t file_step = -1;
  if (it != header->metadata.end())
    std::from_chars(it->second.data(), it->second.data() + it->second.size(), file_step);
  auto shards = runtime::ShardedCheckpoint::open(dir);
  return !shards || shards->step() >= file_step;
}

// The checks both checkpoint forms make before their tensors load: the same model, and the same
// run continued (another one is an error unless asked for by name). Returns the saved inputs.
Expected<runtime::RunInputs> Trainer::sameRun(const std::string& path, const std::map<std::string, std::string>& meta) {
  auto model = meta.find("model");
  const std::string saved_model = model == meta.end() ? "" : model->second;
  if (!s_.modelName().empty() && saved_model != s_.modelName())
    return Status::errorf("{}: the checkpoint is of model '{}', not '{}'", path, saved_model, s_.modelName());
  bool files_recorded = false;
  auto saved = runtime::RunInputs::fromMetadata(meta, &files_recorded);
  if (!saved) return Status::errorf("{}: {}", path, saved.status().message());
  if (!files_recorded) {
    warn(fmt::format("{} does not record its data files (an older checkpoint): they are not checked", path));
    saved->synthetic = inputs_.synthetic;
    saved->files = inputs_.files;
  }
  std::vector<std::string> diffs = runtime::compareRunInputs(*saved, inputs_);
  if (!diffs.empty() && !f_.resume_anyway) {
    std::string list;
    for (const std::string& d : diffs) list += "\n  " + d;
    return Status::errorf(
        "{}: this is not the run the checkpoint was saved by:{}\n"
        "resuming would not continue it (--resume-anyway resumes regardless)",
        path, list);
  }
  for (const std::string& d : diffs) warn(fmt::format("--resume-anyway: ignoring that {}", d));
  return saved.take();
}

// Where the data resumes: the saved position, unless the data is another (a byte offset into
// other files would land mid-line).
Status Trainer::resumePosition(const std::string& path, const runtime::RunInputs& saved,
                               const std::map<std::string, std::string>& meta) {
  if (!runtime::sameData(saved, inputs_)) {
    warn("--resume-anyway: the data is not the checkpoint's, so it is read from its start");
    return Status::ok();
  }
  auto it = meta.find("data_position");
  auto pos = data::StreamPosition::parse(it == meta.end() ? "" : it->second);
  if (!pos) return Status::errorf("{}: {}", path, pos.status().message());
  resume_position_ = *pos;
  return Status::ok();
}

Status Trainer::resume() {
  if (resumeFromShards(f_.checkpoint_dir)) return resumeSharded();
  std::string path = checkpointFile(f_.checkpoint_dir);
  if (!std::filesystem::exists(path))
    return Status::error(fmt::format("--resume: no checkpoint at '{}'", path));
  KILN_ASSIGN_OR_RETURN(runtime::Checkpoint ckpt, runtime::loadCheckpoint(path));
  auto meta = [&](const char* k) -> std::string {
    auto it = ckpt.metadata.find(k);
    return it == ckpt.metadata.end() ? "" : it->second;
  };
  KILN_ASSIGN_OR_RETURN(runtime::RunInputs saved, sameRun(path, ckpt.metadata));

  if (ranks_ == 1) {
    std::map<std::string, ir::TensorView> dest;
    for (const std::string& name : s_.checkpointNames()) dest[name] = s_.params().find(name)->view;
    KILN_RETURN_IF_ERROR(runtime::restoreTensors(ckpt, dest, path));
  } else {
    // A single-file checkpoint resumed on N ranks: each takes its pieces' regions.
    for (runtime::LocalPiece& p : s_.localPieces()) {
      const ir::HostTensor* whole = ckpt.find(p.name);
      if (!whole || whole->view.shape != p.global_shape || whole->view.dtype != p.view.dtype)
        return Status::errorf("{}: no tensor '{}' of the model's shape", path, p.name);
      KILN_RETURN_IF_ERROR(runtime::copyRegion(whole->view, p.offset, p.view));
    }
    KILN_RETURN_IF_ERROR(s_.loadHotRows(
        [&](const std::string& name, const std::vector<int64_t>& offset, ir::TensorView& row) -> Status {
          const ir::HostTensor* whole = ckpt.find(name);
          if (!whole) return Status::errorf("{}: no tensor '{}' for its hot rows", path, name);
          return runtime::copyRegion(whole->view, offset, row);
        }));
  }
  std::string step = meta("step");
  auto [end, ec] = std::from_chars(step.data(), step.data() + step.size(), step_);
  if (step.empty() || ec != std::errc() || end != step.data() + step.size() || step_ < 0)
    return Status::error(fmt::format("{}: bad 'step' in the checkpoint metadata: '{}'{}", path, step,
                                     ec == std::errc::result_out_of_range ? " (beyond int64)" : ""));
  KILN_RETURN_IF_ERROR(resumePosition(path, saved, ckpt.metadata));
  resumed_ = true;
  start_step_ = step_;
  // A single file resumed on N ranks is saved sharded at the end, even with nothing to train.
  if (ranks_ == 1) saved_step_ = step_;
  if (loud())
    std::fprintf(stderr, "resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(step_));
  return Status::ok();
}

// A sharded directory (its index) resumed on any rank count and plan: every rank reads its
// own pieces' regions from whichever shards cover them.
Status Trainer::resumeSharded() {
  KILN_ASSIGN_OR_RETURN(auto ckpt, runtime::ShardedCheckpoint::open(f_.checkpoint_dir));
  const std::string path = (std::filesystem::path(f_.checkpoint_dir) / runtime::kShardedIndexFile).string();
  KILN_ASSIGN_OR_RETURN(runtime::RunInputs saved, sameRun(path, ckpt.metadata()));
  KILN_RETURN_IF_ERROR(s_.loadPieces(ckpt));
  step_ = ckpt.step();
  KILN_RETURN_IF_ERROR(resumePosition(path, saved, ckpt.metadata()));
  resumed_ = true;
  start_step_ = step_;
  // A sharded checkpoint resumed on one rank is saved as one file at the end, even with nothing
  // to train (`kiln train --resume` converts it).
  if (ranks_ > 1) saved_step_ = step_;
  if (loud())
    std::fprintf(stderr, "resumed from %s at step %lld (saved by %d rank%s, resumed on %d)\n", path.c_str(),
                 static_cast<long long>(step_), ckpt.ranks(), ckpt.ranks() == 1 ? "" : "s", ranks_);
  return Status::ok();
}

// One rank: DIR/checkpoint.safetensors. N ranks: each its shard file, rank 0 the index (a
// sharded checkpoint, runtime/sharded_checkpoint.h). Either form replaces the other once the new
// one is in place, so that --resume finds the latest.
Status Trainer::saveCheckpoint(const data::StreamPosition& position) {
  std::map<std::string, std::string> meta{
      {"step", std::to_string(step_)}, {"data_position", position.str()}, {"format", "kiln-checkpoint-2"}};
  inputs_.toMetadata(meta);
  const std::filesystem::path dir(f_.checkpoint_dir);
  std::error_code ec;
  if (ranks_ > 1) {
    KILN_RETURN_IF_ERROR(
        runtime::saveShardedCheckpoint(*comm_, f_.checkpoint_dir, step_, s_.localPieces(), meta));
    if (rank_ == 0) std::filesystem::remove(dir / "checkpoint.safetensors", ec);
    saved_step_ = step_;
    return Status::ok();
  }
  std::vector<std::pair<std::string, ir::TensorView>> tensors;
  for (const std::string& name : s_.checkpointNames())
    tensors.emplace_back(name, s_.params().find(name)->view);
  KILN_RETURN_IF_ERROR(runtime::saveCheckpoint(checkpointFile(f_.checkpoint_dir), tensors, meta));
  saved_step_ = step_;
  // The index first: without it the shard files are no checkpoint.
  if (std::filesystem::remove(dir / runtime::kShardedIndexFile, ec))
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("shard-", 0) == 0 && e.path().extension() == ".safetensors")
        std::filesystem::remove(e.path(), ec);
    }
  return Status::ok();
}

Expected<EvalResult> Trainer::evaluate() {
  EvalDataOptions o;
  o.paths = f_.eval_data.empty() ? std::vector<std::string>{"synthetic"} : f_.eval_data;
  if (!f_.eval_data.empty() || f_.data[0] == "synthetic") {
    o.batch = f_.batch;
    o.synthetic_samples = f_.eval_samples;
    o.seed = seed_;
    o.strict = f_.strict;
    o.token_dtype = f_.token_dtype;
    return evaluateModel(s_, o);
  }
  return Status::error("--eval-every needs --eval-data when training on files");
}

// A language model's evaluation is its loss and perplexity; other models' their loss and AUC.
void Trainer::noteEvaluation(const EvalResult& ev) {
  last_eval_loss_ = ev.loss;
  if (s_.trainSpec().readsTokens())
    last_perplexity_ = ev.perplexity;
  else if (std::isfinite(ev.auc))  // a model without a prediction (two towers) has no AUC
    last_auc_ = ev.auc;
  last_tasks_ = ev.tasks;
  last_metrics_ = ev.metrics;
  last_balancing_ = ev.balancing;
}

void Trainer::addTaskLosses(const std::vector<std::pair<std::string, std::vector<double>>>& stats) {
  for (const auto& [name, values] : stats) {
    const std::optional<size_t> task = taskLossIndex(name);
    if (!task || values.size() != 1) continue;
    const size_t i = *task;
    if (task_loss_window_.size() <= i) task_loss_window_.resize(i + 1);
    task_loss_window_[i].add(values[0]);
  }
}

// The tasks' names for their losses: the label's columns when there is one per loss.
static std::string taskLossName(const std::vector<std::string>& tasks, size_t i, size_t losses) {
  return tasks.size() == losses ? tasks[i] : fmt::format("task{}", i);
}

std::string Trainer::taskLossText() const {
  if (task_losses_.empty()) return "";
  const std::vector<std::string> tasks = taskNames(s_.trainSpec());
  std::string text = " (";
  for (size_t i = 0; i < task_losses_.size(); ++i)
    text += fmt::format("{}{} {:.5f}", i ? " " : "", taskLossName(tasks, i, task_losses_.size()),
                        task_losses_[i]);
  return text + ")";
}

void Trainer::progress(bool final_line) {
  if (!loud()) return;
  double elapsed = secondsSince(start_);
  int64_t done = step_ - start_step_;
  std::string total = f_.steps > 0 ? fmt::format("/{}", f_.steps) : "";
  std::string left = "?";
  if (f_.steps > 0 && done > 0) left = driver::formatDuration(elapsed / static_cast<double>(done) * static_cast<double>(f_.steps - step_));
  std::string auc = last_auc_ ? fmt::format(" | eval auc {:.4f}", *last_auc_) : "";
  if (!last_tasks_.empty()) {
    auc = " | eval auc";
    for (const TaskResult& t : last_tasks_) auc += fmt::format(" {} {:.4f}", t.name, t.auc);
  }
  if (last_perplexity_) auc = fmt::format(" | eval ppl {:.4f}", *last_perplexity_);
  if (!last_metrics_.empty()) {
    auc += " | eval";
    for (const auto& [name, value] : last_metrics_) auc += fmt::format(" {} {:.4f}", name, value);
  }
  // On N ranks: the global rate, each rank's share, what a step sends and the time in collectives.
  std::string ranks =
      ranks_ == 1
          ? ""
          : fmt::format(" ({:.0f}/rank) | {}/step sent, {:.0f}% in collectives", window_rate_ / ranks_,
                        runtime::formatBytes(static_cast<uint64_t>(comm_bytes_per_step_)),
                        100 * comm_fraction_);
  // The loss of a progress line is the mean over the steps since the line before, as the metrics
  // file's and the per-task losses are (docs/runtime.md, "One loss per progress line").
  const double loss = window_loss_.weight() > 0 ? window_loss_.mean() : last_loss_;
  std::string line = fmt::format("step {}{} | {:.0f} samples/s{} | loss {:.5f}{}{}{} | elapsed {} | left {}",
                                 step_, total, window_rate_, ranks, loss, taskLossText(), moe_text_,
                                 auc, driver::formatDuration(elapsed), final_line ? "0:00" : left);
  if (tty_)
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), final_line ? "\n" : "");
  else
    std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

Status Trainer::publish() {
  runtime::Tracer::Scope scope(tracer_, "publish", runtime::TraceCategory::Host, rank_, runtime::kHostTrack,
                               {{"step", step_}});
  return publisher_->publish(step_, s_.params());
}

int Trainer::run() {
  auto inputs = runtime::RunInputs::describe(s_.modelName(), seed_, f_.batch, f_.data);
  if (!inputs) {
    error(inputs.status());
    return kExitError;
  }
  inputs_ = inputs.take();
  // An unusable or busy checkpoint directory fails now, not at the first save after hours of
  // training.
  if (!f_.checkpoint_dir.empty()) {
    if (Status st = claimCheckpointDir(); !st) {
      error(st);
      return kExitError;
    }
  }
  if (!f_.checkpoint_dir.empty() && f_.resume) {
    Status st = resume();
    if (!st) {
      error(st);
      return kExitError;
    }
  }
  if (!f_.metrics_path.empty() && loud()) {
    auto w = runtime::MetricsWriter::open(f_.metrics_path, /*append=*/resumed_);
    if (!w) {
      error(w.status());
      return kExitError;
    }
    metrics_ = w.take();
  }

  if (loud() && s_.device() == "cpu") printCpuHeader(s_.options().threads);
  if (loud() && ranks_ > 1) printShardPlan(s_.module());

  data::DataOptions opts;
  opts.paths = f_.data;
  opts.batch_size = f_.batch;
  opts.epochs = f_.steps > 0 && f_.epochs == 0 ? 0 : std::max<int64_t>(f_.epochs, 1);
  opts.strict = f_.strict;
  opts.synthetic.seed = seed_ + 1;
  opts.synthetic.stream = 0;
  opts.token_dtype = f_.token_dtype;
  auto reader = data::openBatchReader(s_.trainSpec(), opts);
  if (!reader) {
    error(reader.status());
    return kExitError;
  }
  entropy_floor_ = (*reader)->entropyFloor();
  if (entropy_floor_ && loud())
    std::fprintf(stderr, "synthetic tokens: entropy floor %.4f nats (the per-token loss no model can beat)\n",
                 *entropy_floor_);
  if (resumed_) {
    Status st = (*reader)->seek(resume_position_);
    if (!st) {
      error(st);
      return kExitError;
    }
  }
  data::Prefetcher prefetch(reader.take(), driver::kTrainPrefetchDepth);

  const ir::AttrDict& train = s_.trainConfig();
  ir::AttrDict schedule;
  if (const ir::Attribute* a = driver::trainValue(train, "lr_schedule"); a && a->isDict()) schedule = a->asDict();

  runtime::Tracer* tracer = tracer_;
  // What the run did up to a failure is worth seeing too.
  auto fail = [&](const Status& st) {
    if (tty_ && loud()) std::fprintf(stderr, "\n");
    error(st);
    if (tracer && loud()) {
      absorbPeers();
      (void)tracer->write(f_.trace_path);
    }
    return kExitError;
  };

  if (!f_.publish_dir.empty()) {
    // The served tables' rows a step reads are the rows it may change (embedding updates are
    // sparse); every other parameter of @forward goes whole.
    const ir::Function* fwd = s_.module().lookup("forward");
    std::vector<serving::ServedTable> tables = serving::findServedTables(*fwd);
    std::set<std::string> table_names, dense;
    for (const serving::ServedTable& t : tables) table_names.insert(t.name);
    const_cast<ir::Function*>(fwd)->walk([&](ir::Op& op) {
      if (op.is(ir::OpCode::Parameter) && !table_names.count(op.strAttr("name"))) dense.insert(op.strAttr("name"));
    });
    publisher_ = std::make_unique<serving::UpdatePublisher>(f_.publish_dir, s_.modelName(), std::move(tables),
                                                            std::vector<std::string>(dense.begin(), dense.end()),
                                                            step_);
  }

  start_ = window_start_ = Clock::now();
  data::Batch batch, ahead, ahead_share;
  bool have_ahead = false;  // the pipelined step read the next batch already
  data::StreamPosition position = resume_position_;
  bool data_done = false;
  double log_interval = 1.0;
  Clock::time_point last_log = start_;
  while (f_.steps == 0 || step_ < f_.steps) {
    const int64_t run_step = step_ - start_step_ + 1;
    if (tracer) tracer->setRecording(run_step >= f_.trace_first && run_step <= f_.trace_last);
    runtime::Tracer::Scope data_wait(tracer, "data wait", runtime::TraceCategory::Data, rank_,
                                     runtime::kHostTrack, {{"step", step_ + 1}});
    Expected<bool> more = true;
    if (have_ahead) {
      std::swap(batch, ahead);
      have_ahead = false;
    } else {
      more = prefetch.next(batch);
    }
    data_wait.end();
    if (!more) return fail(more.status());
    if (!*more) {
      data_done = true;
      break;
    }
    if (ranks_ > 1 && batch.size % ranks_ != 0) {
      // Every rank runs the same program size: the short last batch of the data is left out.
      warn(fmt::format("the last batch holds {} samples, which do not split over {} ranks: left out",
                       batch.size, ranks_));
      data_done = true;
      break;
    }
    auto mine = share(batch, share_);
    if (!mine) return fail(mine.status());
    double lr = passes::learningRateFactor(schedule, step_ + 1);
    runtime::Tracer::Scope step_scope(tracer, fmt::format("step {}", step_ + 1), runtime::TraceCategory::Host,
                                      rank_, runtime::kHostTrack, {{"step", step_ + 1}});
    Expected<driver::StepOutputs> out = Status::error("not run");
    if (s_.pipelined()) {
      // The pipelined step routes the next batch's ids now: read it ahead (not past the last
      // step). A next batch of another size (the data's short last one) is routed again when
      // its turn comes, and the last step routes its own batch once more, unused.
      const data::Batch* next = *mine;
      bool reroute = false;
      if (f_.steps == 0 || step_ + 1 < f_.steps) {
        auto read = prefetch.next(ahead);
        if (!read) return fail(read.status());
        have_ahead = *read;
        if (have_ahead && ahead.size == batch.size) {
          auto next_share = share(ahead, ahead_share);
          if (!next_share) return fail(next_share.status());
          next = *next_share;
        } else {
          reroute = have_ahead;
        }
      }
      out = s_.trainStep(**mine, *next, lr, step_ + 1);
      if (reroute) s_.resetPipeline();
    } else {
      out = s_.trainStep(**mine, lr, step_ + 1);
    }
    step_scope.end();
    if (!out) return fail(out.status());
    // Whether to log now (by the clock, which ranks read apart) and whether a signal asked the
    // run to stop: on N ranks every rank must decide alike, so both ride on the loss's
    // all-reduce, and any rank's yes is everyone's.
    bool log_due = f_.log_every > 0 ? (step_ + 1) % f_.log_every == 0 : secondsSince(last_log) >= log_interval;
    int stop_signal = runtime::stopSignal();
    if (ranks_ > 1) {
      // The global batch's loss: the mean of the ranks' means over equal shares.
      double mine[4] = {out->loss, log_due ? 1.0 : 0.0, stop_signal == SIGINT ? 1.0 : 0.0,
                        stop_signal == SIGTERM ? 1.0 : 0.0};
      double sum[4];
      if (Status st = comm_->allReduceSync(mine, sum, 4, comm::DataType::f64); !st) return fail(st);
      out->loss = sum[0] / ranks_;
      log_due = sum[1] > 0;
      if (stop_signal == 0) stop_signal = sum[3] > 0 ? SIGTERM : sum[2] > 0 ? SIGINT : 0;  // another rank's
    }
    ++step_;
    if (stop_signal && loud())
      std::fprintf(stderr, "%s%s: stopping after step %lld%s (a second signal ends the run at once)\n",
                   tty_ ? "\n" : "", runtime::signalName(stop_signal).c_str(), static_cast<long long>(step_),
                   f_.checkpoint_dir.empty() ? "" : ", once its checkpoint is saved");
    if (publisher_) publisher_->noteBatch(batch);
    position = batch.end;
    samples_ += batch.size;
    window_samples_ += batch.size;
    last_loss_ = out->loss;
    window_loss_.add(out->loss);
    // The shard pass all-reduces the counts: they are the global batch's on any rank count.
    moe_window_.add(out->stats, batch.size);
    addTaskLosses(out->stats);
    if (!std::isfinite(out->loss))
      return fail(Status::error(fmt::format("the loss is {} at step {}; lower the learning rate", out->loss, step_)));

    bool evaluated = false;
    if (f_.eval_every > 0 && step_ % f_.eval_every == 0) {
      runtime::Tracer::Scope eval_scope(tracer, "evaluate", runtime::TraceCategory::Host, rank_,
                                        runtime::kHostTrack, {{"step", step_}});
      auto ev = evaluate();
      if (!ev) return fail(ev.status());
      noteEvaluation(*ev);
      evaluated = true;
    }
    if (log_due || evaluated || step_ == f_.steps || stop_signal) {
      double window = secondsSince(window_start_);
      window_rate_ = window > 0 ? static_cast<double>(window_samples_) / window : 0;
      if (ranks_ > 1) {
        const comm::CommStats now = s_.commStats();
        const int64_t steps = std::max<int64_t>(1, step_ - std::max(logged_step_, start_step_));
        comm_bytes_per_step_ = static_cast<double>(now.bytes_sent - window_comm_.bytes_sent) / steps;
        comm_fraction_ = window > 0 ? (now.seconds - window_comm_.seconds) / window : 0;
        window_comm_ = now;
      }
      std::vector<MoeLayerStats> moe = moe_window_.take();
      if (ranks_ > 1) {
        // A rank's balancing losses judge its share of the batch (its tokens' router scores,
        // against the global counts): the global batch's are the ranks' mean, as the loss's is.
        std::vector<double> mine, sum;
        for (const MoeLayerStats& l : moe)
          for (const auto& entry : l.losses) mine.push_back(entry.second);
        sum.resize(mine.size());
        if (!mine.empty())
          if (Status st = comm_->allReduceSync(mine.data(), sum.data(), mine.size(), comm::DataType::f64); !st)
            return fail(st);
        size_t i = 0;
        for (MoeLayerStats& l : moe)
          for (auto& entry : l.losses) entry.second = sum[i++] / ranks_;
      }
      moe_text_ = MoeStatsWindow::progressText(moe);
      task_losses_.assign(task_loss_window_.size(), 0.0);
      for (size_t i = 0; i < task_loss_window_.size(); ++i) task_losses_[i] = task_loss_window_[i].mean();
      if (ranks_ > 1 && !task_losses_.empty()) {
        // Each rank's mean over its equal share: the global batch's is the mean of the ranks'.
        std::vector<double> sum(task_losses_.size());
        if (Status st =
                comm_->allReduceSync(task_losses_.data(), sum.data(), sum.size(), comm::DataType::f64);
            !st)
          return fail(st);
        for (size_t i = 0; i < sum.size(); ++i) task_losses_[i] = sum[i] / ranks_;
      }
      progress(false);
      logged_step_ = step_;
      if (metrics_) {
        runtime::MetricsRecord r;
        r.step = step_;
        r.loss = window_loss_.mean();
        r.samples_per_s = window_rate_;
        r.lr = lr;
        if (entropy_floor_) r.extra["entropy_floor"] = *entropy_floor_;
        if (ranks_ > 1) {
          r.extra["ranks"] = ranks_;
          if (f_.ep > 1) r.extra["ep"] = f_.ep;
          r.extra["samples_per_s_per_rank"] = window_rate_ / ranks_;
          r.extra["comm_bytes_per_step"] = comm_bytes_per_step_;
          r.extra["comm_wait_fraction"] = comm_fraction_;
        }
        MoeStatsWindow::addToMetrics(moe, r.extra);
        if (!task_losses_.empty()) {
          const std::vector<std::string> tasks = taskNames(s_.trainSpec());
          for (size_t i = 0; i < task_losses_.size(); ++i)
            r.extra["loss." + taskLossName(tasks, i, task_losses_.size())] = task_losses_[i];
        }
        if (evaluated) {
          r.auc = last_auc_;
          r.eval_loss = last_eval_loss_;
          if (last_perplexity_) r.extra["perplexity"] = *last_perplexity_;
          for (const TaskResult& t : last_tasks_) {
            r.extra["auc." + t.name] = t.auc;
            r.extra["accuracy." + t.name] = t.accuracy;
          }
          for (const auto& [name, value] : last_metrics_) r.extra[name] = value;
          for (const auto& [name, value] : last_balancing_) r.extra["eval." + name] = value;
        }
        Status st = metrics_->write(r);
        if (!st) return fail(st);
      }
      window_loss_.reset();
      for (runtime::RunningMean& m : task_loss_window_) m.reset();
      window_samples_ = 0;
      window_start_ = last_log = Clock::now();
    }
    if (publisher_ && step_ % f_.publish_every == 0) {
      if (Status st = publish(); !st) return fail(st);
    }
    if (!f_.checkpoint_dir.empty() && f_.checkpoint_every > 0 && step_ % f_.checkpoint_every == 0) {
      runtime::Tracer::Scope save_scope(tracer, "checkpoint save", runtime::TraceCategory::Host, rank_,
                                        runtime::kHostTrack, {{"step", step_}});
      Status st = saveCheckpoint(position);
      if (!st) return fail(st);
    }
    if (stop_signal) {
      stopped_by_ = stop_signal;
      break;
    }
  }
  if (tracer) tracer->setRecording(false);
  if (prefetch.malformed() > 0 && loud())
    std::fprintf(stderr, "%sskipped %lld malformed lines\n", tty_ ? "\n" : "", static_cast<long long>(prefetch.malformed()));

  // Final evaluation when evaluation was asked for (--eval-every, or --eval-data alone: data to
  // evaluate on is a request to evaluate) and the last step did not just do it.
  // A run asked to stop skips it: its grace period is for the checkpoint.
  if ((f_.eval_every > 0 || !f_.eval_data.empty()) && (f_.eval_every == 0 || step_ % f_.eval_every != 0) &&
      !stopped_by_) {
    auto ev = evaluate();
    if (!ev) return fail(ev.status());
    noteEvaluation(*ev);
  }
  const bool trained = step_ > start_step_;
  if (trained && (tty_ || logged_step_ != step_)) progress(true);
  if (publisher_ && step_ % f_.publish_every != 0 && trained) {
    if (Status st = publish(); !st) return fail(st);
  }
  // The last step, unless the directory already holds it in this run's form: --checkpoint-every
  // just saved it, or nothing was trained since a resume from a checkpoint of the same form.
  if (!f_.checkpoint_dir.empty() && step_ != saved_step_) {
    Status st = saveCheckpoint(position);
    if (!st) return fail(st);
  }

  double elapsed = secondsSince(start_);
  // Rank 0 writes the other in-process ranks' tracers with its own once every rank is past its
  // last event. (Every rank knows the flag, so all of them, MPI ranks too, meet at the barrier.)
  if (!f_.trace_path.empty() && ranks_ > 1) {
    if (Status st = comm_->barrier(); !st) return fail(st);
  }
  // Stopped by a signal: the shell's code for it (128 + the signal), so that a script tells an
  // interrupted run from a finished one; the checkpoint is whole either way.
  const int done = stopped_by_ ? 128 + stopped_by_ : kExitOk;
  if (!loud()) return done;
  std::printf("trained %s: %lld steps (%lld this run), %lld samples in %.1f s, %.0f samples/s%s\n",
              s_.modelName().c_str(), static_cast<long long>(step_), static_cast<long long>(step_ - start_step_),
              static_cast<long long>(samples_), elapsed, elapsed > 0 ? static_cast<double>(samples_) / elapsed : 0.0,
              data_done ? " (data exhausted)" : "");
  if (trained)
    std::printf("final train loss: %.6f\n", last_loss_);
  else if (f_.steps > 0)
    std::printf("nothing left to train: the checkpoint holds step %lld, and --steps asks for %lld\n",
                static_cast<long long>(step_), static_cast<long long>(f_.steps));
  else
    std::printf("nothing left to train: the checkpoint holds step %lld, past the data's last batch\n",
                static_cast<long long>(step_));
  if (last_eval_loss_) std::printf("eval loss: %.6f\n", *last_eval_loss_);
  if (last_auc_) std::printf("eval auc: %.6f\n", *last_auc_);
  for (const TaskResult& t : last_tasks_) std::printf("eval auc.%s: %.6f\n", t.name.c_str(), t.auc);
  if (last_perplexity_) std::printf("eval perplexity: %.6f\n", *last_perplexity_);
  for (const auto& [name, value] : last_metrics_) std::printf("eval %s: %.6f\n", name.c_str(), value);
  for (const auto& [name, value] : last_balancing_) std::printf("eval %s: %.6f\n", name.c_str(), value);
  if (entropy_floor_) std::printf("entropy floor: %.6f nats\n", *entropy_floor_);
  if (!f_.checkpoint_dir.empty())
    std::printf("checkpoint: %s\n",
                ranks_ > 1 ? (std::filesystem::path(f_.checkpoint_dir) / runtime::kShardedIndexFile).c_str()
                           : checkpointFile(f_.checkpoint_dir).c_str());
  if (f_.profile) std::printf("%s", s_.profileTable("train_step").c_str());
  if (stopped_by_) {
    // What a scheduler's preemption (or the user at the terminal) needs to know: where the run
    // stands, and that nothing is half written.
    const std::string held =
        f_.checkpoint_dir.empty()
            ? "no --checkpoint was given, so the steps trained are not saved"
            : fmt::format("the checkpoint in {} holds step {} (--resume continues from it)", f_.checkpoint_dir,
                          saved_step_);
    std::fprintf(stderr, "stopped by %s after step %lld%s: %s\n", runtime::signalName(stopped_by_).c_str(),
                 static_cast<long long>(step_),
                 f_.steps > 0 ? fmt::format(" of {}", f_.steps).c_str() : "", held.c_str());
  }
  if (tracer) {
    const int64_t ran = step_ - start_step_;
    if (ran < f_.trace_first)
      warn(fmt::format("--trace-steps {}:{}: this run ran only {} step(s), so the trace holds none",
                       f_.trace_first, f_.trace_last, ran));
    absorbPeers();
    if (Status st = tracer->write(f_.trace_path); !st) return fail(st);
    if (ran >= f_.trace_first)
      std::printf("trace: %s (steps %lld to %lld of this run)\n", f_.trace_path.c_str(),
                  static_cast<long long>(f_.trace_first),
                  static_cast<long long>(std::min(f_.trace_last, ran)));
    else
      std::printf("trace: %s (no step)\n", f_.trace_path.c_str());
  }
  return done;
}

// A rank's code for a run a stop signal ended cleanly, every rank at the same step.
bool stoppedBySignal(int rc) { return rc > 128; }

}  // namespace

int runTrain(const std::vector<std::string>& args) {
  ArgParser p("train", "kiln train MODEL.kiln [--data synthetic|PATH...] [--steps N | --epochs E] [flags]",
              "Compiles the model's training step and trains it on the CPU, showing step, samples/s, loss,\n"
              "the last eval AUC and the time left.");
  p.setPositionals("MODEL.kiln", 1, 1, "the model to train");
  p.addOption("data", "synthetic|PATH",
              "training data: 'synthetic' or Criteo TSV / Kiln binary files (a language model: token files, "
              "e.g. train.bin)",
              "synthetic", true);
  p.addOption("eval-data", "PATH", "held-out data to evaluate on (default with synthetic data: a held-out stream)",
              std::nullopt, true);
  p.addOption("steps", "N", "train until step N (counted from the start of training, also when resuming)");
  p.addOption("epochs", "E", "passes over the data (default 1 without --steps)");
  p.addOption("batch", "B", "samples per step", "256");
  p.addOption("eval-every", "N",
              "evaluate every N steps and at the end (0: only at the end, and only when --eval-data is given)", "0");
  p.addOption("eval-samples", "N", "samples of the held-out synthetic stream per evaluation", "16384");
  p.addOption("log-every", "N", "log every N steps (default: about once a second)");
  p.addOption("checkpoint", "DIR", "save a checkpoint into DIR at the end (and every --checkpoint-every steps)");
  p.addOption("checkpoint-every", "N", "also save every N steps", "0");
  p.addOption("publish", "DIR",
              "write the changed rows and dense weights every --publish-every steps to DIR, for kiln serve --watch");
  p.addOption("publish-every", "N", "steps between published updates", "100");
  p.addFlag("resume", "continue from the checkpoint in --checkpoint DIR (same model, data, seed and batch)");
  p.addFlag("resume-anyway",
            "like --resume, but where the model's data files, seed or batch differ from the checkpoint's, "
            "say so and continue");
  p.addOption("metrics", "FILE", "append one JSON object per logged step to FILE");
  p.addFlag("strict", "a malformed data line is fatal instead of skipped and counted");
  p.addOption(
      "token-dtype", "u16|u32",
      "token files (language models): the id type (default: by name, .bin and .u16 are u16, .u32 u32)");
  p.addFlag("profile", "time every op of the training step (CPU) and print where the time went");
  p.addOption("trace", "FILE",
              "write a Chrome trace-event timeline (Perfetto, chrome://tracing) of --trace-steps to FILE");
  p.addOption("trace-steps", "A:B",
              "the steps of this run --trace records (default 2:4; 1 is its first step, which warms up)");
  p.addOption("ranks", "N",
              "train on N in-process ranks (one thread each; --batch is the global batch); under mpirun the "
              "ranks are MPI's processes (default: 1)");
  p.addFlag("pipeline",
            "on several ranks, route the next batch's ids (its all_to_all) while this batch computes, as "
            "TorchRec's sparse-dist pipeline does; the numbers are the unpipelined step's");
  p.addFlag("no-overlap",
            "on several ranks, wait on each collective right after issuing it instead of computing while it "
            "moves (a baseline for the overlap)");
  p.addOption("ep", "N",
              "expert parallelism: spread each MoE layer's experts over groups of N ranks (N divides the "
              "rank count; a layer's moe(..., ep = N) overrides it)",
              "1");
  p.addOption("comm-timeout", "SECONDS", "a rank that waits this long for a peer fails, naming it", "300");
  p.addOption("plan", "FILE",
              "the sharding plan on several ranks (kiln plan -o; default: the automatic plan)");
  p.addOption(
      "sharding", "TYPE",
      "on several ranks, shard every table this way (data_parallel, table_wise, row_wise, column_wise, "
      "table_row_wise) instead of a plan");
  p.addOption("ranks-per-node", "G", "ranks per node (table_row_wise keeps a table's rows inside one)", "0");
  addModelFlags(p);
  addDeviceFlag(p);
  int code;
  if (!p.parse(args, &code)) return code;

  TrainFlags f;
  f.data = p.getAll("data").empty() ? std::vector<std::string>{"synthetic"} : p.getAll("data");
  f.eval_data = p.getAll("eval-data");
  auto intFlag = [&](const char* name, int64_t& out, int64_t min) -> bool {
    if (!p.has(name)) return true;
    auto v = p.getInt(name);
    if (!v) return false;
    if (*v < min) {
      p.usageError(fmt::format("--{} must be at least {}, got {}", name, min, *v));
      return false;
    }
    out = *v;
    return true;
  };
  int64_t ranks = 1, comm_timeout = 300, ranks_per_node = 0;
  if (!intFlag("ranks", ranks, 1) || !intFlag("ep", f.ep, 1) || !intFlag("comm-timeout", comm_timeout, 1) ||
      !intFlag("ranks-per-node", ranks_per_node, 0))
    return kExitUsage;
  if (!intFlag("steps", f.steps, 1) || !intFlag("epochs", f.epochs, 1) || !intFlag("batch", f.batch, 1) ||
      !intFlag("eval-every", f.eval_every, 0) || !intFlag("eval-samples", f.eval_samples, 1) ||
      !intFlag("log-every", f.log_every, 1) || !intFlag("checkpoint-every", f.checkpoint_every, 0))
    return kExitUsage;
  f.checkpoint_dir = p.get("checkpoint");
  f.resume_anyway = p.flag("resume-anyway");
  f.resume = p.flag("resume") || f.resume_anyway;
  if (f.resume && f.checkpoint_dir.empty())
    return p.usageError(
        fmt::format("--{} needs --checkpoint DIR", f.resume_anyway ? "resume-anyway" : "resume"));
  if (f.checkpoint_every > 0 && f.checkpoint_dir.empty()) return p.usageError("--checkpoint-every needs --checkpoint DIR");
  f.publish_dir = p.get("publish");
  if (!intFlag("publish-every", f.publish_every, 1)) return kExitUsage;
  if (!f.publish_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(f.publish_dir, ec);
    if (!std::filesystem::is_directory(f.publish_dir))
      return p.usageError(fmt::format("--publish: cannot make the directory '{}'", f.publish_dir));
    if (ranks > 1) return p.usageError("--publish runs on one rank (the sharded tables are not gathered yet)");
  }
  f.metrics_path = p.get("metrics");
  f.strict = p.flag("strict");
  f.token_dtype = p.get("token-dtype");
  if (!f.token_dtype.empty() && f.token_dtype != "u16" && f.token_dtype != "u32")
    return p.usageError(fmt::format("--token-dtype must be u16 or u32, got '{}'", f.token_dtype));
  f.profile = p.flag("profile");
  f.trace_path = p.get("trace");
  if (p.has("trace-steps")) {
    if (f.trace_path.empty()) return p.usageError("--trace-steps needs --trace FILE");
    std::string v = p.get("trace-steps");
    size_t colon = v.find(':');
    auto number = [](std::string_view text, int64_t& out) {
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
      return !text.empty() && ec == std::errc() && end == text.data() + text.size();
    };
    if (colon == std::string::npos || !number(std::string_view(v).substr(0, colon), f.trace_first) ||
        !number(std::string_view(v).substr(colon + 1), f.trace_last) || f.trace_first < 1 ||
        f.trace_last < f.trace_first)
      return p.usageError(fmt::format("--trace-steps must be A:B with 1 <= A <= B, got '{}'", v));
  }
  if (!f.trace_path.empty()) {
    std::filesystem::path dir = std::filesystem::path(f.trace_path).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir))
      return p.usageError(fmt::format("--trace: no such directory '{}'", dir.string()));
  }
  for (const std::string& d : f.data)
    if (d != "synthetic" && !std::filesystem::exists(d)) return p.usageError(fmt::format("no such data file '{}'", d));
  if (f.data.size() > 1 && std::find(f.data.begin(), f.data.end(), "synthetic") != f.data.end())
    return p.usageError("'synthetic' cannot be mixed with data files");
  for (const std::string& d : f.eval_data)
    if (!std::filesystem::exists(d)) return p.usageError(fmt::format("no such eval data file '{}'", d));

  driver::SessionOptions so;
  so.model_path = p.positionals()[0];
  if (!std::filesystem::exists(so.model_path)) return p.usageError(fmt::format("no such model file '{}'", so.model_path));
  so.batch = f.batch;
  so.profile = f.profile;
  // Made before the session, which keeps a pointer for its executors; off until the window.
  std::unique_ptr<runtime::Tracer> tracer;
  if (!f.trace_path.empty()) {
    tracer = std::make_unique<runtime::Tracer>();
    tracer->setRecording(false);
  }
  if (f.resume) so.checkpoint_path = f.checkpoint_dir;  // loaded whole: the memory check counts it
  if (!readModelFlags(p, so, &code) || !readDeviceFlag(p, so, &code)) return code;
  so.plan_path = p.get("plan");
  so.sharding = p.get("sharding");
  so.plan_data = f.data;  // the automatic plan: the planner's proposal over these ids
  so.ranks_per_node = static_cast<int>(ranks_per_node);
  so.no_overlap = p.has("no-overlap");
  so.pipeline = p.has("pipeline");
  if (!so.plan_path.empty() && !std::filesystem::exists(so.plan_path))
    return p.usageError(fmt::format("no such plan file '{}'", so.plan_path));

  // mpirun started this process: one rank of MPI's processes.
  auto world = comm::mpiWorldIfLaunched();
  if (!world) {
    printError("train", world.status());
    return kExitError;
  }
  std::unique_ptr<comm::Communicator> mpi = world.take();
  if (mpi) {
    if (p.has("ranks") && ranks != mpi->size())
      return p.usageError(fmt::format("--ranks {} disagrees with mpirun's {} processes", ranks, mpi->size()));
    ranks = mpi->size();
  }
  if (ranks > 1 && so.device != "cpu")
    return p.usageError(
        "several ranks train on the CPU for now (the CUDA backend does not issue collectives yet)");
  if (f.batch % ranks != 0)
    return p.usageError(
        fmt::format("--batch {} does not split over {} ranks (it is the global batch)", f.batch, ranks));
  if (ranks % f.ep != 0)
    return p.usageError(
        fmt::format("--ep {} does not divide the rank count {} (an expert group is ep ranks)", f.ep, ranks));
  so.ep = static_cast<int>(f.ep);

  // One rank's run: its session (its own sharded program) and training loop. In-process ranks
  // trace each into its own tracer, on its own tracks (pid = rank), and rank 0 writes them all;
  // of MPI processes only rank 0 traces (the others' events would have to cross processes).
  std::vector<std::unique_ptr<runtime::Tracer>> peer_tracers;
  if (tracer && !mpi)
    for (int64_t r = 1; r < ranks; ++r) {
      peer_tracers.push_back(std::make_unique<runtime::Tracer>());
      peer_tracers.back()->setRecording(false);
    }
  auto trainRank = [&](comm::Communicator* c) -> int {
    driver::SessionOptions mine = so;
    mine.comm = c;
    mine.batch = f.batch / ranks;
    if (!mpi) mine.memory_shares = static_cast<int>(ranks);
    const int rank = c ? c->rank() : 0;
    mine.tracer = rank == 0 || !tracer ? tracer.get()
                  : mpi                ? nullptr
                                       : peer_tracers[static_cast<size_t>(rank - 1)].get();
    auto session = openSession(mine, std::cerr);
    if (!session) {
      printError(ranks > 1 ? fmt::format("train: rank {}", rank) : "train", session.status());
      return kExitError;
    }
    Trainer t(**session, f, so.seed, mine.tracer,
              rank == 0 && !peer_tracers.empty() ? &peer_tracers : nullptr);
    return t.run();
  };
  // SIGINT / SIGTERM from here on stop the run after the step under way, its checkpoint saved
  // (a second one ends it at once, removing a checkpoint file half written).
  runtime::StopSignals stop_signals;
  const auto timeout = std::chrono::seconds(comm_timeout);
  if (mpi) {
    mpi->setTimeout(timeout);
    const int rc = trainRank(mpi.get());
    if (rc != kExitOk && !stoppedBySignal(rc)) {
      // The others must not wait for this rank's next collective until their timeout. MPI cannot
      // cancel the collectives a broken group left started, and MPI_Finalize could wait on them:
      // exit without it (mpirun then ends the job).
      mpi->abort(fmt::format("rank {} failed", mpi->rank()));
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(rc);
    }
    return rc;
  }
  if (ranks == 1) return trainRank(nullptr);
  comm::LocalGroup group(static_cast<int>(ranks));
  group.setTimeout(timeout);
  std::vector<int> codes(static_cast<size_t>(ranks), kExitOk);
  // A rank that fails aborts the group, so the others stop at their next collective.
  Status st = group.run([&](comm::Communicator& c) -> Status {
    const int rc = trainRank(&c);
    codes[static_cast<size_t>(c.rank())] = rc;
    return rc == kExitOk || stoppedBySignal(rc) ? Status::ok() : Status::errorf("rank {} failed", c.rank());
  });
  int rc = kExitOk;
  for (int c : codes) rc = std::max(rc, c);
  if (!st && rc == kExitOk) {
    // No rank reported a failure of its own (none started: the group could not create their
    // threads): the group's error is the only word on it.
    printError("train", st);
    rc = kExitError;
  }
  return rc;
}

}  // namespace kiln::cli
