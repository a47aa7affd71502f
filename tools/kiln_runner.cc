// The runner of a model compiled ahead of time (`kiln compile`, docs/aot.md): this binary with a
// payload appended. `./NAME train|eval|predict` are kiln's own commands run on the payload as
// their model source (CompiledSource, tools/session_flags.h): one parse of the user's arguments,
// the same flags as `kiln` less the model file and the compiler's flags (--set, the passes), which
// were fixed at compile time, and --batch defaulting to the batch it was compiled for; then the
// same driver calls. `./NAME info` describes it.
#include <fmt/format.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "ir/parser.h"
#include "runtime/data/batch.h"
#include "runtime/payload.h"
#include "tools/cli.h"
#include "driver/compiled_model.h"
#include "tools/session_flags.h"

namespace kiln::cli {

int runTrain(const ModelSource& model, const std::vector<std::string>& args);
int runEval(const ModelSource& model, const std::vector<std::string>& args);
int runPredict(const ModelSource& model, const std::vector<std::string>& args);
#ifdef KILN_RUNNER_SERVE
int runServe(const ModelSource& model, const std::vector<std::string>& args);
#endif

namespace {

std::string joined(const std::vector<std::string>& v) {
  return v.empty() ? "none" : fmt::format("{}", fmt::join(v, ", "));
}

int info(const driver::CompiledModel& c, const std::string& self) {
  auto module = ir::parseModule(c.module_text, "payload");
  if (!module) {
    printError("info", module.status());
    return kExitError;
  }
  std::printf("model: %s (compiled from %s by Kiln %s)\n", c.name.c_str(), c.source.c_str(),
              c.kiln_version.c_str());
  std::printf("payload: version %u, %.1f MB in %s\n", c.payload->version(),
              static_cast<double>(c.payload->size()) / 1e6, self.c_str());
  std::printf("max batch: %lld\n", static_cast<long long>(c.max_batch));
  std::printf("functions: %s\n", joined(c.functions).c_str());
  std::printf("devices: %s\n", joined(c.devices).c_str());
  std::printf("cuda architectures: %s\n", joined(c.archs).c_str());
  std::printf("planned for: %s\n", c.target.c_str());
  std::vector<std::string> sets;
  for (const auto& [k, v] : c.overrides) sets.push_back(k + "=" + v);
  std::printf("compiled with: %s\n",
              sets.empty() ? "no --set" : fmt::format("--set {}", fmt::join(sets, " --set ")).c_str());
  std::printf("weights: %s\n", c.weights.empty()
                                   ? "initialised at run time from --seed"
                                   : fmt::format("embedded ({:.1f} MB)", c.weights.size() / 1e6).c_str());
  if (const ir::Function* f = (*module)->lookup("forward")) {
    auto spec = data::fromFunction(*f);
    if (spec) {
      std::printf("inputs:\n");
      for (const data::InputSpec& in : spec->inputs)
        std::printf("  %-16s %-28s %s\n", in.name.c_str(), in.type.str().c_str(),
                    std::string(data::roleName(in.role)).c_str());
    }
  }
  std::printf("parameters:\n");
  const ir::Function* f = (*module)->lookup("train_step");
  if (!f) f = (*module)->lookup("forward");
  int64_t total = 0;
  for (const auto& op : f->entry().ops()) {
    if (!op->is(ir::OpCode::Parameter)) continue;
    const ir::TensorType& t = op->result(0)->type();
    auto bytes = t.checkedBytes({});
    if (bytes) total += *bytes;
    std::printf("  %-32s %-24s %s\n", op->strAttr("name").c_str(), t.str().c_str(),
                op->strAttr("init", "zeros").c_str());
  }
  std::printf("parameter bytes: %lld\n", static_cast<long long>(total));
  return kExitOk;
}

void printHelp(const std::string& name, const driver::CompiledModel& c) {
  std::printf(
      "usage: %s COMMAND [flags]\n\n%s, compiled ahead of time by Kiln %s (batch up to %lld).\n\ncommands:\n",
      name.c_str(), c.name.c_str(), c.kiln_version.c_str(), static_cast<long long>(c.max_batch));
  if (c.has("train"))
    std::printf("  train      Train it (synthetic data or Criteo files), with eval, checkpoints, resume\n");
  if (c.has("eval")) std::printf("  eval       Evaluate it on data: loss and AUC\n");
  if (c.has("predict")) std::printf("  predict    Write one score per input sample\n");
#ifdef KILN_RUNNER_SERVE
  if (c.has("predict")) std::printf("  serve      Serve it over HTTP: KServe v2, dynamic batching (docs/serving.md)\n");
#endif
  std::printf("  info       Its inputs, parameters, architectures, max batch and payload version\n");
  std::printf("\nRun '%s COMMAND --help' for a command's flags (those of kiln's, without MODEL.kiln).\n",
              name.c_str());
}

}  // namespace
}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln;
  using namespace kiln::cli;
  std::signal(SIGXFSZ, SIG_IGN);
  const std::string name = std::filesystem::path(argv[0]).filename().string();
  auto self = runtime::selfExecutablePath();
  auto payload = self ? runtime::Payload::open(*self) : Expected<runtime::Payload>(self.status());
  if (!payload) {
    std::fprintf(stderr, "%s: error: %s\n", name.c_str(), payload.status().message().c_str());
    return kExitError;
  }
  auto compiled = driver::loadCompiledModel(std::make_shared<const runtime::Payload>(payload.take()));
  if (!compiled) {
    std::fprintf(stderr, "%s: error: %s\n", name.c_str(), compiled.status().message().c_str());
    return kExitError;
  }
  const driver::CompiledModel& c = **compiled;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    printHelp(name, c);
    return argc < 2 ? kExitUsage : kExitOk;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  if (command == "info") return info(c, *self);
  using Run = int (*)(const ModelSource&, const std::vector<std::string>&);
  const std::map<std::string, std::pair<std::string, Run>> commands{
      {"train", {"train", runTrain}},
      {"eval", {"eval", runEval}},
      {"predict", {"predict", runPredict}},
#ifdef KILN_RUNNER_SERVE
      {"serve", {"predict", runServe}},
#endif
  };
  auto it = commands.find(command);
  if (it == commands.end()) {
    std::fprintf(stderr, "%s: error: unknown command '%s' (see '%s --help')\n", name.c_str(), command.c_str(),
                 name.c_str());
    return kExitUsage;
  }
  if (!c.has(it->second.first)) {
    std::fprintf(stderr, "%s: error: compiled without '%s' (kiln compile --functions %s)\n", name.c_str(),
                 command.c_str(), fmt::format("{}", fmt::join(c.functions, ",")).c_str());
    return kExitUsage;
  }
  // The runner has no --set (its source declares no compile flags): say why rather than that the
  // flag is unknown.
  for (const std::string& a : args)
    if (a == "--set" || a.rfind("--set=", 0) == 0) {
      std::fprintf(stderr,
                   "%s: error: the model's params were fixed when it was compiled (%s); recompile with kiln "
                   "compile --set to change them\n",
                   name.c_str(), c.overrides.empty() ? "no --set" : "see `info`");
      return kExitUsage;
    }
  const CompiledSource model(*compiled, *self, name);
  const Run run = it->second.second;
  return runCommandGuarded(name, command, [&](const std::vector<std::string>& a) { return run(model, a); }, args);
}
