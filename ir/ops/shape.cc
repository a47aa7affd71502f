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

#include "ir/checked.h"
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
  if (pi.overflow || po.overflow)
    return Status::errorf("'kiln.reshape' of {} to {}: the element count overflows int64", in.str(),
                          out.str());
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
  KILN_ASSIGN_OR_RETURN(auto axis, normalizeAxis(op, op.intAttr("axis"), first.rank()));
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
      if (i != axis && !(t.dim(i) == first.dim(i)))
        return Status::errorf("'kiln.concat' operands differ off axis {}: {} and {}", axis, first.str(),
                              t.str());
    const Dim& d = t.dim(axis);
    if (d.isBounded()) dynamic = true;
    int64_t& sum = d.sym().empty() ? static_sum : sym_factor;
    if (!d.sym().empty() && !sym.empty() && sym != d.sym())
      return Status::errorf("'kiln.concat' cannot add dims {} and {}", sym, d.sym());
    if (!d.sym().empty()) sym = d.sym();
    auto total = checkedAdd(sum, d.factor());
    if (!total)
      return Status::errorf("'kiln.concat' along axis {}: the size overflows int64 at {}", axis, t.str());
    sum = *total;
  }
  if (!sym.empty() && static_sum != 0)
    return Status::error("'kiln.concat' along an axis mixing static and symbolic sizes is not supported");
  Dim d = sym.empty() ? Dim::fixed(static_sum) : Dim::symbol(sym, sym_factor);
  s[static_cast<size_t>(axis)] = dynamic ? Dim::bounded(d) : d;
  out = {TensorType(first.dtype(), std::move(s))};
  return Status::ok();
}

