// Data movement ops: broadcast, reshape, transpose, concat, slice, gather, cast, and the ops
// their gradients need:
//   kiln.sum_to(x) -> stated type    sums x over the dims along which the stated type broadcasts
//                                    to x's shape (the adjoint of broadcasting)
//   kiln.pad(x) {axis, low, high}    zeros before and after x along a static axis (slice's adjoint)
//   kiln.scatter_add(base, indices, updates) {axis}
//                                    base with updates added at indices along axis (gather's adjoint);
//                                    updates are shaped like gather(base, indices, axis)
#include <algorithm>
#include <numeric>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

// broadcast: result type stated; the operand must broadcast to it.
Status verifyBroadcast(const Op& op) {
  const TensorType& in = op.operand(0)->type();
  const TensorType& out = op.result()->type();
  if (in.dtype() != out.dtype()) return Status::error("'kiln.broadcast' cannot change the element type");
  auto s = broadcastShapes(in.shape(), out.shape());
  if (!s || !(TensorType(out.dtype(), *s) == out.withSharding(std::nullopt)))
    return Status::errorf("'kiln.broadcast' cannot broadcast {} to {}", in.str(), out.str());
  return Status::ok();
}

// reshape: result type stated; element counts must agree symbolically.
Status verifyReshape(const Op& op) {
  const TensorType& in = op.operand(0)->type();
  const TensorType& out = op.result()->type();
  if (in.dtype() != out.dtype()) return Status::error("'kiln.reshape' cannot change the element type");
  auto pi = symbolicProduct(in.shape()), po = symbolicProduct(out.shape());
  if (!pi.known || !po.known) {
    // A bounded dim may only pass through unchanged in the same position count.
    if (in.rank() == out.rank() && in.shape() == out.shape()) return Status::ok();
    if (!pi.known && !po.known) {
      // Splitting or merging static dims next to a bounded one is allowed when the static
      // parts match; keep it simple: the static factors must agree.
      if (pi.factor == po.factor && pi.symbols == po.symbols) return Status::ok();
    }
    return Status::errorf("'kiln.reshape' cannot reshape {} to {}", in.str(), out.str());
  }
  if (!(pi == po))
    return Status::errorf("'kiln.reshape' changes the element count: {} to {}", in.str(), out.str());
  return Status::ok();
}

Status inferTranspose(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  std::vector<int64_t> perm = op.intsAttr("perm");
  if (static_cast<int64_t>(perm.size()) != in.rank())
    return Status::errorf("'kiln.transpose' perm has {} entries for {}", perm.size(), in.str());
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < in.rank(); ++i)
    if (sorted[static_cast<size_t>(i)] != i) return Status::error("'kiln.transpose' perm is not a permutation");
  Shape s;
  for (int64_t p : perm) s.push_back(in.dim(p));
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

Status inferConcat(const Op& op, std::vector<TensorType>& out) {
  const TensorType& first = op.operand(0)->type();
  auto axis = normalizeAxis(op, op.intAttr("axis"), first.rank());
  if (!axis) return axis.status();
  Shape s = first.shape();
  int64_t static_sum = 0;
  std::string sym;
  int64_t sym_factor = 0;
  bool dynamic = false;
  for (Value* v : op.operands()) {
    const TensorType& t = v->type();
    if (t.rank() != first.rank() || t.dtype() != first.dtype())
      return Status::errorf("'kiln.concat' operands differ: {} and {}", first.str(), t.str());
    for (int64_t i = 0; i < t.rank(); ++i)
      if (i != *axis && !(t.dim(i) == first.dim(i)))
        return Status::errorf("'kiln.concat' operands differ off axis {}: {} and {}", *axis, first.str(), t.str());
    const Dim& d = t.dim(*axis);
    if (d.isBounded()) dynamic = true;
    if (d.sym().empty()) {
      static_sum += d.factor();
    } else if (sym.empty() || sym == d.sym()) {
      sym = d.sym();
      sym_factor += d.factor();
    } else {
      return Status::errorf("'kiln.concat' cannot add dims {} and {}", sym, d.sym());
    }
  }
  if (!sym.empty() && static_sum != 0)
    return Status::error("'kiln.concat' along an axis mixing static and symbolic sizes is not supported");
  Dim d = sym.empty() ? Dim::fixed(static_sum) : Dim::symbol(sym, sym_factor);
  s[static_cast<size_t>(*axis)] = dynamic ? Dim::bounded(d) : d;
  out = {TensorType(first.dtype(), std::move(s))};
  return Status::ok();
}

