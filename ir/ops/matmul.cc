// Matrix multiplication, optionally batched, with transpose flags:
//   a: [..., M, K] (or [..., K, M] with transpose_a), b: [..., K, N] (or [..., N, K] with
//   transpose_b); batch dims broadcast; result [..., M, N].
#include <algorithm>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;

Status inferMatmul(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(1)->type();
  if (a.rank() < 2 || b.rank() < 2)
    return Status::errorf("'kiln.matmul' needs operands of rank >= 2, got {} and {}", a.str(), b.str());
  if (a.dtype() != b.dtype())
    return Status::errorf("'kiln.matmul' operands have different element types: {} and {}", a.str(), b.str());
  bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  const Dim& m = a.dim(a.rank() - (ta ? 1 : 2));
  const Dim& ka = a.dim(a.rank() - (ta ? 2 : 1));
  const Dim& kb = b.dim(b.rank() - (tb ? 1 : 2));
  const Dim& n = b.dim(b.rank() - (tb ? 2 : 1));
  if (!(ka == kb))
    return Status::errorf("'kiln.matmul' contraction dims differ: {} ({}) vs {} ({})", ka.str(), a.str(),
                          kb.str(), b.str());
  Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  auto batch = broadcastShapes(ba, bb);
  if (!batch) return Status::errorf("'kiln.matmul' batch dims: {}", batch.status().message());
  Shape s = batch.take();
  s.push_back(m);
  s.push_back(n);
  out = {TensorType(a.dtype(), std::move(s))};
  return Status::ok();
}

Status verifyMatmul(const Op& op) {
  if (!isFloat(op.operand(0)->type().dtype()))
    return Status::errorf("'kiln.matmul' needs floating-point operands, got {}", op.operand(0)->type().str());
  return Status::ok();
}

// A plain triple loop, accumulated in double: the oracle the BLAS and CUDA paths are checked
// against. Batch dims broadcast; each matrix is read through its transpose flag.
Status cpuMatmul(const Op& op, const std::vector<const TensorView*>& in, const std::vector<TensorView*>& out,
                 const CpuContext&) {
  const TensorView& a = *in[0];
  const TensorView& b = *in[1];
  TensorView& r = *out[0];
  const bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  const size_t ra = a.shape.size(), rb = b.shape.size();
  const int64_t m = a.shape[ra - (ta ? 1 : 2)], k = a.shape[ra - (ta ? 2 : 1)];
  const int64_t kb = b.shape[rb - (tb ? 1 : 2)], n = b.shape[rb - (tb ? 2 : 1)];
  if (k != kb)
    return Status::errorf("'kiln.matmul': run-time contraction sizes differ: {} and {}", shapeString(a.shape),
                          shapeString(b.shape));
  std::vector<int64_t> batch_a(a.shape.begin(), a.shape.end() - 2),
      batch_b(b.shape.begin(), b.shape.end() - 2);
  KILN_ASSIGN_OR_RETURN(auto batch, broadcastRuntime(op, batch_a, batch_b));
  std::vector<int64_t> shape = batch;
  shape.push_back(m);
  shape.push_back(n);
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  // Per-batch matrix offsets, in matrices.
  std::vector<int64_t> off_a, off_b;
  forEachIndex<2>(batch, {broadcastStrides(batch_a, batch), broadcastStrides(batch_b, batch)},
                  [&](int64_t, const std::array<int64_t, 2>& o) {
                    off_a.push_back(o[0]);
                    off_b.push_back(o[1]);
                  });
  if (batch.empty()) off_a = off_b = {0};
  return visitFloat(op, a.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pa = data<T>(a);
    const auto* pb = data<T>(b);
    auto* pr = data<T>(r);
    std::vector<double> row(static_cast<size_t>(n));
    for (size_t bi = 0; bi < off_a.size(); ++bi) {
      const auto* ma = pa + off_a[bi] * m * k;
      const auto* mb = pb + off_b[bi] * k * n;
      auto* mr = pr + static_cast<int64_t>(bi) * m * n;
      for (int64_t i = 0; i < m; ++i) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t p = 0; p < k; ++p) {
          const double av = T::load(ta ? ma[p * m + i] : ma[i * k + p]);
          if (tb)
            for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] += av * T::load(mb[j * k + p]);
          else
            for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] += av * T::load(mb[p * n + j]);
        }
        for (int64_t j = 0; j < n; ++j) mr[i * n + j] = T::store(row[static_cast<size_t>(j)]);
      }
    }
    return Status::ok();
  });
}

// C = op(A) op(B). With G the result gradient:
//   plain:       dA = G B^T      dB = A^T G
//   transpose_a: dA = B G^T      dB = A G
//   transpose_b: dA = G B        dB = G^T A
//   both:        dA = B^T G^T    dB = G^T A^T
// each summed back over broadcast batch dims.
Status gradMatmul(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  Value* a = op.operand(0);
  Value* w = op.operand(1);
  const bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  auto mm = [&](Value* x, Value* y, bool tx, bool ty) {
    return b.createValue("kiln.matmul", {x, y},
                         {{"transpose_a", Attribute(tx)}, {"transpose_b", Attribute(ty)}});
  };
  Expected<Value*> da = !ta ? (!tb ? mm(g, w, false, true) : mm(g, w, false, false))
                            : (!tb ? mm(w, g, false, true) : mm(w, g, true, true));
  if (!da) return da.status();
  Expected<Value*> db = !tb ? (!ta ? mm(a, g, true, false) : mm(a, g, false, false))
                            : (!ta ? mm(g, a, true, false) : mm(g, a, true, true));
  if (!db) return db.status();
  KILN_GRAD_VALUE(sa, grads::sumTo(b, *da, a->type()));
  KILN_GRAD_VALUE(sb, grads::sumTo(b, *db, w->type()));
  ctx.operand_grads = {sa, sb};
  return Status::ok();
}

// 2 M N K flops per batch entry; each operand read once, the result written once.
OpCost costMatmul(const Op& op, const SymbolBindings& symbols) {
  const TensorType& a = op.operand(0)->type();
  const bool ta = op.boolAttr("transpose_a");
  auto k = a.dim(a.rank() - (ta ? 2 : 1)).evaluate(symbols);
  double flops = 2.0 * typeElements(op.result()->type(), symbols) * static_cast<double>(k ? *k : 0);
  return {flops, operandAndResultBytes(op, symbols)};
}

}  // namespace

void registerMatmulOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.matmul",
         .summary = "(batched) matrix product with optional transposes",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"transpose_a", K::Bool, false, Attribute(false)},
                   {"transpose_b", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferMatmul,
         .verify = verifyMatmul,
         .cost = costMatmul,
         .grad = gradMatmul,
         .cpu = cpuMatmul});
}

}  // namespace kiln::ir