// slice: one axis, [start, limit) with stride 1; the axis must be static.
Status inferSlice(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  KILN_ASSIGN_OR_RETURN(auto axis, normalizeAxis(op, op.intAttr("axis"), in.rank()));
  const Dim& d = in.dim(axis);
  if (!d.isStatic()) return Status::errorf("'kiln.slice' axis {} of {} is not static", axis, in.str());
  int64_t start = op.intAttr("start"), limit = op.intAttr("limit");
  if (start < 0 || limit > d.size() || start >= limit)
    return Status::errorf("'kiln.slice' range [{}, {}) is out of bounds for size {}", start, limit, d.size());
  Shape s = in.shape();
  s[static_cast<size_t>(axis)] = Dim::fixed(limit - start);
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

// gather: out = x.shape[:axis] + indices.shape + x.shape[axis+1:]
Status inferGather(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& idx = op.operand(1)->type();
  if (!isInteger(idx.dtype()))
    return Status::errorf("'kiln.gather' indices must be i32 or i64, got {}", idx.str());
  KILN_ASSIGN_OR_RETURN(auto axis, normalizeAxis(op, op.intAttr("axis"), x.rank()));
  Shape s(x.shape().begin(), x.shape().begin() + axis);
  s.insert(s.end(), idx.shape().begin(), idx.shape().end());
  s.insert(s.end(), x.shape().begin() + axis + 1, x.shape().end());
  out = {TensorType(x.dtype(), std::move(s))};
  return Status::ok();
}

Status inferCast(const Op& op, std::vector<TensorType>& out) {
  auto to = parseDType(op.strAttr("to"));
  if (!to) return Status::errorf("'kiln.cast' has unknown target type '{}'", op.strAttr("to"));
  out = {op.operand(0)->type().withDType(*to).withSharding(std::nullopt)};
  return Status::ok();
}

// ---- Ops for gradients: inference and verification -----------------------------------------

// sum_to: the stated result must broadcast to the operand's shape.
Status verifySumTo(const Op& op) {
  const TensorType& in = op.operand(0)->type();
  const TensorType& out = op.result()->type();
  if (in.dtype() != out.dtype()) return Status::error("'kiln.sum_to' cannot change the element type");
  auto s = broadcastShapes(out.shape(), in.shape());
  if (out.rank() > in.rank() || !s || *s != in.shape())
    return Status::errorf("'kiln.sum_to' cannot sum {} to {}: the result must broadcast to the operand",
                          in.str(), out.str());
  return Status::ok();
}

Status inferPad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  KILN_ASSIGN_OR_RETURN(auto axis, normalizeAxis(op, op.intAttr("axis"), in.rank()));
  const Dim& d = in.dim(axis);
  if (!d.isStatic()) return Status::errorf("'kiln.pad' axis {} of {} is not static", axis, in.str());
  int64_t low = op.intAttr("low"), high = op.intAttr("high");
  if (low < 0 || high < 0)
    return Status::errorf("'kiln.pad' needs low >= 0 and high >= 0, got {} and {}", low, high);
  Shape s = in.shape();
  auto padded = checkedAdd(d.size(), low);
  if (padded) padded = checkedAdd(*padded, high);
  if (!padded) return Status::errorf("'kiln.pad' of {} by {} and {} overflows int64", in.str(), low, high);
  s[static_cast<size_t>(axis)] = Dim::fixed(*padded);
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

Status inferScatterAdd(const Op& op, std::vector<TensorType>& out) {
  const TensorType& base = op.operand(0)->type();
  const TensorType& idx = op.operand(1)->type();
  const TensorType& upd = op.operand(2)->type();
  if (!isInteger(idx.dtype()))
    return Status::errorf("'kiln.scatter_add' indices must be i32 or i64, got {}", idx.str());
  KILN_ASSIGN_OR_RETURN(auto axis, normalizeAxis(op, op.intAttr("axis"), base.rank()));
  Shape want(base.shape().begin(), base.shape().begin() + axis);
  want.insert(want.end(), idx.shape().begin(), idx.shape().end());
  want.insert(want.end(), base.shape().begin() + axis + 1, base.shape().end());
  if (upd.dtype() != base.dtype() || upd.shape() != want)
    return Status::errorf("'kiln.scatter_add' updates must be {} for base {} and indices {}, got {}",
                          TensorType(base.dtype(), want).str(), base.str(), idx.str(), upd.str());
  out = {base.withSharding(std::nullopt)};
  return Status::ok();
}

// ---- CPU kernels ------------------------------------------------------------------------------

int64_t product(const std::vector<int64_t>& s, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= s[i];
  return n;
}

Status cpuBroadcast(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  // A dim of 1 takes the result's allocated size; any other dim passes through.
  std::vector<int64_t> shape = r.shape;
  const size_t lead = shape.size() - x.shape.size();
  for (size_t i = 0; i < x.shape.size(); ++i)
    if (x.shape[i] != 1) shape[lead + i] = x.shape[i];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const size_t es = static_cast<size_t>(dtypeBytes(x.dtype));
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  forEachIndex<1>(r.shape, {broadcastStrides(x.shape, r.shape)},
                  [&](int64_t i, const std::array<int64_t, 1>& o) {
                    std::memcpy(pr + static_cast<size_t>(i) * es, px + static_cast<size_t>(o[0]) * es, es);
                  });
  return Status::ok();
}

Status cpuReshape(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  // A bounded result dim takes whatever the element count leaves for it.
  std::vector<int64_t> shape = r.shape;
  const TensorType& t = op.result()->type();
  int64_t known = 1, bounded_at = -1;
  for (int64_t i = 0; i < t.rank(); ++i) {
    if (t.dim(i).isBounded() && bounded_at < 0)
      bounded_at = i;
    else
      known *= shape[static_cast<size_t>(i)];
  }
  if (bounded_at >= 0 && known > 0) shape[static_cast<size_t>(bounded_at)] = x.numel() / known;
  if (product(shape, 0, shape.size()) != x.numel())
    return Status::errorf("'kiln.reshape' cannot reshape run-time shape {} to {}", shapeString(x.shape),
                          shapeString(shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  std::memmove(r.data, x.data, static_cast<size_t>(x.bytes()));
  return Status::ok();
}

Status cpuTranspose(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  std::vector<int64_t> perm = op.intsAttr("perm");
  std::vector<int64_t> xs = rowMajorStrides(x.shape), shape, strides;
  for (int64_t p : perm) {
    shape.push_back(x.shape[static_cast<size_t>(p)]);
    strides.push_back(xs[static_cast<size_t>(p)]);
  }
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const size_t es = static_cast<size_t>(dtypeBytes(x.dtype));
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  forEachIndex<1>(r.shape, {strides}, [&](int64_t i, const std::array<int64_t, 1>& o) {
    std::memcpy(pr + static_cast<size_t>(i) * es, px + static_cast<size_t>(o[0]) * es, es);
  });
  return Status::ok();
}

Status cpuConcat(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  TensorView& r = *out[0];
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis"), in[0]->rank()));
  std::vector<int64_t> shape = in[0]->shape;
  shape[axis] = 0;
  for (const TensorView* v : in) {
    for (size_t i = 0; i < shape.size(); ++i)
      if (i != axis && v->shape[i] != shape[i])
        return Status::errorf("'kiln.concat': run-time shapes {} and {} differ off the axis",
                              shapeString(in[0]->shape), shapeString(v->shape));
    shape[axis] += v->shape[axis];
  }
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const int64_t outer = product(r.shape, 0, axis);
  const int64_t inner_bytes = product(r.shape, axis + 1, r.shape.size()) * dtypeBytes(r.dtype);
  auto* pr = static_cast<unsigned char*>(r.data);
  for (int64_t o = 0; o < outer; ++o)
    for (const TensorView* v : in) {
      const int64_t chunk = v->shape[axis] * inner_bytes;
      std::memcpy(pr, static_cast<const unsigned char*>(v->data) + o * chunk, static_cast<size_t>(chunk));
      pr += chunk;
    }
  return Status::ok();
}

Status cpuSlice(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis"), x.rank()));
  const int64_t start = op.intAttr("start"), limit = op.intAttr("limit");
  std::vector<int64_t> shape = x.shape;
  shape[axis] = limit - start;
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const int64_t outer = product(x.shape, 0, axis);
  const int64_t inner_bytes = product(x.shape, axis + 1, x.shape.size()) * dtypeBytes(x.dtype);
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(pr + o * (limit - start) * inner_bytes, px + (o * x.shape[axis] + start) * inner_bytes,
                static_cast<size_t>((limit - start) * inner_bytes));
  return Status::ok();
}

Status cpuPad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis"), x.rank()));
  const int64_t low = op.intAttr("low"), high = op.intAttr("high");
  std::vector<int64_t> shape = x.shape;
  shape[axis] += low + high;
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  std::memset(r.data, 0, static_cast<size_t>(r.bytes()));  // all-zero bits are 0 in every dtype
  const int64_t outer = product(x.shape, 0, axis);
  const int64_t inner_bytes = product(x.shape, axis + 1, x.shape.size()) * dtypeBytes(x.dtype);
  const int64_t n = x.shape[axis];
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(pr + (o * r.shape[axis] + low) * inner_bytes, px + o * n * inner_bytes,
                static_cast<size_t>(n * inner_bytes));
  return Status::ok();
}

// Checks every index against [0, size); the error names the op, the index and its position.
Status checkIndices(const Op& op, const TensorView& idx, int64_t size) {
  for (int64_t j = 0, n = idx.numel(); j < n; ++j) {
    int64_t id = loadIndex(idx, j);
    if (id < 0 || id >= size)
      return Status::errorf("'{}': index {} at position {} is out of range [0, {})", op.name(), id,
                            indexString(idx.shape, j), size);
  }
  return Status::ok();
}

Status cpuGather(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& idx = *in[1];
  TensorView& r = *out[0];
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis"), x.rank()));
  KILN_RETURN_IF_ERROR(checkIndices(op, idx, x.shape[axis]));
  std::vector<int64_t> shape(x.shape.begin(), x.shape.begin() + static_cast<int64_t>(axis));
  shape.insert(shape.end(), idx.shape.begin(), idx.shape.end());
  shape.insert(shape.end(), x.shape.begin() + static_cast<int64_t>(axis) + 1, x.shape.end());
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const int64_t outer = product(x.shape, 0, axis);
  const int64_t inner_bytes = product(x.shape, axis + 1, x.shape.size()) * dtypeBytes(x.dtype);
  const int64_t n = idx.numel();
  const auto* px = static_cast<const unsigned char*>(x.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(pr + (o * n + j) * inner_bytes, px + (o * x.shape[axis] + loadIndex(idx, j)) * inner_bytes,
                  static_cast<size_t>(inner_bytes));
  return Status::ok();
}

Status cpuScatterAdd(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& base = *in[0];
  const TensorView& idx = *in[1];
  const TensorView& upd = *in[2];
  TensorView& r = *out[0];
  const size_t axis = static_cast<size_t>(*normalizeAxis(op, op.intAttr("axis"), base.rank()));
  KILN_RETURN_IF_ERROR(checkIndices(op, idx, base.shape[axis]));
  const int64_t outer = product(base.shape, 0, axis);
  const int64_t inner = product(base.shape, axis + 1, base.shape.size());
  const int64_t n = idx.numel();
  if (upd.numel() != outer * n * inner)
    return Status::errorf("'kiln.scatter_add': run-time updates {} do not match base {} and indices {}",
                          shapeString(upd.shape), shapeString(base.shape), shapeString(idx.shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, base.shape));
  std::memmove(r.data, base.data, static_cast<size_t>(base.bytes()));
  return visitNumeric(op, base.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pu = data<T>(upd);
    auto* pr = data<T>(r);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t j = 0; j < n; ++j) {
        auto* dst = pr + (o * base.shape[axis] + loadIndex(idx, j)) * inner;
        const auto* src = pu + (o * n + j) * inner;
        for (int64_t k = 0; k < inner; ++k) dst[k] = T::store(T::load(dst[k]) + T::load(src[k]));
      }
    return Status::ok();
  });
}

Status cpuSumTo(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  const TensorType& t = op.result()->type();
  const size_t lead = x.shape.size() - r.shape.size();
  std::vector<int64_t> shape(r.shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const Dim& d = t.dim(static_cast<int64_t>(i));
    shape[i] = d.isStatic() && d.size() == 1 ? 1 : x.shape[lead + i];
  }
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  return visitNumeric(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    std::vector<typename T::Acc> acc(static_cast<size_t>(r.numel()), 0);
    const auto* px = data<T>(x);
    forEachIndex<1>(x.shape, {broadcastStrides(r.shape, x.shape)},
                    [&](int64_t i, const std::array<int64_t, 1>& o) {
                      acc[static_cast<size_t>(o[0])] += T::load(px[i]);
                    });
    auto* pr = data<T>(r);
    for (size_t i = 0; i < acc.size(); ++i) pr[i] = T::store(acc[i]);
    return Status::ok();
  });
}

