// Tensor builtins beyond elementwise math, with numpy's semantics: where, batched products
// (matmul, einsum) lowered to one kiln.matmul each, and selection along an axis (topk, argmax,
// take_along_axis) lowered to the ops of docs/moe.md.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <string>

#include "frontend/model_lowering.h"

namespace kiln::frontend {

std::optional<ir::Dim> dimProduct(const ir::Dim& a, const ir::Dim& b) {
  // A dim is a factor times at most one symbol, so B * T with both symbolic has no type.
  if (a.isBounded() || b.isBounded() || (a.isSymbolic() && b.isSymbolic())) return std::nullopt;
  int64_t f = 0;
  if (__builtin_mul_overflow(a.factor(), b.factor(), &f)) return std::nullopt;
  if (a.isSymbolic()) return ir::Dim::symbol(a.sym(), f);
  if (b.isSymbolic()) return ir::Dim::symbol(b.sym(), f);
  return ir::Dim::fixed(f);
}

ir::Value* transposeTo(ModelLowering& L, ir::Value* x, const std::vector<int64_t>& perm) {
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == static_cast<int64_t>(i);
  if (identity) return x;
  return L.emit(ir::OpCode::Transpose, {x}, {{"perm", ir::Attribute::ints(perm)}});
}

namespace {

using CallArgs = ModelLowering::CallArgs;

// where(c, a, b): a where c holds, else b. A number takes the other branch's dtype (f32 when
// both branches are numbers).
Val fnWhere(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"cond", "a", "b"}, 3);
  ir::Value* c = L.tensorArg(*b.get(0), b.locs[0], "where's condition");
  if (c->type().dtype() != ir::DType::i1)
    L.fail(b.locs[0], fmt::format("where's condition must be a boolean tensor (such as x > 0), got {}",
                                  typeStr(c->type())));
  const Val& x = *b.get(1);
  const Val& y = *b.get(2);
  L.checkNotError(x);
  L.checkNotError(y);
  ir::DType dt = x.kind == Val::Kind::Tensor   ? x.tensor->type().dtype()
                 : y.kind == Val::Kind::Tensor ? y.tensor->type().dtype()
                                               : ir::DType::f32;
  auto branch = [&](const Val& v, const Location& loc) -> ir::Value* {
    if (v.isNumber()) {
      L.builder().setLocation(loc);
      return L.scalarConstant(v.asDouble(), dt);
    }
    return L.tensorArg(v, loc, "a branch of where");
  };
  ir::Value* tx = branch(x, b.locs[1]);
  ir::Value* ty = branch(y, b.locs[2]);
  auto xy = ir::broadcastShapes(tx->type().shape(), ty->type().shape());
  if (tx->type().dtype() != ty->type().dtype() || !xy || !ir::broadcastShapes(c->type().shape(), *xy))
    L.fail(a.loc, fmt::format("where cannot select between {} and {} under {}", typeStr(tx->type()),
                              typeStr(ty->type()), typeStr(c->type())));
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::Select, {c, tx, ty}));
}

// Two float tensors of one dtype, the operands of a product.
std::pair<ir::Value*, ir::Value*> productOperands(ModelLowering& L, CallArgs& a,
                                                  const ModelLowering::Bound& b, size_t first) {
  ir::Value* x =
      floatTensor(L, *b.get(first), b.locs[first], fmt::format("{}'s first operand", a.callee).c_str());
  ir::Value* y = floatTensor(L, *b.get(first + 1), b.locs[first + 1],
                             fmt::format("{}'s second operand", a.callee).c_str());
  if (x->type().dtype() != y->type().dtype())
    L.fail(a.loc, fmt::format("{} needs operands of one dtype, got {} and {}", a.callee, typeStr(x->type()),
                              typeStr(y->type())));
  return {x, y};
}

