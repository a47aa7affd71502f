// Matrix products: f32 and bf16 through oneDNN (gemm.h; bf16 natively, accumulated in f32), f64
// by a plain loop. Batch dims broadcast; when only `a` is batched and not transposed, the batch
// folds into M for one large GEMM. With KernelContext::batch_invariant f32 (and widened bf16)
// products go through invariant_gemm.h instead.
#include <algorithm>
#include <vector>

#include "runtime/cpu/gemm.h"
#include "runtime/cpu/kernels/broadcast.h"
#include "runtime/cpu/kernels/invariant_gemm.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

struct MatmulDims {
  int64_t m, n, k;
  std::vector<int64_t> batch;                  // broadcast batch shape
  std::vector<int64_t> a_batch, b_batch;       // each operand's own batch dims
};

Expected<MatmulDims> matmulDims(const ir::Op& op, const ir::TensorView& a, const ir::TensorView& b) {
  bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  int64_t ra = a.rank(), rb = b.rank();
  if (ra < 2 || rb < 2) return Status::error("'kiln.matmul' needs rank >= 2 operands at run time");
  MatmulDims d;
  d.m = a.shape[static_cast<size_t>(ra - (ta ? 1 : 2))];
  d.k = a.shape[static_cast<size_t>(ra - (ta ? 2 : 1))];
  int64_t kb = b.shape[static_cast<size_t>(rb - (tb ? 1 : 2))];
  d.n = b.shape[static_cast<size_t>(rb - (tb ? 2 : 1))];
  if (kb != d.k) return Status::errorf("'kiln.matmul' contraction sizes differ at run time: {} and {}", d.k, kb);
  d.a_batch.assign(a.shape.begin(), a.shape.end() - 2);
  d.b_batch.assign(b.shape.begin(), b.shape.end() - 2);
  auto batch = broadcastConcrete({&d.a_batch, &d.b_batch});
  if (!batch) return Status::errorf("'kiln.matmul' batch dims: {}", batch.status().message());
  d.batch = *batch;
  return d;
}

// One product of the batch: f64 by the plain loop, f32 under batch invariance by
// invariant_gemm.h, everything else by oneDNN (gemm.h).
template <typename T>
Status product(ir::DType storage, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c,
               const KernelContext& ctx) {
  if constexpr (std::is_same_v<T, double>) {
    gemmF64(ta, tb, m, n, k, a, b, c);
    return Status::ok();
  } else {
    if (ctx.batch_invariant && storage == ir::DType::f32) {
      invariantSgemm(ta, tb, m, n, k, reinterpret_cast<const float*>(a), reinterpret_cast<const float*>(b),
                     reinterpret_cast<float*>(c), *ctx.pool);
      return Status::ok();
    }
    return gemm(GemmDesc::plain(storage, ta, tb, m, n, k), {a, b, c}, ctx.pool);
  }
}

// T is the storage's C++ type: double, float, or uint16_t for bf16.
template <typename T>
Status batchedGemm(const ir::Op& op, ir::DType storage, const MatmulDims& d, const T* a, const T* b, T* c,
                   const KernelContext& ctx) {
  bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  int64_t nbatch = 1;
  for (int64_t x : d.batch) nbatch *= x;
  int64_t b_count = 1;
  for (int64_t x : d.b_batch) b_count *= x;
  if (!ta && b_count == 1)  // fold a's batch into M: one GEMM
    return product<T>(storage, false, tb, nbatch * d.m, d.n, d.k, a, b, c, ctx);
  BroadcastIter it(d.batch, {&d.a_batch, &d.b_batch});
  std::vector<int64_t> offs(2);
  // Walk every batch index; BroadcastIter's rows are all but its innermost dim, so walk that too.
  const int64_t inner = d.batch.empty() ? 1 : it.innerSize();
  const int64_t outer = d.batch.empty() ? 1 : it.outerSize();
  for (int64_t r = 0, idx = 0; r < outer; ++r) {
    if (!d.batch.empty()) it.rowOffsets(r, offs);
    for (int64_t j = 0; j < inner; ++j, ++idx) {
      int64_t ia = d.batch.empty() ? 0 : offs[0] + j * it.innerStride(0);
      int64_t ib = d.batch.empty() ? 0 : offs[1] + j * it.innerStride(1);
      KILN_RETURN_IF_ERROR(product<T>(storage, ta, tb, d.m, d.n, d.k, a + ia * d.m * d.k, b + ib * d.k * d.n,
                                      c + idx * d.m * d.n, ctx));
    }
  }
  return Status::ok();
}

