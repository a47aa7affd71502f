// Top-k selection and Mixture-of-Experts routing: the contracts are docs/moe.md, sections
// "Generic selection", "Routing", "Balancing losses" and "Dispatch".
//   kiln.topk(x) {k, axis}                        the k largest along axis, values and i32 indices
//   kiln.take_along_axis(x, idx) {axis}           numpy's take_along_axis
//   kiln.scatter_along_axis(g, idx) {axis, size}  its adjoint: zeros with g added at idx
//   kiln.moe_router(logits, bias?)                -> (probs, experts), Megatron's top-k routing
//   kiln.moe_aux_loss(logits, experts)            load-balancing loss (per batch or per sequence)
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

Status checkAuxLossOperands(const Op& op) {
  const TensorType& logits = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(expectLogits(op, logits));
  return expectSlots(op, "experts", op.operand(1)->type(), logits.dim(0), op.intAttr("topk"));
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

// Megatron's get_capacity: ceil(N*k / E * cf).
int64_t expertCapacity(int64_t tokens, int64_t k, int64_t experts, double capacity_factor) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(tokens) * static_cast<double>(k) /
                                        static_cast<double>(experts) * capacity_factor));
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
  if (experts.dtype() != DType::i32 || experts.rank() != 2 || !experts.dim(1).isStatic() ||
      experts.dim(0).isBounded())
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
         .infer = inferTopK});
  r.add({.name = "kiln.take_along_axis",
         .summary = "Elements of x at integer indices along an axis (numpy's take_along_axis)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {axis},
         .traits = kPure,
         .infer = inferTakeAlongAxis});
  r.add({.name = "kiln.scatter_along_axis",
         .summary = "Zeros of `size` along an axis with g added at the indices (take_along_axis's adjoint)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {axis, {"size", K::Int, true}},
         .traits = kPure,
         .infer = inferScatterAlongAxis});
  r.add({.name = "kiln.moe_router",
         .summary = "Top-k expert routing of router logits: the chosen experts and their probabilities",
         .min_operands = 1,
         .max_operands = 2,
         .num_results = 2,
         .attrs = router_attrs,
         .traits = kPure,
         .infer = inferRouter,
         .verify = verifyRouterAttrs});
  r.add({.name = "kiln.moe_router_grad",
         .summary = "Gradient of moe_router's probs with respect to the logits, for the recorded selection",
         .min_operands = 3,
         .max_operands = 4,
         .attrs = router_attrs,
         .traits = kPure | kNonDifferentiable,
         .infer = inferRouterGrad,
         .verify = verifyRouterAttrs});
  r.add({.name = "kiln.moe_aux_loss",
         .summary = "MoE load-balancing loss coeff * E * sum_i f_i P_i (per batch or per sequence)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = aux_attrs,
         .traits = kPure,
         .infer = inferAuxLoss,
         .verify = verifyAuxLoss});
  r.add({.name = "kiln.moe_aux_loss_grad",
         .summary = "Gradient of moe_aux_loss with respect to the logits",
         .min_operands = 3,
         .max_operands = 3,
         .attrs = aux_attrs,
         .traits = kPure | kNonDifferentiable,
         .infer = inferAuxLossGrad,
         .verify = verifyAuxLoss});
  r.add({.name = "kiln.moe_z_loss",
         .summary = "Router z-loss coeff * mean_n logsumexp(logits[n])^2",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {coeff},
         .traits = kPure,
         .infer = inferZLoss});
  r.add({.name = "kiln.moe_z_loss_grad",
         .summary = "Gradient of moe_z_loss with respect to the logits",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {coeff},
         .traits = kPure | kNonDifferentiable,
         .infer = inferZLoss});
  r.add({.name = "kiln.moe_dispatch",
         .summary = "Stable expert-major permutation of the routed slots, with capacity dropping and padding",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 3,
         .attrs = {{"experts", K::Int, true},
                   {"capacity_factor", K::Float, false, Attribute(0.0)},
                   {"drop_policy", K::String, false, Attribute("probs"), {"probs", "position"}},
                   {"pad_to_capacity", K::Bool, false, Attribute(false)}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferDispatch,
         .verify = verifyDispatch});
  r.add({.name = "kiln.moe_expert_bias_update",
         .summary = "Aux-loss-free balancing: bias += rate * sign(mean(counts) - counts), in place",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 0,
         .attrs = {{"rate", K::Float, true}},
         .traits = kSideEffect | kNonDifferentiable,
         .infer = inferBiasUpdate,
         .written = writtenByBiasUpdate});
}

}  // namespace kiln::ir
