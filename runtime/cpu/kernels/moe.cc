// The Mixture-of-Experts kernels (docs/moe.md, "Experts"): the grouped GEMMs through oneDNN
// (gemm.h), one GEMM per expert over its rows, and the token permutes threaded over rows or tokens. Activations
// are f32 or bf16 (f32 compute, one rounding at the end), the GEMMs also take f64; probs are f32.
// rows and offsets are checked before any thread starts, with the reference's errors.
#include <algorithm>
#include <mutex>
#include <type_traits>
#include <vector>

#include "runtime/cpu/gemm.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

using Operands = std::vector<const ir::TensorView*>;
using Results = std::vector<ir::TensorView*>;

inline int64_t loadIndex(const ir::TensorView& v, int64_t i) { return v.as<int32_t>()[i]; }

// f32 or bf16 storage (uint16_t), computed in f32.
template <typename S>
inline float ld(const S* p, int64_t i) {
  if constexpr (std::is_same_v<S, uint16_t>)
    return ir::bf16ToFloat(p[i]);
  else
    return p[i];
}
template <typename S>
inline void st(S* p, int64_t i, float v) {
  if constexpr (std::is_same_v<S, uint16_t>)
    p[i] = ir::floatToBf16(v);
  else
    p[i] = v;
}

// Calls fn(S{}) with the storage type of an f32 or bf16 activation.
template <typename Fn>
void visitActivation(ir::DType t, Fn&& fn) {
  if (t == ir::DType::bf16)
    fn(uint16_t{});
  else
    fn(float{});
}

// ---- Checks -----------------------------------------------------------------------------------

// The row holding each of the `slots` slots (-1: dropped), checking that every row's slot lies in
// [0, slots) or is padding (< 0) and that no slot is held twice.
Expected<std::vector<int32_t>> rowOfSlot(const ir::Op& op, const ir::TensorView& rows, int64_t slots) {
  std::vector<int32_t> holder(static_cast<size_t>(slots), -1);
  for (int64_t r = 0; r < rows.shape[0]; ++r) {
    const int64_t s = loadIndex(rows, r);
    if (s < 0) continue;
    if (s >= slots)
      return Status::errorf("'{}': rows[{}] = {} lies outside the {} slots [0, N*k)", op.name(), r, s, slots);
    int32_t& h = holder[static_cast<size_t>(s)];
    if (h >= 0) return Status::errorf("'{}': slot {} is held by rows {} and {}", op.name(), s, h, r);
    h = static_cast<int32_t>(r);
  }
  return holder;
}

Status checkTokens(const ir::Op& op, const ir::TensorView& probs, int64_t tokens) {
  if (probs.shape[0] != tokens)
    return Status::errorf("'{}': probs [{}, {}] for {} tokens", op.name(), probs.shape[0], probs.shape[1],
                          tokens);
  return Status::ok();
}

// Expert e's rows [offsets[e], offsets[e + 1]), checked to rise from 0 to the row count.
Expected<std::vector<int64_t>> expertOffsets(const ir::Op& op, const ir::TensorView& offsets, int64_t rows) {
  std::vector<int64_t> o(static_cast<size_t>(offsets.shape[0]));
  for (size_t e = 0; e < o.size(); ++e) o[e] = loadIndex(offsets, static_cast<int64_t>(e));
  if (o[0] != 0) return Status::errorf("'{}': offsets[0] = {}, want 0", op.name(), o[0]);
  for (size_t e = 0; e + 1 < o.size(); ++e) {
    if (o[e + 1] < o[e])
      return Status::errorf("'{}': offsets decrease at expert {} ({} > {})", op.name(), e, o[e], o[e + 1]);
    if (o[e + 1] > rows)
      return Status::errorf("'{}': offsets[{}] = {} lies beyond the {} rows", op.name(), e + 1, o[e + 1],
                            rows);
  }
  if (o.back() != rows)
    return Status::errorf("'{}': offsets[{}] = {} but there are {} rows", op.name(), o.size() - 1, o.back(),
                          rows);
  return o;
}

