// The builtins of the language: compile-time helpers, tensor operations, the layers of the
// recommendation field (linear, mlp, embeddings, DLRM's dot interaction, DCNv2's cross, FM,
// norms), losses, and the settings records (optimizers, schedules, initializers). Each lowers to
// existing IR ops; parameters follow docs/model-ir.md: linear weights [out, in] multiplied with
// transpose_b, biases [out], dotted names.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "frontend/model_lowering.h"
#include "passes/shard_plan.h"

namespace kiln::frontend {

using CallArgs = ModelLowering::CallArgs;

// ---- helpers shared with the other builtin files (model_lowering.h) ------------------------

int64_t staticLastDim(ModelLowering& L, ir::Value* x, const Location& loc, const char* what) {
  const auto& t = x->type();
  if (t.rank() < 1 || !t.dim(t.rank() - 1).isStatic())
    L.fail(loc, fmt::format("{} needs a static last dimension, got {}", what, typeStr(t)));
  return t.dim(t.rank() - 1).size();
}

int64_t positiveInt(ModelLowering& L, const Val& v, const Location& loc, const char* what) {
  int64_t n = L.intArg(v, loc, what);
  if (n <= 0 || n > (int64_t{1} << 40)) L.fail(loc, fmt::format("{} must be a positive size, got {}", what, n));
  return n;
}

ir::Value* floatTensor(ModelLowering& L, const Val& v, const Location& loc, const char* what) {
  ir::Value* x = L.tensorArg(v, loc, what);
  if (!ir::isFloat(x->type().dtype()))
    L.fail(loc, fmt::format("{} must be a float tensor, got {}", what, typeStr(x->type())));
  return x;
}

Val initRecord(ModelLowering& L, const Val* v, const Location& loc, const char* dflt) {
  static const std::set<std::string> kInits = {"zeros", "ones", "constant", "normal", "uniform",
                                               "xavier_uniform", "xavier_normal", "glorot_uniform", "glorot_normal"};
  Val r = v ? L.recordArg(*v, loc, "init") : L.recordArg(Val::builtin(dflt), loc, "init");
  if (!kInits.count(r.s))
    L.fail(loc, fmt::format("'{}' is not an initializer (use zeros, ones, constant, normal, uniform, xavier_uniform, "
                            "xavier_normal)", r.s));
  auto setDefault = [&](const char* k, double d) {
    if (!r.field(k)) r.fields.push_back({k, Val::number(d)});
  };
  if (r.s == "normal") setDefault("mean", 0.0), setDefault("std", 1.0);
  if (r.s == "uniform") setDefault("low", 0.0), setDefault("high", 1.0);
  if (r.s == "constant" && !r.field("value")) L.fail(loc, "constant(...) as an initializer needs a value");
  return r;
}

// Axes of a reduction: an int, a list of ints, or (absent) every axis.
std::vector<int64_t> axesArg(ModelLowering& L, const Val* v, const Location& loc, int64_t rank) {
  std::vector<int64_t> axes;
  if (!v) {
    for (int64_t i = 0; i < rank; ++i) axes.push_back(i);
    return axes;
  }
  axes = L.intsArg(*v, loc, "axis");
  for (int64_t& a : axes) {
    if (a < -rank || a >= rank) L.fail(loc, fmt::format("axis {} is out of range for rank {}", a, rank));
    if (a < 0) a += rank;
  }
  return axes;
}

ir::Value* reduce(ModelLowering& L, ir::Value* x, const char* kind, std::vector<int64_t> axes, bool keep) {
  return L.emit(ir::OpCode::Reduce, {x},
                {{"kind", kind}, {"axes", ir::Attribute::ints(axes)}, {"keepdims", keep}});
}

ir::Value* linearLayer(ModelLowering& L, ir::Value* x, int64_t out, bool bias, const Val& init,
                       const std::string& name, const Location& loc) {
  int64_t in = staticLastDim(L, x, loc, "linear");
  if (x->type().rank() < 2)
    L.fail(loc, fmt::format("linear needs an input of rank 2 or more, got {}", typeStr(x->type())));
  ir::DType dt = x->type().dtype();
  ir::Value* w =
      L.makeParam(name + ".weight", ir::TensorType(dt, {ir::Dim::fixed(out), ir::Dim::fixed(in)}), init, loc);
  L.builder().setLocation(loc);
  ir::Value* y = L.emit(ir::OpCode::Matmul, {x, w}, {{"transpose_b", true}});
  if (bias) {
    ir::Value* bv =
        L.makeParam(name + ".bias", ir::TensorType(dt, {ir::Dim::fixed(out)}), Val::builtin("zeros"), loc);
    L.builder().setLocation(loc);
    y = L.emit(ir::OpCode::Add, {y, bv});
  }
  return y;
}

namespace {

// [B, D] tensors stacked to [B, F, D].
ir::Value* stackFeatures(ModelLowering& L, const std::vector<ir::Value*>& xs, const Location& loc, const char* what) {
  if (xs.empty()) L.fail(loc, fmt::format("{} needs at least one tensor", what));
  if (xs.size() > 4096) L.fail(loc, fmt::format("{} of {} tensors is too many", what, xs.size()));
  for (ir::Value* x : xs) {
    const auto& t = x->type();
    if (t.rank() != 2 || !(t.shape() == xs[0]->type().shape()) || t.dtype() != xs[0]->type().dtype())
      L.fail(loc, fmt::format("{} needs tensors of one [B, D] type, got {} and {}", what, typeStr(xs[0]->type()), typeStr(t)));
  }
  // Side by side, then one reshape: [B, F*D] row-major is [B, F, D]. The lookups then feed the
  // concat directly, which fusion turns into one kernel writing every pooled row in place.
  const auto& t = xs[0]->type();
  ir::Value* wide = xs.size() == 1 ? xs[0] : L.emit(ir::OpCode::Concat, xs, {{"axis", int64_t{1}}});
  return L.reshape(wide, {t.dim(0), ir::Dim::fixed(static_cast<int64_t>(xs.size())), t.dim(1)});
}

// ---- compile-time helpers ------------------------------------------------------------------

Val fnLen(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  const Val& v = *b.get(0);
  L.checkNotError(v);
  if (v.kind == Val::Kind::List) return Val::integer(static_cast<int64_t>(v.items.size()));
  if (v.kind == Val::Kind::Sparse) return Val::integer(static_cast<int64_t>(v.sparse.size()));
  if (v.kind == Val::Kind::Tables) return Val::integer(static_cast<int64_t>(v.tables.size()));
  if (v.kind == Val::Kind::Str) return Val::integer(static_cast<int64_t>(v.s.size()));
  L.fail(b.locs[0], fmt::format("len() needs a list, got {}", describe(v)));
}

Val minMax(ModelLowering& L, CallArgs& a, bool is_min) {
  const char* name = is_min ? "min" : "max";
  auto b = L.bindArgs(a, {"a", "b"}, 1);
  const Val& x = *b.get(0);
  L.checkNotError(x);
  auto pick = [&](const Val& p, const Val& q, const Location& loc) -> Val {
    if (!p.isNumber() || !q.isNumber()) L.fail(loc, fmt::format("{}() compares numbers, got {} and {}", name, describe(p), describe(q)));
    bool first = is_min ? !(q.asDouble() < p.asDouble()) : !(q.asDouble() > p.asDouble());
    return first ? p : q;
  };
  if (!b.get(1)) {
    if (x.kind != Val::Kind::List || x.items.empty()) L.fail(b.locs[0], fmt::format("{}() of one argument needs a non-empty list", name));
    Val r = x.items[0];
    for (const Val& v : x.items) r = pick(r, v, b.locs[0]);
    return r;
  }
  const Val& y = *b.get(1);
  L.checkNotError(y);
  if (x.kind == Val::Kind::Tensor || y.kind == Val::Kind::Tensor) {
    ir::DType dt = (x.kind == Val::Kind::Tensor ? x : y).tensor->type().dtype();
    auto t = [&](const Val& v, const Location& loc) {
      return v.isNumber() ? L.scalarConstant(v.asDouble(), dt) : L.tensorArg(v, loc, name);
    };
    ir::Value* p = t(x, b.locs[0]);
    ir::Value* q = t(y, b.locs[1]);
    if (!ir::broadcastShapes(p->type().shape(), q->type().shape()) || p->type().dtype() != q->type().dtype())
      L.fail(a.loc, fmt::format("cannot take the {} of {} and {}", name, typeStr(p->type()), typeStr(q->type())));
    L.builder().setLocation(a.loc);
    return Val::ofTensor(L.emit(is_min ? ir::OpCode::Min : ir::OpCode::Max, {p, q}));
  }
  // Lists broadcast against scalars: min(rows, rows_cap) caps every table.
  if (x.kind == Val::Kind::List || y.kind == Val::Kind::List) {
    size_t n = x.kind == Val::Kind::List ? x.items.size() : y.items.size();
    if (x.kind == Val::Kind::List && y.kind == Val::Kind::List && x.items.size() != y.items.size())
      L.fail(a.loc, fmt::format("{}() of lists of {} and {} entries", name, x.items.size(), y.items.size()));
    std::vector<Val> out;
    for (size_t i = 0; i < n; ++i)
      out.push_back(pick(x.kind == Val::Kind::List ? x.items[i] : x, y.kind == Val::Kind::List ? y.items[i] : y, a.loc));
    return Val::list(std::move(out));
  }
  return pick(x, y, a.loc);
}
Val fnMin(ModelLowering& L, CallArgs& a) { return minMax(L, a, true); }
Val fnMax(ModelLowering& L, CallArgs& a) { return minMax(L, a, false); }

// ---- elementwise and shape operations ------------------------------------------------------

// The builtin of a unary function of ir/scalar_fn.def: relu(x), exp(x), ...
template <ir::ScalarFn F>
Val unaryOp(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], a.callee.c_str());
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::opCodeOf(F), {x}));
}

