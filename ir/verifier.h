// The IR verifier: structure (terminators, result types), SSA dominance, and each op's own
// rules from the op table. The pass manager runs it between passes.
#pragma once

#include "ir/ir.h"

namespace kiln::ir {

// Returns the first problem found, located at the offending op.
Status verify(const Function& f);
Status verify(const Module& m);

}  // namespace kiln::ir
