#include "driver/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <set>

#include "passes/lr_schedule.h"
#include "runtime/checkpoint.h"
#include "runtime/data/batch_reader.h"
#include "runtime/data/prefetcher.h"
#include "runtime/dir_lock.h"
#include "runtime/metrics.h"
#include "runtime/run_inputs.h"
#include "runtime/serving/served_tables.h"
#include "runtime/serving/update_file.h"
#include "runtime/sharded_checkpoint.h"
#include "runtime/stop_signals.h"
#include "runtime/trace.h"

namespace kiln::driver {

namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One rank's checkpoint file in DIR (evaluator.h's checkpointFile also takes a file or refuses a
// sharded directory; training writes and resumes DIR's own).
std::string trainCheckpointFile(const std::string& dir) {
  return (std::filesystem::path(dir) / "checkpoint.safetensors").string();
}

// Whether --resume should read DIR's sharded form. A directory holds both forms only where a save
// was cut short between the new form's rename and the old form's removal: the newer step wins
// (an unreadable side loses, and its error comes from the side that is read).
bool resumeFromShards(const std::string& dir) {
  if (!runtime::ShardedCheckpoint::isShardedDir(dir)) return false;
  const std::string file = trainCheckpointFile(dir);
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

// The sharding plan the shard pass recorded (kiln.shard): where it came from, then each table's
// entry.
std::optional<ShardPlanInfo> shardPlan(const ir::Module& m) {
  auto it = m.attrs().find("kiln.shard");
  if (it == m.attrs().end() || !it->second.isDict()) return std::nullopt;
  const ir::AttrDict& shard = it->second.asDict();
  ShardPlanInfo plan;
  plan.source = shard.count("source") ? shard.at("source").asString() : "automatic";
  for (const auto& [table, entry] : shard)
    if (table != "source" && table != "rank" && table != "ranks" && entry.isString())
      plan.tables.emplace_back(table, entry.asString());
  return plan;
}

// The tasks' names for their losses: the label's columns when there is one per loss.
std::string taskLossName(const std::vector<std::string>& tasks, size_t i, size_t losses) {
  return tasks.size() == losses ? tasks[i] : fmt::format("task{}", i);
}

// Told nothing: the observer of a run without one, and of every rank but 0.
TrainObserver kSilent;

}  // namespace

class Trainer::Impl {
 public:
  Impl(Session& session, TrainOptions options, TrainObserver* observer,
       const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers)
      : s_(session),
        f_(std::move(options)),
        tracer_(session.options().tracer),
        peer_tracers_(peer_tracers),
        comm_(session.communicator()),
        rank_(session.rank()),
        ranks_(session.ranks()),
        out_(observer && rank_ == 0 ? *observer : kSilent),
        moe_window_(session.hasTrainBlock() ? session.trainConfig() : ir::AttrDict{}) {}
  Expected<TrainSummary> run();

 private:
  // Everything up to the first step: the checkpoint directory, the resume, the metrics file, the
  // data (positioned where a resumed run left it) and the publisher.
  Status setUp();
  Status loop();
  // An error once the steps began: the observer is told, and the trace written as far as it got.
  Status fail(const Status& st);
  void absorbPeers() {
    if (peer_tracers_)
      for (const auto& t : *peer_tracers_) tracer_->absorb(*t);
  }
  bool loud() const { return rank_ == 0; }
  void warn(const std::string& message) { out_.onWarning(message); }
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
  std::string checkpointPath() const;
  Status evaluate();
  // The window since the last report, summed over the ranks: its progress report and metrics line.
  Status report(double lr, bool evaluated);
  void progress(bool final_line);
  std::vector<std::pair<std::string, double>> taskLosses() const;
  void addTaskLosses(const std::vector<std::pair<std::string, std::vector<double>>>& stats);
  Status publish();