// slice: one axis, [start, limit) with stride 1; the axis must be static.
Status inferSlice(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  auto axis = normalizeAxis(op, op.intAttr("axis"), in.rank());
  if (!axis) return axis.status();
  const Dim& d = in.dim(*axis);
  if (!d.isStatic()) return Status::errorf("'kiln.slice' axis {} of {} is not static", *axis, in.str());
  int64_t start = op.intAttr("start"), limit = op.intAttr("limit");
  if (start < 0 || limit > d.size() || start >= limit)
    return Status::errorf("'kiln.slice' range [{}, {}) is out of bounds for size {}", start, limit, d.size());
  Shape s = in.shape();
  s[static_cast<size_t>(*axis)] = Dim::fixed(limit - start);
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

// gather: out = x.shape[:axis] + indices.shape + x.shape[axis+1:]
Status inferGather(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& idx = op.operand(1)->type();
  if (!isInteger(idx.dtype()))
    return Status::errorf("'kiln.gather' indices must be i32 or i64, got {}", idx.str());
  auto axis = normalizeAxis(op, op.intAttr("axis"), x.rank());
  if (!axis) return axis.status();
  Shape s(x.shape().begin(), x.shape().begin() + *axis);
  s.insert(s.end(), idx.shape().begin(), idx.shape().end());
  s.insert(s.end(), x.shape().begin() + *axis + 1, x.shape().end());
  out = {TensorType(x.dtype(), std::move(s))};
  return Status::ok();
}

Status inferCast(const Op& op, std::vector<TensorType>& out) {
  auto to = parseDType(op.strAttr("to"));
  if (!to) return Status::errorf("'kiln.cast' has unknown target type '{}'", op.strAttr("to"));
  out = {op.operand(0)->type().withDType(*to).withSharding(std::nullopt)};
  return Status::ok();
}

@@HOOKS@@
}  // namespace

void registerShapeOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.broadcast", .summary = "Broadcasts to the stated result shape",
         .min_operands = 1, .max_operands = 1, .traits = kPure | kTypeGiven, .verify = verifyBroadcast});
  r.add({.name = "kiln.reshape", .summary = "Same elements, the stated result shape",
         .min_operands = 1, .max_operands = 1, .traits = kPure | kTypeGiven, .verify = verifyReshape});
  r.add({.name = "kiln.transpose", .summary = "Permutes dimensions: out.dim(i) = in.dim(perm[i])",
         .min_operands = 1, .max_operands = 1, .attrs = {{"perm", K::Array, true}},
         .traits = kPure, .infer = inferTranspose});
  r.add({.name = "kiln.concat", .summary = "Concatenates along an axis",
         .min_operands = 1, .max_operands = -1, .attrs = {{"axis", K::Int, true}},
         .traits = kPure, .infer = inferConcat});
  r.add({.name = "kiln.slice", .summary = "Elements [start, limit) along one axis",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"axis", K::Int, true}, {"start", K::Int, true}, {"limit", K::Int, true}},
         .traits = kPure, .infer = inferSlice});
  r.add({.name = "kiln.gather", .summary = "Rows of x selected by integer indices along an axis",
         .min_operands = 2, .max_operands = 2, .attrs = {{"axis", K::Int, false, Attribute(int64_t{0})}},
         .traits = kPure, .infer = inferGather});
  r.add({.name = "kiln.cast", .summary = "Converts the element type",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"to", K::String, true, std::nullopt,
                    {"f32", "f16", "bf16", "f8e4m3", "f8e5m2", "i32", "i64", "i1", "f64"}}},
         .traits = kPure | kElementwise, .infer = inferCast});
}

}  // namespace kiln::ir
