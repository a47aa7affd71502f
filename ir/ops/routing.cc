// Ops of docs/moe.md, "IR ops" (being written: see that section for each op's contract).
#include "ir/op_def.h"

namespace kiln::ir {

void registerRoutingOps(OpRegistry&) {}

}  // namespace kiln::ir
