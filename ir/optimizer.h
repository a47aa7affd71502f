// The optimizers Kiln trains with: their state slots and the operand layout of the two update
// ops (ir/ops/optimizer.cc), shared by the autodiff pass that emits them and the kernels that run
// them, so both agree on one description.
//
//   "kiln.optimizer_update"(param, grad, state..., lr, step[, grad_scale])
//       {kind = "sgd"|"adagrad"|"adam"|"adamw", lr, momentum, nesterov, eps, beta1, beta2,
//        weight_decay, scaled}
//   "kiln.embedding_bag_update"(table, ids[, lengths][, weights], grad_out, state..., lr, step
//                               [, grad_scale])
//       {optimizer = "sgd"|"adagrad"|"rowwise_adagrad"|"adam", lr, eps, beta1, beta2,
//        weight_decay, mode, weighted, scaled}
//   "kiln.embedding_bag_grad_sqnorm"(ids[, lengths][, weights], grad_out) {mode, weighted}
//
// `lr` is the scalar schedule factor the trainer feeds each step (the step size is the op's
// `lr` attribute times it); `step` is the 1-based step; `grad_scale` (present when `scaled`) is
// the global-norm clipping factor the gradient is multiplied by. lengths are present exactly
// when ids are flat ([N]); weights exactly when `weighted`.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/attribute.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"

namespace kiln::ir {

// One piece of optimizer state kept per parameter, stored as a parameter named
// "<param>.<suffix>" with trainable = false and state_of = "<param>".
struct OptimizerStateSlot {
  std::string suffix;        // "momentum", "adagrad_sum", "rowwise_adagrad_sum", "adam_m", "adam_v"
  bool rowwise = false;      // one value per table row ([R]) instead of the parameter's shape
  double initial_value = 0;  // Adagrad's initial accumulator; 0 otherwise
};

// State slots of a dense optimizer (`kind` of kiln.optimizer_update), given its attributes
// (momentum decides whether SGD keeps a velocity; initial_accumulator seeds Adagrad).
std::vector<OptimizerStateSlot> denseOptimizerState(std::string_view kind, const AttrDict& attrs);
// State slots of a sparse embedding optimizer (`optimizer` of kiln.embedding_bag_update).
std::vector<OptimizerStateSlot> sparseOptimizerState(std::string_view kind, const AttrDict& attrs);
bool isDenseOptimizer(std::string_view kind);
bool isSparseOptimizer(std::string_view kind);

// Operand positions of a kiln.embedding_bag_update or kiln.embedding_bag_grad_sqnorm op (the
// latter has no table, state, lr or step: those fields are -1).
struct EmbeddingUpdateLayout {
  int table = -1;
  int ids = 0;
  int lengths = -1;
  int weights = -1;
  int grad_out = 0;
  int state_begin = -1;
  int num_state = 0;
  int lr = -1;
  int step = -1;
  int grad_scale = -1;
  int num_operands = 0;
};
// nullopt when the op's attributes do not determine a layout (an unknown optimizer).
std::optional<EmbeddingUpdateLayout> embeddingUpdateLayout(const Op& op);

// The sample (bag) that owns each id position of one of those ops, and each position's pooling
// factor before weights: 1/(its sample's length) under mode = "mean", else 1. Flat ids: sample b
// owns the next lengths[b] ids, and the lengths must add up to the ids; [B, H] ids: H each.
// Shared by the op table's reference hooks (ir/ops/optimizer.cc) and the CPU kernel
// (runtime/cpu/kernels/embedding_update.cc).
struct IdSamples {
  std::vector<int64_t> sample;  // per id position
  std::vector<double> coeff;    // per id position
};
Expected<IdSamples> idSamples(const Op& op, const EmbeddingUpdateLayout& l,
                              const std::vector<const TensorView*>& in);

// ---- The dense optimizer step, element by element --------------------------------------------
// One definition of the math of kiln.optimizer_update, shared by the op table's reference hook
// (ir/ops/optimizer.cc) and the threaded CPU kernel (runtime/cpu/kernels/optimizer_update.cc),
// so both give the same bits. Each element is computed in double and stored in T: the sparse
// update computes its rows in double too, and a hybrid table's hot rows (stepped here) must
// agree to the bit with the same rows stepped sparsely under another plan (f32 math here broke
// lit/cli/train_ranks' plan-against-plan AUC in its last digit).

enum class DenseStep { kSgd, kSgdMomentum, kAdagrad, kAdam, kAdamW };

struct DenseHyper {
  DenseStep step = DenseStep::kSgd;
  double lr = 0, momentum = 0, eps = 1e-8, beta1 = 0.9, beta2 = 0.999, weight_decay = 0, scale = 1;
  bool nesterov = false;
  double bias1 = 1, bias2 = 1;  // Adam's 1 - beta^t
};

// The hyperparameters of a kiln.optimizer_update op, given the step's lr factor, its 1-based step
// number and the clipping scale (1 when the op is not `scaled`). Adam needs step >= 1.
Expected<DenseHyper> denseHyper(const Op& op, double lr_factor, double step, double scale);

template <DenseStep K, typename T>
void denseStepRange(const DenseHyper& h, int64_t begin, int64_t end, T* p, const T* grad, T* s0, T* s1) {
  for (int64_t i = begin; i < end; ++i) {
    double w = p[i];
    double g = static_cast<double>(grad[i]) * h.scale;
    if constexpr (K == DenseStep::kAdamW) {
      w -= h.lr * h.weight_decay * w;
    } else {
      g += h.weight_decay * w;
    }
    if constexpr (K == DenseStep::kSgd) {
      w -= h.lr * g;
    } else if constexpr (K == DenseStep::kSgdMomentum) {
      double m = h.momentum * static_cast<double>(s0[i]) + g;
      s0[i] = static_cast<T>(m);
      w -= h.lr * (h.nesterov ? g + h.momentum * m : m);
    } else if constexpr (K == DenseStep::kAdagrad) {
      double s = static_cast<double>(s0[i]) + g * g;
      s0[i] = static_cast<T>(s);
      w -= h.lr * g / (std::sqrt(s) + h.eps);
    } else {
      double m = h.beta1 * static_cast<double>(s0[i]) + (1 - h.beta1) * g;
      double v = h.beta2 * static_cast<double>(s1[i]) + (1 - h.beta2) * g * g;
      s0[i] = static_cast<T>(m);
      s1[i] = static_cast<T>(v);
      w -= h.lr * (m / h.bias1) / (std::sqrt(v / h.bias2) + h.eps);
    }
    p[i] = static_cast<T>(w);
  }
}

// Elements [begin, end) of one step; s0 / s1 are the state slots (null when the step has none).
template <typename T>
void denseStep(const DenseHyper& h, int64_t begin, int64_t end, T* p, const T* grad, T* s0, T* s1) {
  switch (h.step) {
    case DenseStep::kSgd: return denseStepRange<DenseStep::kSgd>(h, begin, end, p, grad, s0, s1);
    case DenseStep::kSgdMomentum: return denseStepRange<DenseStep::kSgdMomentum>(h, begin, end, p, grad, s0, s1);
    case DenseStep::kAdagrad: return denseStepRange<DenseStep::kAdagrad>(h, begin, end, p, grad, s0, s1);
    case DenseStep::kAdam: return denseStepRange<DenseStep::kAdam>(h, begin, end, p, grad, s0, s1);
    case DenseStep::kAdamW: return denseStepRange<DenseStep::kAdamW>(h, begin, end, p, grad, s0, s1);
  }
}

}  // namespace kiln::ir