// ---- Permutes ---------------------------------------------------------------------------------

// Rows per chunk for row-wise work of `width` elements a row: about 4K elements a chunk.
int64_t rowGrain(int64_t width) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)); }

// y[r] = x[rows[r] / k] (* probs[rows[r]]); each thread writes its own rows.
Status runPermute(const ir::Op& op, const Operands& in, const Results& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  const ir::TensorView& rows = *in[1];
  const ir::TensorView& probs = *in[2];
  const int64_t tokens = x.shape[0], width = x.shape[1], k = probs.shape[1], count = rows.shape[0];
  KILN_RETURN_IF_ERROR(checkTokens(op, probs, tokens));
  auto checked = rowOfSlot(op, rows, tokens * k);
  if (!checked) return checked.status();
  out[0]->shape = {count, width};
  const bool apply = op.boolAttr("apply_probs", op.is(ir::OpCode::MoeUnpermute));
  const float* p = probs.as<float>();
  visitActivation(x.dtype, [&](auto tag) {
    using S = decltype(tag);
    const S* px = x.as<S>();
    S* py = out[0]->as<S>();
    ctx.pool->parallelFor(count, rowGrain(width), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s = loadIndex(rows, r);
        const float scale = s < 0 ? 0.0f : apply ? p[s] : 1.0f;
        const S* src = px + (s < 0 ? 0 : s / k) * width;
        S* dst = py + r * width;
        for (int64_t h = 0; h < width; ++h) st(dst, h, s < 0 ? 0.0f : scale * ld(src, h));
      }
    });
  });
  return Status::ok();
}

// out[n] = sum_j (probs[n, j] *) y[row of slot n*k + j]: each token gathers its own slots through
// the inverse map, so no two threads write one row.
Status runUnpermute(const ir::Op& op, const Operands& in, const Results& out, const KernelContext& ctx) {
  const ir::TensorView& y = *in[0];
  const ir::TensorView& rows = *in[1];
  const ir::TensorView& probs = *in[2];
  const int64_t count = y.shape[0], width = y.shape[1], tokens = probs.shape[0], k = probs.shape[1];
  if (rows.shape[0] != count)
    return Status::errorf("'{}': {} rows of y but {} row slots", op.name(), count, rows.shape[0]);
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> row_of, rowOfSlot(op, rows, tokens * k));
  out[0]->shape = {tokens, width};
  const bool apply = op.boolAttr("apply_probs", op.is(ir::OpCode::MoeUnpermute));
  const float* p = probs.as<float>();
  visitActivation(y.dtype, [&](auto tag) {
    using S = decltype(tag);
    const S* py = y.as<S>();
    S* po = out[0]->as<S>();
    ctx.pool->parallelFor(tokens, rowGrain(width * k), [&](int64_t n0, int64_t n1) {
      std::vector<float> acc(static_cast<size_t>(width));
      for (int64_t n = n0; n < n1; ++n) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = n * k; s < (n + 1) * k; ++s) {
          const int32_t r = row_of[static_cast<size_t>(s)];
          if (r < 0) continue;
          const float scale = apply ? p[s] : 1.0f;
          const S* src = py + r * width;
          for (int64_t h = 0; h < width; ++h) acc[static_cast<size_t>(h)] += scale * ld(src, h);
        }
        for (int64_t h = 0; h < width; ++h) st(po + n * width, h, acc[static_cast<size_t>(h)]);
      }
    });
  });
  return Status::ok();
}

