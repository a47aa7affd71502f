// Top-k selection and Mixture-of-Experts routing: the contracts are docs/moe.md, sections
// "Generic selection", "Routing", "Balancing losses" and "Dispatch".
//   kiln.topk(x) {k, axis}                        the k largest along axis, values and i32 indices
//   kiln.take_along_axis(x, idx) {axis}           numpy's take_along_axis
//   kiln.scatter_along_axis(g, idx) {axis, size}  its adjoint: zeros with g added at idx
//   kiln.moe_router(logits, bias?)                -> (probs, experts), Megatron's top-k routing
//   kiln.moe_aux_loss(logits, experts, counts?)   load-balancing loss (per batch or per sequence);
//                                                 with counts (int[E], per batch only), f_i is
//                                                 counts_i / sum(counts): the global batch's
//                                                 load under expert parallelism
//   kiln.moe_z_loss(logits)                       router z-loss
//   kiln.moe_dispatch(experts, probs)             -> (rows, offsets, counts): slots in expert order
//   kiln.moe_expert_bias_update(bias, counts)     aux-loss-free balancing, in place
// and the backward ops of the router and the losses (moe_router_grad, moe_aux_loss_grad,
// moe_z_loss_grad). Routing arithmetic is f32 (f64 logits are accepted, for gradient checks);
// the references accumulate in double. Every top-k breaks ties toward the lower index.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

// Logits, probabilities and biases: f32, or f64 for reference computations.
bool isRoutingFloat(DType t) { return t == DType::f32 || t == DType::f64; }

Status expectRoutingFloat(const Op& op, const char* what, const TensorType& t) {
  if (!isRoutingFloat(t.dtype()))
    return Status::errorf("'{}' {} must be f32 (or f64), got {}", op.name(), what, t.str());
  return Status::ok();
}

// A [N, E] logits operand whose expert count E is static (the attributes are checked against it).
Status expectLogits(const Op& op, const TensorType& logits) {
  KILN_RETURN_IF_ERROR(expectRoutingFloat(op, "logits", logits));
  if (logits.rank() != 2 || !logits.dim(1).isStatic())
    return Status::errorf("'{}' logits must be [N, E] with a static expert count E, got {}", op.name(),
                          logits.str());
  return Status::ok();
}

int64_t expertCount(const Op& op) { return op.operand(0)->type().dim(1).size(); }

// An i32 [N, k] operand aligned with the logits' tokens.
Status expectSlots(const Op& op, const char* what, const TensorType& t, const Dim& tokens, int64_t k) {
  if (t.dtype() != DType::i32 || t.rank() != 2 || !(t.dim(0) == tokens) || !(t.dim(1) == Dim::fixed(k)))
    return Status::errorf("'{}' {} must be i32 [{}, {}], got {}", op.name(), what, tokens.str(), k, t.str());
  return Status::ok();
}

// ---- Generic selection: shapes ----------------------------------------------------------------

Status inferTopK(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  if (!isFloat(x.dtype()) || x.rank() < 1)
    return Status::errorf("'{}' needs a float operand of rank >= 1, got {}", op.name(), x.str());
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis", -1), x.rank()));
  const int64_t k = op.intAttr("k");
  const Dim& n = x.dim(axis);
  if (k < 1 || (n.isStatic() && k > n.size()))
    return Status::errorf("'{}' needs 1 <= k <= {} (the size of axis {}), got k = {}", op.name(), n.str(),
                          axis, k);
  Shape s = x.shape();
  s[static_cast<size_t>(axis)] = Dim::fixed(k);
  out = {TensorType(x.dtype(), s), TensorType(DType::i32, s)};
  return Status::ok();
}

// idx has x's rank and x's dims except along axis (take); or exactly g's dims (scatter).
Status checkAlongAxis(const Op& op, const TensorType& x, const TensorType& idx, int64_t axis,
                      bool same_axis) {
  if (!isInteger(idx.dtype()))
    return Status::errorf("'{}' indices must be i32 or i64, got {}", op.name(), idx.str());
  bool fits = idx.rank() == x.rank();
  for (int64_t i = 0; fits && i < x.rank(); ++i)
    if ((same_axis || i != axis) && !(x.dim(i) == idx.dim(i))) fits = false;
  if (!fits)
    return Status::errorf("'{}' indices {} must have the dims of {}{}", op.name(), idx.str(), x.str(),
                          same_axis ? "" : fmt::format(" except along axis {}", axis));
  return Status::ok();
}

Status inferTakeAlongAxis(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& idx = op.operand(1)->type();
  if (x.rank() < 1) return Status::errorf("'{}' needs an operand of rank >= 1, got {}", op.name(), x.str());
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis"), x.rank()));
  KILN_RETURN_IF_ERROR(checkAlongAxis(op, x, idx, axis, false));
  out = {TensorType(x.dtype(), idx.shape())};
  return Status::ok();
}

Status inferScatterAlongAxis(const Op& op, std::vector<TensorType>& out) {
  const TensorType& g = op.operand(0)->type();
  const TensorType& idx = op.operand(1)->type();
  if (!isFloat(g.dtype()) || g.rank() < 1)
    return Status::errorf("'{}' needs a float operand of rank >= 1, got {}", op.name(), g.str());
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis"), g.rank()));
  KILN_RETURN_IF_ERROR(checkAlongAxis(op, g, idx, axis, true));
  const int64_t size = op.intAttr("size");
  if (size < 0) return Status::errorf("'{}' needs size >= 0, got {}", op.name(), size);
  Shape s = g.shape();
  s[static_cast<size_t>(axis)] = Dim::fixed(size);
  out = {TensorType(g.dtype(), s)};
  return Status::ok();
}

// ---- Routing: shapes --------------------------------------------------------------------------

// The router's attributes against E: 1 <= k <= E, groups dividing E, group_topk groups each
// contributing k / group_topk experts.
Status verifyRouterAttrs(const Op& op) {
  KILN_RETURN_IF_ERROR(expectLogits(op, op.operand(0)->type()));
  const int64_t e = expertCount(op);
  const int64_t k = op.intAttr("topk");
  const int64_t groups = op.intAttr("groups", 1), group_topk = op.intAttr("group_topk", 1);
  if (k < 1 || k > e) return Status::errorf("'{}' needs 1 <= topk <= E = {}, got topk = {}", op.name(), e, k);
  if (groups < 1 || e % groups != 0)
    return Status::errorf("'{}' needs groups >= 1 dividing E = {}, got groups = {}", op.name(), e, groups);
  if (group_topk < 1 || group_topk > groups)
    return Status::errorf("'{}' needs 1 <= group_topk <= groups = {}, got group_topk = {}", op.name(), groups,
                          group_topk);
  if (k % group_topk != 0)
    return Status::errorf("'{}' needs topk = {} to divide by group_topk = {}", op.name(), k, group_topk);
  if (k / group_topk > e / groups)
    return Status::errorf("'{}' takes {} experts from each of {} groups of {}", op.name(), k / group_topk,
                          group_topk, e / groups);
  return Status::ok();
}

