// Reductions (sum, mean, max over axes) over f32 and bf16 storage with f32 accumulation.
// Kept and reduced dims collapse to [outer, reduced, inner] when the reduced axes are adjacent
// (the common cases: a row reduction, a column reduction such as a bias gradient); that form is
// threaded over outer rows or inner columns. Other axis sets take a general strided walk.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

enum class Kind { Sum, Mean, Max };

// The combiners of ir/scalar_fn.def: sum and mean fold with Sum, max with Max.
inline float combine(Kind k, float acc, float v) {
  return k == Kind::Max ? ir::scalar::fold<ir::Combiner::Max>(acc, v) : ir::scalar::fold<ir::Combiner::Sum>(acc, v);
}
inline float initial(Kind k) { return ir::scalar::identity<float>(k == Kind::Max ? ir::Combiner::Max : ir::Combiner::Sum); }

Status runReduce(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                 const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  ir::TensorView& y = *out[0];
  const int64_t rank = x.rank();
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + rank : a);
  const std::string kind_name = op.strAttr("kind");
  const Kind kind = kind_name == "max" ? Kind::Max : kind_name == "mean" ? Kind::Mean : Kind::Sum;
  const bool keep = op.boolAttr("keepdims");

  std::vector<int64_t> shape;
  int64_t reduced_count = 1;
  for (int64_t i = 0; i < rank; ++i) {
    int64_t d = x.shape[static_cast<size_t>(i)];
    if (axes.count(i)) {
      reduced_count *= d;
      if (keep) shape.push_back(1);
    } else {
      shape.push_back(d);
    }
  }
  y.shape = shape;
  const float scale = kind == Kind::Mean ? 1.0f / static_cast<float>(reduced_count) : 1.0f;
  const ir::DType xt = x.dtype, yt = y.dtype;

  // Runs of kept / reduced dims, size-1 dims ignored.
  std::vector<std::pair<int64_t, bool>> runs;
  for (int64_t i = 0; i < rank; ++i) {
    int64_t d = x.shape[static_cast<size_t>(i)];
    if (d == 1) continue;
    bool red = axes.count(i) > 0;
    if (!runs.empty() && runs.back().second == red) runs.back().first *= d;
    else runs.push_back({d, red});
  }
  int reduced_runs = 0;
  for (auto& r : runs) reduced_runs += r.second;

  if (reduced_runs <= 1 && x.numel() > 0) {
    int64_t outer = 1, red = 1, inner = 1;
    bool seen = false;
    for (auto& [d, is_red] : runs) {
      if (is_red) red = d, seen = true;
      else (seen ? inner : outer) *= d;
    }
    if (inner == 1) {
      // Each output reduces one contiguous row.
      ctx.pool->parallelFor(outer, std::max<int64_t>(1, 16384 / std::max<int64_t>(red, 1)), [&](int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; ++o) {
          float acc = initial(kind);
          const int64_t base = o * red;
          for (int64_t r = 0; r < red; ++r) acc = combine(kind, acc, loadF(x.data, xt, base + r));
          storeF(y.data, yt, o, acc * scale);
        }
      });
    } else {
      // out[o, i] = reduce_r x[o, r, i]: walk r outside so the inner loop is contiguous.
      ctx.pool->parallelFor(outer * inner, 1024, [&](int64_t c0, int64_t c1) {
        std::vector<float> acc;
        for (int64_t c = c0; c < c1;) {
          int64_t o = c / inner, i0 = c % inner, i1 = std::min(inner, i0 + (c1 - c));
          acc.assign(static_cast<size_t>(i1 - i0), initial(kind));
          for (int64_t r = 0; r < red; ++r) {
            const int64_t base = (o * red + r) * inner;
            for (int64_t i = i0; i < i1; ++i)
              acc[static_cast<size_t>(i - i0)] = combine(kind, acc[static_cast<size_t>(i - i0)], loadF(x.data, xt, base + i));
          }
          for (int64_t i = i0; i < i1; ++i) storeF(y.data, yt, o * inner + i, acc[static_cast<size_t>(i - i0)] * scale);
          c += i1 - i0;
        }
      });
    }
    return Status::ok();
  }

  // General case: walk the input in order, accumulating into the output through strides that
  // are zero on reduced axes.
  const int64_t ny = y.numel();
  std::vector<float> acc(static_cast<size_t>(ny), initial(kind));
  std::vector<int64_t> ostride(static_cast<size_t>(rank), 0);
  for (int64_t i = rank - 1, s = 1; i >= 0; --i) {
    if (axes.count(i)) continue;
    ostride[static_cast<size_t>(i)] = s;
    s *= x.shape[static_cast<size_t>(i)];
  }
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  int64_t o = 0;
  for (int64_t e = 0, n = x.numel(); e < n; ++e) {
    acc[static_cast<size_t>(o)] = combine(kind, acc[static_cast<size_t>(o)], loadF(x.data, xt, e));
    for (int64_t d = rank - 1; d >= 0; --d) {
      auto du = static_cast<size_t>(d);
      o += ostride[du];
      if (++idx[du] < x.shape[du]) break;
      o -= ostride[du] * idx[du];
      idx[du] = 0;
    }
  }
  for (int64_t i = 0; i < ny; ++i) storeF(y.data, yt, i, acc[static_cast<size_t>(i)] * scale);
  return Status::ok();
}

