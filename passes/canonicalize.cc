// Canonicalization: local rewrites that make the graph smaller or more regular, to a fixpoint.
//   - elementwise ops (and casts) whose operands are all splat constants fold to a splat
//     constant of the result type;
//   - identities: x*1, 1*x, x+0, 0+x, x-0, x/1 -> x (only where x already has the result's
//     type, so that a broadcast is never dropped), neg(neg x) -> x;
//   - reshape to the same type -> x; reshape(reshape x) -> reshape x;
//   - transpose(transpose x) -> one transpose (none when the perms cancel), identity perm -> x;
//   - cast to the operand's own element type -> x;
//   - a sum of zero pads that tile their result along one axis -> kiln.concat of the padded
//     values (the gradient of a value split by slices, e.g. SwiGLU's gate and up halves or
//     attention's q, k, v: one buffer written once instead of a full-size buffer per part);
//   - kiln.running_stat -> the operand its mode selects (the batch's statistic in training; the
//     running one in eval, except in a @forward the autodiff pass has yet to differentiate).
// Pure ops left unused by these rewrites are removed; other dead code is DCE's job.
#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_set>

#include "ir/op_def.h"
#include "ir/tensor_view.h"
#include "passes/pass_registry.h"

namespace kiln::passes {
namespace {

using ir::Attribute;
using ir::DType;
using ir::Op;
using ir::TensorType;
using ir::Value;

// The number of a splat `kiln.constant` (one value for every element), if v is one.
std::optional<double> splatValue(const Value* v) {
  const Op* def = v->definingOp();
  if (!def || !def->is(ir::OpCode::Constant)) return std::nullopt;
  const Attribute* a = def->attr("value");
  if (!a || !a->isNumber()) return std::nullopt;
  return a->asDouble();
}

bool isSplat(const Value* v, double x) {
  auto s = splatValue(v);
  return s && *s == x;
}

// Rounds a double to what an element of `t` holds; nullopt where we do not model the
// element type's rounding (f16, f8), so that folding never changes a result.
std::optional<double> roundTo(DType t, double v) {
  switch (t) {
    case DType::f64:
      return v;
    case DType::f32:
      return static_cast<double>(static_cast<float>(v));
    case DType::bf16:
      return static_cast<double>(ir::bf16ToFloat(ir::floatToBf16(static_cast<float>(v))));
    case DType::i64:
      return std::nearbyint(v) == v && std::fabs(v) < 9.0e15 ? std::optional<double>(v) : std::nullopt;
    case DType::i32:
      return std::nearbyint(v) == v && std::fabs(v) <= 2147483647.0 ? std::optional<double>(v) : std::nullopt;
    case DType::i1:
      return v != 0 ? 1.0 : 0.0;
    default:
      return std::nullopt;
  }
}

// An elementwise function of scalar_fn.def (or a comparison) on constants, evaluated in double;
// nullopt for a function of floats only applied to integers.
std::optional<double> foldFunction(const Op& op, const std::vector<double>& in) {
  auto fn = ir::scalarFnOf(op);
  if (!fn || in.empty()) return std::nullopt;
  const ir::ScalarFnInfo& info = ir::scalarFnInfo(*fn);
  if (info.domain == ir::ScalarDomain::Float && ir::isInteger(op.operand(0)->type().dtype()))
    return std::nullopt;
  return ir::scalar::evaluate<double>(*fn, in[0], info.arity == 2 ? in[1] : 0.0);
}

class Rewriter {
 public:
  // Whether an eval-mode kiln.running_stat may fold into its running operand: not in the
  // @forward that the autodiff pass has yet to clone into @train_step (the clone's training
  // form needs the batch's statistic).
  bool fold_eval_stats = true;

  // Replaces op's single result with v and erases op.
  void replace(Op* op, Value* v) {
    op->result()->replaceAllUsesWith(v);
    erase(op);
  }

  // Erases op, then any pure producer of its operands that it left without uses.
  void erase(Op* op) {
    std::vector<Op*> producers;
    for (Value* v : op->operands())
      if (v && v->definingOp() &&
          std::find(producers.begin(), producers.end(), v->definingOp()) == producers.end())
        producers.push_back(v->definingOp());
    op->parentBlock()->erase(op);
    erased.insert(op);
    changed = true;
    for (Op* p : producers) eraseIfDead(p);
  }

  // Inserts a new op. Its address may be one an erased op had: it is live again.
  Op* insertBefore(Op* before, std::unique_ptr<Op> op) {
    erased.erase(op.get());
    changed = true;
    return before->parentBlock()->insertBefore(before, std::move(op));
  }

