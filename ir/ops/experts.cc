// The expert side of a Mixture-of-Experts layer (docs/moe.md, "Experts"): moving tokens into
// expert-major order and back, and the experts' grouped GEMMs.
//
//   kiln.moe_permute(x[N, H], rows[?R], probs[N, k]) {apply_probs}    -> [?R, H]
//     y[r] = x[rows[r] / k] (times probs[rows[r]] with apply_probs); padding rows (< 0) are 0
//   kiln.moe_unpermute(y[?R, H], rows[?R], probs[N, k]) {apply_probs} -> [N, H]
//     out[n] = sum over the rows r holding a slot of n of (probs[rows[r]] *) y[r]
//   kiln.moe_row_dot(a[?R, H], rows[?R], b[N, H], probs_like[N, k])   -> [N, k]
//     out[s] = dot(a[r], b[s / k]) for the row r holding slot s; 0 for slots in no row
//   kiln.grouped_matmul(x[?R, K], w[E, K, M] (or [E, M, K]), offsets[E + 1]) {transpose_b}
//     -> [?R, M]: rows [offsets[e], offsets[e + 1]) times w[e] (w[e]^T with transpose_b)
//   kiln.grouped_matmul_wgrad(x[?R, K], dy[?R, M], offsets[E + 1]) {transpose}
//     -> [E, K, M] (or [E, M, K]): x_e^T dy_e per expert (its transpose with transpose)
//
// rows and offsets come from kiln.moe_dispatch and are known only at run time, so the row dim
// is bounded (?R) and flows from `rows` (the permutes) or `x` (the GEMMs). The references check
// what the types cannot: each slot lies in [0, N*k) and is held by one row at most, and the
// offsets rise from 0 to the run-time row count.
#include <algorithm>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

// ---- Shape rules ------------------------------------------------------------------------------

Status expectMatrix(const Op& op, unsigned i, const char* what) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 2) return Status::errorf("'{}' needs {} of rank 2, got {}", op.name(), what, t.str());
  return Status::ok();
}

// rows: a 1-d i32 tensor, one entry per permuted row.
Status expectRows(const Op& op, unsigned i) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 1 || t.dtype() != DType::i32)
    return Status::errorf("'{}' needs rows of type i32[?R], got {}", op.name(), t.str());
  return Status::ok();
}

// probs (or probs_like): [N, k] floats whose N is the tokens' dim.
Status expectProbs(const Op& op, unsigned i, const Dim& tokens) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 2 || !isFloat(t.dtype()))
    return Status::errorf("'{}' needs probs of type f32[N, k], got {}", op.name(), t.str());
  if (!(t.dim(0) == tokens))
    return Status::errorf("'{}' probs {} must have one row per token ({})", op.name(), t.str(), tokens.str());
  if (!t.dim(1).isStatic() || t.dim(1).size() < 1)
    return Status::errorf("'{}' probs {} need a static top-k >= 1", op.name(), t.str());
  return Status::ok();
}

Status expectSameRows(const Op& op, const TensorType& a, const TensorType& b) {
  if (!(a.dim(0) == b.dim(0)))
    return Status::errorf("'{}' operands {} and {} must have the same rows", op.name(), a.str(), b.str());
  return Status::ok();
}

Status expectFloat(const Op& op, const TensorType& t) {
  if (!isFloat(t.dtype())) return Status::errorf("'{}' needs float activations, got {}", op.name(), t.str());
  return Status::ok();
}

// (x[N, H], rows[?R], probs[N, k]) -> [?R, H]
Status inferPermute(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(expectMatrix(op, 0, "tokens x"));
  KILN_RETURN_IF_ERROR(expectRows(op, 1));
  const TensorType& x = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectProbs(op, 2, x.dim(0)));
  out = {TensorType(x.dtype(), {op.operand(1)->type().dim(0), x.dim(1)})};
  return Status::ok();
}