Val fnIdentity(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  L.checkNotError(*b.get(0));
  return *b.get(0);
}

Val fnSoftmax(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "axis"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "softmax's input");
  int64_t axis = b.get(1) ? L.intArg(*b.get(1), b.locs[1], "axis") : -1;
  return Val::ofTensor(L.emit(ir::OpCode::Softmax, {x}, {{"axis", axis}}));
}

Val reduction(ModelLowering& L, CallArgs& a, const char* kind) {
  auto b = L.bindArgs(a, {"x", "axis", "keepdims"}, 1);
  const Val& v = *b.get(0);
  L.checkNotError(v);
  if (v.kind == Val::Kind::List && std::string(kind) != "max") {  // compile-time sum/mean of numbers
    if (b.get(1) || b.get(2)) L.fail(a.loc, fmt::format("{}() of a list takes no axis", a.callee));
    bool all_int = true;
    int64_t si = 0;
    double sd = 0;
    for (const Val& x : v.items) {
      double d = L.numberArg(x, b.locs[0], "a list entry");
      all_int &= x.kind == Val::Kind::Int;
      if (x.kind == Val::Kind::Int && __builtin_add_overflow(si, x.i, &si)) L.fail(a.loc, "integer overflow");
      sd += d;
    }
    if (std::string(kind) == "mean") {
      if (v.items.empty()) L.fail(a.loc, "mean() of an empty list");
      return Val::number(sd / static_cast<double>(v.items.size()));
    }
    return all_int ? Val::integer(si) : Val::number(sd);
  }
  ir::Value* x = L.tensorArg(v, b.locs[0], fmt::format("{}'s input", a.callee).c_str());
  if (x->type().rank() == 0) L.fail(b.locs[0], "cannot reduce a scalar");
  auto axes = axesArg(L, b.get(1), b.locs[1], x->type().rank());
  bool keep = b.get(2) ? L.boolArg(*b.get(2), b.locs[2], "keepdims") : false;
  L.builder().setLocation(a.loc);
  return Val::ofTensor(reduce(L, x, kind, axes, keep));
}
Val fnSum(ModelLowering& L, CallArgs& a) { return reduction(L, a, "sum"); }
Val fnMean(ModelLowering& L, CallArgs& a) { return reduction(L, a, "mean"); }
Val fnReduceMax(ModelLowering& L, CallArgs& a) { return reduction(L, a, "max"); }

