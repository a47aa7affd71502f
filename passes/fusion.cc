#include "passes/fusion.h"

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "ir/op_def.h"
#include "ir/printer.h"
#include "passes/dependence.h"
#include "passes/pass_registry.h"
#include "passes/peak_memory.h"

namespace kiln::passes {
namespace {

using ir::Op;
using ir::Value;

enum class Kind { Pointwise, Reduction, Gemm, Embedding, EmbeddingUpdate, Other };

const char* kindName(Kind k) {
  switch (k) {
    case Kind::Pointwise: return "pointwise";
    case Kind::Reduction: return "reduction";
    case Kind::Gemm: return "gemm_epilogue";
    case Kind::Embedding: return "embedding";
    case Kind::EmbeddingUpdate: return "embedding_update";
    case Kind::Other: return "other";
  }
  return "other";
}

bool isReduction(const Op& op) {
  return op.is(ir::OpCode::Reduce) || op.is(ir::OpCode::Softmax) || op.is(ir::OpCode::BceWithLogits) ||
         op.is(ir::OpCode::SumTo);
}

// An activation of scalar_fn.def, or sigmoid or tanh: what may end a GEMM's epilogue.
bool isActivation(const Op& op) {
  auto fn = ir::scalarFnOf(op);
  return fn && (ir::scalarFnInfo(*fn).kind == ir::ScalarFnKind::Activation || *fn == ir::ScalarFn::Sigmoid ||
                *fn == ir::ScalarFn::Tanh);
}

// What a kiln.add adds to the other operand, the running value of a GEMM's epilogue: a bias
// vector (rank 1, cuBLASLt's BIAS), a matrix of the result's own type (cuBLASLt's C with
// beta = 1: a residual, or another product to sum with), or neither.
enum class AddedTerm { None, Bias, Matrix };
AddedTerm addedTerm(const Op& add) {
  if (!add.is(ir::OpCode::Add) || add.numOperands() != 2) return AddedTerm::None;
  const ir::TensorType& r = add.result()->type();
  for (unsigned i = 0; i < 2; ++i) {
    const ir::TensorType& t = add.operand(i)->type();
    if (t.rank() == 1 && r.rank() >= 1) return AddedTerm::Bias;
  }
  if (add.operand(0)->type() == r && add.operand(1)->type() == r) return AddedTerm::Matrix;
  return AddedTerm::None;
}

// "226.5 MB": byte counts in reasons.
std::string byteSize(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.1f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} kB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

struct Group {
  Kind kind = Kind::Other;
  std::vector<Op*> members;  // in block order
  bool closed = false;       // takes no more members
  // Members that share operands, not results (a bias gradient beside its weight gradient) may
  // run as early as their operands allow instead of where the last of them was (materialize).
  bool run_early = false;
  bool has(const Op* op) const { return std::find(members.begin(), members.end(), op) != members.end(); }
};

class FunctionFuser {
 public:
  // `leave_recomputed`: ops remat cloned stay out of groups (a group runs where its last op
  // was, which can move a clone away from the reader it was placed for).
  // `keep_apart`: the block positions of sum_to ops to leave out of weight-gradient GEMMs, and
  // of adds to leave out of a GEMM's epilogue (fuseModule's answer to a planned peak that would
  // rise; optional_joins_).
  // `siblings`: sibling fusion (joinSibling) is tried.
  FunctionFuser(ir::Function& f, const CostModel& cost, bool leave_recomputed = false,
                std::set<int> keep_apart = {}, bool siblings = true)
      : f_(f),
        cost_(cost),
        namer_(f),
        deps_(f.entry()),
        leave_recomputed_(leave_recomputed),
        siblings_(siblings),
        keep_apart_(std::move(keep_apart)) {
    for (size_t i = 0; i < deps_.ops().size(); ++i) pos_[deps_.ops()[i]] = static_cast<int>(i);
  }

  Expected<FusionReport> run() {
    FusionReport report;
    report.function = f_.name();
    report.launches_before = countLaunches(f_);
    formEmbeddingGroups();
    formEmbeddingUpdateGroups();
    formBiasGradientGroups();
    for (Op* op : deps_.ops()) {
      if (!CostModel::launchesWork(*op) || group_of_.count(op)) continue;
      if (leave_recomputed_ && op->boolAttr("kiln.recompute")) continue;
      place(op);
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      Group& grp = groups_[g];
      if (grp.members.size() < 2) continue;
      std::vector<const Op*> members(grp.members.begin(), grp.members.end());
      GroupCost fused = cost_.groupCost(members);
      FusedGroupReport r;
      r.kind = kindName(grp.kind);
      for (Op* op : grp.members) r.ops.push_back(label(*op));
      double unfused_bytes = 0;
      for (const Op* op : members) unfused_bytes += cost_.opCost(*op).bytes;
      r.saved_bytes = unfused_bytes - fused.bytes;
      r.saved_launches = static_cast<int>(members.size()) - 1;
      r.saved_seconds = cost_.fusionBenefit(members);
      report.groups.push_back(std::move(r));
    }
    report.refused = std::move(refused_);
    materialize();
    report.launches_after = countLaunches(f_);
    return report;
  }