// (y[?R, H], rows[?R], probs[N, k]) -> [N, H]
Status inferUnpermute(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(expectMatrix(op, 0, "permuted rows y"));
  KILN_RETURN_IF_ERROR(expectRows(op, 1));
  const TensorType& y = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectSameRows(op, y, op.operand(1)->type()));
  KILN_RETURN_IF_ERROR(expectMatrix(op, 2, "probs"));
  const TensorType& probs = op.operand(2)->type();
  KILN_RETURN_IF_ERROR(expectProbs(op, 2, probs.dim(0)));
  out = {TensorType(y.dtype(), {probs.dim(0), y.dim(1)})};
  return Status::ok();
}

// (a[?R, H], rows[?R], b[N, H], probs_like[N, k]) -> probs_like's type
Status inferRowDot(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(expectMatrix(op, 0, "permuted rows a"));
  KILN_RETURN_IF_ERROR(expectRows(op, 1));
  KILN_RETURN_IF_ERROR(expectMatrix(op, 2, "tokens b"));
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(2)->type();
  KILN_RETURN_IF_ERROR(expectSameRows(op, a, op.operand(1)->type()));
  if (!(a.dim(1) == b.dim(1)))
    return Status::errorf("'{}' rows {} and tokens {} must have the same width", op.name(), a.str(), b.str());
  KILN_RETURN_IF_ERROR(expectProbs(op, 3, b.dim(0)));
  out = {op.operand(3)->type().withSharding(std::nullopt)};
  return Status::ok();
}

// offsets: i32[E + 1] for a static expert count E.
Expected<int64_t> expertsOf(const Op& op, unsigned i) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 1 || t.dtype() != DType::i32 || !t.dim(0).isStatic() || t.dim(0).size() < 2)
    return Status::errorf("'{}' needs offsets of type i32[E + 1] with a static E >= 1, got {}", op.name(),
                          t.str());
  return t.dim(0).size() - 1;
}

// (x[?R, K], w[E, K, M] or [E, M, K], offsets[E + 1]) -> [?R, M]
Status inferGroupedMatmul(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(expectMatrix(op, 0, "rows x"));
  const TensorType& x = op.operand(0)->type();
  const TensorType& w = op.operand(1)->type();
  if (w.rank() != 3) return Status::errorf("'{}' needs weights [E, K, M], got {}", op.name(), w.str());
  KILN_ASSIGN_OR_RETURN(int64_t experts, expertsOf(op, 2));
  if (!(w.dim(0) == Dim::fixed(experts)))
    return Status::errorf("'{}' weights {} must hold one matrix per expert ({} offsets give {})", op.name(),
                          w.str(), experts + 1, experts);
  const bool tb = op.boolAttr("transpose_b");
  const Dim& k = w.dim(tb ? 2 : 1);
  if (!(x.dim(1) == k))
    return Status::errorf("'{}' contraction dims differ: {} ({}) vs {} ({}{})", op.name(), x.dim(1).str(),
                          x.str(), k.str(), w.str(), tb ? ", transpose_b" : "");
  out = {TensorType(x.dtype(), {x.dim(0), w.dim(tb ? 1 : 2)})};
  return Status::ok();
}

// (x[?R, K], dy[?R, M], offsets[E + 1]) -> [E, K, M] (or [E, M, K] with transpose)
Status inferGroupedMatmulWgrad(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(expectMatrix(op, 0, "rows x"));
  KILN_RETURN_IF_ERROR(expectMatrix(op, 1, "row gradients dy"));
  const TensorType& x = op.operand(0)->type();
  const TensorType& dy = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(expectSameRows(op, x, dy));
  KILN_ASSIGN_OR_RETURN(int64_t experts, expertsOf(op, 2));
  const bool t = op.boolAttr("transpose");
  out = {TensorType(x.dtype(), {Dim::fixed(experts), t ? dy.dim(1) : x.dim(1), t ? x.dim(1) : dy.dim(1)})};
  return Status::ok();
}

// ---- Verifiers: element types and static dims the shape rules leave open ----------------------

// A dim that is not the row dim must be known before the run.
Status expectNotBounded(const Op& op, const TensorType& t, int64_t from) {
  for (int64_t i = from; i < t.rank(); ++i)
    if (t.dim(i).isBounded())
      return Status::errorf("'{}' operand {} may have a data-dependent size in dim 0 only", op.name(),
                            t.str());
  return Status::ok();
}

