#include "passes/comm_timeline.h"

#include <algorithm>
#include <unordered_map>

#include "ir/op_def.h"

namespace kiln::passes {

double streamSeconds(const ir::Op& op, const CostModel& cost, const ir::SymbolBindings& symbols,
                     ir::LinkScope scope) {
  if (ir::isCollective(op)) return ir::collectiveSeconds(op, symbols, cost.target(), scope);
  return CostModel::launchesWork(op) ? cost.time(cost.opCost(op)) : 0.0;
}

CommTimeline simulateCommTimeline(const ir::Function& f, const CostModel& cost, ir::LinkScope scope) {
  CommTimeline t;
  if (f.body().empty()) return t;
  const ir::SymbolBindings symbols = bindAllSymbols(f, cost.symbols());
  double compute_clock = 0, comm_clock = 0;
  // When each value is ready, and until when a collective still reads it (its send buffer).
  std::unordered_map<const ir::Value*, double> ready, sending;
  auto readyAt = [&](const ir::Value* v) {
    auto it = ready.find(v);
    return it == ready.end() ? 0.0 : it->second;
  };
  for (const auto& op : f.entry().ops()) {
    double operands_ready = 0;
    for (const ir::Value* v : op->operands()) operands_ready = std::max(operands_ready, readyAt(v));
    if (ir::isCollective(*op)) {
      const double seconds = streamSeconds(*op, cost, symbols, scope);
      const double start = std::max(comm_clock, operands_ready);
      comm_clock = start + seconds;
      t.comm_seconds += seconds;
      t.exposed_comm_seconds_no_overlap += seconds;
      ++t.collectives;
      for (const ir::Value* v : op->operands()) sending[v] = std::max(sending[v], comm_clock);
      for (const ir::Value* r : op->results()) ready[r] = comm_clock;
      continue;
    }
    // An in-place update must not overwrite what a collective is still sending.
    double start = std::max(compute_clock, operands_ready);
    for (unsigned i : ir::writtenOperands(*op)) {
      auto it = sending.find(op->operand(i));
      if (it != sending.end()) start = std::max(start, it->second);
    }
    // The compute stream is in order and only collectives finish after it: any gap is a wait.
    t.exposed_comm_seconds += start - compute_clock;
    const double seconds = streamSeconds(*op, cost, symbols, scope);
    compute_clock = start + seconds;
    t.compute_seconds += seconds;
    for (const ir::Value* r : op->results()) ready[r] = compute_clock;
  }
  // The step waits for every transfer, used or not.
  t.exposed_comm_seconds += std::max(0.0, comm_clock - compute_clock);
  t.step_seconds = std::max(compute_clock, comm_clock);
  return t;
}

}  // namespace kiln::passes