Status cpuCast(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  return visitAny(op, x.dtype, [&](auto src_tag) -> Status {
    using S = decltype(src_tag);
    return visitAny(op, r.dtype, [&](auto dst_tag) -> Status {
      using D = decltype(dst_tag);
      const auto* px = data<S>(x);
      auto* pr = data<D>(r);
      for (int64_t i = 0, n = x.numel(); i < n; ++i) {
        auto v = S::load(px[i]);
        if constexpr (std::is_same_v<D, I1>)
          pr[i] = v != 0;  // any nonzero value is true
        else
          pr[i] = D::store(static_cast<typename D::Acc>(v));  // float to int truncates toward 0
      }
      return Status::ok();
    });
  });
}

// ---- Gradient rules ----------------------------------------------------------------------------

using grads::resetOperandGrads;

Status gradBroadcastLike(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  if (!ctx.result_grads[0]) return Status::ok();
  KILN_GRAD_VALUE(g, grads::sumTo(ctx.builder, ctx.result_grads[0], op.operand(0)->type()));
  ctx.operand_grads[0] = g;
  return Status::ok();
}

// The adjoint of sum_to broadcasts back.
Status gradSumTo(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  auto b =
      ctx.builder.createWithTypes("kiln.broadcast", {g}, {op.operand(0)->type().withSharding(std::nullopt)});
  if (!b) return b.status();
  ctx.operand_grads[0] = (*b)->result();
  return Status::ok();
}