// The optional bias: [E], the logits' dtype.
Status checkBias(const Op& op, unsigned operand) {
  if (op.numOperands() <= operand) return Status::ok();
  const TensorType& logits = op.operand(0)->type();
  const TensorType& bias = op.operand(operand)->type();
  if (bias.dtype() != logits.dtype() || bias.rank() != 1 || !(bias.dim(0) == logits.dim(1)))
    return Status::errorf("'{}' bias must be {} [{}] like the logits, got {}", op.name(),
                          dtypeName(logits.dtype()), logits.dim(1).str(), bias.str());
  return Status::ok();
}

Status inferRouter(const Op& op, std::vector<TensorType>& out) {
  const TensorType& logits = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectLogits(op, logits));
  KILN_RETURN_IF_ERROR(checkBias(op, 1));
  const Shape s = {logits.dim(0), Dim::fixed(op.intAttr("topk"))};
  out = {TensorType(logits.dtype(), s), TensorType(DType::i32, s)};
  return Status::ok();
}

// (logits, experts, dprobs, bias?) -> the logits' type.
Status inferRouterGrad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& logits = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectLogits(op, logits));
  const int64_t k = op.intAttr("topk");
  KILN_RETURN_IF_ERROR(expectSlots(op, "experts", op.operand(1)->type(), logits.dim(0), k));
  const TensorType& dprobs = op.operand(2)->type();
  if (dprobs.dtype() != logits.dtype() || dprobs.shape() != Shape{logits.dim(0), Dim::fixed(k)})
    return Status::errorf("'{}' dprobs must be {} [{}, {}], got {}", op.name(), dtypeName(logits.dtype()),
                          logits.dim(0).str(), k, dprobs.str());
  KILN_RETURN_IF_ERROR(checkBias(op, 3));
  out = {logits.withSharding(std::nullopt)};
  return Status::ok();
}

// ---- Balancing losses: shapes -----------------------------------------------------------------

DType lossType(const TensorType& logits) { return logits.dtype(); }

// The optional counts operand of the aux loss (after g in the gradient op); -1 when absent.
int auxCountsOperand(const Op& op) {
  const unsigned at = op.is(OpCode::MoeAuxLoss) ? 2 : 3;
  return op.numOperands() > at ? static_cast<int>(at) : -1;
}

Status checkAuxLossOperands(const Op& op) {
  const TensorType& logits = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectLogits(op, logits));
  KILN_RETURN_IF_ERROR(expectSlots(op, "experts", op.operand(1)->type(), logits.dim(0), op.intAttr("topk")));
  const int at = auxCountsOperand(op);
  if (at < 0) return Status::ok();
  const TensorType& counts = op.operand(static_cast<unsigned>(at))->type();
  if (counts.rank() != 1 || !isInteger(counts.dtype()) || !(counts.dim(0) == logits.dim(1)))
    return Status::errorf("'{}' counts must be i32 or i64 [{}] (one per expert), got {}", op.name(),
                          logits.dim(1).str(), counts.str());
  return Status::ok();
}

Status inferAuxLoss(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(checkAuxLossOperands(op));
  out = {TensorType(lossType(op.operand(0)->type()), {})};
  return Status::ok();
}

Status expectScalarGrad(const Op& op, unsigned operand) {
  const TensorType& g = op.operand(operand)->type();
  if (g.rank() != 0 || g.dtype() != op.operand(0)->type().dtype())
    return Status::errorf("'{}' needs a scalar {} gradient, got {}", op.name(),
                          dtypeName(op.operand(0)->type().dtype()), g.str());
  return Status::ok();
}

Status inferAuxLossGrad(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(checkAuxLossOperands(op));
  KILN_RETURN_IF_ERROR(expectScalarGrad(op, 2));
  out = {op.operand(0)->type().withSharding(std::nullopt)};
  return Status::ok();
}

// topk within [1, E]; a sequence length that is >= 0 and divides a static token count.
Status verifyAuxLoss(const Op& op) {
  KILN_RETURN_IF_ERROR(expectLogits(op, op.operand(0)->type()));
  const int64_t e = expertCount(op);
  const int64_t k = op.intAttr("topk");
  if (k < 1 || k > e) return Status::errorf("'{}' needs 1 <= topk <= E = {}, got topk = {}", op.name(), e, k);
  const int64_t seq_len = op.intAttr("seq_len", 0);
  const Dim& tokens = op.operand(0)->type().dim(0);
  if (seq_len < 0) return Status::errorf("'{}' needs seq_len >= 0, got {}", op.name(), seq_len);
  // The given counts are the whole batch's: they have no sequences.
  if (seq_len > 0 && auxCountsOperand(op) >= 0)
    return Status::errorf("'{}' takes counts only for the per-batch loss (seq_len = 0), got seq_len = {}",
                          op.name(), seq_len);
  if (seq_len > 0 && tokens.isStatic() && tokens.size() % seq_len != 0)
    return Status::errorf("'{}': {} tokens do not split into sequences of seq_len = {}", op.name(),
                          tokens.size(), seq_len);
  return Status::ok();
}

Status inferZLoss(const Op& op, std::vector<TensorType>& out) {
  const TensorType& logits = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectLogits(op, logits));
  if (op.numOperands() == 2) {
    KILN_RETURN_IF_ERROR(expectScalarGrad(op, 1));
    out = {logits.withSharding(std::nullopt)};
  } else {
    out = {TensorType(lossType(logits), {})};
  }
  return Status::ok();
}

// ---- Dispatch: shapes -------------------------------------------------------------------------

// Each expert's capacity, ceil(N*k*cf / E) (Megatron's get_capacity of the N*k slots).
int64_t expertCapacity(int64_t tokens, int64_t k, int64_t experts, double capacity_factor) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens) * static_cast<double>(k) *
                                        capacity_factor / static_cast<double>(experts)));
}

// The bound of the rows: every slot without padding; with padding E*C, which is at most
// k*cf*N + E <= (f + E)*N for f = ceil(k*max(cf, 1)) and any N >= 1 (exactly E*C for a static N).
Dim dispatchRowsBound(const Op& op, const Dim& tokens, int64_t k) {
  const int64_t e = op.intAttr("experts");
  const double cf = op.floatAttr("capacity_factor", 0.0);
  if (!op.boolAttr("pad_to_capacity", false)) return Dim::bounded(tokens.times(k));
  if (tokens.isStatic()) return Dim::bounded(Dim::fixed(e * expertCapacity(tokens.size(), k, e, cf)));
  const int64_t f = static_cast<int64_t>(std::ceil(static_cast<double>(k) * std::max(cf, 1.0)));
  return Dim::bounded(tokens.times(f + e));
}

