#include "passes/schedule.h"

#include <algorithm>
#include <tuple>
#include <unordered_map>

#include "ir/collective.h"
#include "ir/op_def.h"
#include "passes/comm_timeline.h"
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

// How long the overlap order holds back a collective's consumers.
enum class Patience {
  kAsLateAsPossible,    // until nothing else is ready (most overlap, longest lifetimes)
  kAsTheTransferNeeds,  // until the cost model says the transfer is done
};

// The overlap order: a list schedule played on the two streams of passes/comm_timeline.h. A
// ready collective is issued first, as early as its operands allow; among the other ready ops
// the first in the current order that does not wait on a transfer in flight runs next, so
// independent work fills the gap between a collective and its first consumer. In flight means,
// by `patience`, not yet joined by any consumer, or not yet done by the cost model's clocks (a
// consumer then waits only as long as the transfer takes). When every ready op waits, the one
// whose inputs arrive first runs.
std::vector<int> overlapSchedule(const BlockDependences& deps, const CostModel& cost,
                                 const ir::SymbolBindings& symbols, Patience patience) {
  const auto& ops = deps.ops();
  const int n = static_cast<int>(ops.size());
  std::vector<int> waiting(ops.size()), ready, order;
  std::vector<double> done(ops.size(), 0.0);  // when each op's results are there
  for (int i = 0; i < n; ++i) {
    waiting[static_cast<size_t>(i)] = static_cast<int>(deps.predecessors(i).size());
    if (!waiting[static_cast<size_t>(i)]) ready.push_back(i);
  }
  auto inputsAt = [&](int i) {
    double t = 0;
    for (int p : deps.predecessors(i)) t = std::max(t, done[static_cast<size_t>(p)]);
    return t;
  };
  std::vector<bool> joined(ops.size(), false);  // a collective some scheduled op has read
  // Whether op i reads a collective no consumer has joined yet.
  auto readsUnjoined = [&](int i) {
    for (int p : deps.predecessors(i))
      if (ir::isCollective(*ops[static_cast<size_t>(p)]) && !joined[static_cast<size_t>(p)]) return true;
    return false;
  };
  double compute_clock = 0, comm_clock = 0;
  while (!ready.empty()) {
    // Ranks a ready op: collectives first, then ops that run at once, then by arrival; the
    // current order breaks ties; the terminator only when nothing else is ready.
    auto key = [&](int i) {
      const Op& op = *ops[static_cast<size_t>(i)];
      const bool last = op.hasTrait(ir::kTerminator);
      const bool comm = ir::isCollective(op);
      const double stall = comm ? 0.0 : std::max(0.0, inputsAt(i) - compute_clock);
      const bool waits = patience == Patience::kAsLateAsPossible ? !comm && readsUnjoined(i) : stall > 0;
      return std::make_tuple(last, !comm, waits, stall, i);
    };
    size_t pick = 0;
    auto best = key(ready[0]);
    for (size_t k = 1; k < ready.size(); ++k)
      if (auto candidate = key(ready[k]); candidate < best) {
        best = candidate;
        pick = k;
      }
    const int i = ready[pick];
    ready.erase(ready.begin() + static_cast<long>(pick));
    order.push_back(i);
    const Op& op = *ops[static_cast<size_t>(i)];
    double& clock = ir::isCollective(op) ? comm_clock : compute_clock;
    const double seconds = streamSeconds(op, cost, symbols, ir::LinkScope::intra_node);
    clock = std::max(clock, inputsAt(i)) + seconds;
    done[static_cast<size_t>(i)] = clock;
    for (int p : deps.predecessors(i)) joined[static_cast<size_t>(p)] = true;
    for (int s : deps.successors(i))
      if (--waiting[static_cast<size_t>(s)] == 0) ready.push_back(s);
  }
  return order;
}

}  // namespace

namespace {

void putInOrder(ir::Block& block, const std::vector<Op*>& seq) {
  std::vector<std::unique_ptr<Op>> held;
  for (Op* op : seq) held.push_back(block.remove(op));
  for (auto& op : held) block.push_back(std::move(op));
}

// Puts the block in `order` (positions in `deps`, built on the block as it is) and keeps it
// only if the estimated peak stays within `limit`.
Expected<bool> reorderChecked(ir::Function& f, const std::vector<int>& order, const BlockDependences& deps,
                              const ir::SymbolBindings& symbols, int64_t limit) {
  bool same = true;
  for (size_t k = 0; k < order.size(); ++k) same &= order[k] == static_cast<int>(k);
  if (same) return false;
  const std::vector<Op*> original = deps.ops();
  std::vector<Op*> scheduled;
  for (int i : order) scheduled.push_back(original[static_cast<size_t>(i)]);
  putInOrder(f.entry(), scheduled);
  KILN_ASSIGN_OR_RETURN(auto after, estimatePeakBytes(f, symbols));
  if (after <= limit) return true;
  putInOrder(f.entry(), original);
  return false;
}

}  // namespace

Expected<bool> scheduleFunction(ir::Function& f, const ir::SymbolBindings& symbols, const Target& target) {
  if (f.body().empty()) return false;
  ir::SymbolBindings bound = bindAllSymbols(f, symbols);
  CostModel cost(target, bound);
  // Every reorder below keeps the peak within what the block's order had on entry.
  KILN_ASSIGN_OR_RETURN(const int64_t entry_peak, estimatePeakBytes(f, bound));
  bool changed = false;
  {
    BlockDependences deps(f.entry());
    KILN_ASSIGN_OR_RETURN(changed, reorderChecked(f, listSchedule(deps, cost), deps, bound, entry_peak));
  }
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
  // Then the overlap, planned with the streams placed: a collective's buffers stay live on the
  // comm stream until its consumers join it, which the peak estimate counts.
  bool has_collectives = false;
  for (const auto& op : f.entry().ops()) has_collectives |= ir::isCollective(*op);
  if (has_collectives) {
    KILN_ASSIGN_OR_RETURN(const int64_t placed_peak, estimatePeakBytes(f, bound));
    // The most patient order first; if its longer lifetimes cost memory, the one that waits
    // only as long as the cost model says the transfers take.
    for (Patience patience : {Patience::kAsLateAsPossible, Patience::kAsTheTransferNeeds}) {
      BlockDependences deps(f.entry());
      KILN_ASSIGN_OR_RETURN(auto overlapped, reorderChecked(f, overlapSchedule(deps, cost, bound, patience),
                                                            deps, bound, std::max(entry_peak, placed_peak)));
      changed |= overlapped;
      if (overlapped) break;
    }
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
