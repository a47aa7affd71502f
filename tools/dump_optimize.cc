#include "tools/dump_optimize.h"

#include <fmt/format.h>

#include <ostream>

#include "codegen/lower_cpu.h"
#include "passes/comm_timeline.h"
#include "passes/cost_model.h"
#include "passes/fusion.h"
#include "passes/pass_manager.h"
#include "passes/pipeline.h"
#include "passes/remat.h"
#include "tools/cli.h"
#include "tools/model_session.h"

namespace kiln::cli {

// Runs the training pipeline up to (not including) `stop` ("" = all of it).
Status runTrainingPipeline(ir::Module& m, const OptimizeOptions& o, std::string_view stop) {
  ir::AttrDict symbols = {{"B", ir::Attribute(o.batch)}};
  m.mutableAttrs()["kiln.symbols"] = ir::Attribute(symbols);
  passes::PassManager pm({.target = o.target});
  pm.options().disabled = o.disabled_passes;
  KILN_RETURN_IF_ERROR(pm.addPipeline(stop.empty()
                                          ? passes::defaultPipeline(true, o.memory_budget, o.shard)
                                          : passes::pipelineUpTo(true, stop, o.memory_budget, o.shard)));
  auto r = pm.run(m);
  return r ? Status::ok() : r.status();
}

int printOptimizeStats(ir::Module& m, const OptimizeOptions& o, std::ostream& out, std::ostream& err) {
  if (Status s = runTrainingPipeline(m, o, ""); !s) {
    err << s.str() << "\n";
    return kExitError;
  }
  const ir::Function* f = m.lookup("train_step");
  if (!f) {
    err << "error: the model has no training step (it needs a train block)\n";
    return kExitError;
  }
  ir::SymbolBindings symbols = {{"B", o.batch}};
  // The memory check of `kiln train --batch B` on the CPU counts exactly this: one estimate, so
  // that `--memory-limit <peak_bytes>` fits and one byte less does not.
  auto spec = data::fromFunction(*f);
  if (!spec) {
    err << spec.status().str() << "\n";
    return kExitError;
  }
  SessionOptions session;
  session.batch = o.batch;
  session.training = true;
  session.device = "cpu";
  auto need = estimateSessionMemory(m, session, *spec);
  if (!need) {
    err << need.status().str() << "\n";
    return kExitError;
  }
  const MemoryTotals memory = memoryTotals(*need);
  passes::CostModel cost(o.target, symbols);
  double flops = 0;
  for (const auto& op : f->entry().ops()) flops += cost.opCost(*op).flops;
  out << fmt::format("kernels: {}\n", passes::countLaunches(*f));
  out << fmt::format("param_bytes: {}\n", memory.param_bytes);
  out << fmt::format("optimizer_bytes: {}\n", memory.optimizer_bytes);
  // The planned arena of the step: what the --memory-budget warning compares with the budget.
  out << fmt::format("activation_peak_bytes: {}\n", memory.activation_peak_bytes);
  out << fmt::format("workspace_bytes: {}\n", memory.workspace_bytes);
  out << fmt::format("data_bytes: {}\n", memory.data_bytes);
  if (memory.peak_bytes)
    out << fmt::format("peak_bytes: {}\n", *memory.peak_bytes);
  else
    out << "peak_bytes: more than 2^64-1\n";
  out << fmt::format("flops: {:.0f}\n", flops);
  out << fmt::format("recompute_flops: {:.0f}\n", passes::recomputeFlops(*f, symbols));
  // A sharded step's communication: what the schedule's order hides behind compute, played on
  // the target's links between the ranks of one node (kiln dump places every rank on one).
  passes::CommTimeline timeline = passes::simulateCommTimeline(*f, cost, ir::LinkScope::intra_node);
  if (timeline.collectives > 0) {
    out << fmt::format("collectives: {}\n", timeline.collectives);
    out << fmt::format("comm_seconds: {:.6g}\n", timeline.comm_seconds);
    out << fmt::format("exposed_comm_seconds: {:.6g}\n", timeline.exposed_comm_seconds);
    out << fmt::format("exposed_comm_seconds_no_overlap: {:.6g}\n", timeline.exposed_comm_seconds_no_overlap);
  }
  return kExitOk;
}

int printFusionExplanation(ir::Module& m, const OptimizeOptions& o, std::ostream& out, std::ostream& err) {
  if (Status s = runTrainingPipeline(m, o, "fusion"); !s) {
    err << s.str() << "\n";
    return kExitError;
  }
  if (o.disabled_passes.count("fusion")) {
    out << "fusion is disabled (--disable-pass=fusion)\n";
    return kExitOk;
  }
  passes::FusionOptions fusion;
  fusion.target = o.target;
  auto reports = passes::fuseModule(m, fusion);
  if (!reports) {
    err << reports.status().str() << "\n";
    return kExitError;
  }
  out << passes::explainFusion(*reports);
  return kExitOk;
}

}  // namespace kiln::cli
