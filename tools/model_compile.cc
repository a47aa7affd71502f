// The compiling half of a session: the model file through the frontend and the pass pipeline.
// `kiln` installs it as the session opener (installCompilingOpener); an ahead-of-time runner,
// which holds no compiler, opens its sessions from its payload instead (tools/compiled_model.h).
#include <fmt/format.h>

#include <iostream>

#include "frontend/frontend.h"
#include "passes/pass_manager.h"
#include "passes/pipeline.h"
#include "passes/plan_json.h"
#include "passes/planner.h"
#include "passes/remat.h"
#include "tools/id_sample.h"
#include "tools/model_session.h"

namespace kiln::cli {
namespace {

void addCompileFlags(ArgParser& p) {
  p.addOption("set", "NAME=VALUE", "override a model param (e.g. --set rows_cap=1000)", std::nullopt, true);
  p.addOption("memory-budget", "BYTES|N%",
              "recompute activations in the backward pass until the training step's planned peak fits "
              "(remat{budget=...})");
  p.addOption("precision", "f32|bf16",
              "GEMM precision, overriding the train block's: bf16 stores the inputs and outputs of every "
              "matmul-like op in bf16 and accumulates in f32, over f32 master weights (docs/runtime.md)");
  addTargetFlag(p, "the device the run uses: cpu, or the GPU's with --device cuda");
  p.addOption("disable-pass", "NAME", "leave this pass out of the pipeline", std::nullopt, true);
  p.addOption("print-ir-after", "NAME", "print the IR to stderr after this pass", std::nullopt, true);
  p.addFlag("print-ir-after-all", "print the IR to stderr after every pass");
  p.addOption("dump-dir", "DIR", "write the IR after each pass into DIR (NNNN.<pass>.mlir)");
  p.addFlag("pass-timing", "print the time of each pass to stderr");
}

bool readCompileFlags(const ArgParser& p, SessionOptions& o, int* exit_code) {
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
    if (precision != "f32" && precision != "bf16") {
      *exit_code = p.usageError(fmt::format("--precision must be f32 or bf16, got '{}'", precision));
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

namespace {

// The model file through the frontend, with the session's train block overrides and run seed.
Expected<std::unique_ptr<ir::Module>> frontendModule(const SessionOptions& options, std::ostream& diag) {
  frontend::DiagnosticEngine diags(&diag);
  auto module = frontend::compileModelFile(options.model_path, options.overrides, diags);
  if (!module) {
    if (!diags.hasErrors()) return module.status();
    return Status::error(fmt::format("{}: {} error(s) in the model", options.model_path, diags.errorCount()));
  }
  std::unique_ptr<ir::Module> owned = module.take();
  ir::Module& m = *owned;
  auto train = m.attrs().find("kiln.train");
  const bool has_train = train != m.attrs().end() && train->second.isDict();
  if (has_train && !options.train_overrides.empty()) {
    ir::AttrDict merged = train->second.asDict();
    for (const auto& [key, value] : options.train_overrides) merged[key] = value;
    m.mutableAttrs()["kiln.train"] = ir::Attribute(std::move(merged));
  }
  if (has_train) {
    // The run seed, for the masks of dropout (docs/autodiff.md, "Training mode"); 63 bits.
    ir::AttrDict merged = m.attrs().at("kiln.train").asDict();
    merged["seed"] = static_cast<int64_t>(options.seed & 0x7fffffffffffffffull);
    m.mutableAttrs()["kiln.train"] = ir::Attribute(std::move(merged));
  }
  return owned;
}

// The plan the planner proposes for this run from its data's ids (passes/planner.h), as
// plan.json text: what `kiln plan MODEL --ranks N --batch <global> --target T --data D` prints
// and writes for the same model, target, batch and data. The model's tables come from the
// pipeline up to remat, as `kiln plan` compiles it.
Expected<std::string> proposedPlan(const SessionOptions& options, const Target& target, int ranks) {
  std::ostream& quiet = std::cerr;  // the main compile reports the model's errors; this one stops at the first
  KILN_ASSIGN_OR_RETURN(auto m, frontendModule(options, quiet));
  m->mutableAttrs()["kiln.symbols"] = ir::Attribute(ir::AttrDict{{"B", ir::Attribute(options.batch)}});
  passes::PassManager pm({.target = target});
  KILN_RETURN_IF_ERROR(pm.addPipeline(passes::pipelineUpTo(true, "remat")));
  KILN_RETURN_IF_ERROR(pm.build());
  if (auto ran = pm.run(*m); !ran) return ran.status();
  KILN_ASSIGN_OR_RETURN(auto tables, passes::tablesOf(*m));
  KILN_ASSIGN_OR_RETURN(auto sample, sampleIds(*m, tables, options.plan_data, options.plan_samples));
  KILN_ASSIGN_OR_RETURN(passes::PlanRequest req, passes::planRequestFor(target));
  req.ranks = ranks;
  req.ranks_per_node = options.ranks_per_node;
  req.global_batch = options.batch * ranks;
  KILN_ASSIGN_OR_RETURN(passes::PlanProposal proposal, passes::proposePlan(tables, req, nullptr, &sample));
  return passes::writePlanJson(proposal.plan, &proposal.costs);
}

}  // namespace

Expected<std::unique_ptr<ir::Module>> compileModelModule(const SessionOptions& options, const Target& target,
                                                         std::ostream& diag) {
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<ir::Module> owned, frontendModule(options, diag));
  ir::Module& m = *owned;
  auto train = m.attrs().find("kiln.train");
  const bool has_train = train != m.attrs().end() && train->second.isDict();
  if (options.training && !has_train)
    return Status::error(fmt::format("{}: the model has no train block to train with", options.model_path));

  // Remat and fusion plan the training step at the batch it will run with.
  m.mutableAttrs()["kiln.symbols"] = ir::Attribute(ir::AttrDict{{"B", ir::Attribute(options.batch)}});
  passes::PassManager pm({.target = target});
  pm.options() = options.pass_options;
  if (&diag != &std::cerr) pm.options().log = &diag;
  if (options.comm && options.comm->rank() != 0) {
    // Rank 0 shows its program (kiln dump --ranks N --rank R shows any rank's).
    pm.options().print_ir_after.clear();
    pm.options().print_ir_after_all = false;
    pm.options().dump_dir.clear();
    pm.options().timing = false;
  }
  passes::PassOptions shard;
  if (options.comm && options.comm->size() > 1) {
    shard.set("ranks", std::to_string(options.comm->size()));
    shard.set("rank", std::to_string(options.comm->rank()));
    if (!options.plan_path.empty()) shard.set("plan", options.plan_path);
    if (!options.sharding.empty()) shard.set("sharding", options.sharding);
    if (options.ranks_per_node > 0) shard.set("ranks_per_node", std::to_string(options.ranks_per_node));
    if (options.ep > 1) shard.set("ep", std::to_string(options.ep));
    if (options.pipeline) shard.set("pipeline", "1");
    // No plan given: the planner's proposal over the run's data (the shard pass takes kiln.plan).
    if (options.plan_path.empty() && options.sharding.empty() && !options.plan_data.empty()) {
      auto proposed = proposedPlan(options, target, options.comm->size());
      if (!proposed) return Status::errorf("planning the sharding from the data's ids: {}", proposed.status().message());
      m.mutableAttrs()["kiln.plan"] = ir::Attribute(proposed.take());
    }
  }
  KILN_RETURN_IF_ERROR(
      pm.addPipeline(passes::defaultPipeline(options.training, options.memory_budget, shard)));
  KILN_RETURN_IF_ERROR(pm.build());
  KILN_RETURN_IF_ERROR(pm.run(m));
  if (auto it = m.attrs().find("kiln.remat"); it != m.attrs().end() && it->second.isDict()) {
    // The peak of the step as it will run, after the passes that follow remat (fusion and the
    // schedule change it): the number `kiln dump --stats` prints, not remat's own estimate.
    const int64_t budget = it->second.asDict().at("budget_bytes").asInt();
    if (const ir::Function* ts = m.lookup("train_step")) {
      KILN_ASSIGN_OR_RETURN(int64_t peak, plannedPeakBytes(*ts, options.batch));
      if (peak > budget)
        diag << fmt::format(
            "warning: --memory-budget {}: recomputation gets the training step's planned peak down to "
            "{} bytes, not to the budget of {} bytes\n",
            options.memory_budget, peak, budget);
    }
  }
  return owned;
}

Expected<std::unique_ptr<ModelSession>> ModelSession::create(const SessionOptions& options,
                                                             std::ostream& diag) {
  std::unique_ptr<ModelSession> s(new ModelSession());
  s->options_ = options;
  KILN_RETURN_IF_ERROR(s->openDevice(""));
  KILN_ASSIGN_OR_RETURN(auto module, compileModelModule(options, s->target_, diag));
  KILN_RETURN_IF_ERROR(s->adopt(std::move(module)));
  return s;
}

void installCompilingOpener() {
  SessionOpener o;
  o.open = [](const SessionOptions& options, std::ostream& diag) {
    return ModelSession::create(options, diag);
  };
  o.add_compile_flags = addCompileFlags;
  o.read_compile_flags = readCompileFlags;
  installSessionOpener(std::move(o));
}

}  // namespace kiln::cli