Status inferDispatch(const Op& op, std::vector<TensorType>& out) {
  const TensorType& experts = op.operand(0)->type();
  const TensorType& probs = op.operand(1)->type();
  if (experts.dtype() != DType::i32 || experts.rank() != 2 || !experts.dim(1).isStatic())
    return Status::errorf("'{}' experts must be i32 [N, k] with a static k, got {}", op.name(),
                          experts.str());
  if (!isRoutingFloat(probs.dtype()) || probs.shape() != experts.shape())
    return Status::errorf("'{}' probs must be f32 [{}], like experts, got {}", op.name(),
                          shapeStr(experts.shape()), probs.str());
  const int64_t e = op.intAttr("experts");
  if (e < 1) return Status::errorf("'{}' needs experts >= 1, got {}", op.name(), e);
  const Dim rows = dispatchRowsBound(op, experts.dim(0), experts.dim(1).size());
  out = {TensorType(DType::i32, {rows}), TensorType(DType::i32, {Dim::fixed(e + 1)}),
         TensorType(DType::i32, {Dim::fixed(e)})};
  return Status::ok();
}

Status verifyDispatch(const Op& op) {
  const double cf = op.floatAttr("capacity_factor", 0.0);
  if (!(cf >= 0) || !std::isfinite(cf))
    return Status::errorf("'{}' needs a finite capacity_factor >= 0, got {}", op.name(), cf);
  if (op.hasAttr("ep") && op.intAttr("ep") < 1)
    return Status::errorf("'{}' needs ep >= 1, got {}", op.name(), op.intAttr("ep"));
  if (op.boolAttr("pad_to_capacity", false) && cf == 0)
    return Status::errorf("'{}' pads to a capacity only with capacity_factor > 0", op.name());
  return Status::ok();
}

Status inferBiasUpdate(const Op& op, std::vector<TensorType>& out) {
  out.clear();
  const TensorType& bias = op.operand(0)->type();
  const TensorType& counts = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(expectRoutingFloat(op, "bias", bias));
  if (bias.rank() != 1) return Status::errorf("'{}' bias must be [E], got {}", op.name(), bias.str());
  if (!isInteger(counts.dtype()) || counts.rank() != 1 || !(counts.dim(0) == bias.dim(0)))
    return Status::errorf("'{}' counts must be integers [{}] like the bias, got {}", op.name(),
                          bias.dim(0).str(), counts.str());
  if (!std::isfinite(op.floatAttr("rate")))
    return Status::errorf("'{}' needs a finite rate, got {}", op.name(), op.floatAttr("rate"));
  return Status::ok();
}

std::vector<unsigned> writtenByBiasUpdate(const Op&) { return {0}; }

// ---- CPU references: helpers ------------------------------------------------------------------

// Writes every element of a float result from doubles.
Status storeAll(const Op& op, TensorView& r, const std::vector<double>& v) {
  return visitFloat(op, r.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    auto* p = data<T>(r);
    for (size_t i = 0; i < v.size(); ++i) p[i] = T::store(v[i]);
    return Status::ok();
  });
}

// A shape seen around one axis: outer * n * inner elements, row-major.
struct AxisSplit {
  int64_t outer = 1, n = 1, inner = 1;
  int64_t at(int64_t o, int64_t i, int64_t in) const { return (o * n + i) * inner + in; }
};
AxisSplit splitAround(const std::vector<int64_t>& shape, int64_t axis) {
  AxisSplit s;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    const int64_t size = shape[static_cast<size_t>(d)];
    if (d < axis) s.outer *= size;
    if (d == axis) s.n = size;
    if (d > axis) s.inner *= size;
  }
  return s;
}

// The `k` candidates of largest key, descending; equal keys rank the lower index first, which
// makes every selection deterministic. Keys hold no NaN (callers reject them).
std::vector<int64_t> topPositions(const std::vector<double>& key, std::vector<int64_t> candidates,
                                  int64_t k) {
  auto before = [&](int64_t a, int64_t b) {
    const double ka = key[static_cast<size_t>(a)], kb = key[static_cast<size_t>(b)];
    return ka > kb || (ka == kb && a < b);
  };
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), before);
  candidates.resize(static_cast<size_t>(k));
  return candidates;
}

double sigmoidOf(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// Softmax in place; returns the log-sum-exp of the input.
double softmaxInPlace(std::vector<double>& v) {
  double mx = -INFINITY;
  for (double x : v) mx = std::max(mx, x);
  double sum = 0;
  for (double& x : v) sum += (x = std::exp(x - mx));
  for (double& x : v) x /= sum;
  return mx + std::log(sum);
}

// d loss / d x of s = softmax(x), given ds = d loss / d s: s (ds - <s, ds>).
void softmaxBackward(const std::vector<double>& s, const std::vector<double>& ds, std::vector<double>& dx) {
  double dot = 0;
  for (size_t i = 0; i < s.size(); ++i) dot += s[i] * ds[i];
  for (size_t i = 0; i < s.size(); ++i) dx[i] = s[i] * (ds[i] - dot);
}

// Row n of the run-time [N, E] logits; a NaN is an error, since it has no place in a ranking.
Status loadRow(const Op& op, const TensorView& logits, int64_t n, std::vector<double>& row) {
  const int64_t e = logits.shape[1];
  row.resize(static_cast<size_t>(e));
  for (int64_t i = 0; i < e; ++i) {
    row[static_cast<size_t>(i)] = loadAsDouble(logits, n * e + i);
    if (std::isnan(row[static_cast<size_t>(i)]))
      return Status::errorf("'{}': logit [{}, {}] is NaN", op.name(), n, i);
  }
  return Status::ok();
}

// The run-time logits must have the static expert count the attributes were checked against.
Status checkLogitsRuntime(const Op& op, const TensorView& logits) {
  if (logits.rank() != 2 || logits.shape[1] != expertCount(op))
    return Status::errorf("'{}': run-time logits {} do not have the {} experts of its type", op.name(),
                          shapeString(logits.shape), expertCount(op));
  return Status::ok();
}

// [N, k] expert ids, each within [0, E).
Status checkExperts(const Op& op, const TensorView& experts, int64_t tokens, int64_t k, int64_t e) {
  if (experts.rank() != 2 || experts.shape[0] != tokens || experts.shape[1] != k)
    return Status::errorf("'{}': run-time experts {} are not [{}, {}]", op.name(), shapeString(experts.shape),
                          tokens, k);
  for (int64_t s = 0; s < experts.numel(); ++s) {
    const int64_t id = loadIndex(experts, s);
    if (id < 0 || id >= e)
      return Status::errorf("'{}': expert {} at {} is out of range [0, {})", op.name(), id,
                            indexString(experts.shape, s), e);
  }
  return Status::ok();
}

// ---- Generic selection: CPU -------------------------------------------------------------------

Status cpuTopK(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis", -1), x.rank()));
  const int64_t k = op.intAttr("k");
  const AxisSplit s = splitAround(x.shape, axis);
  if (k > s.n)
    return Status::errorf("'{}': k = {} exceeds the run-time size {} of axis {}", op.name(), k, s.n, axis);
  std::vector<int64_t> shape = x.shape;
  shape[static_cast<size_t>(axis)] = k;
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[1], shape));
  const AxisSplit r{s.outer, k, s.inner};
  std::vector<double> line(static_cast<size_t>(s.n)), values(static_cast<size_t>(out[0]->numel()));
  std::vector<int64_t> all(static_cast<size_t>(s.n));
  auto* indices = static_cast<int32_t*>(out[1]->data);
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t in_ = 0; in_ < s.inner; ++in_) {
      for (int64_t i = 0; i < s.n; ++i) {
        line[static_cast<size_t>(i)] = loadAsDouble(x, s.at(o, i, in_));
        if (std::isnan(line[static_cast<size_t>(i)]))
          return Status::errorf("'{}': element {} is NaN", op.name(), indexString(x.shape, s.at(o, i, in_)));
      }
      std::iota(all.begin(), all.end(), int64_t{0});
      const std::vector<int64_t> top = topPositions(line, all, k);
      for (int64_t j = 0; j < k; ++j) {
        values[static_cast<size_t>(r.at(o, j, in_))] = line[static_cast<size_t>(top[static_cast<size_t>(j)])];
        indices[r.at(o, j, in_)] = static_cast<int32_t>(top[static_cast<size_t>(j)]);
      }
    }
  return storeAll(op, *out[0], values);
}