Status gradReshape(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  auto r =
      ctx.builder.createWithTypes("kiln.reshape", {g}, {op.operand(0)->type().withSharding(std::nullopt)});
  if (!r) return r.status();
  ctx.operand_grads[0] = (*r)->result();
  return Status::ok();
}

Status gradTranspose(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  std::vector<int64_t> perm = op.intsAttr("perm"), inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  KILN_GRAD_VALUE(t, ctx.builder.createValue("kiln.transpose", {g}, {{"perm", Attribute::ints(inverse)}}));
  ctx.operand_grads[0] = t;
  return Status::ok();
}

// Each operand gets its slice of g.
Status gradConcat(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  if (op.numOperands() == 1) {
    ctx.operand_grads[0] = g;
    return Status::ok();
  }
  const int64_t axis = *normalizeAxis(op, op.intAttr("axis"), g->type().rank());
  int64_t start = 0;
  for (unsigned i = 0; i < op.numOperands(); ++i) {
    const Dim& d = op.operand(i)->type().dim(axis);
    if (!d.isStatic())
      return Status::errorf("the gradient of 'kiln.concat' needs static sizes along axis {}, got {}", axis,
                            op.operand(i)->type().str());
    KILN_GRAD_VALUE(s, ctx.builder.createValue("kiln.slice", {g},
                                               {{"axis", Attribute(axis)},
                                                {"start", Attribute(start)},
                                                {"limit", Attribute(start + d.size())}}));
    ctx.operand_grads[i] = s;
    start += d.size();
  }
  return Status::ok();
}