Val fnReshape(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "shape"}, 2);
  ir::Value* x = L.tensorArg(*b.get(0), b.locs[0], "reshape's input");
  const Val& s = *b.get(1);
  L.checkNotError(s);
  if (s.kind != Val::Kind::List) L.fail(b.locs[1], fmt::format("the shape must be a list, got {}", describe(s)));
  ir::Shape shape;
  for (const Val& d : s.items) {
    if (d.kind == Val::Kind::Dim)
      shape.push_back(d.dim);
    else
      shape.push_back(ir::Dim::fixed(positiveInt(L, d, b.locs[1], "a dimension")));
  }
  auto in = ir::symbolicProduct(x->type().shape()), out = ir::symbolicProduct(shape);
  if (!(in == out) || !in.known)
    L.fail(a.loc, fmt::format("cannot reshape {} to {}: the element counts differ", typeStr(x->type()),
                              typeStr(ir::TensorType(x->type().dtype(), shape))));
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.reshape(x, shape));
}

ir::Value* concatAll(ModelLowering& L, const std::vector<ir::Value*>& xs, int64_t axis, const Location& loc) {
  if (xs.empty()) L.fail(loc, "concat needs at least one tensor");
  if (xs.size() == 1) return xs[0];
  int64_t rank = xs[0]->type().rank();
  if (axis < -rank || axis >= rank) L.fail(loc, fmt::format("axis {} is out of range for rank {}", axis, rank));
  if (axis < 0) axis += rank;
  for (ir::Value* x : xs) {
    const auto& t = x->type();
    bool ok = t.rank() == rank && t.dtype() == xs[0]->type().dtype();
    for (int64_t i = 0; ok && i < rank; ++i) ok = i == axis || t.dim(i) == xs[0]->type().dim(i);
    if (!ok) L.fail(loc, fmt::format("cannot concatenate {} and {} along axis {}", typeStr(xs[0]->type()), typeStr(t), axis));
  }
  L.builder().setLocation(loc);
  return L.emit(ir::OpCode::Concat, xs, {{"axis", axis}});
}

Val fnConcat(ModelLowering& L, CallArgs& a) {
  int64_t axis = -1;
  for (size_t k = 0; k < a.named.size(); ++k) {
    if (a.named[k].first != "axis") L.fail(a.named_locs[k], fmt::format("'concat' has no argument '{}' (it takes: tensors..., axis)", a.named[k].first));
    axis = L.intArg(a.named[k].second, a.named_locs[k], "axis");
  }
  std::vector<ir::Value*> xs;
  for (size_t i = 0; i < a.positional.size(); ++i) {
    auto sub = L.tensorList(a.positional[i], a.positional_locs[i], "concat's inputs");
    xs.insert(xs.end(), sub.begin(), sub.end());
  }
  return Val::ofTensor(concatAll(L, xs, axis, a.loc));
}

Val fnFlatten(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x"}, 1);
  const Val& v = *b.get(0);
  L.checkNotError(v);
  if (v.kind == Val::Kind::List) return Val::ofTensor(concatAll(L, L.tensorList(v, b.locs[0], "flatten's input"), -1, a.loc));
  ir::Value* x = L.tensorArg(v, b.locs[0], "flatten's input");
  const auto& t = x->type();
  if (t.rank() < 2) return Val::ofTensor(x);
  int64_t n = 1;
  for (int64_t i = 1; i < t.rank(); ++i) {
    if (!t.dim(i).isStatic()) L.fail(a.loc, fmt::format("flatten needs static dims after the first, got {}", typeStr(t)));
    if (__builtin_mul_overflow(n, t.dim(i).size(), &n)) L.fail(a.loc, "integer overflow");
  }
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.reshape(x, {t.dim(0), ir::Dim::fixed(n)}));
}

Val fnStack(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"xs"}, 1);
  L.builder().setLocation(a.loc);
  return Val::ofTensor(stackFeatures(L, L.tensorList(*b.get(0), b.locs[0], "stack's inputs"), a.loc, "stack"));
}

Val fnTranspose(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "perm"}, 1);
  ir::Value* x = L.tensorArg(*b.get(0), b.locs[0], "transpose's input");
  int64_t r = x->type().rank();
  std::vector<int64_t> perm;
  if (b.get(1)) {
    perm = L.intsArg(*b.get(1), b.locs[1], "perm");
  } else {
    if (r < 2) L.fail(a.loc, "transpose needs a tensor of rank 2 or more");
    for (int64_t i = 0; i < r; ++i) perm.push_back(i);
    std::swap(perm[static_cast<size_t>(r - 1)], perm[static_cast<size_t>(r - 2)]);
  }
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < static_cast<int64_t>(sorted.size()); ++i)
    if (sorted[static_cast<size_t>(i)] != i || static_cast<int64_t>(sorted.size()) != r)
      L.fail(b.locs[1], fmt::format("perm must be a permutation of 0..{}", r));
  return Val::ofTensor(L.emit(ir::OpCode::Transpose, {x}, {{"perm", ir::Attribute::ints(perm)}}));
}