// Run-time shapes of take/scatter: idx has x's rank and dims, except along axis for take.
Status checkAlongAxisRuntime(const Op& op, const TensorView& x, const TensorView& idx, int64_t axis,
                             bool same_axis) {
  bool fits = idx.rank() == x.rank();
  for (int64_t d = 0; fits && d < x.rank(); ++d)
    if ((same_axis || d != axis) && x.shape[static_cast<size_t>(d)] != idx.shape[static_cast<size_t>(d)])
      fits = false;
  if (!fits)
    return Status::errorf("'{}': run-time indices {} do not fit the operand {} along axis {}", op.name(),
                          shapeString(idx.shape), shapeString(x.shape), axis);
  return Status::ok();
}

Status indexOutOfRange(const Op& op, const TensorView& idx, int64_t pos, int64_t n) {
  return Status::errorf("'{}': index {} at {} is out of range [0, {})", op.name(), loadIndex(idx, pos),
                        indexString(idx.shape, pos), n);
}

Status cpuTakeAlongAxis(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& idx = *in[1];
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis"), x.rank()));
  KILN_RETURN_IF_ERROR(checkAlongAxisRuntime(op, x, idx, axis, false));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], idx.shape));
  const AxisSplit src = splitAround(x.shape, axis), dst = splitAround(idx.shape, axis);
  const size_t elem = static_cast<size_t>(dtypeBytes(x.dtype));
  const auto* from = static_cast<const unsigned char*>(x.data);
  auto* to = static_cast<unsigned char*>(out[0]->data);
  for (int64_t o = 0; o < dst.outer; ++o)
    for (int64_t j = 0; j < dst.n; ++j)
      for (int64_t in_ = 0; in_ < dst.inner; ++in_) {
        const int64_t pos = dst.at(o, j, in_);
        const int64_t t = loadIndex(idx, pos);
        if (t < 0 || t >= src.n) return indexOutOfRange(op, idx, pos, src.n);
        std::memcpy(to + static_cast<size_t>(pos) * elem,
                    from + static_cast<size_t>(src.at(o, t, in_)) * elem, elem);
      }
  return Status::ok();
}

Status cpuScatterAlongAxis(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& g = *in[0];
  const TensorView& idx = *in[1];
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, op.intAttr("axis"), g.rank()));
  KILN_RETURN_IF_ERROR(checkAlongAxisRuntime(op, g, idx, axis, true));
  const int64_t size = op.intAttr("size");
  std::vector<int64_t> shape = g.shape;
  shape[static_cast<size_t>(axis)] = size;
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], shape));
  const AxisSplit src = splitAround(g.shape, axis), dst = splitAround(shape, axis);
  std::vector<double> sum(static_cast<size_t>(out[0]->numel()), 0.0);
  for (int64_t o = 0; o < src.outer; ++o)
    for (int64_t j = 0; j < src.n; ++j)
      for (int64_t in_ = 0; in_ < src.inner; ++in_) {
        const int64_t pos = src.at(o, j, in_);
        const int64_t t = loadIndex(idx, pos);
        if (t < 0 || t >= size) return indexOutOfRange(op, idx, pos, size);
        sum[static_cast<size_t>(dst.at(o, t, in_))] += loadAsDouble(g, pos);
      }
  return storeAll(op, *out[0], sum);
}

// ---- Routing: CPU -----------------------------------------------------------------------------

struct RouterSpec {
  int64_t k = 1, groups = 1, group_topk = 1;
  bool sigmoid = false, pre_softmax = false;
  double scale = 1;
};
RouterSpec routerSpec(const Op& op) {
  return {op.intAttr("topk"),
          op.intAttr("groups", 1),
          op.intAttr("group_topk", 1),
          op.strAttr("score", "softmax") == "sigmoid",
          op.boolAttr("pre_softmax", false),
          op.floatAttr("scale", 1.0)};
}

// What the router ranks (before the bias) and what the probs come from: the logits themselves
// (softmax after selection), softmax(logits) over all E, or sigmoid(logits).
std::vector<double> routingScores(const RouterSpec& r, const std::vector<double>& logits) {
  std::vector<double> s = logits;
  if (r.sigmoid) {
    for (double& v : s) v = sigmoidOf(v);
  } else if (r.pre_softmax) {
    softmaxInPlace(s);
  }
  return s;
}