// numpy's matmul: [..., M, K] x [..., K, N] with broadcast batch dims; a 1-D first operand is a
// row vector and a 1-D second operand a column vector, their unit dim dropped from the result.
Val fnMatmul(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"a", "b"}, 2);
  auto [x, y] = productOperands(L, a, b, 0);
  if (x->type().rank() == 0 || y->type().rank() == 0)
    L.fail(a.loc, fmt::format("matmul needs tensors of rank 1 or more, got {} and {}", typeStr(x->type()),
                              typeStr(y->type())));
  L.builder().setLocation(a.loc);
  const bool row = x->type().rank() == 1, col = y->type().rank() == 1;
  if (row) x = L.reshape(x, {ir::Dim::fixed(1), x->type().dim(0)});
  if (col) y = L.reshape(y, {y->type().dim(0), ir::Dim::fixed(1)});
  const auto &tx = x->type(), &ty = y->type();
  if (!(tx.dim(tx.rank() - 1) == ty.dim(ty.rank() - 2)))
    L.fail(a.loc, fmt::format("matmul cannot multiply {} by {}: the contracted dims {} and {} differ",
                              typeStr(b.get(0)->tensor->type()), typeStr(b.get(1)->tensor->type()),
                              tx.dim(tx.rank() - 1).str(), ty.dim(ty.rank() - 2).str()));
  ir::Shape bx(tx.shape().begin(), tx.shape().end() - 2), by(ty.shape().begin(), ty.shape().end() - 2);
  if (!ir::broadcastShapes(bx, by))
    L.fail(a.loc,
           fmt::format("matmul cannot broadcast the batch dims of {} and {}", typeStr(tx), typeStr(ty)));
  ir::Value* r = L.emit(ir::OpCode::Matmul, {x, y});
  if (!row && !col) return Val::ofTensor(r);
  ir::Shape s(r->type().shape().begin(), r->type().shape().end() - 2);
  if (!row) s.push_back(r->type().dim(r->type().rank() - 2));
  if (!col) s.push_back(r->type().dim(r->type().rank() - 1));
  return Val::ofTensor(L.reshape(r, s));
}

// ---- einsum ---------------------------------------------------------------------------------

struct EinsumSpec {
  std::vector<std::string> inputs;  // one label string per operand
  std::string output;
};

