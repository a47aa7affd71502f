#include "passes/remat.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "ir/arena_plan.h"
#include "ir/op_def.h"
#include "ir/printer.h"
#include "passes/cost_model.h"
#include "passes/dependence.h"
#include "passes/pass_registry.h"
#include "passes/peak_memory.h"
#include "passes/schedule.h"

namespace kiln::passes {
namespace {

using ir::Op;
using ir::Value;

// How many producers deep a recomputation may reach (matmul -> bias add -> mul -> add).
constexpr int kMaxChain = 6;
// Candidates tried per step, best-scored first.
constexpr size_t kTriedPerStep = 48;
// Ops of the profile, highest first, whose live values are tried when the peak's do not help.
constexpr size_t kFallbackOps = 16;


// The op of `b` that holds `user` (itself, or the fused group around it).
const Op* topLevel(const Op* user, const ir::Block& b) {
  while (user && user->parentBlock() != &b) {
    const ir::Block* pb = user->parentBlock();
    user = pb && pb->parentRegion() ? pb->parentRegion()->parentOp() : nullptr;
  }
  return user;
}

}  // namespace

Expected<int64_t> parseMemoryBudget(std::string_view text, int64_t unbudgeted_peak, std::string_view what) {
  std::string_view t = text;
  bool percent = !t.empty() && t.back() == '%';
  if (percent) t.remove_suffix(1);
  double v = 0;
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size() || v < 0)
    return Status::errorf("{}: expected bytes or a percentage such as 60%, got '{}'", what, text);
  if (percent) {
    // `text` already ends in '%' (a second one printed "200%%").
    if (v > 100) return Status::errorf("{}: {} is more than the unbudgeted peak (100%)", what, text);
    return static_cast<int64_t>(static_cast<double>(unbudgeted_peak) * v / 100.0);
  }
  return static_cast<int64_t>(v);
}

double recomputeFlops(const ir::Function& f, const ir::SymbolBindings& symbols) {
  double flops = 0;
  CostModel cost(cpuTarget(), symbols);
  const_cast<ir::Function&>(f).walk([&](Op& op) {
    if (op.boolAttr("kiln.recompute")) flops += cost.opCost(op).flops;
  });
  return flops;
}

namespace {

// Live bytes of the block's values at each op, as the memory planner sees them without its
// layout: a result is live from its op to its last reader (returned: to the end), sources live
// outside the arena, and an elementwise op writing over an operand that dies there (same type)
// takes no new bytes. Where this profile peaks is where recomputation must free memory.
class LiveProfile {
 public:
  LiveProfile(const ir::Block& b, const CostModel& cost) : ops_(b.opList()) {
    for (size_t i = 0; i < ops_.size(); ++i) pos_[ops_[i]] = static_cast<int>(i);
    const int n = static_cast<int>(ops_.size());
    std::vector<double> delta(ops_.size() + 1, 0);
    for (int t = 0; t < n; ++t) {
      const Op* op = ops_[static_cast<size_t>(t)];
      if (op->hasTrait(ir::kSource)) continue;
      std::vector<const Value*> donated;
      for (const Value* r : op->results()) {
        int last = lastUse(r);
        double bytes = cost.valueBytes(*r);
        delta[static_cast<size_t>(t)] += bytes;
        delta[static_cast<size_t>(last + 1)] -= bytes;
        if (ir::inPlaceKind(op->name()) == ir::InPlace::kNever) continue;
        for (const Value* o : op->operands()) {
          const Op* d = o->definingOp();
          if (!d || d->hasTrait(ir::kSource) || lastUse(o) != t ||
              std::count(donated.begin(), donated.end(), o) ||
              !(o->type().withSharding(std::nullopt) == r->type().withSharding(std::nullopt)))
            continue;
          donated.push_back(o);  // the operand's bytes end here, and the result's begin in them
          delta[static_cast<size_t>(t)] -= bytes;
          delta[static_cast<size_t>(t) + 1] += bytes;
          break;
        }
      }
    }
    double live = 0;
    for (int t = 0; t < n; ++t) {
      live += delta[static_cast<size_t>(t)];
      bytes_.push_back(live);
      if (live > peak_) peak_ = live, peak_at_ = t;
    }
  }