  Session& s_;
  const TrainOptions f_;
  runtime::Tracer* tracer_;
  const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers_;
  comm::Communicator* comm_;  // nullptr on one rank
  int rank_, ranks_;
  TrainObserver& out_;
  data::Batch share_;
  comm::CommStats window_comm_;
  double comm_bytes_per_step_ = 0, comm_fraction_ = 0;
  runtime::DirLock lock_;      // held from start to exit: one writer per checkpoint directory
  runtime::RunInputs inputs_;  // recorded in every checkpoint, checked on resume
  std::unique_ptr<data::Prefetcher> prefetch_;
  bool staging_asked_ = false;  // whether the prefetcher was given the GPU's staging pool
  ir::AttrDict schedule_;  // kiln.train's lr_schedule
  int64_t step_ = 0, start_step_ = 0;
  // The step the checkpoint directory holds (a resumed run's start, then each save): the end of
  // the run saves only past it. A sharded checkpoint cannot be rewritten at the step it holds.
  int64_t saved_step_ = -1;
  int64_t samples_ = 0;
  int stopped_by_ = 0;  // the signal that stopped the run after a step (runtime/stop_signals.h), or 0
  bool data_done_ = false;
  std::unique_ptr<serving::UpdatePublisher> publisher_;  // --publish
  data::StreamPosition resume_position_, position_;
  bool resumed_ = false;
  runtime::RunningMean window_loss_;
  MoeStatsWindow moe_window_;  // the global batch's MoE load over the logging window
  std::vector<MoeLayerStats> moe_;  // its last window's
  // `loss = [a, b]`: each task's train loss (statistic task_loss.<i>) over the logging window,
  // named as the label's columns name the tasks.
  std::vector<runtime::RunningMean> task_loss_window_;
  std::vector<double> task_losses_;  // the last window's means
  double last_loss_ = NAN;
  TrainEvaluation last_eval_;
  std::optional<double> entropy_floor_;  // synthetic tokens: the loss no model can beat
  Clock::time_point start_, window_start_, last_log_;
  int64_t window_samples_ = 0;
  int64_t logged_step_ = -1;
  double window_rate_ = 0;
  std::unique_ptr<runtime::MetricsWriter> metrics_;
};

Expected<const data::Batch*> Trainer::Impl::share(const data::Batch& global, data::Batch& into) {
  if (ranks_ == 1) return &global;
  const int64_t b = global.size / ranks_;
  KILN_ASSIGN_OR_RETURN(into, data::sliceBatch(global, s_.trainSpec(), rank_ * b, b));
  return &into;
}

// Before any training: the directory exists, holds a checkpoint's worth of free space, and is
// this run's alone.
Status Trainer::Impl::claimCheckpointDir() {
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

// The checks both checkpoint forms make before their tensors load: the same model, and the same
// run continued (another one is an error unless asked for by name). Returns the saved inputs.
Expected<runtime::RunInputs> Trainer::Impl::sameRun(const std::string& path,
                                                    const std::map<std::string, std::string>& meta) {
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
Status Trainer::Impl::resumePosition(const std::string& path, const runtime::RunInputs& saved,
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

Status Trainer::Impl::resume() {
  if (resumeFromShards(f_.checkpoint_dir)) return resumeSharded();
  std::string path = trainCheckpointFile(f_.checkpoint_dir);
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
  out_.onResumed({path, step_, 0, ranks_});
  return Status::ok();
}

// A sharded directory (its index) resumed on any rank count and plan: every rank reads its
// own pieces' regions from whichever shards cover them.
Status Trainer::Impl::resumeSharded() {
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
  out_.onResumed({path, step_, ckpt.ranks(), ranks_});
  return Status::ok();
}

std::string Trainer::Impl::checkpointPath() const {
  return ranks_ > 1 ? (std::filesystem::path(f_.checkpoint_dir) / runtime::kShardedIndexFile).string()
                    : trainCheckpointFile(f_.checkpoint_dir);
}

// One rank: DIR/checkpoint.safetensors. N ranks: each its shard file, rank 0 the index (a
// sharded checkpoint, runtime/sharded_checkpoint.h). Either form replaces the other once the new
// one is in place, so that --resume finds the latest.
Status Trainer::Impl::saveCheckpoint(const data::StreamPosition& position) {
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
    out_.onCheckpoint(step_, checkpointPath());
    return Status::ok();
  }
  std::vector<std::pair<std::string, ir::TensorView>> tensors;
  for (const std::string& name : s_.checkpointNames())
    tensors.emplace_back(name, s_.params().find(name)->view);
  KILN_RETURN_IF_ERROR(runtime::saveCheckpoint(trainCheckpointFile(f_.checkpoint_dir), tensors, meta));
  saved_step_ = step_;
  // The index first: without it the shard files are no checkpoint.
  if (std::filesystem::remove(dir / runtime::kShardedIndexFile, ec))
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("shard-", 0) == 0 && e.path().extension() == ".safetensors")
        std::filesystem::remove(e.path(), ec);
    }
  out_.onCheckpoint(step_, checkpointPath());
  return Status::ok();
}

// Evaluates on --eval-data (or the held-out synthetic stream) and keeps the figures: a language
// model's loss and perplexity, other models' loss and AUC.
Status Trainer::Impl::evaluate() {
  if (f_.eval_data.empty() && f_.data[0] != "synthetic")
    return Status::error("--eval-every needs --eval-data when training on files");
  EvalDataOptions o;
  o.paths = f_.eval_data.empty() ? std::vector<std::string>{"synthetic"} : f_.eval_data;
  o.batch = f_.batch;
  o.synthetic_samples = f_.eval_samples;
  o.seed = f_.seed;
  o.strict = f_.strict;
  o.token_dtype = f_.token_dtype;
  KILN_ASSIGN_OR_RETURN(EvalResult ev, evaluateModel(s_, o));
  last_eval_.loss = ev.loss;
  if (s_.trainSpec().readsTokens())
    last_eval_.perplexity = ev.perplexity;
  else if (std::isfinite(ev.auc))  // a model without a prediction (two towers) has no AUC
    last_eval_.auc = ev.auc;
  last_eval_.tasks = ev.tasks;
  last_eval_.metrics = ev.metrics;
  last_eval_.balancing = ev.balancing;
  out_.onEvaluation(step_, ev);
  return Status::ok();
}

void Trainer::Impl::addTaskLosses(const std::vector<std::pair<std::string, std::vector<double>>>& stats) {
  for (const auto& [name, values] : stats) {
    const std::optional<size_t> task = taskLossIndex(name);
    if (!task || values.size() != 1) continue;
    const size_t i = *task;
    if (task_loss_window_.size() <= i) task_loss_window_.resize(i + 1);
    task_loss_window_[i].add(values[0]);
  }
}

std::vector<std::pair<std::string, double>> Trainer::Impl::taskLosses() const {
  std::vector<std::pair<std::string, double>> named;
  if (task_losses_.empty()) return named;
  const std::vector<std::string> tasks = taskNames(s_.trainSpec());
  for (size_t i = 0; i < task_losses_.size(); ++i)
    named.emplace_back(taskLossName(tasks, i, task_losses_.size()), task_losses_[i]);
  return named;
}

void Trainer::Impl::progress(bool final_line) {
  if (!loud()) return;
  TrainProgress p;
  p.step = step_;
  p.steps = f_.steps;
  p.samples_per_s = window_rate_;
  p.ranks = ranks_;
  p.comm_bytes_per_step = comm_bytes_per_step_;
  p.comm_wait_fraction = comm_fraction_;
  // The loss of a report is the mean over the steps since the one before, as the metrics file's
  // and the per-task losses are (docs/runtime.md, "One loss per progress line").
  p.loss = window_loss_.weight() > 0 ? window_loss_.mean() : last_loss_;
  p.task_losses = taskLosses();
  p.moe = moe_;
  p.evaluation = last_eval_;
  p.elapsed = secondsSince(start_);
  const int64_t done = step_ - start_step_;
  if (final_line)
    p.left = 0.0;
  else if (f_.steps > 0 && done > 0)
    p.left = p.elapsed / static_cast<double>(done) * static_cast<double>(f_.steps - step_);
  p.final = final_line;
  p.repeated = final_line && logged_step_ == step_;
  out_.onProgress(p);
}

Status Trainer::Impl::publish() {
  runtime::Tracer::Scope scope(tracer_, "publish", runtime::TraceCategory::Host, rank_, runtime::kHostTrack,
                               {{"step", step_}});
  KILN_RETURN_IF_ERROR(publisher_->publish(step_, s_.params()));
  out_.onPublish(step_);
  return Status::ok();
}

Status Trainer::Impl::setUp() {
  KILN_ASSIGN_OR_RETURN(inputs_, runtime::RunInputs::describe(s_.modelName(), f_.seed, f_.batch, f_.data));
  // An unusable or busy checkpoint directory fails now, not at the first save after hours of
  // training.
  if (!f_.checkpoint_dir.empty()) KILN_RETURN_IF_ERROR(claimCheckpointDir());
  if (!f_.checkpoint_dir.empty() && f_.resume) KILN_RETURN_IF_ERROR(resume());
  if (!f_.metrics_path.empty() && loud()) {
    KILN_ASSIGN_OR_RETURN(metrics_, runtime::MetricsWriter::open(f_.metrics_path, /*append=*/resumed_));
  }

  TrainStart start;
  start.device = s_.device();
  start.threads = s_.options().threads;
  start.ranks = ranks_;
  if (ranks_ > 1) start.plan = shardPlan(s_.module());
  out_.onStart(start);

  data::DataOptions opts;
  opts.paths = f_.data;
  opts.batch_size = f_.batch;
  opts.epochs = f_.steps > 0 && f_.epochs == 0 ? 0 : std::max<int64_t>(f_.epochs, 1);
  opts.strict = f_.strict;
  opts.synthetic.seed = f_.seed + 1;
  opts.synthetic.stream = 0;
  opts.token_dtype = f_.token_dtype;
  KILN_ASSIGN_OR_RETURN(auto reader, data::openBatchReader(s_.trainSpec(), opts));
  entropy_floor_ = reader->entropyFloor();
  if (entropy_floor_) out_.onEntropyFloor(*entropy_floor_);
  if (resumed_) KILN_RETURN_IF_ERROR(reader->seek(resume_position_));
  prefetch_ = std::make_unique<data::Prefetcher>(std::move(reader), kTrainPrefetchDepth);

  if (const ir::Attribute* a = trainValue(s_.trainConfig(), "lr_schedule"); a && a->isDict())
    schedule_ = a->asDict();

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
  return Status::ok();
}

Status Trainer::Impl::report(double lr, bool evaluated) {
  double window = secondsSince(window_start_);
  window_rate_ = window > 0 ? static_cast<double>(window_samples_) / window : 0;
  if (ranks_ > 1) {
    const comm::CommStats now = s_.commStats();
    const int64_t steps = std::max<int64_t>(1, step_ - std::max(logged_step_, start_step_));
    comm_bytes_per_step_ = static_cast<double>(now.bytes_sent - window_comm_.bytes_sent) / steps;
    comm_fraction_ = window > 0 ? (now.seconds - window_comm_.seconds) / window : 0;
    window_comm_ = now;
  }
  moe_ = moe_window_.take();
  if (ranks_ > 1) {
    // A rank's balancing losses judge its share of the batch (its tokens' router scores,
    // against the global counts): the global batch's are the ranks' mean, as the loss's is.
    std::vector<double> mine, sum;
    for (const MoeLayerStats& l : moe_)
      for (const auto& entry : l.losses) mine.push_back(entry.second);
    sum.resize(mine.size());
    if (!mine.empty())
      KILN_RETURN_IF_ERROR(comm_->allReduceSync(mine.data(), sum.data(), mine.size(), comm::DataType::f64));
    size_t i = 0;
    for (MoeLayerStats& l : moe_)
      for (auto& entry : l.losses) entry.second = sum[i++] / ranks_;
  }
  task_losses_.assign(task_loss_window_.size(), 0.0);
  for (size_t i = 0; i < task_loss_window_.size(); ++i) task_losses_[i] = task_loss_window_[i].mean();
  if (ranks_ > 1 && !task_losses_.empty()) {
    // Each rank's mean over its equal share: the global batch's is the mean of the ranks'.
    std::vector<double> sum(task_losses_.size());
    KILN_RETURN_IF_ERROR(
        comm_->allReduceSync(task_losses_.data(), sum.data(), sum.size(), comm::DataType::f64));
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
    MoeStatsWindow::addToMetrics(moe_, r.extra);
    for (const auto& [name, loss] : taskLosses()) r.extra["loss." + name] = loss;
    if (evaluated) {
      r.auc = last_eval_.auc;
      r.eval_loss = last_eval_.loss;
      if (last_eval_.perplexity) r.extra["perplexity"] = *last_eval_.perplexity;
      for (const TaskResult& t : last_eval_.tasks) {
        r.extra["auc." + t.name] = t.auc;
        r.extra["accuracy." + t.name] = t.accuracy;
      }
      for (const auto& [name, value] : last_eval_.metrics) r.extra[name] = value;
      for (const auto& [name, value] : last_eval_.balancing) r.extra["eval." + name] = value;
    }
    KILN_RETURN_IF_ERROR(metrics_->write(r));
  }
  window_loss_.reset();
  for (runtime::RunningMean& m : task_loss_window_) m.reset();
  window_samples_ = 0;
  window_start_ = last_log_ = Clock::now();
  return Status::ok();
}

Status Trainer::Impl::loop() {
  runtime::Tracer* tracer = tracer_;
  start_ = window_start_ = last_log_ = Clock::now();
  data::Batch batch, ahead, ahead_share;
  bool have_ahead = false;  // the pipelined step read the next batch already
  position_ = resume_position_;
  const double log_interval = 1.0;
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
      more = prefetch_->next(batch);
    }
    data_wait.end();
    if (!more) return more.status();
    if (!*more) {
      data_done_ = true;
      break;
    }
    if (ranks_ > 1 && batch.size % ranks_ != 0) {
      // Every rank runs the same program size: the short last batch of the data is left out.
      warn(fmt::format("the last batch holds {} samples, which do not split over {} ranks: left out",
                       batch.size, ranks_));
      data_done_ = true;
      break;
    }
    KILN_ASSIGN_OR_RETURN(const data::Batch* mine, share(batch, share_));
    double lr = passes::learningRateFactor(schedule_, step_ + 1);
    runtime::Tracer::Scope step_scope(tracer, fmt::format("step {}", step_ + 1), runtime::TraceCategory::Host,
                                      rank_, runtime::kHostTrack, {{"step", step_ + 1}});
    Expected<StepOutputs> out = Status::error("not run");
    if (s_.pipelined()) {
      // The pipelined step routes the next batch's ids now: read it ahead (not past the last
      // step). A next batch of another size (the data's short last one) is routed again when
      // its turn comes, and the last step routes its own batch once more, unused.
      const data::Batch* next = mine;
      bool reroute = false;
      if (f_.steps == 0 || step_ + 1 < f_.steps) {
        KILN_ASSIGN_OR_RETURN(have_ahead, prefetch_->next(ahead));
        if (have_ahead && ahead.size == batch.size) {
          KILN_ASSIGN_OR_RETURN(next, share(ahead, ahead_share));
        } else {
          reroute = have_ahead;
        }
      }
      out = s_.trainStep(*mine, *next, lr, step_ + 1);
      if (reroute) s_.resetPipeline();
    } else if (s_.stagesAhead()) {
      // On the GPU the next batch is read now (the prefetcher has it ready) and copied to pinned
      // memory and uploaded on a copy stream while this step computes (not past the last step).
      Session::NextStep next;
      if (f_.steps == 0 || step_ + 1 < f_.steps) {
        KILN_ASSIGN_OR_RETURN(have_ahead, prefetch_->next(ahead));
        // A next batch of another size (the data's short last one) is staged by its own step.
        if (have_ahead && ahead.size == batch.size) {
          KILN_ASSIGN_OR_RETURN(const data::Batch* next_mine, share(ahead, ahead_share));
          next = {next_mine, passes::learningRateFactor(schedule_, step_ + 2), step_ + 2};
        }
      }
      out = s_.trainStep(*mine, lr, step_ + 1, next);
      // The step made its executor: from now on the data thread copies batches into its
      // page-locked staging buffers, and stage() only enqueues their upload. On one rank (a
      // rank's share is a slice of the batch, copied anyway).
      if (out && !staging_asked_ && ranks_ == 1 && batch.size == f_.batch) {
        staging_asked_ = true;
        auto pool = s_.trainStagingPool(batch.size, kTrainStagingBuffers);
        if (!pool)
          warn(fmt::format("batches are copied to pinned memory on the training thread: {}",
                           pool.status().message()));
        else if (*pool)
          prefetch_->stageInto(*pool);
      }
    } else {
      out = s_.trainStep(*mine, lr, step_ + 1);
    }
    step_scope.end();
    if (!out) return out.status();
    // Whether to log now (by the clock, which ranks read apart) and whether a signal asked the
    // run to stop: on N ranks every rank must decide alike, so both ride on the loss's
    // all-reduce, and any rank's yes is everyone's.
    bool log_due = f_.log_every > 0 ? (step_ + 1) % f_.log_every == 0 : secondsSince(last_log_) >= log_interval;
    int stop_signal = runtime::stopSignal();
    if (ranks_ > 1) {
      // The global batch's loss: the mean of the ranks' means over equal shares.
      double local[4] = {out->loss, log_due ? 1.0 : 0.0, stop_signal == SIGINT ? 1.0 : 0.0,
                         stop_signal == SIGTERM ? 1.0 : 0.0};
      double sum[4];
      KILN_RETURN_IF_ERROR(comm_->allReduceSync(local, sum, 4, comm::DataType::f64));
      out->loss = sum[0] / ranks_;
      log_due = sum[1] > 0;
      if (stop_signal == 0) stop_signal = sum[3] > 0 ? SIGTERM : sum[2] > 0 ? SIGINT : 0;  // another rank's
    }
    ++step_;
    if (stop_signal) out_.onStopping(stop_signal, step_);
    if (publisher_) publisher_->noteBatch(batch);
    position_ = batch.end;
    samples_ += batch.size;
    window_samples_ += batch.size;
    last_loss_ = out->loss;
    window_loss_.add(out->loss);
    // The shard pass all-reduces the counts: they are the global batch's on any rank count.
    moe_window_.add(out->stats, batch.size);
    addTaskLosses(out->stats);
    if (!std::isfinite(out->loss))
      return Status::error(fmt::format("the loss is {} at step {}; lower the learning rate", out->loss, step_));