bool supportsReduce(const ir::Op& op) {
  ir::DType t = op.result()->type().dtype();
  return isF32OrBf16(t) && op.operand(0)->type().dtype() == t;
}

// sum_to over the leading dims (a bias gradient: [B, N] -> [N]): each column summed over the
// rows in order, in double as the reference does, so the bits equal the reference's whatever
// the thread count; threaded over blocks of columns, each row's block read contiguously.
Status runSumToLeading(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                       const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  ir::TensorView& y = *out[0];
  const ir::TensorType& t = op.result()->type();
  const size_t lead = x.shape.size() - static_cast<size_t>(t.rank());
  y.shape.assign(x.shape.begin() + static_cast<int64_t>(lead), x.shape.end());
  for (int64_t i = 0; i < t.rank(); ++i)
    if (const ir::Dim& d = t.dim(i); d.isStatic() && d.size() == 1 && y.shape[static_cast<size_t>(i)] != 1)
      return Status::errorf("'{}': dim {} of the result is 1 but the operand's is {}", op.name(), i,
                            y.shape[static_cast<size_t>(i)]);
  int64_t rows = 1, cols = 1;
  for (size_t i = 0; i < x.shape.size(); ++i) (i < lead ? rows : cols) *= x.shape[i];
  const ir::DType xt = x.dtype;
  constexpr int64_t kBlock = 256;
  ctx.pool->parallelFor((cols + kBlock - 1) / kBlock, std::max<int64_t>(1, 65536 / std::max<int64_t>(rows * kBlock, 1)),
                        [&](int64_t b0, int64_t b1) {
                          double acc[kBlock];
                          for (int64_t b = b0; b < b1; ++b) {
                            const int64_t c0 = b * kBlock, n = std::min(kBlock, cols - c0);
                            std::fill(acc, acc + n, 0.0);
                            for (int64_t r = 0; r < rows; ++r) {
                              const int64_t base = r * cols + c0;
                              if (xt == ir::DType::f32) {
                                const float* px = x.as<float>() + base;
                                for (int64_t j = 0; j < n; ++j) acc[j] += px[j];
                              } else {
                                for (int64_t j = 0; j < n; ++j) acc[j] += loadF(x.data, xt, base + j);
                              }
                            }
                            for (int64_t j = 0; j < n; ++j) storeF(y.data, y.dtype, c0 + j, static_cast<float>(acc[j]));
                          }
                        });
  return Status::ok();
}

// The leading-dims form: the result's dims are the operand's trailing dims (size-1 dims of the
// result must stay 1 in the operand; the kernel checks that at run time).
bool supportsSumToLeading(const ir::Op& op) {
  const ir::DType t = op.result()->type().dtype();
  if (!isF32OrBf16(t) || op.operand(0)->type().dtype() != t) return false;
  const ir::TensorType& x = op.operand(0)->type();
  const ir::TensorType& r = op.result()->type();
  if (r.rank() > x.rank()) return false;
  const int64_t lead = x.rank() - r.rank();
  for (int64_t i = 0; i < r.rank(); ++i) {
    const ir::Dim& rd = r.dim(i);
    const ir::Dim& xd = x.dim(lead + i);
    if (rd.isStatic() && rd.size() == 1 && !(xd.isStatic() && xd.size() == 1)) return false;
  }
  return true;
}

}  // namespace

void registerReduceKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::Reduce, {"reduce", runReduce, supportsReduce});
  addKernel(t, ir::OpCode::SumTo, {"sum_to_leading", runSumToLeading, supportsSumToLeading});
}

}  // namespace kiln::runtime::cpu