EinsumSpec parseEinsum(ModelLowering& L, const std::string& text, const Location& loc) {
  std::string spec;
  for (char c : text)
    if (c != ' ') spec += c;
  if (spec.find("...") != std::string::npos || spec.find('.') != std::string::npos)
    L.fail(loc, "einsum does not support ellipsis ('...'): name every dimension");
  EinsumSpec r;
  size_t arrow = spec.find("->");
  std::string lhs = spec.substr(0, arrow);
  for (size_t start = 0;;) {
    size_t comma = lhs.find(',', start);
    r.inputs.push_back(lhs.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (r.inputs.size() > 2)
    L.fail(loc, fmt::format("einsum takes one or two operands, the spec names {}", r.inputs.size()));
  std::map<char, int> uses;
  for (const std::string& in : r.inputs) {
    for (size_t i = 0; i < in.size(); ++i) {
      char c = in[i];
      if (!std::isalpha(static_cast<unsigned char>(c)))
        L.fail(loc, fmt::format("einsum spec \"{}\": '{}' is not a dimension label (use letters)", text, c));
      if (in.find(c, i + 1) != std::string::npos)
        L.fail(loc, fmt::format(
                        "einsum spec \"{}\": label '{}' repeats in one operand (diagonals are not supported)",
                        text, c));
      ++uses[c];
    }
  }
  if (arrow == std::string::npos) {
    // numpy's implicit output: the labels used once, in alphabetical order.
    for (const auto& [c, n] : uses)
      if (n == 1) r.output += c;
    return r;
  }
  r.output = spec.substr(arrow + 2);
  for (size_t i = 0; i < r.output.size(); ++i) {
    char c = r.output[i];
    if (!uses.count(c))
      L.fail(loc, fmt::format("einsum spec \"{}\": output label '{}' is in no operand", text, c));
    if (r.output.find(c, i + 1) != std::string::npos)
      L.fail(loc, fmt::format("einsum spec \"{}\": output label '{}' repeats", text, c));
  }
  return r;
}

// One operand with its labels, as einsum rearranges it.
struct Labeled {
  ir::Value* x;
  std::string labels;
};

bool has(const std::string& s, char c) { return s.find(c) != std::string::npos; }

// Sums out the labels that neither the other operand nor the output has.
Labeled sumPrivateLabels(ModelLowering& L, Labeled t, const std::string& other, const std::string& out) {
  std::vector<int64_t> axes;
  std::string kept;
  for (size_t i = 0; i < t.labels.size(); ++i) {
    if (!has(other, t.labels[i]) && !has(out, t.labels[i]))
      axes.push_back(static_cast<int64_t>(i));
    else
      kept += t.labels[i];
  }
  if (axes.empty()) return t;
  return {reduce(L, t.x, "sum", axes, false), kept};
}

// The permutation that takes `from`'s labels to `to`'s order.
std::vector<int64_t> permutation(const std::string& from, const std::string& to) {
  std::vector<int64_t> perm;
  for (char c : to) perm.push_back(static_cast<int64_t>(from.find(c)));
  return perm;
}

ir::Dim productOf(ModelLowering& L, const Labeled& t, const std::string& labels, const Location& loc) {
  ir::Dim d = ir::Dim::fixed(1);
  for (char c : labels) {
    auto p = dimProduct(d, t.x->type().dim(static_cast<int64_t>(t.labels.find(c))));
    if (!p)
      L.fail(loc, fmt::format("einsum cannot merge the dims '{}' of {}: a dim holds at most one symbol",
                              labels, typeStr(t.x->type())));
    d = *p;
  }
  return d;
}

// Rearranges t to [batch..., rows, cols] (each a label group merged into one dim); `swapped`
// comes back true when t is already [batch..., cols, rows], which the matmul reads transposed.
ir::Value* asMatrices(ModelLowering& L, const Labeled& t, const std::string& batch, const std::string& rows,
                      const std::string& cols, bool& swapped, const Location& loc) {
  swapped = t.labels != batch + rows + cols && t.labels == batch + cols + rows;
  std::string order = swapped ? batch + cols + rows : batch + rows + cols;
  ir::Value* x = transposeTo(L, t.x, permutation(t.labels, order));
  Labeled ordered{x, order};
  ir::Shape s;
  for (char c : batch) s.push_back(x->type().dim(static_cast<int64_t>(order.find(c))));
  ir::Dim r = productOf(L, ordered, rows, loc), k = productOf(L, ordered, cols, loc);
  s.push_back(swapped ? k : r);
  s.push_back(swapped ? r : k);
  return L.reshape(x, s);
}

ir::Value* einsumTwo(ModelLowering& L, Labeled a, Labeled b, const std::string& out, const Location& loc) {
  a = sumPrivateLabels(L, a, b.labels, out);
  b = sumPrivateLabels(L, b, a.labels, out);
  std::string batch, free_a, free_b, contracted;
  for (char c : out)
    if (has(a.labels, c) && has(b.labels, c)) batch += c;
  for (char c : a.labels) {
    if (has(out, c) && !has(b.labels, c)) free_a += c;
    if (!has(out, c)) contracted += c;  // private labels are gone: it is in b too
  }
  for (char c : b.labels)
    if (has(out, c) && !has(a.labels, c)) free_b += c;
  for (char c : batch + contracted) {
    const ir::Dim& da = a.x->type().dim(static_cast<int64_t>(a.labels.find(c)));
    const ir::Dim& db = b.x->type().dim(static_cast<int64_t>(b.labels.find(c)));
    if (!(da == db))
      L.fail(loc, fmt::format("einsum label '{}' is {} in the first operand ({}) and {} in the second ({})",
                              c, da.str(), typeStr(a.x->type()), db.str(), typeStr(b.x->type())));
  }
  bool ta = false, tb = false;
  ir::Value* ma = asMatrices(L, a, batch, free_a, contracted, ta, loc);
  ir::Value* mb = asMatrices(L, b, batch, contracted, free_b, tb, loc);
  ir::Value* prod = L.emit(ir::OpCode::Matmul, {ma, mb}, {{"transpose_a", ta}, {"transpose_b", tb}});
  // [batch..., M, N] back to one dim per label, then to the output's order.
  std::string labels = batch + free_a + free_b;
  ir::Shape s;
  for (char c : labels) {
    bool in_a = has(a.labels, c);
    const Labeled& src = in_a ? a : b;
    s.push_back(src.x->type().dim(static_cast<int64_t>(src.labels.find(c))));
  }
  ir::Value* r = L.reshape(prod, s);
  return transposeTo(L, r, permutation(labels, out));
}

// einsum("bhqd,bhkd->bhqk", q, k): batch labels (in both operands and the output), free labels
// (in one operand and the output) and contracted labels (in both, not the output) become one
// kiln.matmul between transposes and reshapes; a label in one operand only is summed first.
Val fnEinsum(ModelLowering& L, CallArgs& a) {
  if (a.positional.empty()) L.fail(a.loc, "einsum needs a spec string and its operands");
  if (!a.named.empty()) L.fail(a.named_locs[0], "einsum takes no named arguments");
  L.checkNotError(a.positional[0]);
  if (a.positional[0].kind != Val::Kind::Str)
    L.fail(a.positional_locs[0],
           fmt::format("einsum's first argument must be a spec string such as \"ij,jk->ik\", got {}",
                       describe(a.positional[0])));
  EinsumSpec spec = parseEinsum(L, a.positional[0].s, a.positional_locs[0]);
  size_t operands = a.positional.size() - 1;
  if (operands != spec.inputs.size())
    L.fail(a.loc, fmt::format("einsum spec \"{}\" names {} operand(s), got {}", a.positional[0].s,
                              spec.inputs.size(), operands));
  std::vector<Labeled> ts;
  for (size_t i = 0; i < operands; ++i) {
    ir::Value* x = floatTensor(L, a.positional[i + 1], a.positional_locs[i + 1], "an einsum operand");
    if (x->type().rank() != static_cast<int64_t>(spec.inputs[i].size()))
      L.fail(a.positional_locs[i + 1],
             fmt::format("einsum labels \"{}\" need a tensor of rank {}, got {}", spec.inputs[i],
                         spec.inputs[i].size(), typeStr(x->type())));
    ts.push_back({x, spec.inputs[i]});
  }
  L.builder().setLocation(a.loc);
  if (operands == 1) {
    Labeled t = sumPrivateLabels(L, ts[0], "", spec.output);
    return Val::ofTensor(transposeTo(L, t.x, permutation(t.labels, spec.output)));
  }
  if (ts[0].x->type().dtype() != ts[1].x->type().dtype())
    L.fail(a.loc, fmt::format("einsum needs operands of one dtype, got {} and {}", typeStr(ts[0].x->type()),
                              typeStr(ts[1].x->type())));
  return Val::ofTensor(einsumTwo(L, ts[0], ts[1], spec.output, a.loc));
}

// ---- selection ------------------------------------------------------------------------------

int64_t axisArg(ModelLowering& L, const Val* v, const Location& loc, int64_t rank) {
  int64_t axis = v ? L.intArg(*v, loc, "axis") : -1;
  if (axis < -rank || axis >= rank)
    L.fail(loc, fmt::format("axis {} is out of range for rank {}", axis, rank));
  return axis < 0 ? axis + rank : axis;
}

// kiln.topk of x along axis: [values, indices], the k largest in descending order (ties to the
// lower index); indices are i32.
std::vector<ir::Value*> topk(ModelLowering& L, CallArgs& a, ir::Value* x, int64_t k, int64_t axis,
                             const Location& k_loc) {
  const ir::Dim& n = x->type().dim(axis);
  if (n.isStatic() && k > n.size())
    L.fail(k_loc, fmt::format("{} cannot take {} of the {} entries along axis {} of {}", a.callee, k,
                              n.size(), axis, typeStr(x->type())));
  L.builder().setLocation(a.loc);
  return L.emitResults(ir::OpCode::TopK, {x}, {{"k", k}, {"axis", axis}});
}

Val fnTopk(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "k", "axis"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "topk's input");
  if (x->type().rank() == 0) L.fail(b.locs[0], "topk needs a tensor of rank 1 or more, got a scalar");
  int64_t k = positiveInt(L, *b.get(1), b.locs[1], "k");
  auto r = topk(L, a, x, k, axisArg(L, b.get(2), b.locs[2], x->type().rank()), b.locs[1]);
  return Val::list({Val::ofTensor(r[0]), Val::ofTensor(r[1])});
}

// argmax: topk's index for k = 1, the axis dropped unless keepdims.
Val fnArgmax(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "axis", "keepdims"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "argmax's input");
  if (x->type().rank() == 0) L.fail(b.locs[0], "argmax needs a tensor of rank 1 or more, got a scalar");
  int64_t axis = axisArg(L, b.get(1), b.locs[1], x->type().rank());
  bool keep = b.get(2) ? L.boolArg(*b.get(2), b.locs[2], "keepdims") : false;
  ir::Value* idx = topk(L, a, x, 1, axis, a.loc)[1];
  if (keep) return Val::ofTensor(idx);
  ir::Shape s = idx->type().shape();
  s.erase(s.begin() + axis);
  return Val::ofTensor(L.reshape(idx, s));
}