// A token's experts in descending key, among the experts of its best group_topk groups (a
// group's score: the sum of its top k / group_topk keys).
std::vector<int64_t> selectExperts(const RouterSpec& r, const std::vector<double>& key) {
  const int64_t e = static_cast<int64_t>(key.size());
  std::vector<int64_t> candidates(static_cast<size_t>(e));
  std::iota(candidates.begin(), candidates.end(), int64_t{0});
  if (r.groups > 1) {
    const int64_t size = e / r.groups, per_group = r.k / r.group_topk;
    std::vector<double> group_score(static_cast<size_t>(r.groups), 0.0);
    for (int64_t g = 0; g < r.groups; ++g) {
      std::vector<int64_t> members(candidates.begin() + g * size, candidates.begin() + (g + 1) * size);
      for (int64_t i : topPositions(key, members, per_group))
        group_score[static_cast<size_t>(g)] += key[static_cast<size_t>(i)];
    }
    std::vector<int64_t> groups(static_cast<size_t>(r.groups));
    std::iota(groups.begin(), groups.end(), int64_t{0});
    std::vector<int64_t> eligible;
    for (int64_t g : topPositions(group_score, groups, r.group_topk))
      for (int64_t i = g * size; i < (g + 1) * size; ++i) eligible.push_back(i);
    candidates = std::move(eligible);
  }
  return topPositions(key, candidates, r.k);
}

// The probs of the chosen experts, scaled.
std::vector<double> routerProbs(const RouterSpec& r, const std::vector<double>& logits,
                                const std::vector<double>& scores, const std::vector<int64_t>& chosen) {
  std::vector<double> p;
  for (int64_t e : chosen)
    p.push_back(r.sigmoid || r.pre_softmax ? scores[static_cast<size_t>(e)] : logits[static_cast<size_t>(e)]);
  if (!r.sigmoid && !r.pre_softmax) softmaxInPlace(p);
  if (r.sigmoid && r.k > 1) {
    const double sum = std::accumulate(p.begin(), p.end(), 0.0);
    for (double& v : p) v /= sum + 1e-20;
  }
  for (double& v : p) v *= r.scale;
  return p;
}

// d loss / d logits of one token from dp = d loss / d probs, for the experts `chosen`.
void routerRowBackward(const RouterSpec& r, const std::vector<double>& logits,
                       const std::vector<double>& scores, const std::vector<int64_t>& chosen,
                       std::vector<double> dp, std::vector<double>& dlogits) {
  std::fill(dlogits.begin(), dlogits.end(), 0.0);
  for (double& v : dp) v *= r.scale;
  const size_t k = chosen.size();
  if (!r.sigmoid && !r.pre_softmax) {  // a softmax over the chosen logits
    std::vector<double> z, dz(k);
    for (int64_t e : chosen) z.push_back(logits[static_cast<size_t>(e)]);
    softmaxInPlace(z);
    softmaxBackward(z, dp, dz);
    for (size_t j = 0; j < k; ++j) dlogits[static_cast<size_t>(chosen[j])] = dz[j];
  } else if (!r.sigmoid) {  // the chosen entries of a softmax over all E
    std::vector<double> ds(scores.size(), 0.0);
    for (size_t j = 0; j < k; ++j) ds[static_cast<size_t>(chosen[j])] = dp[j];
    softmaxBackward(scores, ds, dlogits);
  } else {  // q_j = s_j / (sum s + 1e-20) for k > 1, s = sigmoid(logit)
    std::vector<double> ds = dp;
    if (k > 1) {
      double sum = 0, dot = 0;
      for (size_t j = 0; j < k; ++j) {
        sum += scores[static_cast<size_t>(chosen[j])];
        dot += dp[j] * scores[static_cast<size_t>(chosen[j])];
      }
      const double d = sum + 1e-20;
      for (size_t j = 0; j < k; ++j) ds[j] = dp[j] / d - dot / (d * d);
    }
    for (size_t j = 0; j < k; ++j) {
      const double s = scores[static_cast<size_t>(chosen[j])];
      dlogits[static_cast<size_t>(chosen[j])] = ds[j] * s * (1 - s);
    }
  }
}

// The optional bias at run time: E entries, or zeros without one.
Expected<std::vector<double>> loadBias(const Op& op, const CpuOperands& in, unsigned operand, int64_t e) {
  std::vector<double> bias(static_cast<size_t>(e), 0.0);
  if (in.size() <= operand) return bias;
  if (in[operand]->numel() != e)
    return Status::errorf("'{}': run-time bias {} does not have {} experts", op.name(),
                          shapeString(in[operand]->shape), e);
  for (int64_t i = 0; i < e; ++i) bias[static_cast<size_t>(i)] = loadAsDouble(*in[operand], i);
  return bias;
}

Status cpuRouter(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  const RouterSpec r = routerSpec(op);
  const int64_t tokens = x.shape[0], e = x.shape[1];
  KILN_ASSIGN_OR_RETURN(std::vector<double> bias, loadBias(op, in, 1, e));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {tokens, r.k}));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[1], {tokens, r.k}));
  std::vector<double> probs, logits;
  auto* experts = static_cast<int32_t*>(out[1]->data);
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, logits));
    const std::vector<double> scores = routingScores(r, logits);
    std::vector<double> key = scores;
    for (int64_t i = 0; i < e; ++i) key[static_cast<size_t>(i)] += bias[static_cast<size_t>(i)];
    const std::vector<int64_t> chosen = selectExperts(r, key);
    for (double p : routerProbs(r, logits, scores, chosen)) probs.push_back(p);
    for (int64_t j = 0; j < r.k; ++j)
      experts[n * r.k + j] = static_cast<int32_t>(chosen[static_cast<size_t>(j)]);
  }
  return storeAll(op, *out[0], probs);
}

Status cpuRouterGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  const RouterSpec r = routerSpec(op);
  const int64_t tokens = x.shape[0], e = x.shape[1];
  KILN_RETURN_IF_ERROR(checkExperts(op, *in[1], tokens, r.k, e));
  if (in[2]->shape != in[1]->shape)
    return Status::errorf("'{}': run-time dprobs {} are not shaped like experts {}", op.name(),
                          shapeString(in[2]->shape), shapeString(in[1]->shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], x.shape));
  std::vector<double> grad(static_cast<size_t>(tokens * e)), logits, row(static_cast<size_t>(e));
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, logits));
    std::vector<int64_t> chosen;
    std::vector<double> dp;
    for (int64_t j = 0; j < r.k; ++j) {
      chosen.push_back(loadIndex(*in[1], n * r.k + j));
      dp.push_back(loadAsDouble(*in[2], n * r.k + j));
    }
    routerRowBackward(r, logits, routingScores(r, logits), chosen, dp, row);
    std::copy(row.begin(), row.end(), grad.begin() + n * e);
  }
  return storeAll(op, *out[0], grad);
}

// ---- Balancing losses: CPU --------------------------------------------------------------------

// The scores P averages: softmax over E, or sigmoid normalized by the row sum (+ 1e-20).
void auxScores(bool sigmoid, std::vector<double>& row) {
  if (!sigmoid) {
    softmaxInPlace(row);
    return;
  }
  for (double& v : row) v = sigmoidOf(v);
  const double sum = std::accumulate(row.begin(), row.end(), 0.0);
  for (double& v : row) v /= sum + 1e-20;
}

