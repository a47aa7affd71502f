// The sparse embedding update (kiln.embedding_bag_update, math in ir/ops/optimizer.cc),
// threaded over touched rows. Occurrences are grouped by row in O(ids) with a hash map and a
// counting pass that keeps each row's occurrences in id order, so every row's combined
// gradient sums in the same order whatever the thread count. Distinct rows (and their state)
// are disjoint memory, which is what makes the row loop safe to split across threads.
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>

#include "ir/optimizer.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

inline int64_t loadIndex(const ir::TensorView& v, int64_t i) {
  return v.dtype == ir::DType::i32 ? v.as<int32_t>()[i] : v.as<int64_t>()[i];
}
inline double loadScalar(const ir::TensorView& v) { return v.dtype == ir::DType::f64 ? *v.as<double>() : loadF(v.data, v.dtype, 0); }

struct Occurrences {
  std::vector<int64_t> rows;       // touched rows, in order of first appearance
  std::vector<int64_t> begin;      // group k: order[begin[k] .. begin[k + 1])
  std::vector<int64_t> order;      // id positions grouped by row, ascending within a group
  std::vector<int64_t> sample;     // per id position
  std::vector<double> coeff;       // per id position: weight, times 1/length for mean pooling
};

Status groupOccurrences(const ir::Op& op, const ir::EmbeddingUpdateLayout& l, const std::vector<const ir::TensorView*>& in,
                        int64_t num_rows, Occurrences& occ) {
  const ir::TensorView& ids = *in[static_cast<size_t>(l.ids)];
  const int64_t n = ids.numel();
  auto samples = ir::idSamples(op, l, in);
  if (!samples) return samples.status();
  occ.sample = std::move(samples->sample);
  occ.coeff = std::move(samples->coeff);
  if (l.weights >= 0) {
    const ir::TensorView& w = *in[static_cast<size_t>(l.weights)];
    for (int64_t pos = 0; pos < n; ++pos) occ.coeff[static_cast<size_t>(pos)] *= loadF(w.data, w.dtype, pos);
  }
  std::unordered_map<int64_t, int64_t> group_of;
  group_of.reserve(static_cast<size_t>(n));
  std::vector<int64_t> group(static_cast<size_t>(n));
  for (int64_t pos = 0; pos < n; ++pos) {
    int64_t row = loadIndex(ids, pos);
    if (row < 0 || row >= num_rows)
      return Status::errorf("embedding table '{}': id {} at position {} is out of range [0, {})",
                            op.strAttr("table", "?"), row, pos, num_rows);
    auto [it, fresh] = group_of.try_emplace(row, static_cast<int64_t>(occ.rows.size()));
    if (fresh) occ.rows.push_back(row);
    group[static_cast<size_t>(pos)] = it->second;
  }
  // Counting sort by group, stable in position.
  occ.begin.assign(occ.rows.size() + 1, 0);
  for (int64_t g : group) ++occ.begin[static_cast<size_t>(g) + 1];
  for (size_t k = 1; k < occ.begin.size(); ++k) occ.begin[k] += occ.begin[k - 1];
  std::vector<int64_t> fill(occ.begin.begin(), occ.begin.end() - 1);
  occ.order.resize(static_cast<size_t>(n));
  for (int64_t pos = 0; pos < n; ++pos) occ.order[static_cast<size_t>(fill[static_cast<size_t>(group[static_cast<size_t>(pos)])]++)] = pos;
  return Status::ok();
}

enum class Kind { kSgd, kAdagrad, kRowwiseAdagrad, kAdam };

struct Hyper {
  Kind kind = Kind::kSgd;
  double lr = 0, eps = 1e-8, beta1 = 0.9, beta2 = 0.999, weight_decay = 0, scale = 1, bias1 = 1, bias2 = 1;
};

