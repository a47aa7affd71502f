// Losses, reduced to a scalar (f32; f64 when the logits are f64, for gradient checks).
//   kiln.bce_with_logits(logits[...], labels[...])  binary cross entropy on logits, stable form
//     max(x, 0) - x y + log1p(exp(-|x|)), averaged over all elements (or summed)
//   kiln.softmax_cross_entropy(logits[N, C], labels[N] (class ids) or [N, C] (probabilities))
//     logsumexp(x_n) - x_n[label_n], or -sum_c p_nc (x_nc - logsumexp(x_n)); averaged over N
// and their backward ops, which give the gradient with respect to the logits (labels get none):
//   kiln.bce_with_logits_grad(logits, labels, g) {reduction}        g (sigmoid(x) - y) / count
//   kiln.softmax_cross_entropy_grad(logits, labels, g) {reduction}  g (softmax(x) sum_c p - p) / N
#include <cmath>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

DType lossType(const TensorType& logits) { return logits.dtype() == DType::f64 ? DType::f64 : DType::f32; }

Status inferBce(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& y = op.operand(1)->type();
  if (!isFloat(x.dtype()) || !isFloat(y.dtype()))
    return Status::errorf("'kiln.bce_with_logits' needs float operands, got {} and {}", x.str(), y.str());
  if (x.shape() != y.shape())
    return Status::errorf("'kiln.bce_with_logits' logits {} and labels {} differ in shape", x.str(), y.str());
  out = {TensorType(lossType(x), {})};
  return Status::ok();
}

Status inferSoftmaxCE(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& y = op.operand(1)->type();
  if (x.rank() != 2 || !isFloat(x.dtype()))
    return Status::errorf("'kiln.softmax_cross_entropy' logits must be float [N, C], got {}", x.str());
  if (y.rank() == 1) {
    if (!isInteger(y.dtype()) || !(y.dim(0) == x.dim(0)))
      return Status::errorf("'kiln.softmax_cross_entropy' class labels must be integer [{}], got {}",
                            x.dim(0).str(), y.str());
  } else if (y.shape() != x.shape() || !isFloat(y.dtype())) {
    return Status::errorf("'kiln.softmax_cross_entropy' labels must be class ids [N] or probabilities {}, got {}",
                          x.str(), y.str());
  }
  out = {TensorType(lossType(x), {})};
  return Status::ok();
}

// ---- CPU kernels -------------------------------------------------------------------------------

void storeScalar(TensorView& r, double v) {
  if (r.dtype == DType::f64)
    *static_cast<double*>(r.data) = v;
  else
    *static_cast<float*>(r.data) = static_cast<float>(v);
}

// log(1 + exp(-|x|)) never overflows.
double bceTerm(double x, double y) { return std::max(x, 0.0) - x * y + std::log1p(std::exp(-std::abs(x))); }
double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

Status checkSameShape(const Op& op, const TensorView& x, const TensorView& y) {
  if (x.shape != y.shape)
    return Status::errorf("'{}': logits {} and labels {} differ in run-time shape", op.name(),
                          shapeString(x.shape), shapeString(y.shape));
  return Status::ok();
}

Status cpuBce(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& y = *in[1];
  KILN_RETURN_IF_ERROR(checkSameShape(op, x, y));
  double sum = 0;
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) sum += bceTerm(loadAsDouble(x, i), loadAsDouble(y, i));
  storeScalar(*out[0], op.strAttr("reduction") == "sum" || n == 0 ? sum : sum / static_cast<double>(n));
  return Status::ok();
}

Status cpuBceGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& y = *in[1];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(checkSameShape(op, x, y));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  const int64_t n = x.numel();
  const double g = loadAsDouble(*in[2], 0);
  const double scale = op.strAttr("reduction") == "sum" || n == 0 ? g : g / static_cast<double>(n);
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    auto* pr = data<T>(r);
    for (int64_t i = 0; i < n; ++i)
      pr[i] = T::store(scale * (sigmoid(loadAsDouble(x, i)) - loadAsDouble(y, i)));
    return Status::ok();
  });
}

// Calls row_fn(n, softmax row, log-sum-exp) for each row of the [N, C] logits.
template <class RowFn>
void forEachSoftmaxRow(const TensorView& x, RowFn&& row_fn) {
  const int64_t rows = x.shape[0], classes = x.shape[1];
  std::vector<double> p(static_cast<size_t>(classes));
  for (int64_t n = 0; n < rows; ++n) {
    double mx = -INFINITY;
    for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, loadAsDouble(x, n * classes + c));
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) {
      p[static_cast<size_t>(c)] = std::exp(loadAsDouble(x, n * classes + c) - mx);
      sum += p[static_cast<size_t>(c)];
    }
    for (double& v : p) v /= sum;
    row_fn(n, p, mx + std::log(sum));
  }
}