// The aux loss's pieces: tokens per sequence T, the sequence count, the slot counts of each
// (sequence, expert) and the slots they are a fraction of (T k, or the given counts' sum).
struct AuxLossCounts {
  int64_t seq_len = 0, sequences = 0;
  std::vector<int64_t> counts;  // [sequences, E]
  int64_t slots = 0;
};

// Given counts (the global batch's): one sequence of this batch's tokens, f_i = counts_i / sum.
Expected<AuxLossCounts> givenAuxCounts(const Op& op, const TensorView& given, int64_t tokens, int64_t e) {
  if (given.rank() != 1 || given.shape[0] != e)
    return Status::errorf("'{}': run-time counts {} are not one per expert ({})", op.name(),
                          shapeString(given.shape), e);
  AuxLossCounts c;
  c.seq_len = tokens;
  c.sequences = 1;
  for (int64_t i = 0; i < given.numel(); ++i) {
    const int64_t n = loadIndex(given, i);
    if (n < 0) return Status::errorf("'{}': counts[{}] = {} is negative", op.name(), i, n);
    c.counts.push_back(n);
    c.slots += n;
  }
  return c;
}

Expected<AuxLossCounts> auxLossCounts(const Op& op, const CpuOperands& in) {
  const TensorView& x = *in[0];
  const TensorView& experts = *in[1];
  const int64_t tokens = x.shape[0], e = x.shape[1], k = op.intAttr("topk");
  KILN_RETURN_IF_ERROR(checkExperts(op, experts, tokens, k, e));
  if (const int at = auxCountsOperand(op); at >= 0)
    return givenAuxCounts(op, *in[static_cast<size_t>(at)], tokens, e);
  AuxLossCounts c;
  c.seq_len = op.intAttr("seq_len", 0) > 0 ? op.intAttr("seq_len", 0) : tokens;
  c.slots = c.seq_len * k;
  if (tokens == 0) return c;
  if (tokens % c.seq_len != 0)
    return Status::errorf("'{}': {} tokens do not split into sequences of {}", op.name(), tokens, c.seq_len);
  c.sequences = tokens / c.seq_len;
  c.counts.assign(static_cast<size_t>(c.sequences * e), 0);
  for (int64_t s = 0; s < tokens * k; ++s)
    ++c.counts[static_cast<size_t>((s / k) / c.seq_len * e + loadIndex(experts, s))];
  return c;
}

// d loss / d score[n, i] = coeff * E * f_i / T / sequences, with f_i = count / slots (T k, or
// the given counts' sum; f = 0 when that is 0).
double auxScoreGrad(const Op& op, const AuxLossCounts& c, int64_t n, int64_t i, int64_t e) {
  const double t = static_cast<double>(c.seq_len);
  const double count = static_cast<double>(c.counts[static_cast<size_t>(n / c.seq_len * e + i)]);
  const double f = c.slots > 0 ? count / static_cast<double>(c.slots) : 0.0;
  return op.floatAttr("coeff") * static_cast<double>(e) * f / t / static_cast<double>(c.sequences);
}

Status cpuAuxLoss(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  KILN_ASSIGN_OR_RETURN(AuxLossCounts c, auxLossCounts(op, in));
  const bool sigmoid = op.strAttr("score") == "sigmoid";
  const int64_t tokens = x.shape[0], e = x.shape[1];
  // The loss is linear in the scores with the weights auxScoreGrad gives.
  double loss = 0;
  std::vector<double> row;
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, row));
    auxScores(sigmoid, row);
    for (int64_t i = 0; i < e; ++i) loss += auxScoreGrad(op, c, n, i, e) * row[static_cast<size_t>(i)];
  }
  return storeAll(op, *out[0], {loss});
}

Status cpuAuxLossGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  KILN_ASSIGN_OR_RETURN(AuxLossCounts c, auxLossCounts(op, in));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], x.shape));
  const bool sigmoid = op.strAttr("score") == "sigmoid";
  const double g = loadAsDouble(*in[2], 0);
  const int64_t tokens = x.shape[0], e = x.shape[1];
  std::vector<double> grad(static_cast<size_t>(tokens * e)), row, scores, dscore(static_cast<size_t>(e)),
      drow(static_cast<size_t>(e));
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, row));
    for (int64_t i = 0; i < e; ++i) dscore[static_cast<size_t>(i)] = g * auxScoreGrad(op, c, n, i, e);
    if (!sigmoid) {
      scores = row;
      softmaxInPlace(scores);
      softmaxBackward(scores, dscore, drow);
    } else {  // q = sigma / (sum sigma + 1e-20)
      double sum = 0, dot = 0;
      for (int64_t i = 0; i < e; ++i) {
        const double s = sigmoidOf(row[static_cast<size_t>(i)]);
        sum += s;
        dot += dscore[static_cast<size_t>(i)] * s;
      }
      const double d = sum + 1e-20;
      for (int64_t i = 0; i < e; ++i) {
        const double s = sigmoidOf(row[static_cast<size_t>(i)]);
        drow[static_cast<size_t>(i)] = (dscore[static_cast<size_t>(i)] / d - dot / (d * d)) * s * (1 - s);
      }
    }
    std::copy(drow.begin(), drow.end(), grad.begin() + n * e);
  }
  return storeAll(op, *out[0], grad);
}

Status cpuZLoss(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  const int64_t tokens = x.shape[0];
  double sum = 0;
  std::vector<double> row;
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, row));
    const double lse = softmaxInPlace(row);
    sum += lse * lse;
  }
  return storeAll(op, *out[0], {tokens ? op.floatAttr("coeff") * sum / static_cast<double>(tokens) : 0.0});
}

Status cpuZLossGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_RETURN_IF_ERROR(checkLogitsRuntime(op, x));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], x.shape));
  const int64_t tokens = x.shape[0], e = x.shape[1];
  const double g = loadAsDouble(*in[1], 0);
  std::vector<double> grad(static_cast<size_t>(tokens * e)), row;
  for (int64_t n = 0; n < tokens; ++n) {
    KILN_RETURN_IF_ERROR(loadRow(op, x, n, row));
    const double lse = softmaxInPlace(row);
    const double scale = g * op.floatAttr("coeff") * 2 * lse / static_cast<double>(tokens);
    for (int64_t i = 0; i < e; ++i)
      grad[static_cast<size_t>(n * e + i)] = scale * row[static_cast<size_t>(i)];
  }
  return storeAll(op, *out[0], grad);
}

// ---- Dispatch: CPU ----------------------------------------------------------------------------