Status gradSlice(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  const TensorType& in = op.operand(0)->type();
  const int64_t axis = *normalizeAxis(op, op.intAttr("axis"), in.rank());
  const int64_t low = op.intAttr("start"), high = in.dim(axis).size() - op.intAttr("limit");
  KILN_GRAD_VALUE(p, ctx.builder.createValue(
                         "kiln.pad", {g},
                         {{"axis", Attribute(axis)}, {"low", Attribute(low)}, {"high", Attribute(high)}}));
  ctx.operand_grads[0] = p;
  return Status::ok();
}

Status gradPad(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  const TensorType& in = op.operand(0)->type();
  const int64_t axis = *normalizeAxis(op, op.intAttr("axis"), in.rank());
  const int64_t low = op.intAttr("low");
  KILN_GRAD_VALUE(s, ctx.builder.createValue("kiln.slice", {g},
                                             {{"axis", Attribute(axis)},
                                              {"start", Attribute(low)},
                                              {"limit", Attribute(low + in.dim(axis).size())}}));
  ctx.operand_grads[0] = s;
  return Status::ok();
}

// gather's adjoint: scatter-add g into zeros shaped like x; the indices get none.
Status gradGather(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  KILN_GRAD_VALUE(zeros, grads::filled(ctx.builder, op.operand(0)->type(), 0.0));
  KILN_GRAD_VALUE(s, ctx.builder.createValue("kiln.scatter_add", {zeros, op.operand(1), g},
                                             {{"axis", Attribute(op.intAttr("axis"))}}));
  ctx.operand_grads[0] = s;
  return Status::ok();
}

Status gradScatterAdd(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  ctx.operand_grads[0] = g;
  KILN_GRAD_VALUE(u, ctx.builder.createValue("kiln.gather", {g, op.operand(1)},
                                             {{"axis", Attribute(op.intAttr("axis"))}}));
  ctx.operand_grads[2] = u;
  return Status::ok();
}

// Float to float casts pass the gradient back in the operand's type; casts from or to integers
// carry none.
Status gradCast(GradContext& ctx, const Op& op) {
  resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  DType from = op.operand(0)->type().dtype();
  if (!g || !isFloat(from) || !isFloat(g->type().dtype())) return Status::ok();
  KILN_GRAD_VALUE(
      c, ctx.builder.createValue("kiln.cast", {g}, {{"to", Attribute(std::string(dtypeName(from)))}}));
  ctx.operand_grads[0] = c;
  return Status::ok();
}

// ---- Costs -------------------------------------------------------------------------------------

OpCost costMove(const Op& op, const SymbolBindings& symbols) {
  return {0, operandAndResultBytes(op, symbols)};
}

