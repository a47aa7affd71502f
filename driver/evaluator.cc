#include "driver/evaluator.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <optional>

#include "runtime/checkpoint.h"
#include "runtime/data/batch_reader.h"
#include "runtime/data/prefetcher.h"
#include "runtime/metrics.h"
#include "runtime/sharded_checkpoint.h"

namespace kiln::driver {

Expected<EvalResult> evaluateModel(Session& s, const EvalDataOptions& o, const ScoreSink& on_scores) {
  data::DataOptions opts;
  opts.paths = o.paths;
  opts.batch_size = o.batch;
  opts.epochs = 1;
  opts.strict = o.strict;
  opts.on_skip = o.on_skip;
  opts.synthetic.seed = o.seed + 1;  // the same hidden task as training ...
  opts.synthetic.stream = 1;         // ... on the held-out stream
  opts.synthetic_samples = o.synthetic_samples;
  opts.token_dtype = o.token_dtype;
  KILN_ASSIGN_OR_RETURN(auto reader, data::openBatchReader(s.forwardSpec(), opts));
  const std::optional<double> entropy_floor = reader->entropyFloor();
  data::Prefetcher prefetch(std::move(reader), kEvalPrefetchDepth);

  const data::BatchSpec& spec = s.forwardSpec();
  // A language model is scored by its loss alone: it has no per-sample score.
  const bool scored = !spec.readsTokens();
  const std::vector<std::string> tasks = taskNames(spec);
  const auto k = static_cast<int64_t>(std::max<size_t>(tasks.size(), 1));
  std::vector<runtime::AucAccumulator> auc(static_cast<size_t>(k));
  std::vector<float> task_scores, task_labels;
  runtime::RunningMean loss;
  std::vector<std::pair<std::string, runtime::RunningMean>> metrics;  // metric.<name> statistics
  std::vector<runtime::RunningMean> task_loss;                        // `loss = [a, b]`: each task's own
  // The balancing losses the train block's loss adds (MoE layers' aux and z losses): reported on
  // their own, and taken out of the loss, which then is the task's alone.
  std::vector<std::string> aux_names;
  if (const ir::Attribute* a = s.hasTrainBlock() ? trainValue(s.trainConfig(), "aux_losses") : nullptr;
      a && a->isArray())
    for (const ir::Attribute& name : a->asArray()) aux_names.push_back(name.asString());
  std::vector<runtime::RunningMean> balancing(aux_names.size());
  std::vector<double> aux(aux_names.size());
  data::Batch batch, share, ahead;
  EvalResult r;
  std::vector<float> scores, labels;
  // On N ranks each evaluates its 1/N of every global batch; the scores and labels of all of
  // them meet on every rank, in global order, for one AUC (o.batch is the global batch).
  const int ranks = s.ranks();
  comm::Communicator* c = s.communicator();
  // On the GPU (one rank) batch i+1 is read while batch i is handed to the step, and staged (its
  // upload on the copy stream) while batch i computes, as the trainer does: the read's result
  // waits here for its turn, so an error after good batches still comes after their scores.
  const bool stage_ahead = ranks == 1 && s.stagesForwardAhead();
  std::optional<Expected<bool>> read_ahead;
  int64_t number = 0;
  int64_t left_out = 0;
  int64_t columns = k;  // the values per sample on_scores receives
  // Values each rank computed over its equal share of the batch: the global batch's are the
  // ranks' means.
  std::vector<double> rank_sum;
  auto meanOverRanks = [&](double* v, size_t n) -> Status {
    if (ranks == 1 || n == 0) return Status::ok();
    rank_sum.resize(n);
    KILN_RETURN_IF_ERROR(c->allReduceSync(v, rank_sum.data(), n, comm::DataType::f64));
    for (size_t i = 0; i < n; ++i) v[i] = rank_sum[i] / ranks;
    return Status::ok();
  };
  while (true) {
    Expected<bool> more = true;
    if (read_ahead) {
      more = std::move(*read_ahead);
      read_ahead.reset();
      if (more && *more) std::swap(batch, ahead);
    } else {
      more = prefetch.next(batch);
    }
    if (!more) return more.status();
    if (!*more) break;
    ++number;
    const data::Batch* mine = &batch;
    int64_t local = batch.size;
    if (ranks > 1) {
      // Every rank runs the same program size: an indivisible last batch leaves its remainder out.
      local = batch.size / ranks;
      left_out += batch.size - local * ranks;
      if (local == 0) continue;
      KILN_ASSIGN_OR_RETURN(share, data::sliceBatch(batch, spec, s.rank() * local, local));
      mine = &share;
    }
    Expected<StepOutputs> step = Status::error("not run");
    if (stage_ahead) {
      read_ahead = prefetch.next(ahead);
      Session::NextStep next;
      if (*read_ahead && **read_ahead && ahead.size == batch.size) next = {&ahead, 1, number + 1};
      step = s.forward(*mine, number, next);
    } else {
      step = s.forward(*mine);
    }
    if (!step) return step.status();
    StepOutputs& out = *step;
    double batch_loss = out.loss;
    if (!aux_names.empty()) {
      std::fill(aux.begin(), aux.end(), 0.0);
      for (const auto& [name, values] : out.stats) {
        auto it = std::find(aux_names.begin(), aux_names.end(), name);
        if (it == aux_names.end() || values.size() != 1) continue;
        aux[static_cast<size_t>(it - aux_names.begin())] = values[0];
        batch_loss -= values[0];
      }
      KILN_RETURN_IF_ERROR(meanOverRanks(aux.data(), aux.size()));
      for (size_t i = 0; i < aux.size(); ++i) balancing[i].add(aux[i], static_cast<double>(local * ranks));
    }
    for (const auto& [name, values] : out.stats) {
      const std::string_view metric = metricStatName(name);
      if (metric.empty() || values.size() != 1) continue;
      double v = values[0];
      KILN_RETURN_IF_ERROR(meanOverRanks(&v, 1));
      auto it =
          std::find_if(metrics.begin(), metrics.end(), [&](const auto& m) { return m.first == metric; });
      if (it == metrics.end())
        it = metrics.insert(metrics.end(), {std::string(metric), runtime::RunningMean()});
      it->second.add(v, static_cast<double>(local * ranks));
    }
    if (!scored) {
      KILN_RETURN_IF_ERROR(meanOverRanks(&batch_loss, 1));
      loss.add(batch_loss, static_cast<double>(local * ranks));
      r.samples += local * ranks;
      continue;
    }
    if (k > 1 && static_cast<int64_t>(out.logits.size()) != local * k)
      return Status::errorf(
          "the label '{}' has {} tasks, but the prediction has {} values for {} samples, not {} "
          "per sample",
          spec.inputs[static_cast<size_t>(spec.labelIndex())].name, k, out.logits.size(), local, k);
    // One probability per sample and task; for kiln predict a prediction of several values per
    // sample (out.prediction: not one logit per sample) is written as it is, all its columns.
    const bool raw = on_scores && out.logits.empty();
    if (raw) {
      if (out.prediction.empty())
        return Status::error("the model has no prediction output to write (its @forward returns none)");
      if (out.prediction.size() % static_cast<size_t>(local) != 0)
        return Status::errorf("the prediction has {} values for a batch of {} samples, not the same "
                              "number per sample: kiln predict writes one line per sample",
                              out.prediction.size(), local);
      columns = static_cast<int64_t>(out.prediction.size()) / local;
      scores = out.prediction;
    } else {
      columns = k;
      scores.resize(out.logits.size());
      for (size_t i = 0; i < scores.size(); ++i) scores[i] = clickProbability(out.logits[i]);
    }
    if (spec.labelIndex() >= 0) {
      const ir::HostTensor& t = mine->tensors[static_cast<size_t>(spec.labelIndex())];
      labels.assign(t.as<float>(), t.as<float>() + local * k);
    }
    if (ranks > 1) {
      std::vector<float> all(static_cast<size_t>(local * k * ranks));
      KILN_RETURN_IF_ERROR(c->allGatherSync(scores.data(), all.data(), scores.size(), comm::DataType::f32));
      scores.swap(all);
      if (spec.labelIndex() >= 0) {
        all.assign(static_cast<size_t>(local * k * ranks), 0.0f);
        KILN_RETURN_IF_ERROR(c->allGatherSync(labels.data(), all.data(), labels.size(), comm::DataType::f32));
        labels.swap(all);
      }
    }
    KILN_RETURN_IF_ERROR(meanOverRanks(&batch_loss, 1));
    loss.add(batch_loss, static_cast<double>(local * ranks));
    for (const auto& [name, values] : out.stats) {
      const std::optional<size_t> task = taskLossIndex(name);
      if (!task || values.size() != 1) continue;
      const size_t j = *task;
      if (task_loss.size() <= j) task_loss.resize(j + 1);
      double v = values[0];
      KILN_RETURN_IF_ERROR(meanOverRanks(&v, 1));
      task_loss[j].add(v, static_cast<double>(local * ranks));
    }
    if (spec.labelIndex() >= 0 && !raw) {
      if (k == 1) {
        auc[0].add(scores, labels);
      } else {
        const size_t n = labels.size() / static_cast<size_t>(k);
        task_scores.resize(n);
        task_labels.resize(n);
        for (int64_t j = 0; j < k; ++j) {
          for (size_t i = 0; i < n; ++i) {
            task_scores[i] = scores[i * static_cast<size_t>(k) + static_cast<size_t>(j)];
            task_labels[i] = labels[i * static_cast<size_t>(k) + static_cast<size_t>(j)];
          }
          auc[static_cast<size_t>(j)].add(task_scores, task_labels);
        }
      }
    }
    if (on_scores) KILN_RETURN_IF_ERROR(on_scores(scores, columns, batch.skipped));
    r.samples += local * ranks;
  }
  r.left_out = left_out;
  if (on_scores) KILN_RETURN_IF_ERROR(on_scores({}, columns, prefetch.skippedAtEnd()));
  r.malformed = prefetch.malformed();
  if (r.samples == 0) return Status::error("the evaluation data holds no samples");
  r.loss = s.hasTrainBlock() ? loss.mean() : NAN;
  for (const auto& [name, mean] : metrics) r.metrics.push_back({name, mean.mean()});
  for (size_t i = 0; i < aux_names.size(); ++i) r.balancing.push_back({aux_names[i], balancing[i].mean()});
  r.auc = auc[0].size() ? auc[0].auc() : NAN;
  r.accuracy = auc[0].size() ? auc[0].accuracy() : NAN;
  if (k > 1)
    for (int64_t j = 0; j < k; ++j) {
      const runtime::AucAccumulator& a = auc[static_cast<size_t>(j)];
      const double task =
          task_loss.size() == static_cast<size_t>(k) ? task_loss[static_cast<size_t>(j)].mean() : NAN;
      r.tasks.push_back(
          {tasks[static_cast<size_t>(j)], a.size() ? a.auc() : NAN, a.size() ? a.accuracy() : NAN, task});
    }
  if (!scored) {
    r.perplexity = std::exp(r.loss);
    r.entropy_floor = entropy_floor;
  }
  return r;
}

std::string_view metricStatName(std::string_view stat) {
  static constexpr std::string_view kPrefix = "metric.";
  return stat.substr(0, kPrefix.size()) == kPrefix ? stat.substr(kPrefix.size()) : std::string_view();
}

std::vector<std::string> taskNames(const data::BatchSpec& spec) {
  std::vector<std::string> names;
  if (spec.labelIndex() < 0) return names;
  const data::InputSpec& label = spec.inputs[static_cast<size_t>(spec.labelIndex())];
  for (int j = 0; j < label.label_count; ++j) {
    const bool named =
        static_cast<size_t>(j) < label.columns.size() && label.columns[static_cast<size_t>(j)].named();
    names.push_back(named ? label.columns[static_cast<size_t>(j)].name : fmt::format("task{}", j));
  }
  return names;
}

std::optional<size_t> taskLossIndex(std::string_view stat_name) {
  static constexpr std::string_view kPrefix = "task_loss.";
  if (stat_name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  const std::string_view digits = stat_name.substr(kPrefix.size());
  size_t j = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), j);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return j;
}

