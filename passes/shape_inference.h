// Shape inference (passes/shape_inference.cc), also for passes that change a type mid-function
// (the shard pass's expert slices and dispatched rows).
#pragma once

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

// Recomputes every inferred result type of `f` from the op table, in program order, re-verifies
// every op, and makes f's result types what it returns. True when a type changed; fails, located
// at the op, when an op's operands no longer fit together.
Expected<bool> inferShapes(ir::Function& f);

}  // namespace kiln::passes