// bf16 under batch invariance: widened to f32 for the invariant GEMM, rounded once.
Status invariantBf16(const ir::Op& op, const MatmulDims& d, const std::vector<const ir::TensorView*>& in,
                     ir::TensorView& out, const KernelContext& ctx) {
  auto widen = [&](const ir::TensorView& v) {
    std::vector<float> f(static_cast<size_t>(v.numel()));
    const uint16_t* p = v.as<uint16_t>();
    ctx.pool->parallelFor(v.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) f[static_cast<size_t>(i)] = ir::bf16ToFloat(p[i]);
    });
    return f;
  };
  std::vector<float> a = widen(*in[0]), b = widen(*in[1]), c(static_cast<size_t>(out.numel()));
  KILN_RETURN_IF_ERROR(batchedGemm<float>(op, ir::DType::f32, d, a.data(), b.data(), c.data(), ctx));
  uint16_t* o = out.as<uint16_t>();
  ctx.pool->parallelFor(out.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) o[i] = ir::floatToBf16(c[static_cast<size_t>(i)]);
  });
  return Status::ok();
}

Status runMatmul(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                 const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  auto d = matmulDims(op, *in[0], *in[1]);
  if (!d) return d.status();
  std::vector<int64_t> shape = d->batch;
  shape.push_back(d->m);
  shape.push_back(d->n);
  out[0]->shape = shape;
  switch (out[0]->dtype) {
    case ir::DType::f32:
      return batchedGemm<float>(op, ir::DType::f32, *d, in[0]->as<float>(), in[1]->as<float>(), out[0]->as<float>(),
                                ctx);
    case ir::DType::f64:
      return batchedGemm<double>(op, ir::DType::f64, *d, in[0]->as<double>(), in[1]->as<double>(),
                                 out[0]->as<double>(), ctx);
    case ir::DType::bf16:
      if (ctx.batch_invariant) return invariantBf16(op, *d, in, *out[0], ctx);
      return batchedGemm<uint16_t>(op, ir::DType::bf16, *d, in[0]->as<uint16_t>(), in[1]->as<uint16_t>(),
                                   out[0]->as<uint16_t>(), ctx);
    default:
      return Status::errorf("'kiln.matmul': no CPU GEMM for {}", ir::dtypeName(out[0]->dtype));
  }
}

bool supportsMatmul(const ir::Op& op) {
  ir::DType t = op.result()->type().dtype();
  return (t == ir::DType::f32 || t == ir::DType::f64 || t == ir::DType::bf16) &&
         op.operand(0)->type().dtype() == t && op.operand(1)->type().dtype() == t;
}

}  // namespace

bool matmulTakesEpilogue(const ir::Op& op) {
  if (!supportsMatmul(op) || op.result()->type().dtype() == ir::DType::f64 || op.boolAttr("transpose_a"))
    return false;
  // One product: b unbatched, so a's batch folds into M.
  return op.operand(1)->type().rank() == 2;
}

Status runMatmulEpilogue(const ir::Op& op, const ir::TensorView& a, const ir::TensorView& b,
                         const MatmulEpilogue& e, ir::TensorView& y, const KernelContext& ctx) {
  auto d = matmulDims(op, a, b);
  if (!d) return d.status();
  if (!d->b_batch.empty() || op.boolAttr("transpose_a"))
    return Status::errorf("internal error: '{}' with an epilogue must fold its batch into M", op.name());
  int64_t rows = d->m;
  for (int64_t x : d->batch) rows *= x;
  if (e.bias && e.bias->numel() != d->n)
    return Status::errorf("'{}': the fused bias has {} elements for {} columns", op.name(), e.bias->numel(), d->n);
  std::vector<int64_t> shape = d->batch;
  shape.push_back(d->m);
  shape.push_back(d->n);
  y.shape = shape;
  GemmDesc g = GemmDesc::plain(a.dtype, false, op.boolAttr("transpose_b"), rows, d->n, d->k);
  g.c = y.dtype;
  g.bias = e.bias != nullptr;
  g.act = e.act;
  return gemm(g, {a.data, b.data, y.data, e.bias ? e.bias->data : nullptr, nullptr}, ctx.pool);
}

void registerMatmulKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::Matmul, {"onednn_matmul", runMatmul, supportsMatmul});
}

}  // namespace kiln::runtime::cpu