Val fnCast(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "dtype"}, 2);
  ir::Value* x = L.tensorArg(*b.get(0), b.locs[0], "cast's input");
  std::string to = L.wordArg(*b.get(1), b.locs[1], "dtype");
  auto dt = ir::parseDType(to);
  if (!dt) L.fail(b.locs[1], fmt::format("unknown element type '{}'", to));
  if (*dt == x->type().dtype()) return Val::ofTensor(x);
  return Val::ofTensor(L.emit(ir::OpCode::Cast, {x}, {{"to", to}}));
}

// ---- layers --------------------------------------------------------------------------------

Val fnParameter(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"shape", "init", "dtype", "name"}, 1);
  const Val& s = *b.get(0);
  L.checkNotError(s);
  ir::Shape shape;
  if (s.kind == Val::Kind::Int) {
    shape.push_back(ir::Dim::fixed(positiveInt(L, s, b.locs[0], "a dimension")));
  } else if (s.kind == Val::Kind::List) {
    for (const Val& d : s.items) shape.push_back(ir::Dim::fixed(positiveInt(L, d, b.locs[0], "a dimension")));
  } else {
    L.fail(b.locs[0], fmt::format("the shape must be a list of sizes, got {}", describe(s)));
  }
  ir::DType dt = ir::DType::f32;
  if (b.get(2)) {
    auto p = ir::parseDType(L.wordArg(*b.get(2), b.locs[2], "dtype"));
    if (!p || !ir::isFloat(*p)) L.fail(b.locs[2], "a parameter's dtype must be f32, bf16 or f16");
    dt = *p;
  }
  std::string name = L.layerName(a, "parameter", b.get(3));
  return Val::ofTensor(L.makeParam(name, ir::TensorType(dt, shape), initRecord(L, b.get(1), b.locs[1], "zeros"), a.loc));
}

Val fnLinear(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "out", "bias", "init", "name"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "linear's input");
  int64_t out = positiveInt(L, *b.get(1), b.locs[1], "linear's output size");
  bool bias = b.get(2) ? L.boolArg(*b.get(2), b.locs[2], "bias") : true;
  Val init = initRecord(L, b.get(3), b.locs[3], "xavier_uniform");
  return Val::ofTensor(linearLayer(L, x, out, bias, init, L.layerName(a, "linear", b.get(4)), a.loc));
}

Val fnMlp(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "sizes", "act", "last", "bias", "init", "name"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "mlp's input");
  std::vector<int64_t> sizes = L.intsArg(*b.get(1), b.locs[1], "mlp's sizes");
  if (sizes.empty()) L.fail(b.locs[1], "mlp needs at least one layer size");
  for (int64_t s : sizes) positiveInt(L, Val::integer(s), b.locs[1], "a layer size");
  Val act = b.get(2) ? *b.get(2) : Val::builtin("relu");
  Val last = b.get(3) ? *b.get(3) : act;
  L.checkNotError(act);
  L.checkNotError(last);
  bool bias = b.get(4) ? L.boolArg(*b.get(4), b.locs[4], "bias") : true;
  Val init = initRecord(L, b.get(5), b.locs[5], "xavier_uniform");
  std::string name = L.layerName(a, "mlp", b.get(6));
  for (size_t i = 0; i < sizes.size(); ++i) {
    x = linearLayer(L, x, sizes[i], bias, init, fmt::format("{}.{}", name, i), a.loc);
    x = L.activate(i + 1 == sizes.size() ? last : act, x, a.loc);
  }
  return Val::ofTensor(x);
}

// DCNv2 cross layer: x0 * (W x + b) + x, with W = U V of rank r when `rank` is given.
Val fnCross(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x0", "x", "rank", "init", "name"}, 2);
  ir::Value* x0 = floatTensor(L, *b.get(0), b.locs[0], "cross's x0");
  ir::Value* x = floatTensor(L, *b.get(1), b.locs[1], "cross's x");
  if (!(x0->type() == x->type()) || x->type().rank() != 2)
    L.fail(a.loc, fmt::format("cross needs x0 and x of one [B, D] type, got {} and {}", typeStr(x0->type()), typeStr(x->type())));
  int64_t d = staticLastDim(L, x, a.loc, "cross");
  int64_t rank = b.get(2) ? positiveInt(L, *b.get(2), b.locs[2], "rank") : 0;
  Val init = initRecord(L, b.get(3), b.locs[3], "xavier_uniform");
  std::string name = L.layerName(a, "cross", b.get(4));
  ir::DType dt = x->type().dtype();
  auto mat = [&](const char* suffix, int64_t rows, int64_t cols) {
    return L.makeParam(name + "." + suffix, ir::TensorType(dt, {ir::Dim::fixed(rows), ir::Dim::fixed(cols)}), init, a.loc);
  };
  ir::Value* wx;
  if (rank) {
    ir::Value* v = mat("v", rank, d);
    ir::Value* u = mat("u", d, rank);
    L.builder().setLocation(a.loc);
    wx = L.emit(ir::OpCode::Matmul, {L.emit(ir::OpCode::Matmul, {x, v}, {{"transpose_b", true}}), u},
                {{"transpose_b", true}});
  } else {
    ir::Value* w = mat("weight", d, d);
    L.builder().setLocation(a.loc);
    wx = L.emit(ir::OpCode::Matmul, {x, w}, {{"transpose_b", true}});
  }
  ir::Value* bias = L.makeParam(name + ".bias", ir::TensorType(dt, {ir::Dim::fixed(d)}), Val::builtin("zeros"), a.loc);
  L.builder().setLocation(a.loc);
  return Val::ofTensor(
      L.emit(ir::OpCode::Add, {L.emit(ir::OpCode::Mul, {x0, L.emit(ir::OpCode::Add, {wx, bias})}), x}));
}