// A sharded checkpoint (a directory with an index) is merged in memory, as `kiln checkpoint
// merge` would write it; otherwise the directory's checkpoint.safetensors, or the file given.
Expected<std::string> checkpointFile(const std::string& dir_or_file) {
  std::filesystem::path p(dir_or_file);
  if (std::filesystem::is_directory(p)) {
    if (runtime::ShardedCheckpoint::isShardedDir(p.string()))
      return Status::errorf("'{}' is a sharded checkpoint: merge it first (kiln checkpoint merge)", dir_or_file);
    p /= "checkpoint.safetensors";
  }
  if (!std::filesystem::exists(p)) return Status::errorf("no checkpoint at '{}'", p.string());
  return p.string();
}

Expected<runtime::Checkpoint> readCheckpoint(const std::string& dir_or_file, std::string& path) {
  path = dir_or_file;
  if (std::filesystem::is_directory(path) && runtime::ShardedCheckpoint::isShardedDir(path)) {
    KILN_ASSIGN_OR_RETURN(auto sharded, runtime::ShardedCheckpoint::open(path));
    return sharded.merge();
  }
  KILN_ASSIGN_OR_RETURN(path, checkpointFile(dir_or_file));
  return runtime::loadCheckpoint(path);
}

Status loadCheckpointInto(Session& s, const std::string& dir_or_file) {
  std::string path;
  KILN_ASSIGN_OR_RETURN(auto ckpt, readCheckpoint(dir_or_file, path));
  // Evaluation reads the model's parameters; the optimizer state a training checkpoint also
  // holds is left out. Every parameter of the model must be there.
  std::map<std::string, ir::TensorView> dest;
  for (const std::string& name : s.checkpointNames()) dest[name] = s.params().find(name)->view;
  runtime::Checkpoint wanted;
  wanted.metadata = ckpt.metadata;
  for (auto& [name, tensor] : ckpt.tensors)
    if (dest.count(name)) wanted.tensors.emplace_back(name, std::move(tensor));
  return runtime::restoreTensors(wanted, dest, path);
}

}  // namespace kiln::driver
