// The optimizer step's math as kernel expressions, shared by the dense optimizer emitter
// (optimizer.cc) and the sparse row update of the embedding update emitter
// (embedding_update.cc).
#pragma once

#include <functional>
#include <string>

#include "codegen/emit/group_lowering.h"

namespace kiln::codegen::emit {

// An update's hyper-parameters: lr, step and the gradient scale as nodes (-1: no scale), the
// rest from the op's attributes.
struct Hyper {
  int lr = -1, step = -1, scale = -1;
  double eps, beta1, beta2, weight_decay, momentum;
  bool nesterov;
};

// Loads the lr, step (and scale) operands of `op` into kernel `kb`, at compute type ct.
Hyper hyper(GroupLowering& gl, KernelBuilder& kb, const ir::Op& op, int lr_operand, int step_operand,
            int scale_operand, DType ct);

// The per-element update of sgd / adagrad / adam / adamw: stores the new values of w's state
// through `store_state(i, v)` (state i at the element is `state(i)`); returns the new w.
int elementUpdate(ExprGraph& g, const std::string& kind, const Hyper& h, int w, int grad, DType ct,
                  const std::function<int(int)>& state, const std::function<void(int, int)>& store_state);

}  // namespace kiln::codegen::emit
