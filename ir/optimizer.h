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

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/attribute.h"
#include "ir/ir.h"

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

}  // namespace kiln::ir