// DLRM: pairwise dot products of [dense, emb_1..emb_n] (the strictly lower triangle, or with
// the diagonal when self = true), concatenated after the dense vector.
Val fnDotInteraction(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"dense", "embs", "self"}, 2);
  ir::Value* dense = floatTensor(L, *b.get(0), b.locs[0], "the dense vector");
  std::vector<ir::Value*> feats{dense};
  auto embs = L.tensorList(*b.get(1), b.locs[1], "the embeddings");
  feats.insert(feats.end(), embs.begin(), embs.end());
  bool self = b.get(2) ? L.boolArg(*b.get(2), b.locs[2], "self") : false;
  if (feats.size() > 1024) L.fail(a.loc, "dot_interaction of more than 1024 features");
  for (ir::Value* f : feats)
    if (!(f->type() == dense->type()))
      L.fail(a.loc, fmt::format("dot_interaction needs the dense vector and every embedding of one type: {} vs {}",
                                typeStr(dense->type()), typeStr(f->type())));
  L.builder().setLocation(a.loc);
  ir::Value* t = stackFeatures(L, feats, a.loc, "dot_interaction");  // [B, F, D]
  const ir::Dim batch = dense->type().dim(0);
  int64_t f = static_cast<int64_t>(feats.size());
  ir::Value* z = L.emit(ir::OpCode::Matmul, {t, t}, {{"transpose_b", true}});  // [B, F, F]
  ir::Value* flat = L.reshape(z, {batch, ir::Dim::fixed(f * f)});
  ir::AttrArray idx;
  for (int64_t i = 0; i < f; ++i)
    for (int64_t j = 0; j < (self ? i + 1 : i); ++j) idx.push_back(i * f + j);
  if (idx.empty()) L.fail(a.loc, "dot_interaction needs at least one embedding");
  int64_t pairs = static_cast<int64_t>(idx.size());
  ir::Value* ids =
      L.emitTyped(ir::OpCode::Constant, {}, ir::TensorType(ir::DType::i64, {ir::Dim::fixed(pairs)}),
                  {{"value", ir::Attribute(std::move(idx))}});
  ir::Value* tri = L.emit(ir::OpCode::Gather, {flat, ids}, {{"axis", int64_t{1}}});  // [B, pairs]
  return Val::ofTensor(L.emit(ir::OpCode::Concat, {dense, tri}, {{"axis", int64_t{1}}}));
}

// Factorization machine, second order: 0.5 * sum_d((sum_f v)^2 - sum_f v^2), shaped [B, 1].
Val fnFm(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"embs"}, 1);
  auto embs = L.tensorList(*b.get(0), b.locs[0], "fm's embeddings");
  L.builder().setLocation(a.loc);
  ir::Value* t = stackFeatures(L, embs, a.loc, "fm");  // [B, F, D]
  if (embs.size() == 1) t = L.reshape(t, {embs[0]->type().dim(0), ir::Dim::fixed(1), embs[0]->type().dim(1)});
  ir::Value* s = reduce(L, t, "sum", {1}, false);
  ir::Value* sq = reduce(L, L.emit(ir::OpCode::Mul, {t, t}), "sum", {1}, false);
  ir::Value* diff = L.emit(ir::OpCode::Sub, {L.emit(ir::OpCode::Mul, {s, s}), sq});
  ir::Value* r = reduce(L, diff, "sum", {1}, true);
  return Val::ofTensor(L.emit(ir::OpCode::Mul, {r, L.scalarConstant(0.5, r->type().dtype())}));
}

Val norm(ModelLowering& L, CallArgs& a, bool rms) {
  auto b = L.bindArgs(a, {"x", "eps", "name"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], rms ? "rmsnorm's input" : "layernorm's input");
  double eps = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "eps") : (rms ? 1e-6 : 1e-5);
  if (!(eps > 0)) L.fail(b.locs[1], "eps must be positive");
  int64_t d = staticLastDim(L, x, a.loc, rms ? "rmsnorm" : "layernorm");
  std::string name = L.layerName(a, rms ? "rmsnorm" : "layernorm", b.get(2));
  ir::DType dt = x->type().dtype();
  ir::Value* gamma = L.makeParam(name + ".weight", ir::TensorType(dt, {ir::Dim::fixed(d)}), Val::builtin("ones"), a.loc);
  ir::Value* beta = rms ? nullptr : L.makeParam(name + ".bias", ir::TensorType(dt, {ir::Dim::fixed(d)}), Val::builtin("zeros"), a.loc);
  L.builder().setLocation(a.loc);
  int64_t last = x->type().rank() - 1;
  ir::Value* centered = x;
  if (!rms) centered = L.emit(ir::OpCode::Sub, {x, reduce(L, x, "mean", {last}, true)});
  ir::Value* var = reduce(L, L.emit(ir::OpCode::Mul, {centered, centered}), "mean", {last}, true);
  ir::Value* inv = L.emit(ir::OpCode::Rsqrt, {L.emit(ir::OpCode::Add, {var, L.scalarConstant(eps, dt)})});
  ir::Value* y = L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Mul, {centered, inv}), gamma});
  if (beta) y = L.emit(ir::OpCode::Add, {y, beta});
  return Val::ofTensor(y);
}
Val fnLayernorm(ModelLowering& L, CallArgs& a) { return norm(L, a, false); }
Val fnRmsnorm(ModelLowering& L, CallArgs& a) { return norm(L, a, true); }

// elu(x, alpha): x > 0 ? x : alpha (e^x - 1), alpha a scalar operand of kiln.elu.
Val fnElu(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "alpha"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "elu's input");
  double alpha = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "alpha") : 1.0;
  if (!std::isfinite(alpha)) L.fail(b.locs[1], fmt::format("elu's alpha must be finite, got {}", alpha));
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::Elu, {x, L.scalarConstant(alpha, x->type().dtype())}));
}

