// Reductions over axes, softmax along one axis, and the reduction's backward op:
//   kiln.reduce_grad(g[, x, y]) {kind, axes, keepdims} -> the type of x (stated)
//     spreads the gradient g of y = reduce(x) back over the reduced axes: sum copies it, mean
//     divides it by the reduced count, max (which takes x and y too) gives it to the elements
//     equal to the maximum, split evenly among ties.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

Status inferReduce(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) {
    KILN_ASSIGN_OR_RETURN(auto n, normalizeAxis(op, a, in.rank()));
    if (!axes.insert(n).second) return Status::errorf("'kiln.reduce' repeats axis {}", a);
  }
  if (axes.empty()) return Status::error("'kiln.reduce' needs at least one axis");
  bool keep = op.boolAttr("keepdims");
  Shape s;
  for (int64_t i = 0; i < in.rank(); ++i) {
    if (!axes.count(i))
      s.push_back(in.dim(i));
    else if (keep)
      s.push_back(Dim::fixed(1));
  }
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

Status inferSoftmax(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  if (auto axis = normalizeAxis(op, op.intAttr("axis", -1), in.rank()); !axis) return axis.status();
  if (!isFloat(in.dtype())) return Status::errorf("'kiln.softmax' needs a float operand, got {}", in.str());
  out = {in.withSharding(std::nullopt)};
  return Status::ok();
}

// The reduced axes of an op with an `axes` attribute, normalized against rank.
std::vector<bool> reducedAxes(const Op& op, int64_t rank) {
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  for (int64_t a : op.intsAttr("axes")) reduced[static_cast<size_t>(a < 0 ? a + rank : a)] = true;
  return reduced;
}

// The input shape with reduced axes set to 1: the layout of the result with or without keepdims.
std::vector<int64_t> keptShape(const std::vector<int64_t>& in, const std::vector<bool>& reduced) {
  std::vector<int64_t> s = in;
  for (size_t i = 0; i < s.size(); ++i)
    if (reduced[i]) s[i] = 1;
  return s;
}

std::vector<int64_t> resultShape(const std::vector<int64_t>& in, const std::vector<bool>& reduced,
                                 bool keep) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < in.size(); ++i)
    if (!reduced[i])
      s.push_back(in[i]);
    else if (keep)
      s.push_back(1);
  return s;
}

Status cpuReduce(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  const std::vector<bool> reduced = reducedAxes(op, x.rank());
  KILN_RETURN_IF_ERROR(setResultShape(op, r, resultShape(x.shape, reduced, op.boolAttr("keepdims"))));
  const std::vector<int64_t> kept = keptShape(x.shape, reduced);
  const std::string kind = op.strAttr("kind");
  const int64_t count = r.numel() ? x.numel() / r.numel() : 0;
  return visitNumeric(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    using Acc = typename T::Acc;
    const auto* px = data<T>(x);
    auto* pr = data<T>(r);
    // sum and mean fold with scalar_fn.def's Sum combiner, max with its Max.
    const Combiner combiner = kind == "max" ? Combiner::Max : Combiner::Sum;
    std::vector<Acc> acc(static_cast<size_t>(r.numel()), scalar::identity<Acc>(combiner));
    forEachIndex<1>(x.shape, {broadcastStrides(kept, x.shape)},
                    [&](int64_t i, const std::array<int64_t, 1>& o) {
                      Acc v = T::load(px[i]);
                      Acc& a = acc[static_cast<size_t>(o[0])];
                      a = scalar::combine(combiner, a, v);
                    });
    for (size_t i = 0; i < acc.size(); ++i)
      pr[i] = T::store(kind == "mean" && count ? acc[i] / static_cast<Acc>(count) : acc[i]);
    return Status::ok();
  });
}