  void eraseIfDead(Op* op) {
    if (erased.count(op) || !op->hasTrait(ir::kPure) || op->hasTrait(ir::kSideEffect)) return;
    for (Value* r : op->results())
      if (r->hasUses()) return;
    erase(op);
  }

  bool changed = false;
  // Erased ops, compared by address only, so that a sweep skips them in its snapshot of a block.
  std::unordered_set<const Op*> erased;
};

// Folds an op on splat constants; returns the new constant's value or nullptr.
Value* foldConstant(Op* op, Rewriter& rw) {
  const TensorType& type = op->result()->type();
  bool integer = ir::isInteger(type.dtype()) || type.dtype() == DType::i1;
  std::vector<double> in;
  for (Value* v : op->operands()) {
    auto s = splatValue(v);
    if (!s) return nullptr;
    in.push_back(*s);
  }
  std::optional<double> out;
  if (op->is(ir::OpCode::Cast)) {
    DType from = op->operand(0)->type().dtype();
    // Float to integer conversion semantics belong to the backends; leave it to them.
    if (ir::isFloat(from) && !ir::isFloat(type.dtype())) return nullptr;
    out = in[0];
  } else if (op->is(ir::OpCode::Select)) {
    out = in[0] != 0 ? in[1] : in[2];
  } else {
    out = foldFunction(*op, in);
  }
  if (!out) return nullptr;
  out = roundTo(type.dtype(), *out);
  if (!out) return nullptr;
  Attribute value = integer ? Attribute(static_cast<int64_t>(*out)) : Attribute(*out);
  auto c = Op::create(ir::OpCode::Constant, {}, {type}, {{"value", value}}, op->location());
  c->result()->setNameHint(op->result()->nameHint());
  return rw.insertBefore(op, std::move(c))->result();
}

// x op identity -> x, when that does not drop a broadcast.
Value* foldIdentity(Op* op, const Rewriter& rw) {
  if (op->numOperands() != 2) return nullptr;
  Value* a = op->operand(0);
  Value* b = op->operand(1);
  const TensorType& t = op->result()->type();
  auto keep = [&](Value* v) { return v->type() == t ? v : nullptr; };
  if (op->is(ir::OpCode::Mul)) {
    if (isSplat(b, 1)) return keep(a);
    if (isSplat(a, 1)) return keep(b);
  } else if (op->is(ir::OpCode::Add)) {
    if (isSplat(b, 0)) return keep(a);
    if (isSplat(a, 0)) return keep(b);
  } else if (op->is(ir::OpCode::Sub)) {
    if (isSplat(b, 0)) return keep(a);
  } else if (op->is(ir::OpCode::Div)) {
    if (isSplat(b, 1)) return keep(a);
  } else if (op->is(ir::OpCode::RunningStat)) {
    const bool training = op->boolAttr("training", false);
    if (training || rw.fold_eval_stats) return keep(op->operand(training ? 0 : 1));
  }
  return nullptr;
}

// A sum (a tree of kiln.add, each inner add read only by the next) of kiln.pad whose padded
// parts tile the result along one axis, each pad read only by the sum: their concatenation
// along that axis. Each element of the sum is one part's element plus zeros, so the values are
// the same bits.
Value* concatOfPads(Op* root, Rewriter& rw) {
  const TensorType& type = root->result()->type();
  std::vector<Op*> pads;
  std::vector<Op*> stack{root};
  while (!stack.empty()) {
    Op* add = stack.back();
    stack.pop_back();
    for (Value* v : add->operands()) {
      Op* def = v->definingOp();
      if (!def || !(v->type() == type) || v->uses().size() != 1) return nullptr;
      if (def->is(ir::OpCode::Add))
        stack.push_back(def);
      else if (def->is(ir::OpCode::Pad))
        pads.push_back(def);
      else
        return nullptr;
    }
  }
  if (pads.size() < 2) return nullptr;
  const int64_t axis = pads.front()->intAttr("axis");
  if (axis < 0 || axis >= type.rank() || !type.dim(axis).isStatic()) return nullptr;
  std::sort(pads.begin(), pads.end(), [](const Op* a, const Op* b) { return a->intAttr("low") < b->intAttr("low"); });
  int64_t at = 0;
  std::vector<Value*> parts;
  for (const Op* pad : pads) {
    const ir::Dim& d = pad->operand(0)->type().dim(axis);
    if (pad->intAttr("axis") != axis || !d.isStatic() || pad->intAttr("low") != at) return nullptr;
    at += d.size();
    parts.push_back(pad->operand(0));
  }
  if (at != type.dim(axis).size()) return nullptr;
  auto concat = Op::create(ir::OpCode::Concat, parts, {type}, {{"axis", Attribute(axis)}}, root->location());
  concat->result()->setNameHint(root->result()->nameHint());
  return rw.insertBefore(root, std::move(concat))->result();
}

bool isIdentityPerm(const std::vector<int64_t>& perm) {
  for (size_t i = 0; i < perm.size(); ++i)
    if (perm[i] != static_cast<int64_t>(i)) return false;
  return true;
}

// One rewrite of op, if one applies.
void canonicalizeOp(Op* op, Rewriter& rw) {
  if (op->numResults() != 1 || !op->hasTrait(ir::kPure) || !op->regions().empty()) return;
  Value* result = op->result();

  if ((op->hasTrait(ir::kElementwise) || op->is(ir::OpCode::Cast)) && op->numOperands() > 0) {
    if (Value* c = foldConstant(op, rw)) return rw.replace(op, c);
  }
  if (Value* x = foldIdentity(op, rw)) return rw.replace(op, x);
  if (op->is(ir::OpCode::Add))
    if (Value* c = concatOfPads(op, rw)) return rw.replace(op, c);

  Value* in = op->numOperands() == 1 ? op->operand(0) : nullptr;
  if (!in) return;
  Op* producer = in->definingOp();

  if (op->is(ir::OpCode::Neg) && producer && producer->is(ir::OpCode::Neg) &&
      producer->operand(0)->type() == result->type())
    return rw.replace(op, producer->operand(0));

  if (op->is(ir::OpCode::Reshape) || op->is(ir::OpCode::Cast)) {
    if (in->type() == result->type()) return rw.replace(op, in);
  }
  if (op->is(ir::OpCode::Reshape) && producer && producer->is(ir::OpCode::Reshape)) {
    Value* src = producer->operand(0);
    if (src->type() == result->type()) return rw.replace(op, src);
    op->setOperand(0, src);
    rw.changed = true;
    rw.eraseIfDead(producer);
    return;
  }
  if (op->is(ir::OpCode::Transpose)) {
    std::vector<int64_t> perm = op->intsAttr("perm");
    if (isIdentityPerm(perm) && in->type() == result->type()) return rw.replace(op, in);
    if (producer && producer->is(ir::OpCode::Transpose)) {
      // out.dim(i) = mid.dim(perm[i]) = src.dim(inner[perm[i]]).
      std::vector<int64_t> inner = producer->intsAttr("perm");
      if (inner.size() != perm.size()) return;
      std::vector<int64_t> composed(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) composed[i] = inner[static_cast<size_t>(perm[i])];
      Value* src = producer->operand(0);
      if (isIdentityPerm(composed) && src->type() == result->type()) return rw.replace(op, src);
      op->setOperand(0, src);
      op->setAttr("perm", Attribute::ints(composed));
      rw.changed = true;
      rw.eraseIfDead(producer);
      return;
    }
  }
}

void canonicalizeBlock(ir::Block& b, Rewriter& rw) {
  for (Op* op : b.opList()) {
    // A rewrite erases dead producers, which come earlier than their users: skip them if the
    // snapshot of an enclosing block still lists them.
    if (rw.erased.count(op)) continue;
    for (auto& r : op->regions())
      for (auto& blk : r->blocks()) canonicalizeBlock(*blk, rw);
    canonicalizeOp(op, rw);
  }
}

}  // namespace

class CanonicalizePass : public RegisteredPass<CanonicalizePass> {
 public:
  KILN_PASS_INFO(CanonicalizePass)

  Expected<bool> run(ir::Module& m) override {
    bool changed = false;
    const bool before_autodiff = m.attrs().count("kiln.train") && !m.lookup("train_step");
    for (auto& f : m.functions()) {
      // Each sweep shrinks the graph or moves an operand closer to its source, so this ends;
      // the bound guards against a rewrite pair that would undo each other.
      for (int sweep = 0; sweep < 64; ++sweep) {
        Rewriter rw;
        rw.fold_eval_stats = !(before_autodiff && f->name() == "forward");
        canonicalizeBlock(f->entry(), rw);
        if (!rw.changed) break;
        changed = true;
      }
    }
    return changed;
  }
};

Expected<std::unique_ptr<Pass>> createCanonicalizePass(const PassContext&, const PassOptions&) {
  return makePass<CanonicalizePass>();
}

}  // namespace kiln::passes