 private:
  std::string label(const Op& op) const {
    if (op.numResults() > 0) return fmt::format("{} = {}", namer_.name(op.result(0)), op.name());
    std::string s = op.name();
    if (op.hasAttr("table")) s += fmt::format(" {{table = {}}}", ir::quoteString(op.strAttr("table")));
    return s;
  }

  void refuse(const Op& producer, const Op& consumer, const std::string& reason) {
    refused_.push_back({label(producer), label(consumer), reason});
  }

  int newGroup(Kind kind, std::vector<Op*> members, bool closed) {
    std::sort(members.begin(), members.end(), [&](Op* a, Op* b) { return pos_[a] < pos_[b]; });
    int id = static_cast<int>(groups_.size());
    for (Op* op : members) group_of_[op] = id;
    groups_.push_back({kind, std::move(members), closed});
    return id;
  }

  // True when some op of group `g` must run before `op` (through any group on the way), so
  // that putting `op` and group `g` into one kernel would make a cycle.
  bool dependsOnGroup(const Op* op, int g) const {
    std::vector<const Op*> stack = {op};
    std::unordered_set<const Op*> seen = {op};
    while (!stack.empty()) {
      const Op* x = stack.back();
      stack.pop_back();
      auto git = group_of_.find(x);
      if (git != group_of_.end()) {
        if (git->second == g) return true;
        for (Op* m : groups_[static_cast<size_t>(git->second)].members)
          if (seen.insert(m).second) stack.push_back(m);
      }
      for (int p : deps_.predecessors(pos_.at(x))) {
        const Op* y = deps_.ops()[static_cast<size_t>(p)];
        if (seen.insert(y).second) stack.push_back(y);
      }
    }
    return false;
  }

  // Values of group members used by ops outside `members`.
  static int outsideUsers(const Op& op, const std::vector<Op*>& members) {
    int n = 0;
    for (Value* r : op.results())
      for (const ir::Use& u : r->uses()) n += std::find(members.begin(), members.end(), u.user) == members.end();
    return n;
  }

  std::string shapeOf(const Group& g) const { return g.members.back()->result()->type().str(); }

  // Legality of adding `consumer` to the group of its operand's producer `producer`.
  FusionDecision canFuse(const Op& producer, const Op& consumer, int g) const {
    const Group& grp = groups_[static_cast<size_t>(g)];
    auto forbid = [&](std::string why) {
      return FusionDecision::forbid(fmt::format("cannot fuse {} into {}: {}", producer.name(), consumer.name(), why));
    };
    if (grp.closed)
      return forbid(fmt::format("the {} group of {} takes no more ops", kindName(grp.kind), producer.name()));
    if (consumer.numResults() != 1) return forbid("the consumer has no single result");
    if (consumer.boolAttr("kiln.recompute") != producer.boolAttr("kiln.recompute"))
      return forbid("one is recomputed in the backward pass (remat); one kernel would run it in the forward again");
    std::vector<Op*> with = grp.members;
    with.push_back(const_cast<Op*>(&consumer));
    if (grp.kind == Kind::Gemm) {
      const Op& tail = *grp.members.back();
      if (&tail != &producer) return forbid("an epilogue must consume the GEMM's latest result");
      if (int n = outsideUsers(tail, {const_cast<Op*>(&consumer)}); n > 0)
        return forbid(fmt::format("producer has {} user{} outside the group; a cuBLASLt epilogue writes only its "
                                  "final result", n, n == 1 ? "" : "s"));
      // A bf16/f16 product widened to f32 at once is cuBLASLt's f32 accumulator (the lowering
      // skips that rounding, as XLA's excess precision does); the epilogue continues after it.
      const size_t head = grp.members.size() > 1 && ir::isWideningCast(*grp.members[0], *grp.members[1]) ? 2 : 1;
      auto adds = [&](AddedTerm t) {
        return std::any_of(grp.members.begin() + static_cast<std::ptrdiff_t>(head), grp.members.end(),
                           [&](Op* o) { return addedTerm(*o) == t; });
      };
      if (consumer.is(ir::OpCode::Add)) {
        // D = act(A B + C + bias): the bias vector and a matrix C (beta = 1, a residual or a
        // second product) are added before the activation, each once, in either order.
        const AddedTerm term = addedTerm(consumer);
        if (grp.members.size() != head && !grp.members.back()->is(ir::OpCode::Add))
          return forbid("an add must come before the epilogue's activation or cast");
        if (!(consumer.result()->type() == producer.result()->type())) return forbid("the add changes the shape");
        if (term == AddedTerm::Bias) {
          if (adds(AddedTerm::Bias)) return forbid("the epilogue already adds a bias");
        } else if (term == AddedTerm::Matrix) {
          if (adds(AddedTerm::Matrix)) return forbid("the epilogue already adds a matrix (cuBLASLt reads one C)");
          if (consumer.operand(0) == consumer.operand(1)) return forbid("the add doubles the product");
          // fuseModule's answer to a planned peak that rose with this add in the GEMM.
          if (keep_apart_.count(pos_.at(&consumer)))
            return forbid("with the add of C in the GEMM the planned peak rises");
          if (consumer.result()->type().rank() != 2 || producer.numResults() != 1 ||
              grp.members.front()->is(ir::OpCode::SumTo))
            return forbid("cuBLASLt adds C only to an unbatched product without a bias gradient");
        } else {
          return forbid("the added value is neither a bias vector (rank 1) nor a matrix of the product's type (C)");
        }
      } else if (consumer.is(ir::OpCode::ActivationGrad)) {
        if (FusionDecision d = activationBackwardEpilogue(producer, consumer, grp.members.size() == head); !d)
          return forbid(d.reason());
      } else if (isActivation(consumer)) {
        if (std::any_of(grp.members.begin(), grp.members.end(), [](Op* o) { return isActivation(*o); }))
          return forbid("the epilogue already has an activation");
      } else if (consumer.is(ir::OpCode::Cast)) {
        // A cast ends the epilogue (the GEMM's output type), unless it widens the product.
      } else {
        return forbid(fmt::format("{} is not a bias add, activation or cast epilogue", consumer.name()));
      }
      if (tail.is(ir::OpCode::Cast) && !(grp.members.size() == 2 && head == 2))
        return forbid("the epilogue already ends in a cast");
    } else if (grp.kind == Kind::Pointwise) {
      if (ir::isPointwise(consumer)) {
        if (consumer.result()->type().shape() != grp.members.back()->result()->type().shape())
          return forbid(fmt::format("{} produces {} but the group iterates over {}", consumer.name(),
                                    consumer.result()->type().str(), shapeOf(grp)));
      } else if (isReduction(consumer)) {
        for (Op* m : grp.members)
          if (int n = outsideUsers(*m, with); n > 0)
            return forbid(fmt::format("producer has {} user{} outside the group; a reduction computes its producers "
                                      "inline", n, n == 1 ? "" : "s"));
      } else {
        return forbid(fmt::format("{} is not elementwise or a reduction", consumer.name()));
      }
    } else {
      return forbid(fmt::format("a {} group takes no consumers", kindName(grp.kind)));
    }
    for (Value* v : consumer.operands()) {
      const Op* d = v->definingOp();
      if (!d || grp.has(d) || !CostModel::launchesWork(*d)) continue;
      if (dependsOnGroup(d, g))
        return forbid(fmt::format("{} depends on the group and feeds {}: fusing would make a cycle",
                                  namer_.name(v), consumer.name()));
    }
    // The group runs where its last op was: an op between the group and the consumer that reads
    // a group value would have to wait for the consumer, and the values it frees would live on.
    const int from = pos_.at(grp.members.back()), to = pos_.at(&consumer);
    for (const Op* m : grp.members)
      for (const Value* r : m->results())
        for (const ir::Use& u : r->uses()) {
          auto it = pos_.find(u.user);
          if (it != pos_.end() && it->second > from && it->second < to && !grp.has(u.user))
            return forbid(fmt::format("fusing would delay {} (it reads {} in between)", label(*u.user), namer_.name(r)));
        }
    if (FusionDecision d = keepsLiveSetBounded(grp, consumer); !d) return forbid(d.reason());
    // Profitability, from the one cost model.
    std::vector<const Op*> before(grp.members.begin(), grp.members.end()), after(with.begin(), with.end());
    double gain = cost_.fusionBenefit(after) - cost_.fusionBenefit(before) - 0.0;
    if (gain <= 0) return forbid(fmt::format("not profitable: the cost model predicts {:.3f} us saved", gain * 1e6));
    return FusionDecision::allow();
  }