// g[0, n) += c * src[0, n), in double; typed so that the f32 loop vectorizes.
inline void accumulateRow(double* g, double c, const ir::TensorView& src, int64_t base, int64_t n) {
  if (src.dtype == ir::DType::f32) {
    const float* p = src.as<float>() + base;
    for (int64_t d = 0; d < n; ++d) g[d] += c * static_cast<double>(p[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) g[d] += c * static_cast<double>(loadF(src.data, src.dtype, base + d));
  }
}

// grad_out rows are `width` wide; the table's `dim` columns are [offset, offset + dim) of them (a
// column shard), and rowwise_adagrad's statistic spans the whole row.
void updateRows(const Hyper& h, const Occurrences& occ, int64_t k0, int64_t k1,
                const ir::TensorView& grad_out, int64_t dim, int64_t offset, float* table, float* s0,
                float* s1) {
  const int64_t width = grad_out.shape[1];
  std::vector<double> g(static_cast<size_t>(dim));
  for (int64_t k = k0; k < k1; ++k) {
    std::fill(g.begin(), g.end(), 0.0);
    double whole_sq = 0;
    for (int64_t i = occ.begin[static_cast<size_t>(k)]; i < occ.begin[static_cast<size_t>(k) + 1]; ++i) {
      int64_t pos = occ.order[static_cast<size_t>(i)];
      double c = occ.coeff[static_cast<size_t>(pos)] * h.scale;
      accumulateRow(g.data(), c, grad_out, occ.sample[static_cast<size_t>(pos)] * width + offset, dim);
    }
    if (width != dim && h.kind == Kind::kRowwiseAdagrad) {
      // The row's other columns, summed in the same order as the reference's.
      std::vector<double> row(static_cast<size_t>(width), 0.0);
      for (int64_t i = occ.begin[static_cast<size_t>(k)]; i < occ.begin[static_cast<size_t>(k) + 1]; ++i) {
        int64_t pos = occ.order[static_cast<size_t>(i)];
        double c = occ.coeff[static_cast<size_t>(pos)] * h.scale;
        accumulateRow(row.data(), c, grad_out, occ.sample[static_cast<size_t>(pos)] * width, width);
      }
      for (double gd : row) whole_sq += gd * gd;
    }
    const int64_t r = occ.rows[static_cast<size_t>(k)];
    float* w = table + r * dim;
    for (int64_t d = 0; d < dim; ++d) g[static_cast<size_t>(d)] += h.weight_decay * static_cast<double>(w[d]);
    if (h.kind == Kind::kSgd) {
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<float>(w[d] - h.lr * g[static_cast<size_t>(d)]);
    } else if (h.kind == Kind::kAdagrad) {
      float* s = s0 + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        double gd = g[static_cast<size_t>(d)], sd = static_cast<double>(s[d]) + gd * gd;
        s[d] = static_cast<float>(sd);
        w[d] = static_cast<float>(w[d] - h.lr * gd / (std::sqrt(sd) + h.eps));
      }
    } else if (h.kind == Kind::kRowwiseAdagrad) {
      double sq = 0;
      for (double gd : g) sq += gd * gd;
      if (width != dim) sq = whole_sq;
      double s = static_cast<double>(s0[r]) + sq / static_cast<double>(width);
      s0[r] = static_cast<float>(s);
      double step = h.lr / (std::sqrt(s) + h.eps);
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<float>(w[d] - step * g[static_cast<size_t>(d)]);
    } else {  // lazy Adam: only touched rows and their moments move
      float *m = s0 + r * dim, *v = s1 + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        double gd = g[static_cast<size_t>(d)];
        double md = h.beta1 * static_cast<double>(m[d]) + (1 - h.beta1) * gd;
        double vd = h.beta2 * static_cast<double>(v[d]) + (1 - h.beta2) * gd * gd;
        m[d] = static_cast<float>(md);
        v[d] = static_cast<float>(vd);
        w[d] = static_cast<float>(w[d] - h.lr * (md / h.bias1) / (std::sqrt(vd / h.bias2) + h.eps));
      }
    }
  }
}

Status runEmbeddingUpdate(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                          const std::vector<ir::TensorView*>&, const KernelContext& ctx) {
  auto l = ir::embeddingUpdateLayout(op);
  if (!l) return Status::errorf("'{}': unknown optimizer '{}'", op.name(), op.strAttr("optimizer"));
  const ir::TensorView& table = *in[static_cast<size_t>(l->table)];
  const int64_t rows = table.shape[0], dim = table.shape[1];
  Occurrences occ;
  KILN_RETURN_IF_ERROR(groupOccurrences(op, *l, in, rows, occ));
  Hyper h;
  const std::string kind = op.strAttr("optimizer");
  if (kind == "sgd") h.kind = Kind::kSgd;
  else if (kind == "adagrad") h.kind = Kind::kAdagrad;
  else if (kind == "rowwise_adagrad") h.kind = Kind::kRowwiseAdagrad;
  else if (kind == "adam") h.kind = Kind::kAdam;
  else return Status::errorf("'{}': no CPU kernel for the optimizer '{}'", op.name(), kind);
  h.lr = op.floatAttr("lr") * loadScalar(*in[static_cast<size_t>(l->lr)]);
  h.scale = l->grad_scale >= 0 ? loadScalar(*in[static_cast<size_t>(l->grad_scale)]) : 1.0;
  h.eps = op.floatAttr("eps", 1e-8);
  h.beta1 = op.floatAttr("beta1", 0.9);
  h.beta2 = op.floatAttr("beta2", 0.999);
  h.weight_decay = op.floatAttr("weight_decay");
  if (h.kind == Kind::kAdam) {
    double step = loadScalar(*in[static_cast<size_t>(l->step)]);
    if (step < 1) return Status::errorf("'{}' (adam): step must be >= 1, got {}", op.name(), step);
    h.bias1 = 1 - std::pow(h.beta1, step);
    h.bias2 = 1 - std::pow(h.beta2, step);
  }
  // The table and state are parameters the op writes in place (kSideEffect).
  float* t = table.as<float>();
  float* s0 = l->num_state > 0 ? in[static_cast<size_t>(l->state_begin)]->as<float>() : nullptr;
  float* s1 = l->num_state > 1 ? in[static_cast<size_t>(l->state_begin) + 1]->as<float>() : nullptr;
  const ir::TensorView& grad_out = *in[static_cast<size_t>(l->grad_out)];
  ctx.pool->parallelFor(static_cast<int64_t>(occ.rows.size()),
                        std::max<int64_t>(1, 2048 / std::max<int64_t>(dim, 1)), [&](int64_t k0, int64_t k1) {
                          updateRows(h, occ, k0, k1, grad_out, dim, op.intAttr("column_offset", 0), t, s0,
                                     s1);
                        });
  return Status::ok();
}

bool supportsEmbeddingUpdate(const ir::Op& op) {
  auto l = ir::embeddingUpdateLayout(op);
  if (!l || static_cast<int>(op.numOperands()) != l->num_operands) return false;
  if (op.operand(static_cast<unsigned>(l->table))->type().dtype() != ir::DType::f32) return false;
  for (int i = 0; i < l->num_state; ++i)
    if (op.operand(static_cast<unsigned>(l->state_begin + i))->type().dtype() != ir::DType::f32) return false;
  return isF32OrBf16(op.operand(static_cast<unsigned>(l->grad_out))->type().dtype());
}

}  // namespace

void registerEmbeddingUpdateKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::EmbeddingBagUpdate,
            {"embedding_bag_update", runEmbeddingUpdate, supportsEmbeddingUpdate});
}

}  // namespace kiln::runtime::cpu