// Reads the indices and the selected rows, writes the result.
OpCost costGather(const Op& op, const SymbolBindings& symbols) {
  return {0, typeBytes(op.operand(1)->type(), symbols) + 2 * typeBytes(op.result()->type(), symbols)};
}

OpCost costScatterAdd(const Op& op, const SymbolBindings& symbols) {
  return {typeElements(op.operand(2)->type(), symbols), operandAndResultBytes(op, symbols)};
}

OpCost costSumTo(const Op& op, const SymbolBindings& symbols) {
  return {typeElements(op.operand(0)->type(), symbols), operandAndResultBytes(op, symbols)};
}

OpCost costCast(const Op& op, const SymbolBindings& symbols) { return elementwiseCost(op, symbols, 1); }

}  // namespace

void registerShapeOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.broadcast", .summary = "Broadcasts to the stated result shape",
         .min_operands = 1, .max_operands = 1, .traits = kPure | kTypeGiven, .verify = verifyBroadcast,
         .cost = costMove, .grad = gradBroadcastLike, .cpu = cpuBroadcast});
  r.add({.name = "kiln.reshape", .summary = "Same elements, the stated result shape",
         .min_operands = 1, .max_operands = 1, .traits = kPure | kTypeGiven, .verify = verifyReshape,
         .cost = costMove, .grad = gradReshape, .cpu = cpuReshape});
  r.add({.name = "kiln.transpose", .summary = "Permutes dimensions: out.dim(i) = in.dim(perm[i])",
         .min_operands = 1, .max_operands = 1, .attrs = {{"perm", K::Array, true}},
         .traits = kPure, .infer = inferTranspose, .cost = costMove, .grad = gradTranspose, .cpu = cpuTranspose});
  r.add({.name = "kiln.concat", .summary = "Concatenates along an axis",
         .min_operands = 1, .max_operands = -1, .attrs = {{"axis", K::Int, true}},
         .traits = kPure, .infer = inferConcat, .cost = costMove, .grad = gradConcat, .cpu = cpuConcat});
  r.add({.name = "kiln.slice", .summary = "Elements [start, limit) along one axis",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"axis", K::Int, true}, {"start", K::Int, true}, {"limit", K::Int, true}},
         .traits = kPure, .infer = inferSlice, .cost = costMove, .grad = gradSlice, .cpu = cpuSlice});
  r.add({.name = "kiln.gather", .summary = "Rows of x selected by integer indices along an axis",
         .min_operands = 2, .max_operands = 2, .attrs = {{"axis", K::Int, false, Attribute(int64_t{0})}},
         .traits = kPure, .infer = inferGather, .cost = costGather, .grad = gradGather, .cpu = cpuGather});
  r.add({.name = "kiln.cast", .summary = "Converts the element type",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"to", K::String, true, std::nullopt,
                    {"f32", "f16", "bf16", "f8e4m3", "f8e5m2", "i32", "i64", "i1", "f64"}}},
         .traits = kPure | kElementwise, .infer = inferCast, .cost = costCast, .grad = gradCast, .cpu = cpuCast});

  r.add({.name = "kiln.sum_to", .summary = "Sums over the dims along which the stated type broadcasts to the operand",
         .min_operands = 1, .max_operands = 1, .traits = kPure | kTypeGiven | kReduction, .verify = verifySumTo,
         .cost = costSumTo, .grad = gradSumTo, .cpu = cpuSumTo});
  r.add({.name = "kiln.pad", .summary = "Zeros before (low) and after (high) the operand along a static axis",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"axis", K::Int, true}, {"low", K::Int, true}, {"high", K::Int, true}},
         .traits = kPure, .infer = inferPad, .cost = costMove, .grad = gradPad, .cpu = cpuPad});
  r.add({.name = "kiln.scatter_add", .summary = "base with updates added at indices along an axis",
         .min_operands = 3, .max_operands = 3, .attrs = {{"axis", K::Int, false, Attribute(int64_t{0})}},
         .traits = kPure, .infer = inferScatterAdd, .cost = costScatterAdd, .grad = gradScatterAdd,
         .cpu = cpuScatterAdd});
}

}  // namespace kiln::ir