// out[s] = dot(a[row of s], b[s / k]), 0 for dropped slots; threaded over tokens.
Status runRowDot(const ir::Op& op, const Operands& in, const Results& out, const KernelContext& ctx) {
  const ir::TensorView& a = *in[0];
  const ir::TensorView& rows = *in[1];
  const ir::TensorView& b = *in[2];
  const int64_t count = a.shape[0], width = a.shape[1], tokens = b.shape[0], k = in[3]->shape[1];
  if (rows.shape[0] != count)
    return Status::errorf("'{}': {} rows of a but {} row slots", op.name(), count, rows.shape[0]);
  KILN_RETURN_IF_ERROR(checkTokens(op, *in[3], tokens));
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> row_of, rowOfSlot(op, rows, tokens * k));
  out[0]->shape = {tokens, k};
  float* po = out[0]->as<float>();
  visitActivation(a.dtype, [&](auto tag) {
    using S = decltype(tag);
    const S* pa = a.as<S>();
    const S* pb = b.as<S>();
    ctx.pool->parallelFor(tokens, rowGrain(width * k), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t s = n * k; s < (n + 1) * k; ++s) {
          const int32_t r = row_of[static_cast<size_t>(s)];
          float dot = 0;
          if (r >= 0)
            for (int64_t h = 0; h < width; ++h) dot += ld(pa + r * width, h) * ld(pb + n * width, h);
          po[s] = dot;
        }
    });
  });
  return Status::ok();
}

// ---- Grouped GEMMs ----------------------------------------------------------------------------

// One expert's product over row-major operands of `storage` type, packed strides; a and b
// count elements from the tensors' starts. f32 and bf16 through oneDNN (gemm.h), f64 by loops.
Status expertGemm(ir::DType storage, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a,
                  int64_t a_at, const void* b, int64_t b_at, void* c, int64_t c_at, ThreadPool* pool) {
  const int64_t size = ir::dtypeBytes(storage);
  auto at = [&](const void* p, int64_t i) { return static_cast<const char*>(p) + i * size; };
  if (storage == ir::DType::f64) {
    gemmF64(ta, tb, m, n, k, reinterpret_cast<const double*>(at(a, a_at)),
            reinterpret_cast<const double*>(at(b, b_at)), reinterpret_cast<double*>(const_cast<char*>(at(c, c_at))));
    return Status::ok();
  }
  return gemm(GemmDesc::plain(storage, ta, tb, m, n, k), {at(a, a_at), at(b, b_at), const_cast<char*>(at(c, c_at))},
              pool);
}

// Runs gemm_of(e, pool) for every expert: spread over the pool, each product on one thread (no
// pool), when at least as many experts have rows as there are threads; otherwise one after
// another, each product split over the pool.
template <typename Fn>
Status forEachExpert(const std::vector<int64_t>& offsets, const KernelContext& ctx, Fn&& gemm_of) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  const int threads = ctx.pool->numThreads();
  int64_t busy = 0;
  for (int64_t e = 0; e < experts; ++e)
    busy += offsets[static_cast<size_t>(e) + 1] > offsets[static_cast<size_t>(e)];
  if (threads == 1 || busy < threads) {
    for (int64_t e = 0; e < experts; ++e) KILN_RETURN_IF_ERROR(gemm_of(e, ctx.pool));
    return Status::ok();
  }
  std::mutex mu;
  Status first = Status::ok();
  ctx.pool->parallelFor(experts, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e)
      if (Status s = gemm_of(e, nullptr); !s.isOk()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.isOk()) first = s;
      }
  });
  return first;
}

// y[rows of e] = x[rows of e] w[e] (w[e]^T with transpose_b).
Status groupedMatmul(const ir::Op& op, const Operands& in, const Results& out, const std::vector<int64_t>& offsets,
                     const KernelContext& ctx) {
  const bool tb = op.boolAttr("transpose_b");
  const int64_t k = in[0]->shape[1], m = in[1]->shape[tb ? 1 : 2];
  const ir::DType t = out[0]->dtype;
  return forEachExpert(offsets, ctx, [&](int64_t e, ThreadPool* pool) {
    const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e) + 1] - r0;
    return expertGemm(t, false, tb, rows, m, k, in[0]->data, r0 * k, in[1]->data, e * k * m, out[0]->data, r0 * m,
                      pool);
  });
}