  int position(const Op* op) const {
    auto it = pos_.find(op);
    return it == pos_.end() ? -1 : it->second;
  }
  // Position of the last top-level reader (the end for a returned value; the definition if none).
  int lastUse(const Value* v) const {
    int last = v->definingOp() ? position(v->definingOp()) : 0;
    for (const ir::Use& u : v->uses()) {
      const Op* top = topLevel(u.user, *ops_.front()->parentBlock());
      if (!top) continue;
      last =
          std::max(last, top->hasTrait(ir::kTerminator) ? static_cast<int>(ops_.size()) - 1 : position(top));
    }
    return last;
  }
  double peak() const { return peak_; }
  int peakAt() const { return peak_at_; }
  // The `n` ops with the most live bytes, highest first.
  std::vector<int> highest(size_t n) const {
    std::vector<int> order(bytes_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return bytes_[static_cast<size_t>(a)] > bytes_[static_cast<size_t>(b)];
    });
    order.resize(std::min(n, order.size()));
    return order;
  }
  // Live bytes above `target`, summed over the ops (bytes x ops).
  double excessOver(double target) const {
    double sum = 0;
    for (double b : bytes_) sum += std::max(0.0, b - target);
    return sum;
  }
  const std::vector<Op*>& ops() const { return ops_; }

 private:
  std::vector<Op*> ops_;
  std::unordered_map<const Op*, int> pos_;
  std::vector<double> bytes_;
  double peak_ = 0;
  int peak_at_ = 0;
};

// Whether `op` may be cloned to run again at position `at`: pure, one result, no region, and
// nothing it reads is updated in place (optimizer updates) before `at`.
bool recomputable(const Op& op, int at, const LiveProfile& live) {
  if (!op.hasTrait(ir::kPure) || writesInPlace(op) || !CostModel::launchesWork(op) || op.numResults() != 1 ||
      !op.regions().empty() || live.position(&op) < 0)
    return false;
  for (const Value* v : op.operands())
    for (const ir::Use& u : v->uses()) {
      const Op* top = topLevel(u.user, *op.parentBlock());
      if (top && writesInPlace(*top) && live.position(top) <= at) return false;
    }
  return true;
}

// One rematerialization: `value` (live across the peak, unread there) is recomputed right
// before `use_at`, its next reader; producers of operands no longer live there are cloned along
// (up to kMaxChain deep), or a copy made earlier that still lives is read instead.
struct RematPlan {
  Value* value = nullptr;
  int use_at = -1;
  std::vector<Op*> chain;                               // originals to clone, producers first
  std::unordered_map<const Value*, Value*> substitute;  // operand -> a live copy
  double seconds = 0, flops = 0;
};

}  // namespace

