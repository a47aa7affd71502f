#include "passes/remat.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <unordered_map>

#include <fmt/format.h>

#include "ir/op_def.h"
#include "ir/printer.h"
#include "passes/cost_model.h"
#include "passes/dependence.h"
#include "passes/pass_registry.h"
#include "passes/peak_memory.h"

namespace kiln::passes {
namespace {

using ir::Op;
using ir::Value;

// How many producers deep a recomputation may reach (matmul -> bias add -> mul -> add).
constexpr int kMaxChain = 6;

// Every symbol the function mentions gets a value.
ir::SymbolBindings bindAll(ir::Function& f, ir::SymbolBindings s) {
  f.walk([&](Op& op) {
    for (Value* r : op.results())
      for (const ir::Dim& d : r->type().shape())
        if (!d.sym().empty() && !s.count(d.sym())) s[d.sym()] = CostModel::kDefaultSymbolValue;
  });
  return s;
}

std::unordered_map<const Op*, int> positions(const ir::Block& b) {
  std::unordered_map<const Op*, int> pos;
  int i = 0;
  for (const auto& op : b.ops()) pos[op.get()] = i++;
  return pos;
}

// The op of `b` that holds `user` (itself, or the fused group around it).
const Op* topLevel(const Op* user, const ir::Block& b) {
  while (user && user->parentBlock() != &b) {
    const ir::Block* pb = user->parentBlock();
    user = pb && pb->parentRegion() ? pb->parentRegion()->parentOp() : nullptr;
  }
  return user;
}

}  // namespace

Expected<int64_t> parseMemoryBudget(std::string_view text, int64_t unbudgeted_peak) {
  std::string_view t = text;
  bool percent = !t.empty() && t.back() == '%';
  if (percent) t.remove_suffix(1);
  double v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size() || v < 0)
    return Status::errorf("--memory-budget: expected bytes or a percentage such as 60%, got '{}'", text);
  if (percent) {
    if (v > 100) return Status::errorf("--memory-budget: {}% is more than the unbudgeted peak", text);
    return static_cast<int64_t>(static_cast<double>(unbudgeted_peak) * v / 100.0);
  }
  return static_cast<int64_t>(v);
}

double recomputeFlops(const ir::Function& f, const ir::SymbolBindings& symbols) {
  double flops = 0;
  CostModel cost(cpuDevice(), symbols);
  const_cast<ir::Function&>(f).walk([&](Op& op) {
    if (op.boolAttr("kiln.recompute")) flops += cost.opCost(op).flops;
  });
  return flops;
}

