// `kiln eval MODEL.kiln --checkpoint DIR --data PATH...`: loss and AUC of a trained model (of a
// language model: its held-out cross entropy and perplexity).
// `kiln predict MODEL.kiln --checkpoint DIR --data PATH... [-o OUT]`: one score per input line.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "driver/evaluator.h"
#include "tools/cli.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

struct EvalSetup {
  std::unique_ptr<driver::Session> session;
  driver::EvalDataOptions data;
};

// Parses the flags both commands share, compiles the model and loads the checkpoint.
int setUp(const char* command, const ModelSource& model, ArgParser& p, const std::vector<std::string>& args,
          EvalSetup& setup) {
  model.addModelArgument(p);
  p.addOption("checkpoint", "DIR",
              "the checkpoint to load (a directory written by kiln train, a sharded checkpoint directory, or "
              "a .safetensors file)");
  p.addOption("data", "synthetic|PATH", "the data: Criteo TSV or Kiln binary files, or 'synthetic' (its held-out stream)",
              std::nullopt, true);
  p.addOption("batch", "B", "samples per step", model.defaultBatch(1024));
  p.addOption("samples", "N", "samples of the held-out synthetic stream", "16384");
  p.addFlag("strict", "a malformed data line is fatal instead of skipped and counted");
  p.addOption("token-dtype", "u16|u32",
              "token files (language models): the id type (default: by name, .bin is u16)");
  addModelFlags(p, model);
  int code;
  if (!p.parse(args, &code)) return code;
  // A compiled model with embedded weights needs none.
  if (!p.has("checkpoint") && !model.embeddedWeights()) return p.usageError("--checkpoint DIR is required");
  if (p.getAll("data").empty()) return p.usageError("--data PATH is required");
  auto batch = p.getInt("batch");
  auto samples = p.getInt("samples");
  if (!batch || !samples) return kExitUsage;
  if (*batch < 1 || *samples < 1) return p.usageError("--batch and --samples must be positive");
  setup.data.paths = p.getAll("data");
  for (const std::string& d : setup.data.paths)
    if (d != "synthetic" && !std::filesystem::exists(d)) return p.usageError(fmt::format("no such data file '{}'", d));
  setup.data.batch = *batch;
  setup.data.synthetic_samples = *samples;
  setup.data.strict = p.flag("strict");
  setup.data.token_dtype = p.get("token-dtype");

  driver::SessionOptions so;
  if (!model.readModelArgument(p, so, &code)) return code;
  so.batch = *batch;
  so.training = false;
  so.checkpoint_path = p.get("checkpoint");  // loaded whole after create(): the memory check counts it
  if (!readModelFlags(p, model, so, &code)) return code;
  setup.data.seed = so.seed;
  auto session = model.open(so, std::cerr);
  if (!session) {
    printError(command, session.status());
    return kExitError;
  }
  setup.session = session.take();
  Status st = p.has("checkpoint") ? driver::loadCheckpointInto(*setup.session, p.get("checkpoint")) : Status::ok();
  if (!st) {
    printError(command, st);
    return kExitError;
  }
  return -1;
}

}  // namespace

int runEval(const ModelSource& model, const std::vector<std::string>& args) {
  ArgParser p(
      "eval", model.synopsis("eval") + " --checkpoint DIR --data PATH... [flags]",
      "Evaluates a trained model: prints 'loss: X', 'auc: Y', 'accuracy: Z' and 'samples: N'; a\n"
      "multi-task model (a label of k columns) also each task's 'auc.NAME' and 'accuracy.NAME', and a\n"
      "model's own metrics (in_batch_recall's 'recall@K') by name. The loss is the task's: a MoE\n"
      "layer's balancing losses, which training adds to it, are printed on their own ('moe.0.aux_loss').");
  EvalSetup setup;
  if (int code = setUp("eval", model, p, args, setup); code >= 0) return code;
  auto r = driver::evaluateModel(*setup.session, setup.data);
  if (!r) {
    printError("eval", r.status());
    return kExitError;
  }
  // The loss is the task's; the balancing losses the training loss adds follow on their own.
  auto printBalancing = [&] {
    for (const auto& [name, value] : r->balancing) std::printf("%s: %.17g\n", name.c_str(), value);
  };
  if (setup.session->forwardSpec().readsTokens()) {
    std::printf("loss: %.17g\nperplexity: %.17g\n", r->loss, r->perplexity);
    printBalancing();
    if (r->entropy_floor) std::printf("entropy floor: %.17g\n", *r->entropy_floor);
    std::printf("samples: %lld\n", static_cast<long long>(r->samples));
    return kExitOk;
  }
  std::printf("loss: %.17g\nauc: %.17g\naccuracy: %.17g\n", r->loss, r->auc, r->accuracy);
  printBalancing();
  for (const auto& [name, value] : r->metrics) std::printf("%s: %.17g\n", name.c_str(), value);
  for (const driver::TaskResult& t : r->tasks) {
    std::printf("auc.%s: %.17g\naccuracy.%s: %.17g\n", t.name.c_str(), t.auc, t.name.c_str(), t.accuracy);
    if (!std::isnan(t.loss)) std::printf("loss.%s: %.17g\n", t.name.c_str(), t.loss);
  }
  std::printf("samples: %lld\n", static_cast<long long>(r->samples));
  if (r->malformed) std::fprintf(stderr, "skipped %lld malformed lines\n", static_cast<long long>(r->malformed));
  return kExitOk;
}