Expected<RematReport> rematerialize(ir::Module& m, std::string_view budget_text,
                                    const ir::SymbolBindings& given, const Target& target) {
  RematReport report;
  ir::Function* f = m.lookup("train_step");
  if (!f || f->body().empty() || !f->returnOp() || f->returnOp()->numOperands() == 0) return report;
  ir::Block& block = f->entry();
  ir::SymbolBindings symbols = bindAllSymbols(*f, given);
  KILN_ASSIGN_OR_RETURN(auto peak, estimatePeakBytes(*f, symbols));
  report.peak_before = report.peak_after = peak;
  // A percentage is of the unbudgeted peak the pipeline ends with, i.e. after the schedule
  // (which runs later and only lowers the peak): reaching it here before scheduling is enough.
  KILN_ASSIGN_OR_RETURN(auto reference, scheduledPeakBytes(*f, symbols, target));
  KILN_ASSIGN_OR_RETURN(auto budget, parseMemoryBudget(budget_text, std::min(peak, reference)));
  report.budget = budget;
  if (peak <= budget) return report;

  CostModel cost(target, symbols);
  ir::ValueNamer namer(*f);
  auto label = [&](const Value* v) {
    std::string n = namer.name(v);
    return n.find('<') == std::string::npos ? n : "%" + v->nameHint();
  };
  // Recomputed copies: copy -> the value it recomputes, and value -> its copies.
  std::unordered_map<const Value*, Value*> origin;
  std::unordered_map<const Value*, std::vector<Value*>> copies_of;
  auto originOf = [&](Value* v) {
    auto it = origin.find(v);
    return it == origin.end() ? v : it->second;
  };

  // Plans recomputing `v` before position `at`; false when an operand cannot be had there.
  auto plan = [&](Value* v, int at, const LiveProfile& live, RematPlan& p) {
    p = RematPlan{v, at, {}, {}, 0, 0};
    std::unordered_set<const Op*> planned;
    std::function<bool(Op*, int)> visit = [&](Op* op, int depth) {
      if (planned.count(op)) return true;
      if (!recomputable(*op, at, live)) return false;
      for (Value* w : op->operands()) {
        const Op* d = w->definingOp();
        if (!d || d->hasTrait(ir::kSource) || live.lastUse(w) >= at || p.substitute.count(w)) continue;
        Value* alive = nullptr;  // a copy of the same value, made before `at` and read after it
        for (Value* c : copies_of[originOf(w)])
          if (live.position(c->definingOp()) < at && live.lastUse(c) >= at) alive = c;
        if (alive) {
          p.substitute[w] = alive;
          continue;
        }
        if (depth == 0 || !visit(w->definingOp(), depth - 1)) return false;
      }
      planned.insert(op);
      p.chain.push_back(op);
      GroupCost c = cost.opCost(*op);
      p.seconds += cost.time(c);
      p.flops += c.flops;
      return true;
    };
    return visit(v->definingOp(), kMaxChain);
  };

  // Clones the chain before the reader at `use_at`; returns the ops made. Readers of `value`
  // from there on read the copy.
  auto apply = [&](const RematPlan& p, const LiveProfile& live) {
    Op* before = live.ops()[static_cast<size_t>(p.use_at)];
    std::unordered_map<const Value*, Value*> cloned(p.substitute.begin(), p.substitute.end());
    std::vector<Op*> made;
    for (Op* op : p.chain) {
      std::vector<Value*> operands = op->operands();
      for (Value*& w : operands)
        if (auto it = cloned.find(w); it != cloned.end()) w = it->second;
      ir::AttrDict attrs = op->attrs();
      attrs["kiln.recompute"] = ir::Attribute(true);
      auto clone = Op::create(op->name(), operands, {op->result()->type()}, attrs, op->location());
      clone->result()->setNameHint(originOf(op->result())->nameHint() + ".recompute");
      made.push_back(block.insertBefore(before, std::move(clone)));
      cloned[op->result()] = made.back()->result();
    }
    Value* copy = made.back()->result();
    std::vector<ir::Use> later;
    for (const ir::Use& u : p.value->uses()) {
      const Op* top = topLevel(u.user, block);
      if (top && live.position(top) >= p.use_at) later.push_back(u);
    }
    for (const ir::Use& u : later) u.user->setOperand(u.operand_index, copy);
    return std::make_pair(made, later);
  };
  auto undo = [&](Value* value, const std::vector<Op*>& made, const std::vector<ir::Use>& later) {
    for (const ir::Use& u : later) u.user->setOperand(u.operand_index, value);
    for (auto it = made.rbegin(); it != made.rend(); ++it) block.erase(*it);
  };

  // Accepted recomputations, in order, with the planned peak after each.
  struct Move {
    Value* value;
    std::vector<Op*> made;
    std::vector<ir::Use> later;
    double flops;
    int64_t peak;
    std::string label;
  };
  std::vector<Move> moves;
  int64_t current = peak;
  for (int step = 0; step < 256 && current > budget; ++step) {
    LiveProfile live(block, cost);
    // Candidates: values live across the profile's peak op and not read by it, best bytes freed
    // there per second of recomputation first (XLA's rematerialization chooses by memory freed
    // at the peak, not over the whole program). Copies made earlier are candidates too, so a
    // value may be recomputed again before a later reader.
    std::vector<std::pair<double, RematPlan>> candidates;
    std::set<std::pair<const Value*, int>> seen;
    // Values live across op `at` and not read there, recomputed before their next reader; with
    // `at` < 0, every value at the widest gap between its readers.
    auto collect = [&](int at) {
      candidates.clear();
      for (int t = 0; t < static_cast<int>(live.ops().size()) && (at < 0 || t < at); ++t) {
        Op* op = live.ops()[static_cast<size_t>(t)];
        if (op->numResults() != 1 || op->hasTrait(ir::kSource)) continue;
        Value* v = op->result();
        std::vector<int> readers;
        bool returned = false;
        for (const ir::Use& u : v->uses()) {
          const Op* top = topLevel(u.user, block);
          if (!top) continue;
          returned |= top->hasTrait(ir::kTerminator);
          readers.push_back(live.position(top));
        }
        std::sort(readers.begin(), readers.end());
        if (returned || readers.empty()) continue;
        int next = -1;
        if (at >= 0) {
          if (std::binary_search(readers.begin(), readers.end(), at)) continue;
          auto it = std::upper_bound(readers.begin(), readers.end(), at);
          if (it != readers.end()) next = *it;
        } else {
          int prev = t, widest = 1;
          for (int q : readers) {
            if (q - prev > widest) widest = q - prev, next = q;
            prev = q;
          }
        }
        if (next < 0 || !seen.insert({v, next}).second) continue;
        RematPlan p;
        if (plan(v, next, live, p))
          candidates.emplace_back(cost.valueBytes(*v) / (p.seconds + 1e-9), std::move(p));
      }
      std::stable_sort(candidates.begin(), candidates.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
    };
    // Each candidate is tried: the one that lowers the planned peak most per second of
    // recomputation wins. Where none lowers it (the peak sits on several ops, or the planner's
    // layout keeps it), the one that lowers the live bytes above the target most per second
    // explores; exploring moves that never pay off are undone at the end.
    const double target = static_cast<double>(budget);
    const double excess_before = live.excessOver(target);
    int best = -1;
    bool best_lowers = false;
    double best_value = 0;
    int64_t best_peak = current;
    auto choose = [&]() -> Status {
      for (size_t k = 0; k < candidates.size() && k < kTriedPerStep; ++k) {
        const RematPlan& p = candidates[k].second;
        auto [made, later] = apply(p, live);
        KILN_ASSIGN_OR_RETURN(auto now, estimatePeakBytes(*f, symbols));
        const double excess_after = LiveProfile(block, cost).excessOver(target);
        undo(p.value, made, later);
        if (now > current) continue;
        const bool lowers = now < current;
        const double gain = lowers ? static_cast<double>(current - now) : excess_before - excess_after;
        if (gain <= 0 || (best_lowers && !lowers)) continue;
        const double value = gain / (p.seconds + 1e-9);
        if (best < 0 || (lowers && !best_lowers) || value > best_value)
          best = static_cast<int>(k), best_lowers = lowers, best_value = value, best_peak = now;
      }
      return Status::ok();
    };
    // The planner's layout may put its peak at another op than the profile's: when nothing
    // read across the profile's peak helps, values live across the next highest ops are tried,
    // then every value at its widest gap.
    collect(live.peakAt());
    KILN_RETURN_IF_ERROR(choose());
    for (int high : live.highest(kFallbackOps)) {
      if (best >= 0) break;
      collect(high);
      KILN_RETURN_IF_ERROR(choose());
    }
    if (best < 0) {
      collect(-1);
      KILN_RETURN_IF_ERROR(choose());
    }
    if (best < 0) break;
    const RematPlan& p = candidates[static_cast<size_t>(best)].second;
    auto [made, later] = apply(p, live);
    current = best_peak;
    for (size_t i = 0; i < made.size(); ++i) {
      Value* original = originOf(p.chain[i]->result());
      origin[made[i]->result()] = original;
      copies_of[original].push_back(made[i]->result());
    }
    moves.push_back(
        {p.value, made, later, p.flops, current,
         fmt::format("{} = {}{}", label(p.value), p.value->definingOp()->name(),
                     made.size() > 1 ? fmt::format(" (with {} producers)", made.size() - 1) : "")});
  }
  // Moves after the last one that lowered the planned peak only explored: they are undone.
  while (!moves.empty() && (moves.size() == 1 ? peak : moves[moves.size() - 2].peak) == moves.back().peak) {
    undo(moves.back().value, moves.back().made, moves.back().later);
    moves.pop_back();
  }
  for (const Move& mv : moves) {
    report.recompute_flops += mv.flops;
    report.recomputed.push_back(mv.label);
  }
  report.peak_after = moves.empty() ? peak : moves.back().peak;
  return report;
}

// Built with its budget (the `budget` option, set by --memory-budget) and the pipeline's
// target; reads the symbols from `kiln.symbols`. Without a budget it does nothing.
class RematPass : public RegisteredPass<RematPass> {
 public:
  KILN_PASS_INFO(RematPass)
  RematPass(Target target, std::string budget) : target_(std::move(target)), budget_(std::move(budget)) {}

  Expected<bool> run(ir::Module& m) override {
    // The budget used to travel as this module attribute; say so rather than ignore it.
    if (m.attrs().count("kiln.memory_budget"))
      return Status::error(
          "the module attribute kiln.memory_budget is not read: give the budget as remat's option, "
          "e.g. --passes=remat{budget=60%}");
    if (budget_.empty()) return false;
    KILN_ASSIGN_OR_RETURN(auto r, rematerialize(m, budget_, planningSymbols(m), target_));
    // What was reached (a budget below what recomputation can reach is not an error: the step
    // still runs, with the lowest peak found). peak_bytes is remat's estimate before the passes
    // after it; the tools report the planned peak of the final step (plannedPeakBytes in
    // driver/session.h) against budget_bytes.
    m.mutableAttrs()["kiln.remat"] = ir::Attribute(
        ir::AttrDict{{"budget_bytes", ir::Attribute(r.budget)},
                     {"peak_bytes", ir::Attribute(r.peak_after)},
                     {"recomputed_ops", ir::Attribute(static_cast<int64_t>(r.recomputed.size()))}});
    return !r.recomputed.empty();
  }

 private:
  Target target_;
  std::string budget_;
};

Expected<std::unique_ptr<Pass>> createRematPass(const PassContext& context, const PassOptions& options) {
  const std::string& budget = options.get("budget");
  if (!budget.empty())
    if (auto b = parseMemoryBudget(budget, 1, "option 'budget'"); !b) return b.status();
  return makePass<RematPass>(context.target, budget);
}

}  // namespace kiln::passes