// The learned per-channel vector of prelu and dice: one value per entry of x's static last dim
// (or one value in all when shared).
ir::Value* channelParam(ModelLowering& L, ir::Value* x, const std::string& name, double init, bool shared,
                        const Location& loc, const char* what) {
  int64_t c = shared ? 1 : staticLastDim(L, x, loc, what);
  Val rec = L.recordArg(Val::builtin("constant"), loc, "init");
  rec.fields = {{"value", Val::number(init)}};
  return L.makeParam(name, ir::TensorType(x->type().dtype(), {ir::Dim::fixed(c)}), rec, loc);
}

// prelu(x): x > 0 ? x : a x with a learned slope a per channel (the last dim), 0.25 at first as
// in PyTorch's nn.PReLU; shared = true learns one slope for every channel.
Val fnPrelu(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "init", "shared", "name"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "prelu's input");
  double init = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "init") : 0.25;
  bool shared = b.get(2) ? L.boolArg(*b.get(2), b.locs[2], "shared") : false;
  std::string name = L.layerName(a, "prelu", b.get(3));
  ir::Value* slope = channelParam(L, x, name + ".weight", init, shared, a.loc, "prelu");
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::Prelu, {x, slope}));
}

// dice(x) of DIN (Zhou et al. 2018): p = sigmoid((x - E[x]) / sqrt(Var[x] + eps)) with the mean
// and biased variance over every axis but the channel axis (the last), and
// out = p x + (1 - p) alpha x = x (alpha + p (1 - alpha)), alpha learned per channel from 0.
// As in the paper, the statistics are the batch's in training and running averages in eval and
// predict (normStatistics: `name.running_mean`, `name.running_var`).
Val fnDice(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "eps", "momentum", "name"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "dice's input");
  double eps = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "eps") : 1e-8;
  if (!(eps > 0)) L.fail(b.locs[1], fmt::format("dice's eps must be positive, got {}", eps));
  const double momentum = b.get(2) ? L.numberArg(*b.get(2), b.locs[2], "momentum") : 0.1;
  if (!(momentum >= 0 && momentum <= 1))
    L.fail(b.locs[2], fmt::format("dice's momentum must lie in [0, 1], got {}", momentum));
  if (x->type().rank() < 2)
    L.fail(b.locs[0],
           fmt::format("dice needs a [B, ..., C] input of rank 2 or more, got {}", typeStr(x->type())));
  std::string name = L.layerName(a, "dice", b.get(3));
  ir::Value* alpha = channelParam(L, x, name + ".alpha", 0.0, false, a.loc, "dice");
  NormStatistics s = normStatistics(L, x, name, momentum, a.loc);
  ir::DType dt = x->type().dtype();
  ir::Value* inv = L.emit(ir::OpCode::Rsqrt, {L.emit(ir::OpCode::Add, {s.var, L.scalarConstant(eps, dt)})});
  ir::Value* p =
      L.emit(ir::OpCode::Sigmoid, {L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Sub, {x, s.mean}), inv})});
  ir::Value* one_minus_alpha = L.emit(ir::OpCode::Sub, {L.scalarConstant(1.0, dt), alpha});
  ir::Value* gate = L.emit(ir::OpCode::Add, {alpha, L.emit(ir::OpCode::Mul, {p, one_minus_alpha})});
  return Val::ofTensor(L.emit(ir::OpCode::Mul, {x, gate}));
}

// dropout(x, p): kiln.dropout, the identity in @forward (eval, predict); the autodiff pass makes
// @train_step's copy draw its mask. The salt, a hash of the layer's name, gives each dropout its
// own stream and stays the same when the model is compiled again (a resumed run).
Val fnDropout(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "p", "name"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "dropout's input");
  double p = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "p") : 0.5;
  if (!(p >= 0 && p < 1)) L.fail(b.locs[1], fmt::format("dropout's p must lie in [0, 1), got {}", p));
  std::string name = L.layerName(a, "dropout", b.get(2));
  if (p == 0) return Val::ofTensor(x);
  uint64_t salt = 0xcbf29ce484222325ull;  // FNV-1a of the name
  for (unsigned char c : name) salt = (salt ^ c) * 0x100000001b3ull;
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::Dropout, {x},
                              {{"p", p}, {"salt", static_cast<int64_t>(salt & 0x7fffffffffffffffull)}}));
}

