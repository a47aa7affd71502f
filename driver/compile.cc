// The compiling half of a session: the model file through the frontend and the pass pipeline,
// and the sharding proposal a run on several ranks plans from its data's ids. Only binaries with
// the compiler link it; an ahead-of-time runner opens its sessions from its payload instead
// (driver/compiled_model.h).
#include <fmt/format.h>

#include <fmt/ranges.h>

#include <iostream>
#include <map>
#include <mutex>

#include "driver/id_sample.h"
#include "driver/session.h"
#include "frontend/frontend.h"
#include "passes/pass_manager.h"
#include "passes/pipeline.h"
#include "passes/plan_json.h"
#include "passes/planner.h"
#include "passes/remat.h"

namespace kiln::driver {

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
Expected<std::string> planFromData(const SessionOptions& options, const Target& target, int ranks,
                                   std::ostream& diag);

// In-process ranks (kiln train --ranks N) each compile the same model with the same options: the
// first to ask plans, the others take its plan (the sample is the same on every rank).
Expected<std::string> proposedPlan(const SessionOptions& options, const Target& target, int ranks,
                                   std::ostream& diag) {
  std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}", options.model_path, fmt::join(options.plan_data, ","),
                                options.plan_samples, options.batch, ranks, options.ranks_per_node, target.name,
                                options.seed, options.memory_budget);
  for (const auto& [name, value] : options.overrides) key += fmt::format("|{}={}", name, value);
  for (const auto& [name, value] : options.train_overrides) key += fmt::format("|{}={}", name, value.str());
  static std::mutex mu;
  static std::map<std::string, std::string> plans;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  KILN_ASSIGN_OR_RETURN(std::string plan, planFromData(options, target, ranks, diag));
  plans.emplace(key, plan);
  return plan;
}

Expected<std::string> planFromData(const SessionOptions& options, const Target& target, int ranks,
                                   std::ostream& diag) {
  // The main compile parsed the same file without error before it asked for this plan.
  KILN_ASSIGN_OR_RETURN(auto m, frontendModule(options, diag));
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
      auto proposed = proposedPlan(options, target, options.comm->size(), diag);
      if (!proposed) return Status::errorf("planning the sharding from the data's ids: {}", proposed.status().message());
      m.mutableAttrs()["kiln.plan"] = ir::Attribute(proposed.take());
    }
  }
  KILN_RETURN_IF_ERROR(
      pm.addPipeline(passes::defaultPipeline(options.training, options.memory_budget, shard)));
  KILN_RETURN_IF_ERROR(pm.build());
  KILN_RETURN_IF_ERROR(pm.run(m));
  // The peak of the step as it will run, after the passes that follow remat (fusion and the
  // schedule change it): the number `kiln dump --stats` prints, not remat's own estimate.
  KILN_ASSIGN_OR_RETURN(std::string missed, memoryBudgetWarning(m, options.batch, options.memory_budget));
  diag << missed;
  return owned;
}

Expected<std::unique_ptr<Session>> Session::create(const SessionOptions& options,
                                                             std::ostream& diag) {
  std::unique_ptr<Session> s(new Session());
  s->options_ = options;
  KILN_RETURN_IF_ERROR(s->openDevice(""));
  KILN_ASSIGN_OR_RETURN(auto module, compileModelModule(options, s->target_, diag));
  KILN_RETURN_IF_ERROR(s->adopt(std::move(module)));
  return s;
}

}  // namespace kiln::driver