  // cuBLASLt's DRELU/DGELU: the GEMM that makes a layer's output gradient g_h (= g_next W^T)
  // multiplies it by the activation's derivative in its epilogue, so that
  // activation_grad(·, g_h) is no kernel of its own. DGELU reads the GELU's input z; DRELU reads
  // a bit mask that only the forward GEMM of that ReLU can write (RELU_AUX), so the ReLU must end
  // a gemm_epilogue group, which then writes the mask beside its output (kiln.relu_mask).
  // `first`: the group is the bare product (or it widened to f32).
  FusionDecision activationBackwardEpilogue(const Op& producer, const Op& grad, bool first) const {
    auto forbid = [](std::string why) { return FusionDecision::forbid(std::move(why)); };
    if (!first) return forbid("an activation backward epilogue must directly follow the GEMM");
    if (grad.operand(1) != producer.result() || grad.operand(0) == producer.result())
      return forbid("the GEMM's result is not the gradient kiln.activation_grad scales");
    const std::string act = grad.strAttr("activation");
    if (act != "relu" && act != "gelu") return forbid(fmt::format("cuBLASLt has no {} backward epilogue", act));
    const ir::TensorType& t = grad.result()->type();
    if (t.rank() != 2) return forbid(fmt::format("the gradient is {}, not a matrix", t.str()));
    const Value* x = grad.operand(0);
    if (act == "gelu") {
      // cuBLASLt reads the GELU input with a leading dimension that is a multiple of 8.
      if (!t.dim(1).isStatic() || t.dim(1).size() % 8 != 0)
        return forbid(fmt::format("the GELU input {} has rows of other than a multiple of 8", t.str()));
      return FusionDecision::allow();
    }
    const Op* relu = x->definingOp();
    auto it = relu ? group_of_.find(relu) : group_of_.end();
    if (it == group_of_.end() || groups_[static_cast<size_t>(it->second)].kind != Kind::Gemm ||
        groups_[static_cast<size_t>(it->second)].members.back() != relu || !relu->is(ir::OpCode::Relu))
      return forbid(fmt::format("{} is not the output of a GEMM whose epilogue ends in relu (only such a GEMM writes "
                                "the ReLU mask DRELU reads)",
                                namer_.name(x)));
    return FusionDecision::allow();
  }