Val fnEmbeddings(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"rows", "dim", "pool", "dtype", "init", "optimizer", "count", "name", "shard"}, 2);
  size_t n = 1;
  L.checkNotError(*b.get(0));
  if (b.get(0)->kind == Val::Kind::List) n = b.get(0)->items.size();
  if (b.get(6)) n = static_cast<size_t>(positiveInt(L, *b.get(6), b.locs[6], "count"));
  if (n == 0 || n > 4096) L.fail(a.loc, fmt::format("an embedding collection holds 1 to 4096 tables, not {}", n));
  std::vector<int64_t> rows = L.intsArg(*b.get(0), b.locs[0], "rows", n);
  std::vector<int64_t> dims = L.intsArg(*b.get(1), b.locs[1], "dim", n);
  std::string pool = b.get(2) ? L.wordArg(*b.get(2), b.locs[2], "pool") : "sum";
  if (pool != "sum" && pool != "mean" && pool != "none")
    L.fail(b.locs[2], fmt::format("pool must be sum, mean or none, got '{}'", pool));
  // pool = none: sequence lookups (inputs.cc) through a dense kiln.gather, so the tables are
  // dense parameters trained by the model's optimizer, replicated on every rank.
  const bool sequence = pool == "none";
  if (sequence && b.get(5))
    L.fail(b.locs[5], "pool = none tables are dense parameters: they train with the model's optimizer");
  if (sequence && b.get(8)) L.fail(b.locs[8], "pool = none tables are dense parameters and are not sharded");
  ir::DType dt = ir::DType::f32;
  if (b.get(3)) {
    auto p = ir::parseDType(L.wordArg(*b.get(3), b.locs[3], "dtype"));
    if (!p || !ir::isFloat(*p) || *p == ir::DType::f64) L.fail(b.locs[3], "a table's dtype must be f32, bf16 or f16");
    dt = *p;
  }
  ir::AttrDict extra;
  if (!sequence) extra["embedding"] = true;
  if (b.get(5)) extra["optimizer"] = embeddingOptimizerAttr(L, *b.get(5), b.locs[5]);
  // A sharding pin: the planner (passes/auto_plan.h) keeps this type for every table of the
  // collection when the model trains on many ranks.
  if (b.get(8)) {
    std::string shard = L.wordArg(*b.get(8), b.locs[8], "shard");
    if (!passes::parseShardingType(shard))
      L.fail(b.locs[8], fmt::format("unknown sharding '{}' (use {})", shard, passes::shardingNames()));
    extra["shard"] = shard;
  }
  std::string name = L.layerName(a, "tables", b.get(7));
  Val out = Val::none();
  out.kind = Val::Kind::Tables;
  for (size_t i = 0; i < n; ++i) {
    int64_t r = positiveInt(L, Val::integer(rows[i]), b.locs[0], "rows");
    int64_t d = positiveInt(L, Val::integer(dims[i]), b.locs[1], "dim");
    // DLRM's initialization: uniform in +-sqrt(1/rows).
    Val init;
    if (b.get(4)) {
      init = initRecord(L, b.get(4), b.locs[4], "uniform");
    } else {
      double bound = std::sqrt(1.0 / static_cast<double>(r));
      init = L.recordArg(Val::builtin("uniform"), a.loc, "init");
      init.fields = {{"low", Val::number(-bound)}, {"high", Val::number(bound)}};
    }
    EmbeddingTable t;
    t.name = fmt::format("{}.{}", name, i);
    t.rows = r;
    t.dim = d;
    t.pool = pool;
    t.table = L.makeParam(t.name, ir::TensorType(dt, {ir::Dim::fixed(r), ir::Dim::fixed(d)}), init, a.loc, extra);
    out.tables.push_back(t);
  }
  return out;
}

// ---- losses --------------------------------------------------------------------------------

Val fnBce(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"logits", "labels", "reduction"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "the logits");
  ir::Value* y = floatTensor(L, *b.get(1), b.locs[1], "the labels");
  std::string red = b.get(2) ? L.wordArg(*b.get(2), b.locs[2], "reduction") : "mean";
  if (red != "mean" && red != "sum") L.fail(b.locs[2], "reduction must be mean or sum");
  // A [B, 1] logit column against [B] labels is the common case; drop the unit column.
  const auto& xs = x->type().shape();
  if (xs.size() == y->type().shape().size() + 1 && xs.back() == ir::Dim::fixed(1) &&
      std::equal(y->type().shape().begin(), y->type().shape().end(), xs.begin()))
    x = L.reshape(x, y->type().shape());
  if (!(x->type().shape() == y->type().shape()) || x->type().dtype() != y->type().dtype())
    L.fail(a.loc, fmt::format("bce_with_logits needs logits and labels of one shape, got {} and {}",
                              typeStr(x->type()), typeStr(y->type())));
  L.builder().setLocation(a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::BceWithLogits, {x, y}, {{"reduction", red}}));
}

// Sequence logits [B, T, V] with labels [B, T] (class ids) or [B, T, V] (probabilities): every
// token is one row, [B*T, V] (the dim T*B), so the mean runs over all B*T tokens like PyTorch's.
void flattenTokens(ModelLowering& L, ir::Value*& x, ir::Value*& y, const Location& loc) {
  const ir::Shape& xs = x->type().shape();
  ir::Shape lead(xs.begin(), xs.end() - 1);
  const ir::Shape& ys = y->type().shape();
  bool ids = ir::isInteger(y->type().dtype()) && ys == lead;
  bool probs = ir::isFloat(y->type().dtype()) && ys == xs;
  if (!ids && !probs)
    L.fail(
        loc,
        fmt::format(
            "softmax_cross_entropy needs labels {} (class ids) or {} (probabilities) for logits {}, got {}",
            typeStr(ir::TensorType(ir::DType::i32, lead)), typeStr(x->type()), typeStr(x->type()),
            typeStr(y->type())));
  ir::Dim tokens = ir::Dim::fixed(1);
  for (const ir::Dim& d : lead) {
    auto p = dimProduct(tokens, d);
    if (!p)
      L.fail(loc, fmt::format(
                      "softmax_cross_entropy cannot flatten the tokens of {}: a dim holds at most one symbol",
                      typeStr(x->type())));
    tokens = *p;
  }
  x = L.reshape(x, {tokens, xs.back()});
  y = L.reshape(y, ids ? ir::Shape{tokens} : ir::Shape{tokens, xs.back()});
}

Val fnSoftmaxCE(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"logits", "labels", "reduction"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "the logits");
  ir::Value* y = L.tensorArg(*b.get(1), b.locs[1], "the labels");
  std::string red = b.get(2) ? L.wordArg(*b.get(2), b.locs[2], "reduction") : "mean";
  if (red != "mean" && red != "sum") L.fail(b.locs[2], "reduction must be mean or sum");
  L.builder().setLocation(a.loc);
  if (x->type().rank() > 2) flattenTokens(L, x, y, a.loc);
  return Val::ofTensor(L.emit(ir::OpCode::SoftmaxCrossEntropy, {x, y}, {{"reduction", red}}));
}

Val fnMse(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"pred", "target"}, 2);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "the prediction");
  ir::Value* y = floatTensor(L, *b.get(1), b.locs[1], "the target");
  ir::Value* d = L.binaryOp("-", x, y, a.loc);
  ir::Value* sq = L.emit(ir::OpCode::Mul, {d, d});
  if (sq->type().rank() == 0) return Val::ofTensor(sq);
  std::vector<int64_t> axes;
  for (int64_t i = 0; i < sq->type().rank(); ++i) axes.push_back(i);
  return Val::ofTensor(reduce(L, sq, "mean", axes, false));
}