int runPredict(const ModelSource& model, const std::vector<std::string>& raw_args) {
  ArgParser p("predict", model.synopsis("predict") + " --checkpoint DIR --data PATH... [-o OUT]",
              "Writes one score (the predicted probability) per input sample, one per line, in input order\n"
              "(a multi-task model: one tab-separated column per task, in its label's order; a\n"
              "prediction that is not one logit per sample, such as an embedding or a regression's\n"
              "[B, H]: its H values as the model computes them, tab-separated).\n"
              "A malformed TSV line gets the score 'nan' and a warning naming its file and line (with\n"
              "--strict it is an error instead), so line k of the output belongs to line k of the input\n"
              "(the files taken in order) and the two join back by line.");
  p.addOption("output", "OUT", "write the scores to OUT instead of stdout (also -o OUT)");
  std::vector<std::string> args = expandOutputShorthand(raw_args);
  EvalSetup setup;
  if (int code = setUp("predict", model, p, args, setup); code >= 0) return code;
  if (setup.session->forwardSpec().readsTokens()) {
    printError("predict",
               Status::error("a language model (a token input) has no per-sample score: use kiln eval for "
                             "its loss and perplexity"));
    return kExitError;
  }
  std::string out_path = p.get("output");
  std::string tmp_path = out_path.empty() ? "" : out_path + ".tmp";
  std::FILE* out = out_path.empty() ? stdout : std::fopen(tmp_path.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "kiln predict: error: cannot write '%s'\n", tmp_path.c_str());
    return kExitError;
  }
  // The values per line: one score per task, or a prediction's H values per sample (an
  // embedding, a regression's [B, H]); known from the first batch, whose malformed lines the
  // reader reports before the batch is scored, so their warnings wait for it.
  const size_t tasks = std::max<size_t>(driver::taskNames(setup.session->forwardSpec()).size(), 1);
  size_t columns = tasks;
  int64_t unscored = 0;
  std::vector<std::string> waiting;
  auto warn = [&] {
    for (const std::string& w : waiting)
      std::fprintf(stderr, "%s (its %s)\n", w.c_str(), columns == tasks ? "score is nan" : "values are nan");
    waiting.clear();
  };
  setup.data.on_skip = [&](const Status& why) {
    ++unscored;
    waiting.push_back(fmt::format("{}: warning: {}", why.location().str(), why.message()));
  };
  // Each batch's scores with its malformed lines in their places: one output line per input line.
  // A multi-task model writes one tab-separated column per task, a prediction of H values per
  // sample H columns; a malformed line gets a nan in each ('nan' rather than an empty line:
  // numpy.loadtxt and pandas.read_csv skip blank lines, which would shift every later score, but
  // read 'nan' as a missing value in its place).
  auto write = [&](const std::vector<float>& scores, int64_t width,
                   const std::vector<data::SkippedLine>& skipped) {
    columns = static_cast<size_t>(width);
    warn();
    std::string nan_line;
    for (size_t j = 0; j < columns; ++j) nan_line += j + 1 < columns ? "nan\t" : "nan\n";
    size_t k = 0;
    const size_t samples = scores.size() / columns;
    for (size_t i = 0; i <= samples; ++i) {
      for (; k < skipped.size() && skipped[k].before == static_cast<int64_t>(i); ++k)
        if (std::fputs(nan_line.c_str(), out) < 0) return Status::error("write failed");
      for (size_t j = 0; i < samples && j < columns; ++j)
        if (std::fprintf(out, j + 1 < columns ? "%.9g\t" : "%.9g\n",
                         static_cast<double>(scores[i * columns + j])) < 0)
          return Status::error("write failed");
    }
    return Status::ok();
  };
  const auto started = std::chrono::steady_clock::now();
  auto r = driver::evaluateModel(*setup.session, setup.data, write);
  warn();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (out != stdout && std::fclose(out) != 0 && r) r = Status::error(fmt::format("cannot write '{}'", out_path));
  if (!r) {
    if (!tmp_path.empty()) std::filesystem::remove(tmp_path);
    printError("predict", r.status());
    return kExitError;
  }
  if (!tmp_path.empty()) std::filesystem::rename(tmp_path, out_path);
  // The time of reading and scoring, without start-up (compiling, loading the checkpoint).
  const std::string rate = fmt::format(" ({:.2f} s, {:.0f} samples/s)", seconds,
                                       seconds > 0 ? static_cast<double>(r->samples) / seconds : 0.0);
  const std::string what = columns == tasks ? fmt::format("{} scores", r->samples)
                                            : fmt::format("{} predictions of {} values", r->samples, columns);
  if (unscored)
    std::fprintf(stderr, "wrote %s and %lld nan for malformed lines%s\n", what.c_str(),
                 static_cast<long long>(unscored), rate.c_str());
  else
    std::fprintf(stderr, "wrote %s%s\n", what.c_str(), rate.c_str());
  return kExitOk;
}

}  // namespace kiln::cli