// numpy's take_along_axis: idx has x's rank and x's dims except along axis.
Val fnTakeAlongAxis(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "indices", "axis"}, 3);
  ir::Value* x = L.tensorArg(*b.get(0), b.locs[0], fmt::format("{}'s input", a.callee).c_str());
  ir::Value* idx = L.tensorArg(*b.get(1), b.locs[1], fmt::format("{}'s indices", a.callee).c_str());
  if (!ir::isInteger(idx->type().dtype()))
    L.fail(b.locs[1],
           fmt::format("{}'s indices must be an integer tensor, got {}", a.callee, typeStr(idx->type())));
  const auto &tx = x->type(), &ti = idx->type();
  if (tx.rank() == 0)
    L.fail(b.locs[0], fmt::format("{} needs a tensor of rank 1 or more, got a scalar", a.callee));
  int64_t axis = axisArg(L, b.get(2), b.locs[2], tx.rank());
  bool fits = ti.rank() == tx.rank();
  for (int64_t i = 0; fits && i < tx.rank(); ++i) fits = i == axis || tx.dim(i) == ti.dim(i);
  if (!fits)
    L.fail(a.loc, fmt::format("{} needs indices with the dims of {} except along axis {}, got {}", a.callee,
                              typeStr(tx), axis, typeStr(ti)));
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::TakeAlongAxis, {x, idx}, {{"axis", axis}}));
}

}  // namespace

void addTensorBuiltins(std::map<std::string, BuiltinInfo>& m) {
  m["where"] = {fnWhere, "a where cond holds, else b (broadcasting)"};
  m["matmul"] = {fnMatmul, "batched matrix product with numpy broadcasting"};
  m["einsum"] = {fnEinsum, "a two-operand contraction named by labels"};
  m["topk"] = {fnTopk, "[values, indices] of the k largest along an axis"};
  m["argmax"] = {fnArgmax, "the index of the largest entry along an axis"};
  m["take_along_axis"] = {fnTakeAlongAxis, "entries of x at integer indices along an axis (numpy)"};
  m["gather"] = {fnTakeAlongAxis, "take_along_axis"};
}

}  // namespace kiln::frontend