Status verifyPermute(const Op& op) {
  const TensorType& x = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectFloat(op, x));
  KILN_RETURN_IF_ERROR(expectNotBounded(op, x, op.is(OpCode::MoePermute) ? 0 : 1));
  return expectNotBounded(op, op.operand(2)->type(), 0);
}

Status verifyRowDot(const Op& op) {
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(2)->type();
  KILN_RETURN_IF_ERROR(expectFloat(op, a));
  if (a.dtype() != b.dtype())
    return Status::errorf("'{}' rows {} and tokens {} have different element types", op.name(), a.str(),
                          b.str());
  KILN_RETURN_IF_ERROR(expectNotBounded(op, a, 1));
  KILN_RETURN_IF_ERROR(expectNotBounded(op, b, 0));
  return expectNotBounded(op, op.operand(3)->type(), 0);
}

Status verifyGroupedMatmul(const Op& op) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& other = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(expectFloat(op, x));
  if (x.dtype() != other.dtype())
    return Status::errorf("'{}' operands {} and {} have different element types", op.name(), x.str(),
                          other.str());
  KILN_RETURN_IF_ERROR(expectNotBounded(op, x, 1));
  return expectNotBounded(op, other, op.is(OpCode::GroupedMatmul) ? 0 : 1);
}

// ---- Costs ------------------------------------------------------------------------------------

// What a permute reads: its operands (probs only when applied) and writes: its result.
// apply_probs as the op states it, else its default (permute: false, unpermute: true): an op
// read from text carries only the attributes written there.
bool appliesProbs(const Op& op) { return op.boolAttr("apply_probs", op.is(OpCode::MoeUnpermute)); }

OpCost costPermute(const Op& op, const SymbolBindings& symbols) {
  const bool apply = appliesProbs(op);
  double bytes = typeBytes(op.operand(0)->type(), symbols) + typeBytes(op.operand(1)->type(), symbols) +
                 typeBytes(op.result()->type(), symbols);
  if (apply) bytes += typeBytes(op.operand(2)->type(), symbols);
  // One multiply per moved element with the probs; unpermute adds each row into its token.
  const TensorType& moved = op.is(OpCode::MoePermute) ? op.result()->type() : op.operand(0)->type();
  const double flops = (apply ? 1 : 0) + (op.is(OpCode::MoeUnpermute) ? 1 : 0);
  return {flops * typeElements(moved, symbols), bytes};
}

// A multiply and an add per element of a.
OpCost costRowDot(const Op& op, const SymbolBindings& symbols) {
  return {2 * typeElements(op.operand(0)->type(), symbols), operandAndResultBytes(op, symbols)};
}

// 2*R*K*M at R's bound, whichever of the two products.
OpCost costGroupedMatmul(const Op& op, const SymbolBindings& symbols) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& other = op.operand(1)->type();
  const double rows = x.dim(0).evaluate(symbols).value_or(0);
  const double k = x.dim(1).evaluate(symbols).value_or(0);
  const double m = (op.is(OpCode::GroupedMatmul) ? op.result()->type().dim(1) : other.dim(1))
                       .evaluate(symbols)
                       .value_or(0);
  return {2 * rows * k * m, operandAndResultBytes(op, symbols)};
}

// ---- CPU reference ----------------------------------------------------------------------------

// Checks each row's slot against the N*k slots and that no slot is held twice; the permutes and
// their gradients rest on rows being a (partial) permutation.
Status checkRows(const Op& op, const TensorView& rows, int64_t slots) {
  std::vector<int64_t> holder(static_cast<size_t>(slots), -1);
  for (int64_t r = 0; r < rows.shape[0]; ++r) {
    const int64_t s = loadIndex(rows, r);
    if (s < 0) continue;  // a padding row
    if (s >= slots)
      return Status::errorf("'{}': rows[{}] = {} lies outside the {} slots [0, N*k)", op.name(), r, s, slots);
    int64_t& h = holder[static_cast<size_t>(s)];
    if (h >= 0) return Status::errorf("'{}': slot {} is held by rows {} and {}", op.name(), s, h, r);
    h = r;
  }
  return Status::ok();
}