Status cpuReduceGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& g = *in[0];
  TensorView& r = *out[0];
  const std::string kind = op.strAttr("kind");
  const std::vector<bool> reduced = reducedAxes(op, r.rank());
  // Run-time shape: the kept axes come from g (or x), the reduced ones keep their allocated size.
  std::vector<int64_t> shape = r.shape;
  if (kind == "max") {
    shape = in[1]->shape;
  } else {
    const bool keep = op.boolAttr("keepdims");
    size_t gi = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      if (!reduced[i]) shape[i] = g.shape[gi];
      if (!reduced[i] || keep) ++gi;
    }
  }
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const std::vector<int64_t> kept = keptShape(r.shape, reduced);
  const std::vector<int64_t> g_strides = broadcastStrides(kept, r.shape);
  int64_t count = 1;
  for (size_t i = 0; i < reduced.size(); ++i)
    if (reduced[i]) count *= r.shape[i];
  return visitFloat(op, g.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pg = data<T>(g);
    auto* pr = data<T>(r);
    if (kind != "max") {
      const double scale = kind == "mean" ? 1.0 / static_cast<double>(count) : 1.0;
      forEachIndex<1>(r.shape, {g_strides}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        pr[i] = T::store(T::load(pg[o[0]]) * scale);
      });
      return Status::ok();
    }
    const auto* px = data<T>(*in[1]);
    const auto* py = data<T>(*in[2]);
    std::vector<int64_t> ties(static_cast<size_t>(g.numel()), 0);
    forEachIndex<1>(r.shape, {g_strides}, [&](int64_t i, const std::array<int64_t, 1>& o) {
      ties[static_cast<size_t>(o[0])] += T::load(px[i]) == T::load(py[o[0]]);
    });
    forEachIndex<1>(r.shape, {g_strides}, [&](int64_t i, const std::array<int64_t, 1>& o) {
      const bool hit = T::load(px[i]) == T::load(py[o[0]]);
      pr[i] = T::store(hit ? T::load(pg[o[0]]) / static_cast<double>(ties[static_cast<size_t>(o[0])]) : 0.0);
    });
    return Status::ok();
  });
}

Status cpuSoftmax(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis", -1), x.rank()));
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < axis; ++i) outer *= x.shape[i];
  for (size_t i = axis + 1; i < x.shape.size(); ++i) inner *= x.shape[i];
  const int64_t n = x.shape[axis];
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* px = data<T>(x);
    auto* pr = data<T>(r);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t in_i = 0; in_i < inner; ++in_i) {
        const int64_t base = o * n * inner + in_i;
        // Subtracting the max keeps exp from overflowing.
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max<double>(mx, T::load(px[base + j * inner]));
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += std::exp(T::load(px[base + j * inner]) - mx);
        for (int64_t j = 0; j < n; ++j)
          pr[base + j * inner] = T::store(std::exp(T::load(px[base + j * inner]) - mx) / sum);
      }
    return Status::ok();
  });
}

// ---- Gradient rules ----------------------------------------------------------------------------

Status gradReduce(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  Value* x = op.operand(0);
  if (!g || !isFloat(x->type().dtype())) return Status::ok();
  std::vector<Value*> operands = {g};
  if (op.strAttr("kind") == "max") operands = {g, x, op.result()};
  KILN_ASSIGN_OR_RETURN(auto r, ctx.builder.createWithTypes(
                                    "kiln.reduce_grad", operands, {x->type().withSharding(std::nullopt)},
                                    {{"kind", Attribute(op.strAttr("kind"))},
                                     {"axes", Attribute::ints(op.intsAttr("axes"))},
                                     {"keepdims", Attribute(op.boolAttr("keepdims"))}}));
  ctx.operand_grads[0] = r->result();
  return Status::ok();
}