Expected<RematReport> rematerialize(ir::Module& m, std::string_view budget_text, const ir::SymbolBindings& given) {
  RematReport report;
  ir::Function* f = m.lookup("train_step");
  if (!f || f->body().empty() || !f->returnOp() || f->returnOp()->numOperands() == 0) return report;
  ir::Block& block = f->entry();
  ir::SymbolBindings symbols = bindAll(*f, given);
  auto peak = estimatePeakBytes(*f, symbols);
  if (!peak) return peak.status();
  report.peak_before = report.peak_after = *peak;
  auto budget = parseMemoryBudget(budget_text, *peak);
  if (!budget) return budget.status();
  report.budget = *budget;
  if (*peak <= *budget) return report;

  // The forward ends at the loss (docs/autodiff.md: @train_step returns the loss first).
  const Op* loss = f->returnOp()->operand(0)->definingOp();
  if (!loss || loss->parentBlock() != &block) return report;
  CostModel cost(cpuDevice(), symbols);
  ir::ValueNamer namer(*f);

  struct Candidate {
    Op* op;
    double score;
  };
  auto candidates = [&]() {
    auto pos = positions(block);
    const int boundary = pos.at(loss);
    std::vector<Candidate> out;
    for (const auto& holder : block.ops()) {
      Op* op = holder.get();
      if (pos[op] > boundary) break;
      if (!op->hasTrait(ir::kPure) || writesInPlace(*op) || !CostModel::launchesWork(*op) || op->numResults() != 1 ||
          !op->regions().empty() || op->boolAttr("kiln.recompute"))
        continue;
      bool returned = false;
      int first_backward = -1;
      for (const ir::Use& u : op->result()->uses()) {
        const Op* top = topLevel(u.user, block);
        if (!top) continue;
        returned |= top->hasTrait(ir::kTerminator);
        if (pos[top] > boundary && (first_backward < 0 || pos[top] < first_backward)) first_backward = pos[top];
      }
      if (first_backward < 0 || returned) continue;
      // A clone must read what the original read: what it reads may be updated in place
      // (optimizer updates) only after the clone runs.
      bool reads_written = false;
      for (Value* v : op->operands())
        for (const ir::Use& u : v->uses()) {
          const Op* top = topLevel(u.user, block);
          reads_written |= top && writesInPlace(*top) && pos[top] <= first_backward;
        }
      if (reads_written) continue;
      double bytes = cost.valueBytes(*op->result());
      out.push_back({op, bytes / (cost.opCost(*op).flops + 1.0)});
    }
    std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.score > b.score; });
    return out;
  };

  int64_t current = *peak;
  std::unordered_map<Value*, Value*> copies;  // forward value -> its recomputed copy
  for (int round = 0; round < 4 && current > *budget; ++round) {
    bool progress = false;
    for (const Candidate& c : candidates()) {
      if (current <= *budget) break;
      auto pos = positions(block);
      const int boundary = pos.at(loss);
      Op* first_use = nullptr;
      std::vector<ir::Use> backward;
      for (const ir::Use& u : c.op->result()->uses()) {
        const Op* top = topLevel(u.user, block);
        if (!top || pos[top] <= boundary) continue;
        backward.push_back(u);
        if (!first_use || pos[top] < pos[first_use]) first_use = const_cast<Op*>(top);
      }
      if (!first_use) continue;
      const int at = pos[first_use];
      // An operand's producer may be recomputed along (a chain such as matmul -> bias add), so
      // that the operand need not stay live either.
      auto chainable = [&](const Op* q) {
        if (!q || !pos.count(q) || pos[q] > boundary || !q->hasTrait(ir::kPure) || writesInPlace(*q) ||
            !CostModel::launchesWork(*q) || q->numResults() != 1 || !q->regions().empty())
          return false;
        for (Value* v : q->operands())
          for (const ir::Use& u : v->uses()) {
            const Op* top = topLevel(u.user, block);
            if (top && writesInPlace(*top) && pos[top] <= at) return false;
          }
        return true;
      };
      // A value still read at or after `at` costs nothing more to read there.
      auto liveFrom = [&](const Value* v, int from) {
        for (const ir::Use& u : v->uses()) {
          const Op* top = topLevel(u.user, block);
          if (top && pos.count(top) && pos[top] >= from) return true;
        }
        return false;
      };
      std::function<Value*(Op*, int, std::vector<Op*>&)> cloneChain = [&](Op* op, int depth, std::vector<Op*>& made) {
        std::vector<Value*> operands = op->operands();
        for (Value*& v : operands) {
          // A copy recomputed earlier in the backward pass serves as well as the original.
          auto copy = copies.find(v);
          if (copy != copies.end() && pos.count(copy->second->definingOp()) && pos[copy->second->definingOp()] < at) {
            v = copy->second;
            continue;
          }
          if (depth > 0 && !liveFrom(v, at) && chainable(v->definingOp())) v = cloneChain(v->definingOp(), depth - 1, made);
        }
        ir::AttrDict attrs = op->attrs();
        attrs["kiln.recompute"] = ir::Attribute(true);
        auto clone = Op::create(op->name(), operands, {op->result()->type()}, attrs, op->location());
        clone->result()->setNameHint(op->result()->nameHint() + ".recompute");
        Op* copy = block.insertBefore(first_use, std::move(clone));
        made.push_back(copy);
        return copy->result();
      };
      bool kept = false;
      for (int depth = 0; depth <= kMaxChain && !kept; ++depth) {
        std::vector<Op*> made;
        Value* copy = cloneChain(c.op, depth, made);
        for (const ir::Use& u : backward) u.user->setOperand(u.operand_index, copy);
        auto now = estimatePeakBytes(*f, symbols);
        if (!now) return now.status();
        if (*now < current) {
          current = *now;
          progress = kept = true;
          for (Op* op : made) report.recompute_flops += cost.opCost(*op).flops;
          copies[c.op->result()] = copy;
          report.recomputed.push_back(fmt::format("{} = {}{}", namer.name(c.op->result()), c.op->name(),
                                                  made.size() > 1 ? fmt::format(" (with {} producers)", made.size() - 1) : ""));
          break;
        }
        for (const ir::Use& u : backward) u.user->setOperand(u.operand_index, c.op->result());
        for (auto it = made.rbegin(); it != made.rend(); ++it) block.erase(*it);
      }
    }
    if (!progress) break;
  }
  report.peak_after = current;
  return report;
}

// Reads the budget from the module (`kiln.memory_budget = "60%"`, set by --memory-budget) and
// the symbols from `kiln.symbols`; without a budget it does nothing.
class RematPass : public RegisteredPass<RematPass> {
 public:
  KILN_PASS_INFO(RematPass)
  Expected<bool> run(ir::Module& m) override {
    auto it = m.attrs().find("kiln.memory_budget");
    if (it == m.attrs().end()) return false;
    std::string budget = it->second.isString() ? it->second.asString() : it->second.isInt() ? std::to_string(it->second.asInt()) : "";
    auto r = rematerialize(m, budget, planningSymbols(m));
    if (!r) return r.status();
    return !r->recomputed.empty();
  }
};

std::unique_ptr<Pass> createRematPass() { return std::make_unique<RematPass>(); }

}  // namespace kiln::passes