// Keeps at most `capacity` of an expert's slots (given in slot order), in slot order: the first
// ones, or those of highest prob (equal probs keep the lower slot).
void keepWithinCapacity(std::vector<int64_t>& slots, int64_t capacity, bool by_position,
                        const std::vector<double>& probs) {
  if (static_cast<int64_t>(slots.size()) <= capacity) return;
  if (!by_position) {
    slots = topPositions(probs, slots, capacity);
    std::sort(slots.begin(), slots.end());
  }
  slots.resize(static_cast<size_t>(capacity));
}

Status cpuDispatch(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& experts = *in[0];
  const TensorView& probs_in = *in[1];
  const int64_t e = op.intAttr("experts");
  const int64_t tokens = experts.shape[0], k = experts.shape[1];
  KILN_RETURN_IF_ERROR(checkExperts(op, experts, tokens, k, e));
  if (probs_in.shape != experts.shape)
    return Status::errorf("'{}': run-time probs {} are not shaped like experts {}", op.name(),
                          shapeString(probs_in.shape), shapeString(experts.shape));
  const double cf = op.floatAttr("capacity_factor", 0.0);
  const bool pad = op.boolAttr("pad_to_capacity", false);
  const bool by_position = op.strAttr("drop_policy", "probs") == "position";
  std::vector<double> probs(static_cast<size_t>(tokens * k));
  for (int64_t s = 0; s < tokens * k; ++s) {
    probs[static_cast<size_t>(s)] = loadAsDouble(probs_in, s);
    if (std::isnan(probs[static_cast<size_t>(s)]))
      return Status::errorf("'{}': prob {} is NaN", op.name(), indexString(probs_in.shape, s));
  }
  // Each expert's slots in token order, then capacity.
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(e));
  for (int64_t s = 0; s < tokens * k; ++s) slots[static_cast<size_t>(loadIndex(experts, s))].push_back(s);
  const int64_t capacity = cf > 0 ? expertCapacity(tokens, k, e, cf) : tokens * k;
  if (cf > 0)
    for (auto& kept : slots) keepWithinCapacity(kept, capacity, by_position, probs);
  int64_t total = 0;
  for (const auto& kept : slots) total += pad ? capacity : static_cast<int64_t>(kept.size());
  if (total > out[0]->shape[0])
    return Status::errorf("'{}': {} rows exceed the bound {} of its result type {}", op.name(), total,
                          out[0]->shape[0], op.result(0)->type().str());
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {total}));
  auto* rows = static_cast<int32_t*>(out[0]->data);
  auto* offsets = static_cast<int32_t*>(out[1]->data);
  auto* counts = static_cast<int32_t*>(out[2]->data);
  int64_t r = 0;
  for (int64_t x = 0; x < e; ++x) {
    const auto& kept = slots[static_cast<size_t>(x)];
    offsets[x] = static_cast<int32_t>(r);
    counts[x] = static_cast<int32_t>(kept.size());
    for (int64_t s : kept) rows[r++] = static_cast<int32_t>(s);
    if (pad)
      for (int64_t i = static_cast<int64_t>(kept.size()); i < capacity; ++i) rows[r++] = -1;
  }
  offsets[e] = static_cast<int32_t>(r);
  return Status::ok();
}

Status cpuBiasUpdate(const Op& op, const CpuOperands& in, const CpuResults&, const CpuContext&) {
  const TensorView& bias = *in[0];
  const TensorView& counts = *in[1];
  const int64_t e = bias.numel();
  if (counts.numel() != e)
    return Status::errorf("'{}': {} counts for a bias of {} experts", op.name(), counts.numel(), e);
  if (e == 0) return Status::ok();
  double mean = 0;
  for (int64_t i = 0; i < e; ++i) mean += static_cast<double>(loadIndex(counts, i));
  mean /= static_cast<double>(e);
  const double rate = op.floatAttr("rate");
  std::vector<double> updated(static_cast<size_t>(e));
  for (int64_t i = 0; i < e; ++i) {
    const double gap = mean - static_cast<double>(loadIndex(counts, i));
    updated[static_cast<size_t>(i)] =
        loadAsDouble(bias, i) + rate * static_cast<double>((gap > 0) - (gap < 0));
  }
  TensorView written = bias;  // the op updates its bias operand in place
  return storeAll(op, written, updated);
}

// ---- Gradient rules ---------------------------------------------------------------------------

Value* resultGrad(const GradContext& ctx, size_t i) {
  return i < ctx.result_grads.size() ? ctx.result_grads[i] : nullptr;
}