// probs[N, k] at run time: N must be the tokens' count.
Status checkTokens(const Op& op, const TensorView& probs, int64_t tokens) {
  if (probs.shape[0] != tokens)
    return Status::errorf("'{}': probs {} for {} tokens", op.name(), shapeString(probs.shape), tokens);
  return Status::ok();
}

// Expert e's rows are [offsets[e], offsets[e + 1]): they must rise from 0 to the row count.
Status checkOffsets(const Op& op, const TensorView& offsets, int64_t rows) {
  const int64_t experts = offsets.shape[0] - 1;
  if (loadIndex(offsets, 0) != 0)
    return Status::errorf("'{}': offsets[0] = {}, want 0", op.name(), loadIndex(offsets, 0));
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t lo = loadIndex(offsets, e), hi = loadIndex(offsets, e + 1);
    if (hi < lo) return Status::errorf("'{}': offsets decrease at expert {} ({} > {})", op.name(), e, lo, hi);
    if (hi > rows)
      return Status::errorf("'{}': offsets[{}] = {} lies beyond the {} rows", op.name(), e + 1, hi, rows);
  }
  if (loadIndex(offsets, experts) != rows)
    return Status::errorf("'{}': offsets[{}] = {} but there are {} rows", op.name(), experts,
                          loadIndex(offsets, experts), rows);
  return Status::ok();
}

Status cpuPermute(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& rows = *in[1];
  const TensorView& probs = *in[2];
  const int64_t tokens = x.shape[0], width = x.shape[1], k = probs.shape[1];
  KILN_RETURN_IF_ERROR(checkTokens(op, probs, tokens));
  KILN_RETURN_IF_ERROR(checkRows(op, rows, tokens * k));
  const int64_t count = rows.shape[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {count, width}));
  const bool apply = appliesProbs(op);
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* px = data<T>(x);
    auto* py = data<T>(*out[0]);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = loadIndex(rows, r);
      const double scale = s < 0 ? 0.0 : apply ? loadAsDouble(probs, s) : 1.0;
      const int64_t n = s < 0 ? 0 : s / k;
      for (int64_t h = 0; h < width; ++h)
        py[r * width + h] = T::store(s < 0 ? 0.0 : scale * static_cast<double>(T::load(px[n * width + h])));
    }
    return Status::ok();
  });
}

Status cpuUnpermute(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& y = *in[0];
  const TensorView& rows = *in[1];
  const TensorView& probs = *in[2];
  const int64_t count = y.shape[0], width = y.shape[1], tokens = probs.shape[0], k = probs.shape[1];
  if (rows.shape[0] != count)
    return Status::errorf("'{}': {} rows of y but {} row slots", op.name(), count, rows.shape[0]);
  KILN_RETURN_IF_ERROR(checkRows(op, rows, tokens * k));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {tokens, width}));
  const bool apply = appliesProbs(op);
  return visitFloat(op, y.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* py = data<T>(y);
    std::vector<double> sum(static_cast<size_t>(tokens * width), 0.0);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = loadIndex(rows, r);
      if (s < 0) continue;
      const double scale = apply ? loadAsDouble(probs, s) : 1.0;
      double* acc = sum.data() + (s / k) * width;
      for (int64_t h = 0; h < width; ++h) acc[h] += scale * static_cast<double>(T::load(py[r * width + h]));
    }
    auto* po = data<T>(*out[0]);
    for (size_t i = 0; i < sum.size(); ++i) po[i] = T::store(sum[i]);
    return Status::ok();
  });
}