  // The bytes the ops strictly between block positions `from` and `to` allocate.
  double allocatedBetween(int from, int to) const {
    double bytes = 0;
    for (int q = from + 1; q < to; ++q) {
      const Op* op = deps_.ops()[static_cast<size_t>(q)];
      if (CostModel::launchesWork(*op))
        for (const Value* r : op->results()) bytes += cost_.valueBytes(*r);
    }
    return bytes;
  }

  // The last op strictly between block positions `from` and `to` that launches work and
  // allocates a result, or null.
  const Op* lastAllocatingOpBetween(int from, int to) const {
    for (int q = to - 1; q > from; --q) {
      const Op* op = deps_.ops()[static_cast<size_t>(q)];
      if (CostModel::launchesWork(*op) && op->numResults() > 0) return op;
    }
    return nullptr;
  }

  // A fused group runs where its last op was (`from`); taking `consumer` moves it to the
  // consumer (`to`). Values the group reads that would have died in it then live across the ops
  // in between, while the group's results that only it and the consumer read stop living there.
  // Fusion must not raise the planned peak, so it is refused when the live bytes would grow at
  // an allocating op in between: e.g. a gradient sum fused across the backward pass would keep
  // one [B, d] term per layer live to its end, and the clones made by remat along with them.
  FusionDecision keepsLiveSetBounded(const Group& grp, const Op& consumer) const {
    // The extension is largest at the last op in between that allocates.
    const Op* alloc = lastAllocatingOpBetween(pos_.at(grp.members.back()), pos_.at(&consumer));
    if (!alloc) return FusionDecision::allow();
    const int last_alloc = pos_.at(alloc);
    double freed = 0;
    for (const Op* m : grp.members)
      for (const Value* r : m->results()) {
        bool consumer_reads = false, others_read = false;
        for (const ir::Use& u : r->uses()) {
          consumer_reads |= u.user == &consumer;
          others_read |= u.user != &consumer && !grp.has(u.user);
        }
        if (consumer_reads && !others_read) freed += cost_.valueBytes(*r);
      }
    double kept = 0, largest = 0;
    const Value* largest_value = nullptr;
    std::unordered_set<const Value*> seen;
    for (const Op* m : grp.members)
      for (const Value* v : m->operands()) {
        const Op* d = v->definingOp();
        if (!d || grp.has(d) || d->hasTrait(ir::kSource) || !seen.insert(v).second) continue;
        bool live_there = false;  // read at or after the op in between by an op outside the group
        for (const ir::Use& u : v->uses()) {
          if (grp.has(u.user)) continue;
          auto it = pos_.find(u.user);
          live_there |= it == pos_.end() || it->second >= last_alloc;
        }
        if (live_there) continue;
        double bytes = cost_.valueBytes(*v);
        kept += bytes;
        if (bytes > largest) largest = bytes, largest_value = v;
      }
    if (kept <= freed) return FusionDecision::allow();
    return FusionDecision::forbid(fmt::format(
        "fusing would keep {} ({}) live until {}, past {}: {} more live bytes there (the planned peak may rise)",
        namer_.name(largest_value), byteSize(largest), label(consumer), label(*deps_.ops()[static_cast<size_t>(last_alloc)]),
        static_cast<int64_t>(kept - freed)));
  }

  // Sibling fusion (XLA's multi-output fusion of siblings): an elementwise op that no producer's
  // group takes joins an earlier pointwise group that reads one of its operands, when the group
  // iterates over the op's shape: the shared operand is read once, by one kernel that stores
  // both results. The legality and cost checks are a consumer's (canFuse): no cycle through
  // another group, nothing delayed, the live set bounded, and a gain the cost model predicts
  // (the shared read). A refusal here is not reported: most candidates are simply unrelated.
  bool joinSibling(Op* op, std::set<int>& tried) {
    for (Value* v : op->operands()) {
      if (v->type().rank() == 0) continue;  // a scalar shared by many ops is no reason to group them
      for (const ir::Use& u : v->uses()) {
        auto it = group_of_.find(u.user);
        if (u.user == op || it == group_of_.end()) continue;
        const int g = it->second;
        Group& grp = groups_[static_cast<size_t>(g)];
        if (grp.kind != Kind::Pointwise || !tried.insert(g).second) continue;
        if (!canFuse(*u.user, *op, g)) continue;
        grp.members.push_back(op);
        group_of_[op] = g;
        return true;
      }
    }
    return false;
  }

