#include "tools/run_data.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>

#include "runtime/checkpoint.h"
#include "runtime/data/batch_reader.h"
#include "runtime/data/prefetcher.h"
#include "runtime/metrics.h"
#include "runtime/sharded_checkpoint.h"

namespace kiln::cli {

Expected<EvalResult> evaluateModel(ModelSession& s, const EvalDataOptions& o, const ScoreSink& on_scores) {
  data::DataOptions opts;
  opts.paths = o.paths;
  opts.batch_size = o.batch;
  opts.epochs = 1;
  opts.strict = o.strict;
  opts.on_skip = o.on_skip;
  opts.synthetic.seed = o.seed + 1;  // the same hidden task as training ...
  opts.synthetic.stream = 1;         // ... on the held-out stream
  opts.synthetic_samples = o.synthetic_samples;
  KILN_ASSIGN_OR_RETURN(auto reader, data::openBatchReader(s.forwardSpec(), opts));
  data::Prefetcher prefetch(std::move(reader), kEvalPrefetchDepth);

  const data::BatchSpec& spec = s.forwardSpec();
  runtime::AucAccumulator auc;
  runtime::RunningMean loss;
  data::Batch batch;
  EvalResult r;
  std::vector<float> scores, labels;
  while (true) {
    KILN_ASSIGN_OR_RETURN(auto more, prefetch.next(batch));
    if (!more) break;
    KILN_ASSIGN_OR_RETURN(auto out, s.forward(batch));
    loss.add(out.loss, static_cast<double>(batch.size));
    scores.resize(out.logits.size());
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = 1.0f / (1.0f + std::exp(-out.logits[i]));
    if (spec.labelIndex() >= 0) {
      labels.resize(static_cast<size_t>(batch.size));
      for (int64_t i = 0; i < batch.size; ++i) labels[static_cast<size_t>(i)] = data::batchLabel(batch, spec, i);
      auc.add(scores, labels);
    }
    if (on_scores) KILN_RETURN_IF_ERROR(on_scores(scores, batch.skipped));
    r.samples += batch.size;
  }
  if (on_scores) KILN_RETURN_IF_ERROR(on_scores({}, prefetch.skippedAtEnd()));
  r.malformed = prefetch.malformed();
  if (r.samples == 0) return Status::error("the evaluation data holds no samples");
  r.loss = s.hasTrainBlock() ? loss.mean() : NAN;
  r.auc = auc.size() ? auc.auc() : NAN;
  r.accuracy = auc.size() ? auc.accuracy() : NAN;
  return r;
}

namespace {

// A sharded checkpoint (a directory with an index) is merged in memory, as `kiln checkpoint
// merge` would write it; otherwise the directory's checkpoint.safetensors, or the file given.
Expected<runtime::Checkpoint> readCheckpoint(const std::string& dir_or_file, std::string& path) {
  path = dir_or_file;
  if (std::filesystem::is_directory(path)) {
    if (runtime::ShardedCheckpoint::isShardedDir(path)) {
      KILN_ASSIGN_OR_RETURN(auto sharded, runtime::ShardedCheckpoint::open(path));
      return sharded.merge();
    }
    path = (std::filesystem::path(path) / "checkpoint.safetensors").string();
  }
  if (!std::filesystem::exists(path)) return Status::error(fmt::format("no checkpoint at '{}'", path));
  return runtime::loadCheckpoint(path);
}

}  // namespace

Status loadCheckpointInto(ModelSession& s, const std::string& dir_or_file) {
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

}  // namespace kiln::cli