// Class-id labels must lie in [0, C).
Status checkLabels(const Op& op, const TensorView& x, const TensorView& y) {
  if (y.rank() == 1) {
    if (y.shape[0] != x.shape[0])
      return Status::errorf("'{}': {} labels for {} rows of logits", op.name(), y.shape[0], x.shape[0]);
    for (int64_t n = 0; n < y.shape[0]; ++n) {
      const int64_t c = loadIndex(y, n);
      if (c < 0 || c >= x.shape[1])
        return Status::errorf("'{}': label {} at position [{}] is out of range [0, {})", op.name(), c, n,
                              x.shape[1]);
    }
    return Status::ok();
  }
  return checkSameShape(op, x, y);
}

Status cpuSoftmaxCE(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& y = *in[1];
  KILN_RETURN_IF_ERROR(checkLabels(op, x, y));
  const int64_t classes = x.shape[1];
  double total = 0;
  forEachSoftmaxRow(x, [&](int64_t n, const std::vector<double>&, double lse) {
    if (y.rank() == 1) {
      total += lse - loadAsDouble(x, n * classes + loadIndex(y, n));
    } else {
      for (int64_t c = 0; c < classes; ++c)
        total -= loadAsDouble(y, n * classes + c) * (loadAsDouble(x, n * classes + c) - lse);
    }
  });
  const int64_t rows = x.shape[0];
  storeScalar(*out[0],
              op.strAttr("reduction") == "sum" || rows == 0 ? total : total / static_cast<double>(rows));
  return Status::ok();
}

Status cpuSoftmaxCEGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& y = *in[1];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(checkLabels(op, x, y));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  const int64_t rows = x.shape[0], classes = x.shape[1];
  const double g = loadAsDouble(*in[2], 0);
  const double scale = op.strAttr("reduction") == "sum" || rows == 0 ? g : g / static_cast<double>(rows);
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    auto* pr = data<T>(r);
    forEachSoftmaxRow(x, [&](int64_t n, const std::vector<double>& p, double) {
      double mass = 1;  // sum_c of the label distribution
      if (y.rank() == 2) {
        mass = 0;
        for (int64_t c = 0; c < classes; ++c) mass += loadAsDouble(y, n * classes + c);
      }
      for (int64_t c = 0; c < classes; ++c) {
        const double target =
            y.rank() == 1 ? (loadIndex(y, n) == c ? 1.0 : 0.0) : loadAsDouble(y, n * classes + c);
        pr[n * classes + c] = T::store(scale * (p[static_cast<size_t>(c)] * mass - target));
      }
    });
    return Status::ok();
  });
}

// ---- Gradient rules ----------------------------------------------------------------------------

// Both losses: the logits get a fused backward op; the labels get no gradient.
Status gradLoss(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  const std::string name = op.name() + "_grad";
  KILN_GRAD_VALUE(dx, ctx.builder.createValue(name, {op.operand(0), op.operand(1), g},
                                              {{"reduction", Attribute(op.strAttr("reduction", "mean"))}}));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

// (logits, labels, g): the logits' type; g is the loss's scalar gradient.
Status inferLossGrad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& g = op.operand(2)->type();
  if (g.rank() != 0 || !isFloat(g.dtype()))
    return Status::errorf("'{}' needs a scalar float gradient, got {}", op.name(), g.str());
  std::vector<TensorType> loss;
  KILN_RETURN_IF_ERROR(op.name() == "kiln.bce_with_logits_grad" ? inferBce(op, loss)
                                                                : inferSoftmaxCE(op, loss));
  out = {x.withSharding(std::nullopt)};
  return Status::ok();
}

// A few operations per logit (exp, log1p or a softmax), on every logit and label.
OpCost costLoss(const Op& op, const SymbolBindings& symbols) {
  return {6 * typeElements(op.operand(0)->type(), symbols), operandAndResultBytes(op, symbols)};
}

}  // namespace

void registerLossOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.bce_with_logits", .summary = "Binary cross entropy on logits",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure, .infer = inferBce, .cost = costLoss, .grad = gradLoss, .cpu = cpuBce});
  r.add({.name = "kiln.softmax_cross_entropy", .summary = "Cross entropy of softmax(logits) against labels",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure, .infer = inferSoftmaxCE, .cost = costLoss, .grad = gradLoss, .cpu = cpuSoftmaxCE});
  // Backward-only: autodiff emits them; no second-order gradients flow through them.
  r.add({.name = "kiln.bce_with_logits_grad", .summary = "Gradient of bce_with_logits with respect to the logits",
         .min_operands = 3, .max_operands = 3,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure | kNonDifferentiable, .infer = inferLossGrad, .cost = costLoss, .cpu = cpuBceGrad});
  r.add({.name = "kiln.softmax_cross_entropy_grad",
         .summary = "Gradient of softmax_cross_entropy with respect to the logits",
         .min_operands = 3, .max_operands = 3,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure | kNonDifferentiable, .infer = inferLossGrad, .cost = costLoss, .cpu = cpuSoftmaxCEGrad});
}

}  // namespace kiln::ir