  // Puts `op` into the first group of an operand producer that may take it, else into a new one.
  void place(Op* op) {
    std::set<int> tried;
    if (ir::isPointwise(*op) || isReduction(*op)) {
      for (Value* v : op->operands()) {
        Op* p = v->definingOp();
        if (!p || !group_of_.count(p)) continue;
        int g = group_of_[p];
        if (!tried.insert(g).second) continue;
        FusionDecision d = canFuse(*p, *op, g);
        if (d) {
          Group& grp = groups_[static_cast<size_t>(g)];
          grp.members.push_back(op);
          group_of_[op] = g;
          // A matrix added in the GEMM moves it to the add, past whatever allocates in between:
          // an optional join fuseModule may undo (the bytes allocated in between first).
          if (grp.kind == Kind::Gemm && addedTerm(*op) == AddedTerm::Matrix)
            optional_joins_.push_back({pos_.at(op), allocatedBetween(pos_.at(grp.members.front()), pos_.at(op))});
          // A DRELU epilogue: the ReLU's own GEMM writes the mask it reads.
          if (grp.kind == Kind::Gemm && op->is(ir::OpCode::ActivationGrad) && op->strAttr("activation") == "relu")
            op->operand(0)->definingOp()->setAttr("kiln.relu_mask", ir::Attribute(true));
          if (grp.kind == Kind::Pointwise && isReduction(*op)) {
            grp.kind = Kind::Reduction;
            grp.closed = true;
          }
          return;
        }
        refuse(*p, *op, d.reason());
      }
    }
    if (siblings_ && ir::isPointwise(*op) && joinSibling(op, tried)) return;
    if (op->is(ir::OpCode::Matmul))
      newGroup(Kind::Gemm, {op}, false);
    else if (ir::isPointwise(*op))
      newGroup(Kind::Pointwise, {op}, false);
    else newGroup(isReduction(*op) ? Kind::Reduction : Kind::Other, {op}, true);
  }

  // A fixed-hotness bag over a table and ids straight from the model's sources.
  FusionDecision bagFusible(const Op& bag, const Op& concat) const {
    auto forbid = [&](std::string why) {
      return FusionDecision::forbid(fmt::format("cannot fuse kiln.embedding_bag into {}: {}", concat.name(), why));
    };
    if (bag.numOperands() != 2) return forbid("per-id weights or lengths (variable hotness) need their own kernel");
    if (bag.operand(1)->type().rank() != 2 || bag.operand(1)->type().hasBoundedDims())
      return forbid("the ids are not a fixed-hotness [B, H] tensor");
    for (Value* v : bag.operands())
      if (!v->definingOp() || !v->definingOp()->hasTrait(ir::kSource))
        return forbid(fmt::format("{} is computed, not a table or ids of the model", namer_.name(v)));
    if (bag.result()->uses().size() != 1) return forbid("the pooled rows have other users than the concat");
    return FusionDecision::allow();
  }

  void formEmbeddingGroups() {
    for (Op* op : deps_.ops()) {
      if (!op->is(ir::OpCode::Concat)) continue;
      std::vector<Op*> members;
      for (Value* v : op->operands()) {
        Op* bag = v->definingOp();
        if (!bag || !bag->is(ir::OpCode::EmbeddingBag) || group_of_.count(bag)) continue;
        if (FusionDecision d = bagFusible(*bag, *op); d) members.push_back(bag);
        else refuse(*bag, *op, d.reason());
      }
      if (members.empty()) continue;
      members.push_back(op);
      newGroup(Kind::Embedding, members, true);
    }
  }

  void formEmbeddingUpdateGroups() {
    std::unordered_map<Value*, std::vector<Op*>> by_source;  // concatenated gradient -> slices+updates
    std::vector<Value*> order;
    for (Op* op : deps_.ops()) {
      if (!op->is(ir::OpCode::EmbeddingBagUpdate)) continue;
      Op* slice = op->operand(2)->definingOp();
      if (!slice || !slice->is(ir::OpCode::Slice)) continue;
      if (slice->result()->uses().size() != 1) {
        refuse(*slice, *op, "cannot fuse kiln.slice into kiln.embedding_bag_update: the gradient slice has other users");
        continue;
      }
      Value* src = slice->operand(0);
      if (!by_source.count(src)) order.push_back(src);
      by_source[src].push_back(slice);
      by_source[src].push_back(op);
    }
    for (Value* src : order) newGroup(Kind::EmbeddingUpdate, by_source[src], true);
  }

  // The weight gradient of a linear layer with a bias, dW = g^T x (matmul(g, x) with
  // transpose_a; or x^T g, g as B), and its bias gradient db = sum_to(g) folding g's leading dim
  // read the same g: cuBLASLt computes db in the GEMM's epilogue (BGRADA/BGRADB) while g passes
  // through it, so the fold stops being kernels of its own and g is read once. The GEMM may read
  // g narrowed to bf16 (mixed precision): cuBLASLt then sums the bf16 values it multiplies, as
  // a bf16 backward does (codegen/emit/gemm.cc). Returns the matmul, or why none fits.
  FusionDecision biasGradientGemm(const Op& sum, Op** found) const {
    auto forbid = [&](std::string why) {
      return FusionDecision::forbid(
          fmt::format("cannot fuse kiln.sum_to into a weight-gradient GEMM: {}", why));
    };
    Value* g = sum.operand(0);
    const ir::TensorType& gt = g->type();
    const ir::TensorType& st = sum.result()->type();
    if (gt.rank() != 2 || st.rank() != 1 || !(st.dim(0) == gt.dim(1)))
      return forbid(fmt::format("it folds {} to {}, not the leading dim of a matrix", gt.str(), st.str()));
    // The values a GEMM may read for g: g, or g cast to bf16/f16.
    std::vector<Value*> reads = {g};
    for (const ir::Use& u : g->uses())
      if (u.user->is(ir::OpCode::Cast) && gt.dtype() == ir::DType::f32 &&
          (u.user->result()->type().dtype() == ir::DType::bf16 ||
           u.user->result()->type().dtype() == ir::DType::f16))
        reads.push_back(u.user->result());
    std::string why = "no matmul folds g's leading dim as its K (g^T x, or x^T g)";
    for (Value* v : reads)
      for (const ir::Use& u : v->uses()) {
        Op* mm = u.user;
        if (!mm->is(ir::OpCode::Matmul) || group_of_.count(mm) || pos_.find(mm) == pos_.end()) continue;
        bool k_leading = (u.operand_index == 0 && mm->boolAttr("transpose_a")) ||
                         (u.operand_index == 1 && !mm->boolAttr("transpose_b"));
        if (!k_leading || mm->operand(0)->type().rank() != 2 || mm->operand(1)->type().rank() != 2) continue;
        if (mm->boolAttr("kiln.recompute") != sum.boolAttr("kiln.recompute")) {
          why = "one is recomputed in the backward pass (remat)";
          continue;
        }
        *found = mm;
        return FusionDecision::allow();
      }
    return forbid(why);
  }

