#include "passes/schedule.h"

#include <unordered_map>

#include "ir/collective.h"
#include "ir/op_def.h"
#include "passes/cost_model.h"
#include "passes/dependence.h"
#include "passes/pass_registry.h"
#include "passes/peak_memory.h"

namespace kiln::passes {
namespace {

using ir::Op;
using ir::Value;

constexpr int64_t kCommStream = 2;

bool onEmbeddingStream(const Op& op) {
  if (op.is(ir::OpCode::EmbeddingBagUpdate)) return true;
  if (op.is(ir::OpCode::Fused)) return op.strAttr("kind") == "embedding_update";
  if (op.is(ir::OpCode::EmbeddingBag)) {
    for (Value* v : op.operands())
      if (!v->definingOp() || !v->definingOp()->hasTrait(ir::kSource)) return false;
    return true;
  }
  if (op.is(ir::OpCode::Slice)) {
    const auto& uses = op.result()->uses();
    return uses.size() == 1 && uses[0].user->is(ir::OpCode::EmbeddingBagUpdate);
  }
  return false;
}

// The list-scheduled order of the block, as positions in its current order.
std::vector<int> listSchedule(const BlockDependences& deps, const CostModel& cost) {
  const auto& ops = deps.ops();
  const int n = static_cast<int>(ops.size());
  std::unordered_map<const Value*, int> unscheduled_users;
  for (Op* op : ops)
    for (Value* v : op->operands()) ++unscheduled_users[v];
  auto arenaBytes = [&](const Value* v) {
    const Op* d = v->definingOp();
    return d && CostModel::launchesWork(*d) ? cost.valueBytes(*v) : 0.0;
  };
  auto netBytes = [&](int i) {
    const Op* op = ops[static_cast<size_t>(i)];
    double net = 0;
    for (const Value* r : op->results()) net += cost.valueBytes(*r);
    std::vector<const Value*> seen;
    for (const Value* v : op->operands()) {
      if (std::find(seen.begin(), seen.end(), v) != seen.end()) continue;
      seen.push_back(v);
      int users = 0;
      for (const Value* w : op->operands()) users += w == v;
      if (unscheduled_users[v] == users) net -= arenaBytes(v);
    }
    return net;
  };
  std::vector<int> waiting(ops.size()), ready, order;
  for (int i = 0; i < n; ++i) {
    waiting[static_cast<size_t>(i)] = static_cast<int>(deps.predecessors(i).size());
    if (!waiting[static_cast<size_t>(i)]) ready.push_back(i);
  }
  while (!ready.empty()) {
    size_t pick = 0;
    double best_net = 0;
    int earliest = n;
    for (size_t k = 0; k < ready.size(); ++k) earliest = std::min(earliest, ready[k]);
    for (size_t k = 0; k < ready.size(); ++k) {
      int i = ready[k];
      if (i == earliest && best_net == 0) pick = k;
      const Op* op = ops[static_cast<size_t>(i)];
      if (op->boolAttr("kiln.recompute") || op->hasTrait(ir::kTerminator)) continue;
      double net = netBytes(i);
      if (net < best_net) {
        best_net = net;
        pick = k;
      }
    }
    int i = ready[pick];
    ready.erase(ready.begin() + static_cast<long>(pick));
    order.push_back(i);
    for (const Value* v : ops[static_cast<size_t>(i)]->operands()) --unscheduled_users[v];
    for (int s : deps.successors(i))
      if (--waiting[static_cast<size_t>(s)] == 0) ready.push_back(s);
  }
  return order;
}

}  // namespace

namespace {

// Keeps the new order only if the estimated peak does not grow.
Expected<bool> reorderChecked(ir::Function& f, const CostModel& cost, const ir::SymbolBindings& symbols) {
  ir::Block& block = f.entry();
  KILN_ASSIGN_OR_RETURN(auto before, estimatePeakBytes(f, symbols));
  BlockDependences deps(block);
  std::vector<int> order = listSchedule(deps, cost);
  bool same = true;
  for (size_t k = 0; k < order.size(); ++k) same &= order[k] == static_cast<int>(k);
  if (same) return false;
  std::vector<Op*> original = deps.ops();
  auto apply = [&](const std::vector<Op*>& seq) {
    std::vector<std::unique_ptr<Op>> held;
    for (Op* op : seq) held.push_back(block.remove(op));
    for (auto& op : held) block.push_back(std::move(op));
  };
  std::vector<Op*> scheduled;
  for (int i : order) scheduled.push_back(original[static_cast<size_t>(i)]);
  apply(scheduled);
  KILN_ASSIGN_OR_RETURN(auto after, estimatePeakBytes(f, symbols));
  if (after <= before) return true;
  apply(original);
  return false;
}

}  // namespace

Expected<bool> scheduleFunction(ir::Function& f, const ir::SymbolBindings& symbols, const Target& target) {
  if (f.body().empty()) return false;
  ir::SymbolBindings bound = bindAllSymbols(f, symbols);
  CostModel cost(target, bound);
  KILN_ASSIGN_OR_RETURN(auto changed, reorderChecked(f, cost, bound));
  bool streams = false;
  auto place = [&](Op& op, int64_t stream) {
    if (op.intAttr("kiln.stream", 0) == stream) return;
    op.setAttr("kiln.stream", ir::Attribute(stream));
    streams = true;
  };
  for (const auto& op : f.entry().ops()) {
    // Collectives on their own stream (2), in program order, so that a GPU overlaps them with
    // compute; their operands and users wait on events like any other cross-stream value.
    if (ir::isCollective(*op))
      place(*op, kCommStream);
    else if (onEmbeddingStream(*op))
      place(*op, 1);
  }
  return changed || streams;
}

Expected<int64_t> scheduledPeakBytes(const ir::Function& f, const ir::SymbolBindings& symbols,
                                     const Target& target) {
  ir::Module scratch;
  ir::Function& copy = ir::cloneFunction(f, scratch, f.name());
  KILN_RETURN_IF_ERROR(scheduleFunction(copy, symbols, target));
  return estimatePeakBytes(copy, symbols);
}

class SchedulePass : public RegisteredPass<SchedulePass> {
 public:
  KILN_PASS_INFO(SchedulePass)
  explicit SchedulePass(Target target) : target_(std::move(target)) {}

  Expected<bool> run(ir::Module& m) override {
    bool changed = false;
    ir::SymbolBindings symbols = planningSymbols(m);
    for (auto& f : m.functions()) {
      KILN_ASSIGN_OR_RETURN(auto c, scheduleFunction(*f, symbols, target_));
      changed |= c;
    }
    return changed;
  }

 private:
  Target target_;
};

Expected<std::unique_ptr<Pass>> createSchedulePass(const PassContext& context, const PassOptions&) {
  return makePass<SchedulePass>(context.target);
}

}  // namespace kiln::passes
