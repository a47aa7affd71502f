// Autodiff: builds @train_step (forward, loss, backward, optimizer updates as one function) from
// @forward and the module's `kiln.train` block. docs/autodiff.md describes the result.
#pragma once

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

// Replaces any existing @train_step. Errors (no train block, an unknown optimizer, an op without
// a gradient rule, ...) are located at the offending op or name the offending field.
Status buildTrainStep(ir::Module& module);

}  // namespace kiln::passes
