// Elementwise ops: binary arithmetic with numpy broadcasting, unary math and activations,
// comparison and selection, and the fused activation backward op. Each function's meaning is
// its entry in ir/scalar_fn.def; this file adds what the op table needs around it (shape
// rules, gradient rules, the CPU reference loops).
//   kiln.activation_grad(x, dy) {activation}  dy * f'(x) for an activation of scalar_fn.def (for
//                                             relu, x may be relu's output: f'(y) = f'(x))
#include <cctype>
#include <cmath>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

Status inferBinary(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(1)->type();
  if (a.dtype() != b.dtype())
    return Status::errorf("'{}' operands have different element types: {} and {}", op.name(), a.str(), b.str());
  auto shape = broadcastShapes(a.shape(), b.shape());
  if (!shape) return Status::errorf("'{}': {}", op.name(), shape.status().message());
  out = {TensorType(a.dtype(), shape.take())};
  return Status::ok();
}

Status inferUnary(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  out = {a.withSharding(std::nullopt)};
  return Status::ok();
}

Status verifyFloatOperands(const Op& op) {
  for (Value* v : op.operands())
    if (!isFloat(v->type().dtype()))
      return Status::errorf("'{}' needs floating-point operands, got {}", op.name(), v->type().str());
  return Status::ok();
}

Status inferCompare(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(inferBinary(op, out));
  out[0] = out[0].withDType(DType::i1);
  return Status::ok();
}

Status inferSelect(const Op& op, std::vector<TensorType>& out) {
  const TensorType& c = op.operand(0)->type();
  const TensorType& a = op.operand(1)->type();
  const TensorType& b = op.operand(2)->type();
  if (c.dtype() != DType::i1)
    return Status::errorf("'kiln.select' condition must be i1, got {}", c.str());
  if (a.dtype() != b.dtype())
    return Status::errorf("'kiln.select' branches have different element types: {} and {}", a.str(), b.str());
  auto ab = broadcastShapes(a.shape(), b.shape());
  if (!ab) return Status::errorf("'kiln.select': {}", ab.status().message());
  auto all = broadcastShapes(c.shape(), *ab);
  if (!all) return Status::errorf("'kiln.select': {}", all.status().message());
  out = {TensorType(a.dtype(), all.take())};
  return Status::ok();
}

// ---- CPU kernels -------------------------------------------------------------------------------

using scalar::apply;

// The function kiln.activation_grad differentiates.
ScalarFn activationOf(const Op& op) {
  return *findScalarFn(ScalarFnKind::Activation, op.strAttr("activation"));
}

template <ScalarFn F>
Status cpuBinary(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& a = *in[0];
  const TensorView& b = *in[1];
  TensorView& r = *out[0];
  KILN_ASSIGN_OR_RETURN(auto shape, broadcastRuntime(op, a.shape, b.shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  auto body = [&](auto tag) -> Status {
    using T = decltype(tag);
    using C = typename T::Compute;
    if constexpr (isFloatOnly(F) && !std::is_floating_point_v<C>) {
      return unsupportedDType(op, a.dtype);
    } else {
      const auto* pa = data<T>(a);
      const auto* pb = data<T>(b);
      auto* pr = data<T>(r);
      forEachIndex<2>(r.shape, {broadcastStrides(a.shape, r.shape), broadcastStrides(b.shape, r.shape)},
                      [&](int64_t i, const std::array<int64_t, 2>& o) {
                        pr[i] = T::store(apply<F, C>(T::load(pa[o[0]]), T::load(pb[o[1]])));
                      });
      return Status::ok();
    }
  };
  return visitNumeric(op, a.dtype, body);
}

template <ScalarFn F>
Status cpuUnary(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  auto body = [&](auto tag) -> Status {
    using T = decltype(tag);
    using C = typename T::Compute;
    if constexpr (isFloatOnly(F) && !std::is_floating_point_v<C>) {
      return unsupportedDType(op, x.dtype);
    } else {
      const auto* px = data<T>(x);
      auto* pr = data<T>(r);
      for (int64_t i = 0, n = x.numel(); i < n; ++i) pr[i] = T::store(apply<F, C>(T::load(px[i])));
      return Status::ok();
    }
  };
  return visitNumeric(op, x.dtype, body);
}

Status cpuActivationGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& dy = *in[1];
  TensorView& r = *out[0];
  if (x.shape != dy.shape)
    return Status::errorf("'{}': x {} and dy {} differ in run-time shape", op.name(), shapeString(x.shape),
                          shapeString(dy.shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  const ScalarFn derivative = *scalarFnInfo(activationOf(op)).partner;
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    using C = typename T::Compute;
    const auto* px = data<T>(x);
    const auto* pd = data<T>(dy);
    auto* pr = data<T>(r);
    const scalar::UnaryFnPtr<C> d = scalar::unaryFnPtr<C>(derivative);
    for (int64_t i = 0, n = x.numel(); i < n; ++i) pr[i] = T::store(T::load(pd[i]) * d(T::load(px[i])));
    return Status::ok();
  });
}

Status cpuCompare(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& a = *in[0];
  const TensorView& b = *in[1];
  TensorView& r = *out[0];
  KILN_ASSIGN_OR_RETURN(auto shape, broadcastRuntime(op, a.shape, b.shape));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const ScalarFn pred = *scalarFnOf(op);
  return visitAny(op, a.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pa = data<T>(a);
    const auto* pb = data<T>(b);
    auto* pr = static_cast<uint8_t*>(r.data);
    forEachIndex<2>(r.shape, {broadcastStrides(a.shape, r.shape), broadcastStrides(b.shape, r.shape)},
                    [&](int64_t i, const std::array<int64_t, 2>& o) {
                      using C = typename T::Compute;
                      pr[i] = scalar::evaluate<C>(pred, T::load(pa[o[0]]), T::load(pb[o[1]])) != C(0);
                    });
    return Status::ok();
  });
}