Status cpuRowDot(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& a = *in[0];
  const TensorView& rows = *in[1];
  const TensorView& b = *in[2];
  const int64_t count = a.shape[0], width = a.shape[1], tokens = b.shape[0], k = in[3]->shape[1];
  if (rows.shape[0] != count)
    return Status::errorf("'{}': {} rows of a but {} row slots", op.name(), count, rows.shape[0]);
  KILN_RETURN_IF_ERROR(checkTokens(op, *in[3], tokens));
  KILN_RETURN_IF_ERROR(checkRows(op, rows, tokens * k));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {tokens, k}));
  std::vector<double> dots(static_cast<size_t>(tokens * k), 0.0);
  KILN_RETURN_IF_ERROR(visitFloat(op, a.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pa = data<T>(a);
    const auto* pb = data<T>(b);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t s = loadIndex(rows, r);
      if (s < 0) continue;
      double dot = 0;
      for (int64_t h = 0; h < width; ++h)
        dot += static_cast<double>(T::load(pa[r * width + h])) * T::load(pb[(s / k) * width + h]);
      dots[static_cast<size_t>(s)] = dot;
    }
    return Status::ok();
  }));
  return visitFloat(op, out[0]->dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    auto* po = data<T>(*out[0]);
    for (size_t i = 0; i < dots.size(); ++i) po[i] = T::store(dots[i]);
    return Status::ok();
  });
}

// Element (e, p, j) of the expert matrices [E, P, J], stored as [E, J, P] when transposed.
int64_t expertIndex(bool transposed, int64_t e, int64_t p, int64_t j, int64_t np, int64_t nj) {
  return transposed ? (e * nj + j) * np + p : (e * np + p) * nj + j;
}

Status cpuGroupedMatmul(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& w = *in[1];
  const bool tb = op.boolAttr("transpose_b");
  const int64_t count = x.shape[0], k = x.shape[1], m = w.shape[tb ? 1 : 2];
  if (w.shape[tb ? 2 : 1] != k || w.shape[0] != in[2]->shape[0] - 1)
    return Status::errorf("'{}': run-time shapes x {}, w {} and offsets {} disagree", op.name(),
                          shapeString(x.shape), shapeString(w.shape), shapeString(in[2]->shape));
  KILN_RETURN_IF_ERROR(checkOffsets(op, *in[2], count));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {count, m}));
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* px = data<T>(x);
    const auto* pw = data<T>(w);
    auto* py = data<T>(*out[0]);
    std::vector<double> row(static_cast<size_t>(m));
    for (int64_t e = 0; e + 1 < in[2]->shape[0]; ++e) {
      for (int64_t r = loadIndex(*in[2], e); r < loadIndex(*in[2], e + 1); ++r) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t p = 0; p < k; ++p) {
          const double xv = T::load(px[r * k + p]);
          for (int64_t j = 0; j < m; ++j)
            row[static_cast<size_t>(j)] += xv * T::load(pw[expertIndex(tb, e, p, j, k, m)]);
        }
        for (int64_t j = 0; j < m; ++j) py[r * m + j] = T::store(row[static_cast<size_t>(j)]);
      }
    }
    return Status::ok();
  });
}

Status cpuGroupedMatmulWgrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& dy = *in[1];
  const bool t = op.boolAttr("transpose");
  const int64_t count = x.shape[0], k = x.shape[1], m = dy.shape[1], experts = in[2]->shape[0] - 1;
  if (dy.shape[0] != count)
    return Status::errorf("'{}': x has {} rows but dy has {}", op.name(), count, dy.shape[0]);
  KILN_RETURN_IF_ERROR(checkOffsets(op, *in[2], count));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {experts, t ? m : k, t ? k : m}));
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* px = data<T>(x);
    const auto* pd = data<T>(dy);
    auto* pw = data<T>(*out[0]);
    std::vector<double> acc(static_cast<size_t>(k * m));
    for (int64_t e = 0; e < experts; ++e) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t r = loadIndex(*in[2], e); r < loadIndex(*in[2], e + 1); ++r)
        for (int64_t p = 0; p < k; ++p) {
          const double xv = T::load(px[r * k + p]);
          for (int64_t j = 0; j < m; ++j) acc[static_cast<size_t>(p * m + j)] += xv * T::load(pd[r * m + j]);
        }
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < m; ++j)
          pw[expertIndex(t, e, p, j, k, m)] = T::store(acc[static_cast<size_t>(p * m + j)]);
    }
    return Status::ok();
  });
}

// ---- Gradient rules ---------------------------------------------------------------------------

AttrDict applyProbs(const Op& op) { return {{"apply_probs", Attribute(appliesProbs(op))}}; }

