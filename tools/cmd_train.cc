// `kiln train MODEL.kiln`: compiles the model's training step and trains it, showing progress
// (step, samples/s, loss, last eval AUC, time left), evaluating, checkpointing and resuming. The
// loop is the driver's (driver/trainer.h); this file holds its flags, the ranks it runs on and the
// console that prints it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "driver/trainer.h"
#include "runtime/comm/local_group.h"
#include "runtime/comm/mpi_communicator.h"
#include "runtime/memory.h"
#include "runtime/stop_signals.h"
#include "runtime/trace.h"
#include "tools/cli.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

// What rank 0 prints of a run: the header, warnings and progress on stderr (on a terminal the
// progress line is redrawn in place), the summary on stdout.
class Console : public driver::TrainObserver {
 public:
  explicit Console(const driver::TrainOptions& options) : f_(options) {}

  void onWarning(const std::string& text) override {
    std::fprintf(stderr, "kiln train: warning: %s\n", text.c_str());
  }

  void onResumed(const driver::ResumeInfo& r) override {
    if (r.saved_ranks == 0)
      std::fprintf(stderr, "resumed from %s at step %lld\n", r.path.c_str(), static_cast<long long>(r.step));
    else
      std::fprintf(stderr, "resumed from %s at step %lld (saved by %d rank%s, resumed on %d)\n", r.path.c_str(),
                   static_cast<long long>(r.step), r.saved_ranks, r.saved_ranks == 1 ? "" : "s", r.ranks);
  }

  void onStart(const driver::TrainStart& start) override {
    if (start.device == "cpu") printCpuHeader(start.threads);
    if (!start.plan) return;
    // The sharding plan the run uses: where it came from, then each table's type, ranks, hot rows
    // and de-duplication.
    std::string source = start.plan->source;
    if (source == "proposed") source = "the planner's proposal over the data's ids (kiln plan --data prints it)";
    std::fprintf(stderr, "plan: %s\n", source.c_str());
    for (const auto& [table, entry] : start.plan->tables)
      std::fprintf(stderr, "  %-16s %s\n", table.c_str(), entry.c_str());
  }

  void onEntropyFloor(double nats) override {
    std::fprintf(stderr, "synthetic tokens: entropy floor %.4f nats (the per-token loss no model can beat)\n", nats);
  }

  void onProgress(const driver::TrainProgress& p) override;

  void onStopping(int signal, int64_t step) override {
    std::fprintf(stderr, "%s%s: stopping after step %lld%s (a second signal ends the run at once)\n",
                 tty_ ? "\n" : "", runtime::signalName(signal).c_str(), static_cast<long long>(step),
                 f_.checkpoint_dir.empty() ? "" : ", once its checkpoint is saved");
  }

  void onSkippedLines(int64_t count) override {
    std::fprintf(stderr, "%sskipped %lld malformed lines\n", tty_ ? "\n" : "", static_cast<long long>(count));
  }

  void onFinish(const driver::TrainSummary& s) override;

  void onTraceWritten(const std::string& path, int64_t first, int64_t last) override {
    if (first <= last)
      std::printf("trace: %s (steps %lld to %lld of this run)\n", path.c_str(), static_cast<long long>(first),
                  static_cast<long long>(last));
    else
      std::printf("trace: %s (no step)\n", path.c_str());
  }

  // The error that follows starts on a line of its own.
  void onAbort(int64_t) override {
    if (tty_) std::fprintf(stderr, "\n");
  }

 private:
  const driver::TrainOptions& f_;
  bool tty_ = isatty(STDERR_FILENO);
};