// Dtype-agnostic: elements are copied as bytes.
Status cpuSelect(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& c = *in[0];
  const TensorView& a = *in[1];
  const TensorView& b = *in[2];
  TensorView& r = *out[0];
  KILN_ASSIGN_OR_RETURN(auto ab, broadcastRuntime(op, a.shape, b.shape));
  KILN_ASSIGN_OR_RETURN(auto shape, broadcastRuntime(op, c.shape, ab));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, std::move(shape)));
  const size_t es = static_cast<size_t>(dtypeBytes(a.dtype));
  const auto* pc = static_cast<const uint8_t*>(c.data);
  const auto* pa = static_cast<const unsigned char*>(a.data);
  const auto* pb = static_cast<const unsigned char*>(b.data);
  auto* pr = static_cast<unsigned char*>(r.data);
  forEachIndex<3>(r.shape,
                  {broadcastStrides(c.shape, r.shape), broadcastStrides(a.shape, r.shape),
                   broadcastStrides(b.shape, r.shape)},
                  [&](int64_t i, const std::array<int64_t, 3>& o) {
                    const unsigned char* src = pc[o[0]] ? pa + o[1] * es : pb + o[2] * es;
                    std::memcpy(pr + static_cast<size_t>(i) * es, src, es);
                  });
  return Status::ok();
}

// ---- Gradient rules ----------------------------------------------------------------------------
// Every binary rule computes the gradient at the broadcast result shape and sums it back to each
// operand's shape. Integer operands get no gradient.

using grads::binary;
using grads::sumTo;
using grads::unary;

Status setSummed(GradContext& ctx, unsigned i, Value* g, const Op& op) {
  KILN_ASSIGN_OR_RETURN(auto s, sumTo(ctx.builder, g, op.operand(i)->type()));
  ctx.operand_grads[i] = s;
  return Status::ok();
}

Status gradAdd(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, g, op));
  return setSummed(ctx, 1, g, op);
}

Status gradSub(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, g, op));
  KILN_GRAD_VALUE(ng, unary(ctx.builder, "kiln.neg", g));
  return setSummed(ctx, 1, ng, op);
}

Status gradMul(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  Builder& b = ctx.builder;
  KILN_GRAD_VALUE(ga, binary(b, "kiln.mul", g, op.operand(1)));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, ga, op));
  KILN_GRAD_VALUE(gb, binary(b, "kiln.mul", g, op.operand(0)));
  return setSummed(ctx, 1, gb, op);
}

// y = a / b: da = g / b, db = -g * y / b.
Status gradDiv(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  KILN_GRAD_VALUE(ga, binary(b, "kiln.div", g, op.operand(1)));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, ga, op));
  KILN_GRAD_VALUE(gy, binary(b, "kiln.mul", g, op.result()));
  KILN_GRAD_VALUE(gyb, binary(b, "kiln.div", gy, op.operand(1)));
  KILN_GRAD_VALUE(gb, unary(b, "kiln.neg", gyb));
  return setSummed(ctx, 1, gb, op);
}