// permute:   dx = unpermute(dy)            dprobs = row_dot(dy, rows, x)
// unpermute: dy = permute(dout)            dprobs = row_dot(y, rows, dout)
// each with the forward's apply_probs; probs get a gradient only when they were applied.
Status gradPermute(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  Value* rows = op.operand(1);
  Value* probs = op.operand(2);
  const bool forward = op.is(OpCode::MoePermute);
  const OpCode adjoint = forward ? OpCode::MoeUnpermute : OpCode::MoePermute;
  KILN_GRAD_VALUE(dmoved, b.createValue(adjoint, {g, rows, probs}, applyProbs(op)));
  ctx.operand_grads[0] = dmoved;
  if (appliesProbs(op)) {
    Value* permuted = forward ? g : op.operand(0);
    Value* tokens = forward ? op.operand(0) : g;
    KILN_GRAD_VALUE(dprobs, b.createValue(OpCode::MoeRowDot, {permuted, rows, tokens, probs}));
    ctx.operand_grads[2] = dprobs;
  }
  return Status::ok();
}

// y = x w_e:   dx = grouped_matmul(dy, w, !transpose_b)   dw = wgrad(x, dy){transpose = transpose_b}
Status gradGroupedMatmul(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  Value* offsets = op.operand(2);
  const bool tb = op.boolAttr("transpose_b");
  KILN_GRAD_VALUE(dx, b.createValue(OpCode::GroupedMatmul, {g, op.operand(1), offsets},
                                    {{"transpose_b", Attribute(!tb)}}));
  KILN_GRAD_VALUE(dw, b.createValue(OpCode::GroupedMatmulWgrad, {op.operand(0), g, offsets},
                                    {{"transpose", Attribute(tb)}}));
  ctx.operand_grads[0] = dx;
  ctx.operand_grads[1] = dw;
  return Status::ok();
}

}  // namespace

void registerExpertOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.moe_permute",
         .summary = "Token rows into expert-major order (rows[r] = slot), optionally scaled by their probs",
         .min_operands = 3,
         .max_operands = 3,
         .attrs = {{"apply_probs", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferPermute,
         .verify = verifyPermute,
         .cost = costPermute,
         .grad = gradPermute,
         .cpu = cpuPermute});
  r.add({.name = "kiln.moe_unpermute",
         .summary = "Expert-major rows summed back into their tokens, optionally weighted by their probs",
         .min_operands = 3,
         .max_operands = 3,
         .attrs = {{"apply_probs", K::Bool, false, Attribute(true)}},
         .traits = kPure,
         .infer = inferUnpermute,
         .verify = verifyPermute,
         .cost = costPermute,
         .grad = gradPermute,
         .cpu = cpuUnpermute});
  // Backward-only: the probs' gradient of the permutes; no gradient flows through it.
  r.add({.name = "kiln.moe_row_dot",
         .summary = "Per slot, the dot product of its permuted row with its token's row",
         .min_operands = 4,
         .max_operands = 4,
         .traits = kPure | kNonDifferentiable,
         .infer = inferRowDot,
         .verify = verifyRowDot,
         .cost = costRowDot,
         .cpu = cpuRowDot});
  r.add({.name = "kiln.grouped_matmul",
         .summary = "Each expert's rows [offsets[e], offsets[e+1]) times its weight matrix",
         .min_operands = 3,
         .max_operands = 3,
         .attrs = {{"transpose_b", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferGroupedMatmul,
         .verify = verifyGroupedMatmul,
         .cost = costGroupedMatmul,
         .grad = gradGroupedMatmul,
         .cpu = cpuGroupedMatmul});
  // Backward-only: the weights' gradient of grouped_matmul.
  r.add({.name = "kiln.grouped_matmul_wgrad",
         .summary = "Per expert, x_e^T dy_e over its rows (the weight gradient of grouped_matmul)",
         .min_operands = 3,
         .max_operands = 3,
         .attrs = {{"transpose", K::Bool, false, Attribute(false)}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferGroupedMatmulWgrad,
         .verify = verifyGroupedMatmul,
         .cost = costGroupedMatmul,
         .cpu = cpuGroupedMatmulWgrad});
}

}  // namespace kiln::ir