    bool evaluated = false;
    if (f_.eval_every > 0 && step_ % f_.eval_every == 0) {
      runtime::Tracer::Scope eval_scope(tracer, "evaluate", runtime::TraceCategory::Host, rank_,
                                        runtime::kHostTrack, {{"step", step_}});
      KILN_RETURN_IF_ERROR(evaluate());
      evaluated = true;
    }
    if (log_due || evaluated || step_ == f_.steps || stop_signal) KILN_RETURN_IF_ERROR(report(lr, evaluated));
    if (publisher_ && step_ % f_.publish_every == 0) KILN_RETURN_IF_ERROR(publish());
    if (!f_.checkpoint_dir.empty() && f_.checkpoint_every > 0 && step_ % f_.checkpoint_every == 0) {
      runtime::Tracer::Scope save_scope(tracer, "checkpoint save", runtime::TraceCategory::Host, rank_,
                                        runtime::kHostTrack, {{"step", step_}});
      KILN_RETURN_IF_ERROR(saveCheckpoint(position_));
    }
    if (stop_signal) {
      stopped_by_ = stop_signal;
      break;
    }
  }
  if (tracer) tracer->setRecording(false);
  if (prefetch_->malformed() > 0) out_.onSkippedLines(prefetch_->malformed());

  // Final evaluation when evaluation was asked for (--eval-every, or --eval-data alone: data to
  // evaluate on is a request to evaluate) and the last step did not just do it.
  // A run asked to stop skips it: its grace period is for the checkpoint.
  if ((f_.eval_every > 0 || !f_.eval_data.empty()) && (f_.eval_every == 0 || step_ % f_.eval_every != 0) &&
      !stopped_by_)
    KILN_RETURN_IF_ERROR(evaluate());
  const bool trained = step_ > start_step_;
  if (trained) progress(true);
  if (publisher_ && step_ % f_.publish_every != 0 && trained) KILN_RETURN_IF_ERROR(publish());
  // The last step, unless the directory already holds it in this run's form: --checkpoint-every
  // just saved it, or nothing was trained since a resume from a checkpoint of the same form.
  if (!f_.checkpoint_dir.empty() && step_ != saved_step_) KILN_RETURN_IF_ERROR(saveCheckpoint(position_));
  return Status::ok();
}