// topk's values and take_along_axis's result go back to where they were read from.
Status gradScatterBack(GradContext& ctx, const Op& op, Value* indices, int64_t attr_axis) {
  grads::resetOperandGrads(ctx, op);
  Value* g = resultGrad(ctx, 0);
  const TensorType& x = op.operand(0)->type();
  if (!g || !isFloat(x.dtype())) return Status::ok();
  KILN_ASSIGN_OR_RETURN(int64_t axis, normalizeAxis(op, attr_axis, x.rank()));
  if (!x.dim(axis).isStatic())
    return Status::errorf("'{}' has a gradient only along a static axis, not {} of {}", op.name(), axis,
                          x.str());
  KILN_GRAD_VALUE(
      dx, ctx.builder.createValue(OpCode::ScatterAlongAxis, {g, indices},
                                  {{"axis", Attribute(axis)}, {"size", Attribute(x.dim(axis).size())}}));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

Status gradTopK(GradContext& ctx, const Op& op) {
  return gradScatterBack(ctx, op, op.result(1), op.intAttr("axis", -1));
}
Status gradTakeAlongAxis(GradContext& ctx, const Op& op) {
  return gradScatterBack(ctx, op, op.operand(1), op.intAttr("axis"));
}

Status gradScatterAlongAxis(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = resultGrad(ctx, 0);
  if (!g) return Status::ok();
  KILN_GRAD_VALUE(dg, ctx.builder.createValue(OpCode::TakeAlongAxis, {g, op.operand(1)},
                                              {{"axis", Attribute(op.intAttr("axis"))}}));
  ctx.operand_grads[0] = dg;
  return Status::ok();
}

// The router, the aux loss and the z-loss: the logits get the backward op with the forward's
// attributes; the bias and the expert ids get nothing.
Status gradRouting(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = resultGrad(ctx, 0);
  if (!g) return Status::ok();
  std::vector<Value*> operands = {op.operand(0)};
  OpCode backward = OpCode::MoeZLossGrad;
  if (op.is(OpCode::MoeRouter)) {
    backward = OpCode::MoeRouterGrad;
    operands.push_back(op.result(1));
    operands.push_back(g);
    if (op.numOperands() == 2) operands.push_back(op.operand(1));
  } else if (op.is(OpCode::MoeAuxLoss)) {
    backward = OpCode::MoeAuxLossGrad;
    operands.push_back(op.operand(1));
    operands.push_back(g);
    if (op.numOperands() == 3) operands.push_back(op.operand(2));  // the global counts
  } else {
    operands.push_back(g);
  }
  KILN_GRAD_VALUE(dx, ctx.builder.createValue(backward, operands, op.attrs()));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

// ---- Costs ------------------------------------------------------------------------------------

// Data movement: bytes only.
OpCost costMoving(const Op& op, const SymbolBindings& symbols) {
  return {0, operandAndResultBytes(op, symbols)};
}

// A selection: about log2(k) comparisons per element of the operand.
OpCost costTopK(const Op& op, const SymbolBindings& symbols) {
  const double k = static_cast<double>(op.intAttr("k", 1));
  return {typeElements(op.operand(0)->type(), symbols) * std::log2(k + 1),
          operandAndResultBytes(op, symbols)};
}

// Routing and its losses: an exp or a sigmoid and a few operations per logit.
OpCost costRouting(const Op& op, const SymbolBindings& symbols) {
  return {8 * typeElements(op.operand(0)->type(), symbols), operandAndResultBytes(op, symbols)};
}

}  // namespace

void registerRoutingOps(OpRegistry& r) {
  using K = Attribute::Kind;
  const AttrSpec axis{"axis", K::Int, true};
  const AttrSpec topk{"topk", K::Int, true};
  const AttrSpec score{"score", K::String, false, Attribute("softmax"), {"softmax", "sigmoid"}};
  const std::vector<AttrSpec> router_attrs = {topk,
                                              score,
                                              {"pre_softmax", K::Bool, false, Attribute(false)},
                                              {"groups", K::Int, false, Attribute(int64_t{1})},
                                              {"group_topk", K::Int, false, Attribute(int64_t{1})},
                                              {"scale", K::Float, false, Attribute(1.0)}};
  const std::vector<AttrSpec> aux_attrs = {{"coeff", K::Float, true},
                                           {"score", K::String, true, std::nullopt, {"softmax", "sigmoid"}},
                                           topk,
                                           {"seq_len", K::Int, false, Attribute(int64_t{0})}};
  const AttrSpec coeff{"coeff", K::Float, true};

  r.add({.name = "kiln.topk",
         .summary =
             "The k largest entries along an axis, descending (ties to the lower index), and their indices",
         .min_operands = 1,
         .max_operands = 1,
         .num_results = 2,
         .attrs = {{"k", K::Int, true}, {"axis", K::Int, false, Attribute(int64_t{-1})}},
         .traits = kPure,
         .infer = inferTopK,
         .cost = costTopK,
         .grad = gradTopK,
         .cpu = cpuTopK});
  r.add({.name = "kiln.take_along_axis",
         .summary = "Elements of x at integer indices along an axis (numpy's take_along_axis)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {axis},
         .traits = kPure,
         .infer = inferTakeAlongAxis,
         .cost = costMoving,
         .grad = gradTakeAlongAxis,
         .cpu = cpuTakeAlongAxis});
  r.add({.name = "kiln.scatter_along_axis",
         .summary = "Zeros of `size` along an axis with g added at the indices (take_along_axis's adjoint)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {axis, {"size", K::Int, true}},
         .traits = kPure,
         .infer = inferScatterAlongAxis,
         .cost = costMoving,
         .grad = gradScatterAlongAxis,
         .cpu = cpuScatterAlongAxis});
  r.add({.name = "kiln.moe_router",
         .summary = "Top-k expert routing of router logits: the chosen experts and their probabilities",
         .min_operands = 1,
         .max_operands = 2,
         .num_results = 2,
         .attrs = router_attrs,
         .traits = kPure,
         .infer = inferRouter,
         .verify = verifyRouterAttrs,
         .cost = costRouting,
         .grad = gradRouting,
         .cpu = cpuRouter});
  r.add({.name = "kiln.moe_router_grad",
         .summary = "Gradient of moe_router's probs with respect to the logits, for the recorded selection",
         .min_operands = 3,
         .max_operands = 4,
         .attrs = router_attrs,
         .traits = kPure | kNonDifferentiable,
         .infer = inferRouterGrad,
         .verify = verifyRouterAttrs,
         .cost = costRouting,
         .cpu = cpuRouterGrad});
  r.add({.name = "kiln.moe_aux_loss",
         .summary = "MoE load-balancing loss coeff * E * sum_i f_i P_i (per batch or per sequence)",
         .min_operands = 2,
         .max_operands = 3,
         .attrs = aux_attrs,
         .traits = kPure,
         .infer = inferAuxLoss,
         .verify = verifyAuxLoss,
         .cost = costRouting,
         .grad = gradRouting,
         .cpu = cpuAuxLoss});
  r.add({.name = "kiln.moe_aux_loss_grad",
         .summary = "Gradient of moe_aux_loss with respect to the logits",
         .min_operands = 3,
         .max_operands = 4,
         .attrs = aux_attrs,
         .traits = kPure | kNonDifferentiable,
         .infer = inferAuxLossGrad,
         .verify = verifyAuxLoss,
         .cost = costRouting,
         .cpu = cpuAuxLossGrad});
  r.add({.name = "kiln.moe_z_loss",
         .summary = "Router z-loss coeff * mean_n logsumexp(logits[n])^2",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {coeff},
         .traits = kPure,
         .infer = inferZLoss,
         .cost = costRouting,
         .grad = gradRouting,
         .cpu = cpuZLoss});
  r.add({.name = "kiln.moe_z_loss_grad",
         .summary = "Gradient of moe_z_loss with respect to the logits",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {coeff},
         .traits = kPure | kNonDifferentiable,
         .infer = inferZLoss,
         .cost = costRouting,
         .cpu = cpuZLossGrad});
  r.add({.name = "kiln.moe_dispatch",
         .summary = "Stable expert-major permutation of the routed slots, with capacity dropping and padding",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 3,
         .attrs = {{"experts", K::Int, true},
                   {"capacity_factor", K::Float, false, Attribute(0.0)},
                   {"drop_policy", K::String, false, Attribute("probs"), {"probs", "position"}},
                   {"pad_to_capacity", K::Bool, false, Attribute(false)},
                   // moe(..., ep = N): this layer's expert-parallel size (the shard pass's; absent: --ep)
                   {"ep", K::Int, false}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferDispatch,
         .verify = verifyDispatch,
         .cost = costMoving,
         .cpu = cpuDispatch});
  r.add({.name = "kiln.moe_expert_bias_update",
         .summary = "Aux-loss-free balancing: bias += rate * sign(mean(counts) - counts), in place",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 0,
         .attrs = {{"rate", K::Float, true}},
         .traits = kSideEffect | kNonDifferentiable,
         .infer = inferBiasUpdate,
         .cost = costMoving,
         .cpu = cpuBiasUpdate,
         .written = writtenByBiasUpdate});
}

}  // namespace kiln::ir