  void formBiasGradientGroups() {
    for (Op* sum : deps_.ops()) {
      if (!sum->is(ir::OpCode::SumTo) || group_of_.count(sum) || keep_apart_.count(pos_.at(sum))) continue;
      if (leave_recomputed_ && sum->boolAttr("kiln.recompute")) continue;
      Op* mm = nullptr;
      FusionDecision d = biasGradientGemm(*sum, &mm);
      if (!d) {
        // Only a fold some matmul reads the operand of is worth a reason in --explain.
        for (const ir::Use& u : sum->operand(0)->uses())
          if (u.user->is(ir::OpCode::Matmul) || u.user->is(ir::OpCode::Cast)) {
            refuse(*sum, *u.user, d.reason());
            break;
          }
        continue;
      }
      std::vector<Op*> members = {mm, sum};
      // A bf16 product widened to f32 at once is the GEMM's f32 accumulator (as in every
      // gemm_epilogue group); the bias gradient then has the f32 output's type.
      const ir::Use* only = mm->result()->uses().size() == 1 ? &mm->result()->uses().front() : nullptr;
      if (only && ir::isWideningCast(*mm, *only->user) && !group_of_.count(only->user))
        members.push_back(only->user);
      const ir::DType out = members.size() == 3 ? ir::DType::f32 : mm->result()->type().dtype();
      if (sum->result()->type().dtype() != out) {
        refuse(*sum, *mm,
               fmt::format("cannot fuse kiln.sum_to into a weight-gradient GEMM: a {} bias gradient of a "
                           "{} product (cuBLASLt writes it in the output's type)",
                           ir::dtypeName(sum->result()->type().dtype()), ir::dtypeName(out)));
        continue;
      }
      if (FusionDecision m = siblingsMayMeet(members); !m) {
        refuse(*sum, *mm, m.reason());
        continue;
      }
      std::vector<const Op*> cost_members(members.begin(), members.end());
      if (double gain = cost_.fusionBenefit(cost_members); gain <= 0) {
        refuse(*sum, *mm,
               fmt::format("cannot fuse kiln.sum_to into a weight-gradient GEMM: not profitable: the cost "
                           "model predicts {:.3f} us saved",
                           gain * 1e6));
        continue;
      }
      const double early = siblingExtraBytes(members, true), late = siblingExtraBytes(members, false);
      groups_[static_cast<size_t>(newGroup(Kind::Gemm, members, true))].run_early = early <= late;
      optional_joins_.push_back({pos_.at(sum), std::min(early, late)});
    }
  }

  // Ops that share an operand but not a result run as one unit either where the last of them
  // was (the earlier ones move down: what only they read lives longer) or as early as their
  // operands allow (the later ones move up: what they write lives longer). No op between them
  // may have to follow an earlier one (a reader of its result, an in-place writer of what it
  // reads).
  FusionDecision siblingsMayMeet(std::vector<Op*> members) const {
    std::sort(members.begin(), members.end(), [&](Op* a, Op* b) { return pos_.at(a) < pos_.at(b); });
    auto forbid = [&](std::string why) {
      return FusionDecision::forbid(
          fmt::format("cannot fuse {} with {}: {}", members.front()->name(), members.back()->name(), why));
    };
    const int last = pos_.at(members.back());
    for (Op* m : members) {
      if (m == members.back()) break;
      for (int q : deps_.successors(pos_.at(m))) {
        const Op* after = deps_.ops()[static_cast<size_t>(q)];
        if (q < last && std::find(members.begin(), members.end(), after) == members.end())
          return forbid(fmt::format("fusing would delay {} (it must follow {})", label(*after), label(*m)));
      }
    }
    return FusionDecision::allow();
  }