// max: the gradient goes to a where a >= b (ties to a), else to b; min likewise with <=.
Status gradMinMax(GradContext& ctx, const Op& op, const char* predicate) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  Builder& b = ctx.builder;
  KILN_GRAD_VALUE(mask, b.createValue("kiln.compare", {op.operand(0), op.operand(1)},
                                      {{"predicate", Attribute(predicate)}}));
  KILN_GRAD_VALUE(zero, grads::scalar(b, g->type().dtype(), 0.0));
  KILN_GRAD_VALUE(ga, b.createValue("kiln.select", {mask, g, zero}));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, ga, op));
  KILN_GRAD_VALUE(gb, b.createValue("kiln.select", {mask, zero, g}));
  return setSummed(ctx, 1, gb, op);
}
Status gradMax(GradContext& ctx, const Op& op) { return gradMinMax(ctx, op, "ge"); }
Status gradMin(GradContext& ctx, const Op& op) { return gradMinMax(ctx, op, "le"); }

// y = a ** b: da = g * b * a ** (b - 1), db = g * y * log(a).
Status gradPow(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  Builder& b = ctx.builder;
  Value* x = op.operand(0);
  Value* e = op.operand(1);
  KILN_GRAD_VALUE(one, grads::scalar(b, e->type().dtype(), 1.0));
  KILN_GRAD_VALUE(em1, binary(b, "kiln.sub", e, one));
  KILN_GRAD_VALUE(p, binary(b, "kiln.pow", x, em1));
  KILN_GRAD_VALUE(ep, binary(b, "kiln.mul", e, p));
  KILN_GRAD_VALUE(ga, binary(b, "kiln.mul", g, ep));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, ga, op));
  KILN_GRAD_VALUE(lx, unary(b, "kiln.log", x));
  KILN_GRAD_VALUE(yl, binary(b, "kiln.mul", op.result(), lx));
  KILN_GRAD_VALUE(gb, binary(b, "kiln.mul", g, yl));
  return setSummed(ctx, 1, gb, op);
}

// elu(x, alpha) and prelu(x, slope) share the form x > 0 ? x : h(x, b). Where x > 0 the gradient
// goes to x alone; elsewhere `dx(g)` goes to x and `db(g)` to b.
template <class DxFormula, class DbFormula>
Status gradPiecewiseLinearAbove(GradContext& ctx, const Op& op, DxFormula dx, DbFormula db) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  Builder& b = ctx.builder;
  Value* x = op.operand(0);
  KILN_GRAD_VALUE(zero, grads::scalar(b, g->type().dtype(), 0.0));
  KILN_GRAD_VALUE(above, b.createValue("kiln.compare", {x, zero}, {{"predicate", Attribute("gt")}}));
  KILN_GRAD_VALUE(gx_below, dx(b, g));
  KILN_GRAD_VALUE(gx, b.createValue("kiln.select", {above, g, gx_below}));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 0, gx, op));
  KILN_GRAD_VALUE(gb_below, db(b, g));
  KILN_GRAD_VALUE(gb, b.createValue("kiln.select", {above, zero, gb_below}));
  return setSummed(ctx, 1, gb, op);
}

// y = alpha (e^x - 1) below 0: dx = g alpha e^x = g (y + alpha), dalpha = g (e^x - 1).
Status gradElu(GradContext& ctx, const Op& op) {
  Value* x = op.operand(0);
  Value* alpha = op.operand(1);
  Value* y = op.result();
  return gradPiecewiseLinearAbove(
      ctx, op,
      [&](Builder& b, Value* g) -> Expected<Value*> {
        KILN_GRAD_VALUE(slope, binary(b, "kiln.add", y, alpha));
        return binary(b, "kiln.mul", g, slope);
      },
      [&](Builder& b, Value* g) -> Expected<Value*> {
        KILN_GRAD_VALUE(ex, unary(b, "kiln.exp", x));
        KILN_GRAD_VALUE(one, grads::scalar(b, g->type().dtype(), 1.0));
        KILN_GRAD_VALUE(em1, binary(b, "kiln.sub", ex, one));
        return binary(b, "kiln.mul", g, em1);
      });
}

// y = slope x below 0: dx = g slope, dslope = g x (summed over the broadcast dims: a
// per-channel slope gets the sum over the batch).
Status gradPrelu(GradContext& ctx, const Op& op) {
  Value* x = op.operand(0);
  Value* slope = op.operand(1);
  return gradPiecewiseLinearAbove(
      ctx, op, [&](Builder& b, Value* g) { return binary(b, "kiln.mul", g, slope); },
      [&](Builder& b, Value* g) { return binary(b, "kiln.mul", g, x); });
}

