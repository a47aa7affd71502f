#include "tools/dump_optimize.h"

#include <fmt/format.h>

#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "codegen/lower_cpu.h"
#include "driver/roofline.h"
#include "ir/op_def.h"
#include "passes/comm_timeline.h"
#include "passes/cost_model.h"
#include "passes/fusion.h"
#include "passes/pass_manager.h"
#include "passes/pipeline.h"
#include "passes/remat.h"
#include "tools/cli.h"
#include "tools/session_flags.h"

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
  if (!r) return r.status();
  // A budget the step misses is said wherever one is asked for, as kiln train says it.
  if (stop.empty() && !o.memory_budget.empty()) {
    KILN_ASSIGN_OR_RETURN(std::string missed, driver::memoryBudgetWarning(m, o.batch, o.memory_budget));
    std::cerr << missed;
  }
  return Status::ok();
}

namespace {

// The matmul-like ops of a step (in fused groups too) by the dtype they compute in, and the f32
// ones where the rest follow precision = bf16: what mixed precision left in f32, and why.
void printGemmPrecision(ir::Function& f, std::ostream& out) {
  int64_t bf16 = 0, f32 = 0, other = 0;
  std::vector<std::string> kept;
  f.walk([&](ir::Op& op) {
    if (!op.isAnyOf(ir::OpCode::Matmul, ir::OpCode::GroupedMatmul, ir::OpCode::GroupedMatmulWgrad)) return;
    const ir::DType t = op.operand(0)->type().dtype();
    if (t == ir::DType::bf16) {
      ++bf16;
      return;
    }
    if (t != ir::DType::f32) {
      ++other;
      return;
    }
    ++f32;
    const std::string name = op.result()->nameHint().empty() ? "" : "%" + op.result()->nameHint() + " = ";
    const std::string why = op.strAttr("kiln.precision") == "f32"
                                ? "marked kiln.precision = \"f32\" (routing is computed in f32)"
                                : "f32 operands (the gradient of an f32 GEMM, or an op mixed precision leaves)";
    kept.push_back(fmt::format("{}{} at {}: {}", name, op.name(), op.location().str(), why));
  });
  out << fmt::format("gemms: {} (bf16 {}, f32 {}{})\n", bf16 + f32 + other, bf16, f32,
                     other ? fmt::format(", other {}", other) : "");
  if (bf16 == 0) return;  // all f32: precision f32, nothing singled out
  for (const std::string& k : kept) out << "f32 gemm: " << k << "\n";
}

}  // namespace

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
  driver::SessionOptions session;
  session.batch = o.batch;
  session.training = true;
  session.device = "cpu";
  auto need = driver::estimateSessionMemory(m, session, *spec);
  if (!need) {
    err << need.status().str() << "\n";
    return kExitError;
  }
  const driver::MemoryTotals memory = driver::memoryTotals(*need);
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
  if (o.device == "cuda") {
    // The GPU's half of `kiln train --device cuda`'s check: the CUDA program's own arena.
    session.device = "cuda";
    auto device_need = driver::estimateDeviceMemory(m, session);
    if (!device_need) {
      err << device_need.status().str() << "\n";
      return kExitError;
    }
    const driver::MemoryTotals gpu = driver::memoryTotals(*device_need);
    out << fmt::format("gpu_param_bytes: {}\n", gpu.param_bytes);
    out << fmt::format("gpu_optimizer_bytes: {}\n", gpu.optimizer_bytes);
    out << fmt::format("gpu_activation_peak_bytes: {}\n", gpu.activation_peak_bytes);
    out << fmt::format("gpu_workspace_bytes: {}\n", gpu.workspace_bytes);
    if (gpu.peak_bytes)
      out << fmt::format("gpu_bytes: {}\n", *gpu.peak_bytes);
    else
      out << "gpu_bytes: more than 2^64-1\n";
  }
  out << fmt::format("flops: {:.0f}\n", flops);
  out << fmt::format("recompute_flops: {:.0f}\n", passes::recomputeFlops(*f, symbols));
  printGemmPrecision(*m.lookup("train_step"), out);
  if (o.roofline) {
    auto roofline = driver::estimateRoofline(*f, o.batch, o.target);
    if (!roofline) {
      err << roofline.status().str() << "\n";
      return kExitError;
    }
    out << driver::formatRoofline(*roofline);
  }
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