  // The bytes a sibling group (members in block order) keeps live longer across the allocating
  // ops between its first and last member, run early or late (above). Mixed precision's bias
  // gradient shows both sides: late, the f32 g the sum_to reads lives across the data-gradient
  // GEMM ([B, N]); early, the weight gradient does ([N, K], f32 and its bf16 product). Which is
  // less depends on B against K: fusion takes the smaller (the peak check has the last word).
  double siblingExtraBytes(const std::vector<Op*>& members, bool early) const {
    const int first = pos_.at(members.front()), last = pos_.at(members.back());
    auto member = [&](const Op* op) {
      return std::find(members.begin(), members.end(), op) != members.end();
    };
    int last_alloc = -1;
    for (int q = last - 1; q > first && last_alloc < 0; --q) {
      const Op* op = deps_.ops()[static_cast<size_t>(q)];
      if (!member(op) && CostModel::launchesWork(*op) && op->numResults() > 0) last_alloc = q;
    }
    if (last_alloc < 0) return 0;
    double bytes = 0;
    if (early) {
      for (const Op* m : members)
        if (m != members.front())
          for (const Value* r : m->results()) bytes += cost_.valueBytes(*r);
      return bytes;
    }
    std::unordered_set<const Value*> seen;
    for (const Op* m : members) {
      if (m == members.back()) continue;
      for (const Value* v : m->operands()) {
        const Op* d = v->definingOp();
        if (!d || member(d) || d->hasTrait(ir::kSource) || !seen.insert(v).second) continue;
        bool live_there = false;  // read by a non-member at or after the last allocating op
        for (const ir::Use& u : v->uses()) {
          if (member(u.user)) continue;
          auto it = pos_.find(u.user);
          live_there |= it == pos_.end() || it->second >= last_alloc;
        }
        if (!live_there) bytes += cost_.valueBytes(*v);
      }
    }
    return bytes;
  }

  // Builds one kiln.fused op per group of two or more ops, then restores a valid order.
  void materialize() {
    ir::Block& block = f_.entry();
    std::unordered_map<const Op*, int> key;  // preferred position: the group's last op
    for (const auto& [op, p] : pos_) key[op] = p;
    for (Group& grp : groups_) {
      if (grp.members.size() < 2) continue;
      std::unordered_set<const Op*> in(grp.members.begin(), grp.members.end());
      std::vector<Value*> inputs, outputs;
      std::unordered_map<Value*, unsigned> input_index;
      // Parameters an op updates in place stay named directly (captured from the function),
      // as the verifier requires of in-place updates.
      auto captured = [](const Op& m, const Value* v) {
        return writesInPlace(m) && v->definingOp() && v->definingOp()->is(ir::OpCode::Parameter);
      };
      for (Op* m : grp.members) {
        for (Value* v : m->operands())
          if ((!v->definingOp() || !in.count(v->definingOp())) && !input_index.count(v) && !captured(*m, v)) {
            input_index[v] = static_cast<unsigned>(inputs.size());
            inputs.push_back(v);
          }
        for (Value* r : m->results())
          for (const ir::Use& u : r->uses())
            if (!in.count(u.user)) {
              outputs.push_back(r);
              break;
            }
      }
      std::vector<ir::TensorType> types;
      for (Value* v : outputs) types.push_back(v->type());
      auto fused = Op::create(ir::OpCode::Fused, inputs, types, {{"kind", ir::Attribute(kindName(grp.kind))}},
                              grp.members.front()->location());
      ir::Block& body = fused->addRegion().addBlock();
      for (Value* v : inputs) body.addArgument(v->type(), v->nameHint());
      // At the last member: every reader of what the group writes in place still comes first.
      Op* fop = block.insertBefore(grp.members.back(), std::move(fused));
      key[fop] = pos_[grp.run_early ? grp.members.front() : grp.members.back()];
      for (size_t i = 0; i < outputs.size(); ++i) {
        fop->result(static_cast<unsigned>(i))->setNameHint(outputs[i]->nameHint());
        std::vector<ir::Use> uses = outputs[i]->uses();
        for (const ir::Use& u : uses)
          if (!in.count(u.user)) u.user->setOperand(u.operand_index, fop->result(static_cast<unsigned>(i)));
      }
      for (Op* m : grp.members) {
        Op* moved = body.push_back(block.remove(m));
        for (unsigned i = 0; i < moved->numOperands(); ++i) {
          auto it = input_index.find(moved->operand(i));
          if (it != input_index.end()) moved->setOperand(i, body.argument(it->second));
        }
      }
      body.push_back(Op::create(ir::OpCode::Yield, outputs, {}));
    }
    std::vector<Op*> now = block.opList();
    reorderBlock(block, [&](int a, int b) {
      return key.at(now[static_cast<size_t>(a)]) < key.at(now[static_cast<size_t>(b)]);
    });
  }

  ir::Function& f_;
  const CostModel& cost_;
  ir::ValueNamer namer_;
  BlockDependences deps_;
  std::unordered_map<const Op*, int> pos_;
  std::vector<Group> groups_;
  std::unordered_map<const Op*, int> group_of_;
  std::vector<RefusedFusion> refused_;
  bool leave_recomputed_ = false;
  bool siblings_ = true;
  std::set<int> keep_apart_;
  // Joins fuseModule may undo when the planned peak rises: a bias gradient's sum_to beside its
  // weight-gradient GEMM, an add of C in a GEMM. (block position of the sum_to or add, the
  // extra bytes the join may keep live.)
  std::vector<std::pair<int, double>> optional_joins_;