// Unary rules: operand_grads[0] = g * f'(x), written with the op's result y where shorter.
// `formula(builder, g, x, y)` builds it.
template <class Formula>
Status unaryRule(GradContext& ctx, const Op& op, Formula formula) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  Expected<Value*> v = formula(ctx.builder, g, op.operand(0), op.result());
  if (!v) return v.status();
  ctx.operand_grads[0] = *v;
  return Status::ok();
}
using B = Builder;
using V = Value*;
using EV = Expected<Value*>;

Status gradNeg(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V) -> EV { return unary(b, "kiln.neg", g); });
}

// |x|' = sign(x), with the subgradient +1 at 0.
Status gradAbs(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V x, V) -> EV {
    KILN_GRAD_VALUE(zero, grads::scalar(b, x->type().dtype(), 0.0));
    KILN_GRAD_VALUE(mask, b.createValue("kiln.compare", {x, zero}, {{"predicate", Attribute("ge")}}));
    KILN_GRAD_VALUE(ng, unary(b, "kiln.neg", g));
    return b.createValue("kiln.select", {mask, g, ng});
  });
}

Status gradExp(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V y) -> EV { return binary(b, "kiln.mul", g, y); });
}

Status gradLog(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V x, V) -> EV { return binary(b, "kiln.div", g, x); });
}

// sqrt' = 0.5 / y
Status gradSqrt(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V y) -> EV {
    KILN_GRAD_VALUE(half, grads::scalar(b, g->type().dtype(), 0.5));
    KILN_GRAD_VALUE(gh, binary(b, "kiln.mul", g, half));
    return binary(b, "kiln.div", gh, y);
  });
}

// rsqrt' = -0.5 y^3
Status gradRsqrt(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V y) -> EV {
    KILN_GRAD_VALUE(c, grads::scalar(b, g->type().dtype(), -0.5));
    KILN_GRAD_VALUE(y2, binary(b, "kiln.mul", y, y));
    KILN_GRAD_VALUE(y3, binary(b, "kiln.mul", y2, y));
    KILN_GRAD_VALUE(gy3, binary(b, "kiln.mul", g, y3));
    return binary(b, "kiln.mul", gy3, c);
  });
}

// sigmoid' = y (1 - y)
Status gradSigmoid(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V y) -> EV {
    KILN_GRAD_VALUE(one, grads::scalar(b, g->type().dtype(), 1.0));
    KILN_GRAD_VALUE(omy, binary(b, "kiln.sub", one, y));
    KILN_GRAD_VALUE(d, binary(b, "kiln.mul", y, omy));
    return binary(b, "kiln.mul", g, d);
  });
}

// tanh' = 1 - y^2
Status gradTanh(GradContext& ctx, const Op& op) {
  return unaryRule(ctx, op, [](B& b, V g, V, V y) -> EV {
    KILN_GRAD_VALUE(one, grads::scalar(b, g->type().dtype(), 1.0));
    KILN_GRAD_VALUE(y2, binary(b, "kiln.mul", y, y));
    KILN_GRAD_VALUE(d, binary(b, "kiln.sub", one, y2));
    return binary(b, "kiln.mul", g, d);
  });
}

// relu, gelu, silu: one fused backward op that reads x. relu reads its output instead (y > 0
// exactly where x > 0): the pre-activation then dies in the forward pass, which saves its memory
// and lets matmul + bias + relu run as one GEMM with an epilogue.
Status gradActivation(GradContext& ctx, const Op& op) {
  const ScalarFn act = *op.def()->scalar_fn;
  return unaryRule(ctx, op, [&](B& b, V g, V x, V y) -> EV {
    return b.createValue("kiln.activation_grad", {act == ScalarFn::Relu ? y : x, g},
                         {{"activation", Attribute(std::string(scalarFnInfo(act).spelling))}});
  });
}

// select(c, a, b): a gets g where c holds, b elsewhere; the condition gets none.
Status gradSelect(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g || !isFloat(g->type().dtype())) return Status::ok();
  Builder& b = ctx.builder;
  KILN_GRAD_VALUE(zero, grads::scalar(b, g->type().dtype(), 0.0));
  KILN_GRAD_VALUE(ga, b.createValue("kiln.select", {op.operand(0), g, zero}));
  KILN_RETURN_IF_ERROR(setSummed(ctx, 1, ga, op));
  KILN_GRAD_VALUE(gb, b.createValue("kiln.select", {op.operand(0), zero, g}));
  return setSummed(ctx, 2, gb, op);
}

Status inferActivationGrad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& dy = op.operand(1)->type();
  if (x.dtype() != dy.dtype() || x.shape() != dy.shape())
    return Status::errorf("'kiln.activation_grad' x {} and dy {} must have the same type", x.str(), dy.str());
  out = {x.withSharding(std::nullopt)};
  return Status::ok();
}