void Console::onProgress(const driver::TrainProgress& p) {
  // The last line repeats the step's report only where it redraws the same line.
  if (p.final && p.repeated && !tty_) return;
  std::string total = p.steps > 0 ? fmt::format("/{}", p.steps) : "";
  const driver::TrainEvaluation& ev = p.evaluation;
  std::string auc = ev.auc ? fmt::format(" | eval auc {:.4f}", *ev.auc) : "";
  if (!ev.tasks.empty()) {
    auc = " | eval auc";
    for (const driver::TaskResult& t : ev.tasks) auc += fmt::format(" {} {:.4f}", t.name, t.auc);
  }
  if (ev.perplexity) auc = fmt::format(" | eval ppl {:.4f}", *ev.perplexity);
  if (!ev.metrics.empty()) {
    auc += " | eval";
    for (const auto& [name, value] : ev.metrics) auc += fmt::format(" {} {:.4f}", name, value);
  }
  // On N ranks: the global rate, each rank's share, what a step sends and the time in collectives.
  std::string ranks =
      p.ranks == 1 ? ""
                   : fmt::format(" ({:.0f}/rank) | {}/step sent, {:.0f}% in collectives", p.samples_per_s / p.ranks,
                                 runtime::formatBytes(static_cast<uint64_t>(p.comm_bytes_per_step)),
                                 100 * p.comm_wait_fraction);
  std::string tasks;
  for (size_t i = 0; i < p.task_losses.size(); ++i)
    tasks += fmt::format("{}{} {:.5f}", i ? " " : " (", p.task_losses[i].first, p.task_losses[i].second);
  if (!tasks.empty()) tasks += ")";
  std::string line = fmt::format("step {}{} | {:.0f} samples/s{} | loss {:.5f}{}{}{} | elapsed {} | left {}",
                                 p.step, total, p.samples_per_s, ranks, p.loss, tasks,
                                 driver::MoeStatsWindow::progressText(p.moe), auc,
                                 driver::formatDuration(p.elapsed), p.left ? driver::formatDuration(*p.left) : "?");
  if (tty_)
    std::fprintf(stderr, "\r\033[K%s%s", line.c_str(), p.final ? "\n" : "");
  else
    std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

void Console::onFinish(const driver::TrainSummary& s) {
  std::printf("trained %s: %lld steps (%lld this run), %lld samples in %.1f s, %.0f samples/s%s\n", s.model.c_str(),
              static_cast<long long>(s.step), static_cast<long long>(s.step - s.start_step),
              static_cast<long long>(s.samples), s.seconds,
              s.seconds > 0 ? static_cast<double>(s.samples) / s.seconds : 0.0,
              s.data_exhausted ? " (data exhausted)" : "");
  if (s.trained())
    std::printf("final train loss: %.6f\n", s.final_loss);
  else if (f_.steps > 0)
    std::printf("nothing left to train: the checkpoint holds step %lld, and --steps asks for %lld\n",
                static_cast<long long>(s.step), static_cast<long long>(f_.steps));
  else
    std::printf("nothing left to train: the checkpoint holds step %lld, past the data's last batch\n",
                static_cast<long long>(s.step));
  const driver::TrainEvaluation& ev = s.evaluation;
  if (ev.loss) std::printf("eval loss: %.6f\n", *ev.loss);
  if (ev.auc) std::printf("eval auc: %.6f\n", *ev.auc);
  for (const driver::TaskResult& t : ev.tasks) std::printf("eval auc.%s: %.6f\n", t.name.c_str(), t.auc);
  if (ev.perplexity) std::printf("eval perplexity: %.6f\n", *ev.perplexity);
  for (const auto& [name, value] : ev.metrics) std::printf("eval %s: %.6f\n", name.c_str(), value);
  for (const auto& [name, value] : ev.balancing) std::printf("eval %s: %.6f\n", name.c_str(), value);
  if (s.entropy_floor) std::printf("entropy floor: %.6f nats\n", *s.entropy_floor);
  if (!s.checkpoint.empty()) std::printf("checkpoint: %s\n", s.checkpoint.c_str());
  std::printf("%s", s.profile.c_str());
  if (s.stopped_by) {
    // What a scheduler's preemption (or the user at the terminal) needs to know: where the run
    // stands, and that nothing is half written.
    const std::string held =
        f_.checkpoint_dir.empty()
            ? "no --checkpoint was given, so the steps trained are not saved"
            : fmt::format("the checkpoint in {} holds step {} (--resume continues from it)", f_.checkpoint_dir,
                          s.checkpoint_step);
    std::fprintf(stderr, "stopped by %s after step %lld%s: %s\n", runtime::signalName(s.stopped_by).c_str(),
                 static_cast<long long>(s.step), f_.steps > 0 ? fmt::format(" of {}", f_.steps).c_str() : "",
                 held.c_str());
  }
}

// A rank's code for a run a stop signal ended cleanly, every rank at the same step.
bool stoppedBySignal(int rc) { return rc > 128; }

}  // namespace

int runTrain(const ModelSource& model, const std::vector<std::string>& args) {
  ArgParser p("train", model.synopsis("train") + " [--data synthetic|PATH...] [--steps N | --epochs E] [flags]",
              "Compiles the model's training step and trains it on the CPU, showing step, samples/s, loss,\n"
              "the last eval AUC and the time left.");
  model.addModelArgument(p);
  p.addOption("data", "synthetic|PATH",
              "training data: 'synthetic' or Criteo TSV / Kiln binary files (a language model: token files, "
              "e.g. train.bin)",
              "synthetic", true);
  p.addOption("eval-data", "PATH", "held-out data to evaluate on (default with synthetic data: a held-out stream)",
              std::nullopt, true);
  p.addOption("steps", "N", "train until step N (counted from the start of training, also when resuming)");
  p.addOption("epochs", "E", "passes over the data (default 1 without --steps)");
  p.addOption("batch", "B", "samples per step", model.defaultBatch(256));
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
  addModelFlags(p, model);
  addDeviceFlag(p);
  int code;
  if (!p.parse(args, &code)) return code;

  driver::TrainOptions f;
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
  if (!model.readModelArgument(p, so, &code)) return code;
  so.batch = f.batch;
  so.profile = f.profile;
  // Made before the session, which keeps a pointer for its executors; off until the window.
  std::unique_ptr<runtime::Tracer> tracer;
  if (!f.trace_path.empty()) {
    tracer = std::make_unique<runtime::Tracer>();
    tracer->setRecording(false);
  }
  if (f.resume) so.checkpoint_path = f.checkpoint_dir;  // loaded whole: the memory check counts it
  if (!readModelFlags(p, model, so, &code) || !readDeviceFlag(p, so, &code)) return code;
  f.seed = so.seed;
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
    auto session = model.open(mine, std::cerr);
    if (!session) {
      printError(ranks > 1 ? fmt::format("train: rank {}", rank) : "train", session.status());
      return kExitError;
    }
    Console console(f);
    driver::Trainer trainer(**session, f, &console, rank == 0 && !peer_tracers.empty() ? &peer_tracers : nullptr);
    auto summary = trainer.run();
    if (!summary) {
      printError(ranks > 1 ? fmt::format("train: rank {}", rank) : "train", summary.status());
      return kExitError;
    }
    // Stopped by a signal: the shell's code for it (128 + the signal), so that a script tells an
    // interrupted run from a finished one; the checkpoint is whole either way.
    return summary->stopped_by ? 128 + summary->stopped_by : kExitOk;
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