Status Trainer::Impl::fail(const Status& st) {
  out_.onAbort(step_);
  // What the run did up to a failure is worth seeing too.
  if (tracer_ && loud()) {
    absorbPeers();
    (void)tracer_->write(f_.trace_path);
  }
  return st;
}

Expected<TrainSummary> Trainer::Impl::run() {
  KILN_RETURN_IF_ERROR(setUp());
  if (Status st = loop(); !st) return fail(st);
  TrainSummary summary;
  summary.seconds = secondsSince(start_);
  // Rank 0 writes the other in-process ranks' tracers with its own once every rank is past its
  // last event. (Every rank knows the flag, so all of them, MPI ranks too, meet at the barrier.)
  if (!f_.trace_path.empty() && ranks_ > 1) {
    if (Status st = comm_->barrier(); !st) return fail(st);
  }
  summary.model = s_.modelName();
  summary.step = step_;
  summary.start_step = start_step_;
  summary.samples = samples_;
  summary.final_loss = last_loss_;
  summary.evaluation = last_eval_;
  summary.entropy_floor = entropy_floor_;
  summary.data_exhausted = data_done_;
  summary.stopped_by = stopped_by_;
  if (!f_.checkpoint_dir.empty()) {
    summary.checkpoint = checkpointPath();
    summary.checkpoint_step = saved_step_;
  }
  if (f_.profile) summary.profile = s_.profileTable("train_step");
  if (!loud()) return summary;
  out_.onFinish(summary);
  if (tracer_) {
    const int64_t ran = step_ - start_step_;
    if (ran < f_.trace_first)
      warn(fmt::format("--trace-steps {}:{}: this run ran only {} step(s), so the trace holds none",
                       f_.trace_first, f_.trace_last, ran));
    absorbPeers();
    if (Status st = tracer_->write(f_.trace_path); !st) return fail(st);
    if (ran >= f_.trace_first)
      out_.onTraceWritten(f_.trace_path, f_.trace_first, std::min(f_.trace_last, ran));
    else
      out_.onTraceWritten(f_.trace_path, 1, 0);
  }
  return summary;
}

Trainer::Trainer(Session& session, TrainOptions options, TrainObserver* observer,
                 const std::vector<std::unique_ptr<runtime::Tracer>>* peer_tracers)
    : impl_(std::make_unique<Impl>(session, std::move(options), observer, peer_tracers)) {}

Trainer::~Trainer() = default;

Expected<TrainSummary> Trainer::run() { return impl_->run(); }

}  // namespace kiln::driver
