// The dense optimizer step (kiln.optimizer_update, math in ir/ops/optimizer.cc) over f32
// parameters, threaded over elements. The optimizer is chosen once per launch (a template
// parameter), not per element, and each element is computed in double exactly as the reference
// does, so a step gives the same bits whatever the thread count and whichever path ran it.
#include <cmath>

#include <fmt/format.h>

#include "ir/optimizer.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

enum class Kind { kSgd, kSgdMomentum, kAdagrad, kAdam, kAdamW };

struct Hyper {
  double lr, momentum, eps, beta1, beta2, weight_decay, scale;
  bool nesterov;
  double bias1 = 1, bias2 = 1;  // Adam's 1 - beta^t
};

inline double loadScalar(const ir::TensorView& v) {
  return v.dtype == ir::DType::f64 ? *v.as<double>() : loadF(v.data, v.dtype, 0);
}

template <Kind K>
void update(const Hyper& h, int64_t begin, int64_t end, float* p, const float* grad, float* s0, float* s1) {
  for (int64_t i = begin; i < end; ++i) {
    double w = p[i];
    double g = static_cast<double>(grad[i]) * h.scale;
    if constexpr (K == Kind::kAdamW) {
      w -= h.lr * h.weight_decay * w;
    } else {
      g += h.weight_decay * w;
    }
    if constexpr (K == Kind::kSgd) {
      w -= h.lr * g;
    } else if constexpr (K == Kind::kSgdMomentum) {
      double m = h.momentum * static_cast<double>(s0[i]) + g;
      s0[i] = static_cast<float>(m);
      w -= h.lr * (h.nesterov ? g + h.momentum * m : m);
    } else if constexpr (K == Kind::kAdagrad) {
      double s = static_cast<double>(s0[i]) + g * g;
      s0[i] = static_cast<float>(s);
      w -= h.lr * g / (std::sqrt(s) + h.eps);
    } else {
      double m = h.beta1 * static_cast<double>(s0[i]) + (1 - h.beta1) * g;
      double v = h.beta2 * static_cast<double>(s1[i]) + (1 - h.beta2) * g * g;
      s0[i] = static_cast<float>(m);
      s1[i] = static_cast<float>(v);
      w -= h.lr * (m / h.bias1) / (std::sqrt(v / h.bias2) + h.eps);
    }
    p[i] = static_cast<float>(w);
  }
}

bool supportsOptimizerUpdate(const ir::Op& op) {
  if (!ir::isDenseOptimizer(op.strAttr("kind"))) return false;
  const size_t nstate = ir::denseOptimizerState(op.strAttr("kind"), op.attrs()).size();
  for (size_t i = 0; i < 2 + nstate && i < op.numOperands(); ++i)
    if (op.operand(static_cast<unsigned>(i))->type().dtype() != ir::DType::f32) return false;
  return true;
}

Status runOptimizerUpdate(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                          const std::vector<ir::TensorView*>&, const KernelContext& ctx) {
  const std::string kind = op.strAttr("kind");
  const size_t nstate = ir::denseOptimizerState(kind, op.attrs()).size();
  const size_t s = 2 + nstate;
  if (in.size() < s + 2) return Status::errorf("'{}' ({}): expected {} operands, got {}", op.name(), kind, s + 2, in.size());
  Hyper h;
  h.lr = op.floatAttr("lr") * loadScalar(*in[s]);
  const double step = loadScalar(*in[s + 1]);
  h.scale = op.boolAttr("scaled") ? loadScalar(*in[s + 2]) : 1.0;
  h.momentum = op.floatAttr("momentum");
  h.nesterov = op.boolAttr("nesterov");
  h.eps = op.floatAttr("eps", 1e-8);
  h.beta1 = op.floatAttr("beta1", 0.9);
  h.beta2 = op.floatAttr("beta2", 0.999);
  h.weight_decay = op.floatAttr("weight_decay");
  Kind k;
  if (kind == "sgd") {
    k = nstate ? Kind::kSgdMomentum : Kind::kSgd;
  } else if (kind == "adagrad") {
    k = Kind::kAdagrad;
  } else {
    if (step < 1) return Status::errorf("'{}' ({}): step must be >= 1, got {}", op.name(), kind, step);
    h.bias1 = 1 - std::pow(h.beta1, step);
    h.bias2 = 1 - std::pow(h.beta2, step);
    k = kind == "adamw" ? Kind::kAdamW : Kind::kAdam;
  }
  const int64_t n = in[0]->numel();
  for (size_t i = 1; i < s; ++i)
    if (in[i]->numel() != n)
      return Status::errorf("'{}': operand {} has {} elements, the parameter {}", op.name(), i, in[i]->numel(), n);
  float* p = static_cast<float*>(in[0]->data);
  const float* g = in[1]->as<float>();
  float* s0 = nstate > 0 ? static_cast<float*>(in[2]->data) : nullptr;
  float* s1 = nstate > 1 ? static_cast<float*>(in[3]->data) : nullptr;
  // Memory-bound: chunks of 64K elements keep every thread streaming.
  ctx.pool->parallelFor(n, 1 << 16, [&](int64_t b, int64_t e) {
    switch (k) {
      case Kind::kSgd: update<Kind::kSgd>(h, b, e, p, g, s0, s1); break;
      case Kind::kSgdMomentum: update<Kind::kSgdMomentum>(h, b, e, p, g, s0, s1); break;
      case Kind::kAdagrad: update<Kind::kAdagrad>(h, b, e, p, g, s0, s1); break;
      case Kind::kAdam: update<Kind::kAdam>(h, b, e, p, g, s0, s1); break;
      case Kind::kAdamW: update<Kind::kAdamW>(h, b, e, p, g, s0, s1); break;
    }
  });
  return Status::ok();
}

}  // namespace

void registerOptimizerKernels(KernelTable& t) {
  addKernel(t, "kiln.optimizer_update", {"optimizer_update", runOptimizerUpdate, supportsOptimizerUpdate});
}

}  // namespace kiln::runtime::cpu
