// Mixed precision: the `mixed-precision` pass (passes.def) and its rewrite, for tests and tools.
#pragma once

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

// Rewrites each f32 kiln.matmul of `f` to cast(matmul(cast(a, bf16), cast(b, bf16)), f32):
// bf16 storage of GEMM inputs and outputs, f32 accumulation. Returns whether anything changed.
Expected<bool> castMatmulsToBf16(ir::Function& f);

}  // namespace kiln::passes