 public:
  // The optional joins made (optional_joins_), for fuseModule to undo the costliest first.
  const std::vector<std::pair<int, double>>& optionalJoins() const { return optional_joins_; }
};

}  // namespace

int countLaunches(const ir::Function& f) {
  int n = 0;
  for (const auto& op : f.entry().ops()) n += CostModel::launchesWork(*op);
  return n;
}

Expected<std::vector<FusionReport>> fuseModule(ir::Module& m, const FusionOptions& options) {
  ir::SymbolBindings symbols = options.symbols.empty() ? planningSymbols(m) : options.symbols;
  CostModel cost(options.target, symbols);
  std::vector<FusionReport> reports;
  for (auto& f : m.functions()) {
    if (f->body().empty()) continue;
    // The lifetime rule refuses most fusions that would keep memory live; what it cannot see
    // (the arena's layout after groups move) is checked here: fusion is tried on a copy, then
    // without the optional joins one by one (bias gradients, adds of C), then without remat's
    // clones (with and without them), then all of that again without sibling fusion, and kept
    // only in a form that does not raise the planned peak.
    const ir::SymbolBindings bound = bindAllSymbols(*f, symbols);
    KILN_ASSIGN_OR_RETURN(auto before, estimatePeakBytes(*f, bound));
    // A step remat made fit a memory budget (it holds recomputed clones) gets no sibling fusion:
    // a sibling join moves its group later, past ops the budgeted plan was made around, for one
    // read saved (the planned peak after scheduling rose by a vector in DCNv2's budgeted step).
    bool recomputes = false;
    for (const auto& op : f->entry().ops()) recomputes |= op->boolAttr("kiln.recompute");
    bool fused = false;
    for (int attempt = recomputes ? 2 : 0; attempt < 4 && !fused; ++attempt) {
      const bool siblings = attempt < 2, leave_recomputed = attempt % 2 == 1;
      std::set<int> keep_apart;
      for (;;) {
        ir::Module scratch;
        ir::Function& trial = ir::cloneFunction(*f, scratch, f->name());
        FunctionFuser fuser(trial, cost, leave_recomputed, keep_apart, siblings);
        KILN_ASSIGN_OR_RETURN(auto t, fuser.run());
        KILN_ASSIGN_OR_RETURN(auto after, estimatePeakBytes(trial, bound));
        if (after <= before) {
          std::vector<std::string> apart;  // named before fusion renames and reorders
          const ir::ValueNamer namer(*f);
          const std::vector<Op*> ops = f->entry().opList();
          for (int at : keep_apart) {
            const Op& op = *ops[static_cast<size_t>(at)];
            apart.push_back(fmt::format("{} = {}", namer.name(op.result()), op.name()));
          }
          KILN_ASSIGN_OR_RETURN(auto r, FunctionFuser(*f, cost, leave_recomputed, keep_apart, siblings).run());
          for (const std::string& sum : apart)
            r.refused.push_back({sum, "", "kept out of its GEMM: with it the planned peak rises"});
          if (!siblings)
            r.refused.push_back({"@" + f->name(), "",
                                 recomputes ? "no sibling fusion in a step with recomputed clones (remat)"
                                            : "no sibling fusion: with it the planned peak rises"});
          reports.push_back(std::move(r));
          fused = true;
          break;
        }
        // Too much: the optional join that may keep the most bytes live goes first.
        const auto& formed = fuser.optionalJoins();
        if (formed.empty()) break;
        keep_apart.insert(std::max_element(formed.begin(), formed.end(), [](const auto& a, const auto& b) {
                            return a.second < b.second;
                          })->first);
      }
    }
    if (!fused) {
      FusionReport r;
      r.function = f->name();
      r.launches_before = r.launches_after = countLaunches(*f);
      r.refused.push_back({"@" + f->name(), "", "every grouping found would raise the planned peak; left unfused"});
      reports.push_back(std::move(r));
    }
  }
  return reports;
}

std::string explainFusion(const std::vector<FusionReport>& reports) {
  std::string out;
  for (const FusionReport& r : reports) {
    out += fmt::format("fusion @{}: {} launches -> {} ({} groups, {} refused pairs)\n", r.function, r.launches_before,
                       r.launches_after, r.groups.size(), r.refused.size());
    for (size_t i = 0; i < r.groups.size(); ++i) {
      const FusedGroupReport& g = r.groups[i];
      out += fmt::format("  group {} ({}, {} ops): saves {} launches, {:.0f} bytes, {:.2f} us\n", i, g.kind,
                         g.ops.size(), g.saved_launches, g.saved_bytes, g.saved_seconds * 1e6);
      for (const std::string& op : g.ops) out += fmt::format("    {}\n", op);
    }
    for (const RefusedFusion& x : r.refused)
      out += fmt::format("  refused {} -> {}: {}\n", x.producer, x.consumer, x.reason);
  }
  return out;
}

class FusionPass : public RegisteredPass<FusionPass> {
 public:
  KILN_PASS_INFO(FusionPass)
  explicit FusionPass(Target target) : target_(std::move(target)) {}
  Expected<bool> run(ir::Module& m) override {
    FusionOptions options;
    options.target = target_;
    KILN_ASSIGN_OR_RETURN(auto reports, fuseModule(m, options));
    for (const FusionReport& r : reports)
      if (r.launches_after != r.launches_before) return true;
    return false;
  }

 private:
  Target target_;
};

Expected<std::unique_ptr<Pass>> createFusionPass(const PassContext& context, const PassOptions&) {
  return makePass<FusionPass>(context.target);
}

}  // namespace kiln::passes