// Rough per-element flop counts: a transcendental function counts as several operations.
template <int Flops>
OpCost costPerElement(const Op& op, const SymbolBindings& symbols) {
  return elementwiseCost(op, symbols, Flops);
}

// The one-line summary of a function's op: its body when that is one return statement, with
// the T(...) of its constants dropped ("x > 0 ? x : 0").
std::string formulaOf(const ScalarFnInfo& info) {
  std::string_view b = info.body;
  if (!b.starts_with("return ") || !b.ends_with(";") || b.find(';') != b.size() - 1)
    return fmt::format("{} (ir/scalar_fn.def)", info.spelling);
  b = b.substr(7, b.size() - 8);
  std::string out;
  for (size_t i = 0; i < b.size(); ++i) {
    const bool starts_word =
        i == 0 || !(std::isalnum(static_cast<unsigned char>(b[i - 1])) || b[i - 1] == '_');
    if (starts_word && b.substr(i, 2) == "T(") {
      size_t close = b.find(')', i);
      std::string_view inner = b.substr(i + 2, close - i - 2);
      if (close != std::string_view::npos &&
          inner.find_first_not_of("0123456789.-") == std::string_view::npos) {
        out += inner;
        i = close;
        continue;
      }
    }
    out += b[i];
  }
  return out;
}

void addElementwise(OpRegistry& r, ScalarFn fn, CpuFn cpu, GradFn grad, CostFn cost) {
  const ScalarFnInfo& info = scalarFnInfo(fn);
  const bool binary = info.arity == 2;
  r.add({.name = fmt::format("kiln.{}", info.spelling),
         .summary = formulaOf(info),
         .min_operands = info.arity,
         .max_operands = info.arity,
         .traits =
             kPure | kElementwise | (binary ? kBroadcasting : 0u) | (info.commutative ? kCommutative : 0u),
         .infer = binary ? inferBinary : inferUnary,
         .verify = info.domain == ScalarDomain::Float ? verifyFloatOperands : nullptr,
         .cost = cost,
         .grad = grad,
         .cpu = cpu,
         .scalar_fn = fn});
}

std::vector<std::string> activationNames() {
  std::vector<std::string> names;
  for (const ScalarFnInfo& i : scalarFns())
    if (i.kind == ScalarFnKind::Activation) names.emplace_back(i.spelling);
  return names;
}

}  // namespace

void registerElementwiseOps(OpRegistry& r) {
  // Every op of scalar_fn.def; the gradient rule of an entry is grad<Name> above, or for an
  // activation the shared kiln.activation_grad rule.
#define KILN_UNARY(Name, spelling, flops, domain, body) \
  addElementwise(r, ScalarFn::Name, cpuUnary<ScalarFn::Name>, grad##Name, costPerElement<flops>);
#define KILN_ACTIVATION(Name, spelling, flops, body, derivative) \
  addElementwise(r, ScalarFn::Name, cpuUnary<ScalarFn::Name>, gradActivation, costPerElement<flops>);
#define KILN_BINARY(Name, spelling, flops, domain, commutative, body) \
  addElementwise(r, ScalarFn::Name, cpuBinary<ScalarFn::Name>, grad##Name, costPerElement<flops>);
#include "ir/scalar_fn.def"

  std::vector<std::string> predicates;
  for (const ScalarFnInfo& i : scalarFns())
    if (i.kind == ScalarFnKind::Compare) predicates.emplace_back(i.spelling);
  r.add({.name = "kiln.compare",
         .summary = "Elementwise comparison, an i1 result",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"predicate", Attribute::Kind::String, true, std::nullopt, predicates}},
         .traits = kPure | kElementwise | kBroadcasting | kNonDifferentiable,
         .infer = inferCompare,
         .cost = costPerElement<1>,
         .cpu = cpuCompare});
  r.add({.name = "kiln.select", .summary = "cond ? a : b, elementwise with broadcasting",
         .min_operands = 3, .max_operands = 3,
         .traits = kPure | kElementwise | kBroadcasting,
         .infer = inferSelect, .cost = costPerElement<1>, .grad = gradSelect, .cpu = cpuSelect});
  // Backward-only: autodiff emits it; no second-order gradients flow through it.
  r.add({.name = "kiln.activation_grad",
         .summary = "dy * f'(x) for an activation f (the backward of an activation)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"activation", Attribute::Kind::String, true, std::nullopt, activationNames()}},
         .traits = kPure | kElementwise | kNonDifferentiable,
         .infer = inferActivationGrad,
         .verify = verifyFloatOperands,
         .cost = costPerElement<12>,
         .cpu = cpuActivationGrad});
}

}  // namespace kiln::ir