// dw[e] = x_e^T dy_e (dy_e^T x_e with transpose); an expert without rows gets zeros.
Status groupedWgrad(const ir::Op& op, const Operands& in, const Results& out, const std::vector<int64_t>& offsets,
                    const KernelContext& ctx) {
  const bool t = op.boolAttr("transpose");
  const int64_t k = in[0]->shape[1], m = in[1]->shape[1];
  const ir::DType dt = out[0]->dtype;
  return forEachExpert(offsets, ctx, [&](int64_t e, ThreadPool* pool) {
    const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e) + 1] - r0;
    if (t)
      return expertGemm(dt, true, false, m, k, rows, in[1]->data, r0 * m, in[0]->data, r0 * k, out[0]->data,
                        e * k * m, pool);
    return expertGemm(dt, true, false, k, m, rows, in[0]->data, r0 * k, in[1]->data, r0 * m, out[0]->data,
                      e * k * m, pool);
  });
}

Status runGroupedMatmul(const ir::Op& op, const Operands& in, const Results& out, const KernelContext& ctx) {
  const bool tb = op.boolAttr("transpose_b");
  const int64_t count = in[0]->shape[0], k = in[0]->shape[1];
  if (in[1]->shape[tb ? 2 : 1] != k || in[1]->shape[0] != in[2]->shape[0] - 1)
    return Status::errorf("'{}': run-time shapes of x, w and offsets disagree", op.name());
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, expertOffsets(op, *in[2], count));
  out[0]->shape = {count, in[1]->shape[tb ? 1 : 2]};
  return groupedMatmul(op, in, out, offsets, ctx);
}

Status runGroupedWgrad(const ir::Op& op, const Operands& in, const Results& out, const KernelContext& ctx) {
  const bool t = op.boolAttr("transpose");
  const int64_t count = in[0]->shape[0], k = in[0]->shape[1], m = in[1]->shape[1];
  if (in[1]->shape[0] != count)
    return Status::errorf("'{}': x has {} rows but dy has {}", op.name(), count, in[1]->shape[0]);
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> offsets, expertOffsets(op, *in[2], count));
  out[0]->shape = {static_cast<int64_t>(offsets.size()) - 1, t ? m : k, t ? k : m};
  return groupedWgrad(op, in, out, offsets, ctx);
}

// ---- Support ----------------------------------------------------------------------------------

bool gemmType(ir::DType t) { return t == ir::DType::f32 || t == ir::DType::f64 || t == ir::DType::bf16; }

bool supportsGroupedGemm(const ir::Op& op) {
  const ir::DType t = op.result()->type().dtype();
  return gemmType(t) && op.operand(0)->type().dtype() == t && op.operand(1)->type().dtype() == t;
}

// Activations f32 or bf16, probs (or the result of row_dot) f32.
bool supportsPermute(const ir::Op& op) {
  const ir::DType t = op.operand(0)->type().dtype();
  const unsigned probs = op.is(ir::OpCode::MoeRowDot) ? 3 : 2;
  return isF32OrBf16(t) && op.operand(probs)->type().dtype() == ir::DType::f32 &&
         (!op.is(ir::OpCode::MoeRowDot) || op.operand(2)->type().dtype() == t);
}

}  // namespace

void registerMoeKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::GroupedMatmul, {"onednn_grouped_matmul", runGroupedMatmul, supportsGroupedGemm});
  addKernel(t, ir::OpCode::GroupedMatmulWgrad,
            {"onednn_grouped_matmul_wgrad", runGroupedWgrad, supportsGroupedGemm});
  addKernel(t, ir::OpCode::MoePermute, {"moe_permute", runPermute, supportsPermute});
  addKernel(t, ir::OpCode::MoeUnpermute, {"moe_unpermute", runUnpermute, supportsPermute});
  addKernel(t, ir::OpCode::MoeRowDot, {"moe_row_dot", runRowDot, supportsPermute});
}

}  // namespace kiln::runtime::cpu
