// The one cost model every planning pass shares (fusion, recomputation, scheduling): the time
// of an op or a group of ops is
//     max(flops / flop rate, bytes / bandwidth) + launches * launch overhead
// over a target's rates (ir/target.h), as XLA's GpuPerformanceModel estimates a fusion's time. Flops and
// bytes come from each op's `cost` hook in the op table; a group reads each value that enters it once and
// writes each value that leaves it once, so fusing saves the bytes of the values that stay inside and all
// launches but one.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/status.h"
#include "ir/target.h"

namespace kiln::passes {

// The work of a set of ops run as one kernel.
struct GroupCost {
  double flops = 0;
  double gemm_flops = 0;  // the part of flops done by matrix multiplies, at the 16-bit GEMM rate
  double bytes = 0;       // values entering read once, values leaving written once
  int launches = 0;
  double f32_gemm_flops = 0;   // the part of gemm_flops with f32 inputs, at the f32 GEMM rate
  double tf32_gemm_flops = 0;  // the part of f32_gemm_flops a GPU may run in TF32 (ir::allowsTf32)
};

class CostModel {
 public:
  // Symbols not in `symbols` are costed at kDefaultSymbolValue, so that a model with an unbound
  // batch still gets relative costs that follow its shapes.
  static constexpr int64_t kDefaultSymbolValue = 1024;
  CostModel(Target target, ir::SymbolBindings symbols);

  const Target& target() const { return target_; }
  const ir::SymbolBindings& symbols() const { return symbols_; }

  // Seconds for the given work.
  double time(const GroupCost& c) const;
  // One op as its own kernel (a kiln.fused op: its group). Sources, constants and terminators
  // cost nothing: they launch nothing.
  GroupCost opCost(const ir::Op& op) const;
  // The ops as one kernel: flops add up, bytes are those of the values crossing the group's
  // boundary (block arguments and results of ops outside the set, results used outside it or
  // returned).
  GroupCost groupCost(const std::vector<const ir::Op*>& ops) const;
  // Seconds saved by running `ops` as one kernel instead of one kernel each (XLA's
  // time_unfused - time_fused); positive means fusing pays.
  double fusionBenefit(const std::vector<const ir::Op*>& ops) const;

  // Bytes of a value's type under the model's symbols (bounded dims at their bound).
  double valueBytes(const ir::Value& v) const;
  // Whether an op launches any work (sources, constants and terminators do not).
  static bool launchesWork(const ir::Op& op);

 private:
  ir::SymbolBindings bind(const ir::Function* f) const;
  Target target_;
  ir::SymbolBindings symbols_;
};

// The symbols a module asks planning passes to cost at: its `kiln.symbols = {B = 16384}`
// attribute (set by `kiln dump --batch`), missing symbols defaulting as in CostModel.
ir::SymbolBindings planningSymbols(const ir::Module& m);
// `symbols` plus every other symbol `f` mentions, at CostModel::kDefaultSymbolValue.
ir::SymbolBindings bindAllSymbols(const ir::Function& f, ir::SymbolBindings symbols);

}  // namespace kiln::passes