// y = softmax(x): dx = y * (g - sum(g * y, axis)).
Status gradSoftmax(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  Value* y = op.result();
  KILN_GRAD_VALUE(gy, grads::binary(b, "kiln.mul", g, y));
  KILN_GRAD_VALUE(s, b.createValue("kiln.reduce", {gy},
                                   {{"kind", Attribute("sum")},
                                    {"axes", Attribute::ints({op.intAttr("axis", -1)})},
                                    {"keepdims", Attribute(true)}}));
  KILN_GRAD_VALUE(d, grads::binary(b, "kiln.sub", g, s));
  KILN_GRAD_VALUE(dx, grads::binary(b, "kiln.mul", y, d));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

// reduce_grad: the result type must reduce (by the op's axes and keepdims) to g's type.
Status verifyReduceGrad(const Op& op) {
  const TensorType& g = op.operand(0)->type();
  const TensorType& x = op.result()->type();
  const bool is_max = op.strAttr("kind") == "max";
  if (op.numOperands() != (is_max ? 3u : 1u))
    return Status::errorf("'kiln.reduce_grad' of kind {} takes {}", op.strAttr("kind"),
                          is_max ? "(g, x, y)" : "(g)");
  if (g.dtype() != x.dtype() || !isFloat(g.dtype()))
    return Status::errorf("'kiln.reduce_grad' needs float g and result of one type, got {} and {}", g.str(),
                          x.str());
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) {
    KILN_ASSIGN_OR_RETURN(auto n, normalizeAxis(op, a, x.rank()));
    axes.insert(n);
  }
  Shape want;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (!axes.count(i))
      want.push_back(x.dim(i));
    else if (op.boolAttr("keepdims"))
      want.push_back(Dim::fixed(1));
  }
  if (g.shape() != want)
    return Status::errorf("'kiln.reduce_grad' gradient {} is not the reduction of {}", g.str(), x.str());
  if (is_max && (op.operand(1)->type().withSharding(std::nullopt) != x.withSharding(std::nullopt) ||
                 op.operand(2)->type().shape() != g.shape()))
    return Status::errorf("'kiln.reduce_grad' x and y must have the types of the result {} and g {}", x.str(),
                          g.str());
  return Status::ok();
}

OpCost costReduceInput(const Op& op, const SymbolBindings& symbols) {
  return {typeElements(op.operand(0)->type(), symbols), operandAndResultBytes(op, symbols)};
}
OpCost costReduceGrad(const Op& op, const SymbolBindings& symbols) { return elementwiseCost(op, symbols, 2); }
// max, subtract, exp, sum, divide: about five operations an element.
OpCost costSoftmax(const Op& op, const SymbolBindings& symbols) { return elementwiseCost(op, symbols, 5); }

}  // namespace

void registerReduceOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.reduce", .summary = "sum, mean or max over axes",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"kind", K::String, true, std::nullopt, {"sum", "mean", "max"}},
                   {"axes", K::Array, true},
                   {"keepdims", K::Bool, false, Attribute(false)}},
         .traits = kPure | kReduction, .infer = inferReduce,
         .cost = costReduceInput, .grad = gradReduce, .cpu = cpuReduce});
  r.add({.name = "kiln.softmax", .summary = "exp(x) / sum(exp(x)) along an axis",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"axis", K::Int, false, Attribute(int64_t{-1})}},
         .traits = kPure, .infer = inferSoftmax, .cost = costSoftmax, .grad = gradSoftmax, .cpu = cpuSoftmax});
  // Backward-only: autodiff emits it; no second-order gradients flow through it.
  r.add({.name = "kiln.reduce_grad", .summary = "Spreads the gradient of a reduction back over its axes",
         .min_operands = 1, .max_operands = 3,
         .attrs = {{"kind", K::String, true, std::nullopt, {"sum", "mean", "max"}},
                   {"axes", K::Array, true},
                   {"keepdims", K::Bool, false, Attribute(false)}},
         .traits = kPure | kTypeGiven | kNonDifferentiable,
         .verify = verifyReduceGrad, .cost = costReduceGrad, .cpu = cpuReduceGrad});
}

}  // namespace kiln::ir
