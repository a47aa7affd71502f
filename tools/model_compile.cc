// The model file as a command's source: `kiln` opens its sessions by compiling MODEL.kiln
// (driver/compile.cc) under the compile flags (--set, --memory-budget, --precision, --target, the
// pass manager's); an ahead-of-time runner, which holds no compiler, opens its payload instead
// (CompiledSource, driver/compiled_model.h).
#include <fmt/format.h>

#include <filesystem>
#include <iostream>

#include "frontend/frontend.h"
#include "ir/precision.h"
#include "passes/remat.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

class ModelFile final : public ModelSource {
 public:
  std::string synopsis(const std::string& command) const override { return "kiln " + command + " MODEL.kiln"; }
  void addModelArgument(ArgParser& p) const override { p.setPositionals("MODEL.kiln", 1, 1, "the model"); }
  bool readModelArgument(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const override;
  void addCompileFlags(ArgParser& p) const override;
  bool readCompileFlags(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const override;
  Expected<std::unique_ptr<driver::Session>> open(const driver::SessionOptions& options,
                                                  std::ostream& diag) const override {
    return driver::Session::create(options, diag);
  }
};

bool ModelFile::readModelArgument(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const {
  o.model_path = p.positionals()[0];
  if (std::filesystem::exists(o.model_path)) return true;
  *exit_code = p.usageError(fmt::format("no such model file '{}'", o.model_path));
  return false;
}

void ModelFile::addCompileFlags(ArgParser& p) const {
  p.addOption("set", "NAME=VALUE", "override a model param (e.g. --set rows_cap=1000)", std::nullopt, true);
  p.addOption("memory-budget", "BYTES|N%",
              "recompute activations in the backward pass until the training step's planned peak fits "
              "(remat{budget=...})");
  p.addOption("precision", "f32|bf16|f32_strict",
              "GEMM precision, overriding the train block's: bf16 stores the inputs and outputs of every "
              "matmul-like op in bf16 and accumulates in f32, over f32 master weights; f32 runs f32 GEMMs "
              "in TF32 on a GPU's tensor cores, f32_strict in exact f32 (docs/runtime.md)");
  addTargetFlag(p, "the device the run uses: cpu, or the GPU's with --device cuda");
  p.addOption("disable-pass", "NAME", "leave this pass out of the pipeline", std::nullopt, true);
  p.addOption("print-ir-after", "NAME", "print the IR to stderr after this pass", std::nullopt, true);
  p.addFlag("print-ir-after-all", "print the IR to stderr after every pass");
  p.addOption("dump-dir", "DIR", "write the IR after each pass into DIR (NNNN.<pass>.mlir)");
  p.addFlag("pass-timing", "print the time of each pass to stderr");
}

bool ModelFile::readCompileFlags(const ArgParser& p, driver::SessionOptions& o, int* exit_code) const {
  for (const std::string& s : p.getAll("set")) {
    Status st = frontend::addOverride(s, o.overrides);
    if (!st) {
      *exit_code = p.usageError(st.message());
      return false;
    }
  }
  if (p.has("memory-budget")) {
    o.memory_budget = p.get("memory-budget");
    if (auto b = passes::parseMemoryBudget(o.memory_budget, 1); !b) {
      *exit_code = p.usageError(b.status().message());
      return false;
    }
  }
  if (p.has("precision")) {
    const std::string precision = p.get("precision");
    if (!ir::isGemmPrecision(precision)) {
      *exit_code =
          p.usageError(fmt::format("--precision must be one of {}, got '{}'", ir::gemmPrecisionNames(), precision));
      return false;
    }
    o.train_overrides["precision"] = ir::Attribute(precision);
  }
  std::optional<Target> target;
  if (!readTargetFlag(p, &target, exit_code)) return false;
  o.target = target ? target->name : "";
  for (const std::string& d : p.getAll("disable-pass")) o.pass_options.disabled.insert(d);
  for (const std::string& d : p.getAll("print-ir-after")) o.pass_options.print_ir_after.insert(d);
  o.pass_options.print_ir_after_all = p.flag("print-ir-after-all");
  o.pass_options.dump_dir = p.get("dump-dir");
  o.pass_options.timing = p.flag("pass-timing");
  return true;
}

}  // namespace

const ModelSource& modelFileSource() {
  static const ModelFile source;
  return source;
}

}  // namespace kiln::cli
