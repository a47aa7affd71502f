// Matrix products through the CPU BLAS (OpenBLAS from Debian, or any CBLAS): f32 by sgemm,
// f64 by dgemm, bf16 storage by f32 sgemm over converted copies. Batch dims broadcast; when
// only `a` is batched and not transposed, the batch folds into M for one large GEMM. With
// KernelContext::batch_invariant f32 products go through invariant_gemm.h instead.
#include <cblas.h>

#include <algorithm>
#include <vector>

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

template <typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c, const KernelContext& ctx) {
  if constexpr (std::is_same_v<T, float>) {
    if (ctx.batch_invariant) return invariantSgemm(ta, tb, m, n, k, a, b, c, *ctx.pool);
  }
  auto tra = ta ? CblasTrans : CblasNoTrans, trb = tb ? CblasTrans : CblasNoTrans;
  int lda = static_cast<int>(ta ? m : k), ldb = static_cast<int>(tb ? k : n), ldc = static_cast<int>(n);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(c, c + m * n, T(0));
    return;
  }
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, tra, trb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a, lda,
                b, ldb, 0.0f, c, ldc);
  else
    cblas_dgemm(CblasRowMajor, tra, trb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0, a, lda,
                b, ldb, 0.0, c, ldc);
}

template <typename T>
void batchedGemm(const ir::Op& op, const MatmulDims& d, const T* a, const T* b, T* c, const KernelContext& ctx) {
  bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  int64_t nbatch = 1;
  for (int64_t x : d.batch) nbatch *= x;
  int64_t b_count = 1;
  for (int64_t x : d.b_batch) b_count *= x;
  if (!ta && b_count == 1) {  // fold a's batch into M: one GEMM
    gemm<T>(false, tb, nbatch * d.m, d.n, d.k, a, b, c, ctx);
    return;
  }
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
      gemm<T>(ta, tb, d.m, d.n, d.k, a + ia * d.m * d.k, b + ib * d.k * d.n, c + idx * d.m * d.n, ctx);
    }
  }
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
      batchedGemm<float>(op, *d, in[0]->as<float>(), in[1]->as<float>(), out[0]->as<float>(), ctx);
      break;
    case ir::DType::f64:
      batchedGemm<double>(op, *d, in[0]->as<double>(), in[1]->as<double>(), out[0]->as<double>(), ctx);
      break;
    case ir::DType::bf16: {
      // bf16 storage, f32 compute: widen, multiply, round once.
      auto widen = [&](const ir::TensorView& v) {
        std::vector<float> f(static_cast<size_t>(v.numel()));
        const uint16_t* p = v.as<uint16_t>();
        ctx.pool->parallelFor(v.numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) f[static_cast<size_t>(i)] = ir::bf16ToFloat(p[i]);
        });
        return f;
      };
      std::vector<float> a = widen(*in[0]), b = widen(*in[1]), c(static_cast<size_t>(out[0]->numel()));
      batchedGemm<float>(op, *d, a.data(), b.data(), c.data(), ctx);
      uint16_t* o = out[0]->as<uint16_t>();
      ctx.pool->parallelFor(out[0]->numel(), 1 << 15, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) o[i] = ir::floatToBf16(c[static_cast<size_t>(i)]);
      });
      break;
    }
    default:
      return Status::errorf("'kiln.matmul': no BLAS kernel for {}", ir::dtypeName(out[0]->dtype));
  }
  return Status::ok();
}

bool supportsMatmul(const ir::Op& op) {
  ir::DType t = op.result()->type().dtype();
  return (t == ir::DType::f32 || t == ir::DType::f64 || t == ir::DType::bf16) &&
         op.operand(0)->type().dtype() == t && op.operand(1)->type().dtype() == t;
}

}  // namespace

void registerMatmulKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::Matmul, {"blas_matmul", runMatmul, supportsMatmul});
}

}  // namespace kiln::runtime::cpu