// ---- settings records ----------------------------------------------------------------------

const std::map<std::string, std::vector<std::string>>& recordFields() {
  static const std::map<std::string, std::vector<std::string>> k = {
      {"sgd", {"lr", "momentum", "nesterov", "weight_decay"}},
      {"adagrad", {"lr", "eps", "initial_accumulator", "weight_decay"}},
      {"rowwise_adagrad", {"lr", "eps", "initial_accumulator", "weight_decay"}},
      {"adam", {"lr", "beta1", "beta2", "eps", "weight_decay"}},
      {"adamw", {"lr", "beta1", "beta2", "eps", "weight_decay"}},
      {"constant", {"value"}},
      {"warmup_decay", {"warmup_steps", "decay_start", "decay_steps", "end_factor", "power"}},
      {"exponential", {"decay_rate", "decay_steps", "staircase", "warmup_steps"}},
      {"zeros", {}}, {"ones", {}}, {"normal", {"mean", "std"}}, {"uniform", {"low", "high"}},
      {"xavier_uniform", {}}, {"xavier_normal", {}}, {"glorot_uniform", {}}, {"glorot_normal", {}}};
  return k;
}

Val fnRecord(ModelLowering& L, CallArgs& a) {
  const auto& fields = recordFields().at(a.callee);
  auto b = L.bindArgs(a, fields, 0);
  Val r = Val::none();
  r.kind = Val::Kind::Record;
  r.s = a.callee;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (!b.get(i)) continue;
    const Val& v = *b.get(i);
    L.checkNotError(v);
    if (!v.isNumber() && v.kind != Val::Kind::Bool)
      L.fail(b.locs[i], fmt::format("{} must be a number or true/false, got {}", fields[i], describe(v)));
    r.fields.push_back({fields[i], v});
  }
  return r;
}

const std::map<std::string, BuiltinInfo>& builtins() {
  static const std::map<std::string, BuiltinInfo> k = [] {
    std::map<std::string, BuiltinInfo> m = {
        {"len", {fnLen, "length of a list"}},
        {"min", {fnMin, "minimum (numbers, lists elementwise, or tensors)"}},
        {"max", {fnMax, "maximum (numbers, lists elementwise, or tensors)"}},
        {"identity", {fnIdentity, "x unchanged"}},
        {"softmax", {fnSoftmax, "softmax along an axis"}},
        {"sum", {fnSum, "sum over axes (or of a list)"}},
        {"mean", {fnMean, "mean over axes (or of a list)"}},
        {"reduce_max", {fnReduceMax, "maximum over axes"}},
        {"reshape", {fnReshape, "same elements, a new shape"}},
        {"concat", {fnConcat, "concatenation along an axis"}},
        {"flatten", {fnFlatten, "[B, ...] to [B, n], or a list concatenated"}},
        {"stack", {fnStack, "[B, D] tensors to [B, F, D]"}},
        {"transpose", {fnTranspose, "permute dimensions"}},
        {"cast", {fnCast, "convert the element type"}},
        {"parameter", {fnParameter, "a trainable tensor"}},
        {"linear", {fnLinear, "x W^T + b"}},
        {"mlp", {fnMlp, "stacked linear layers with activations"}},
        {"cross", {fnCross, "DCNv2 cross layer (full or low-rank)"}},
        {"dot_interaction", {fnDotInteraction, "DLRM pairwise dot products"}},
        {"fm", {fnFm, "factorization machine, second order"}},
        {"layernorm", {fnLayernorm, "layer normalization"}},
        {"rmsnorm", {fnRmsnorm, "RMS normalization"}},
        {"dropout", {fnDropout, "inverted dropout in training, the identity in eval and predict"}},
        {"elu", {fnElu, "x > 0 ? x : alpha (e^x - 1)"}},
        {"prelu", {fnPrelu, "x > 0 ? x : a x, a learned per channel"}},
        {"dice", {fnDice, "DIN's data-adaptive activation (batch statistics, running ones in eval)"}},
        {"embeddings", {fnEmbeddings, "a collection of embedding tables"}},
        {"bce_with_logits", {fnBce, "binary cross entropy on logits"}},
        {"softmax_cross_entropy", {fnSoftmaxCE, "cross entropy of a softmax"}},
        {"mse", {fnMse, "mean squared error"}},
        {"moe", {lowerMoe, "Mixture-of-Experts feed-forward layer (docs/moe.md)"}},
    };
    // The unary functions of ir/scalar_fn.def (negation is the `-` operator).
#define KILN_BUILTIN(Name)                                                                        \
  if (ir::ScalarFn::Name != ir::ScalarFn::Neg)                                                    \
    m[std::string(ir::scalarFnInfo(ir::ScalarFn::Name).spelling)] = {unaryOp<ir::ScalarFn::Name>, \
                                                                     "elementwise, ir/scalar_fn.def"};
#define KILN_UNARY(Name, ...) KILN_BUILTIN(Name)
#define KILN_ACTIVATION(Name, ...) KILN_BUILTIN(Name)
#include "ir/scalar_fn.def"
#undef KILN_BUILTIN
    for (const auto& [name, fields] : recordFields()) m[name] = {fnRecord, "a setting"};
    addTensorBuiltins(m);
    addTransformerBuiltins(m);
    addSequenceBuiltins(m);
    addRecsysBuiltins(m);
    return m;
  }();
  return k;
}

}  // namespace

const BuiltinInfo* findBuiltin(const std::string& name) {
  auto it = builtins().find(name);
  return it == builtins().end() ? nullptr : &it->second;
}

bool isWord(const std::string& name) {
  static const std::set<std::string> k = {"f32",    "bf16",     "f16",   "i32",        "i64",
                                          "auc",    "accuracy", "loss",  "perplexity", "hash",
                                          "modulo", "none",     "probs", "position"};
  return k.count(name) > 0;
}

}  // namespace kiln::frontend
