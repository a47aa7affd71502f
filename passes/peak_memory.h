// The planned arena peak of a function, estimated in passes/ (which may not call codegen): the
// same computation as codegen's CPU lowering plus memory planner (codegen/lower_cpu.h,
// codegen/memory_planner.h): one buffer per op result in op order (a fused group's ops one by
// one, each on the stream the schedule chose), inputs and parameters outside the arena, returned
// values live to the end, and the same layout (ir/arena_plan.h: best fit at 64-byte alignment,
// in-place reuse by elementwise ops and reshapes, reuse across streams only after a join). A
// test keeps the two equal on every model.
#pragma once

#include <cstdint>

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

// Arena high-water mark in bytes under concrete symbol values; an error names an unbound symbol.
Expected<int64_t> estimatePeakBytes(const ir::Function& f, const ir::SymbolBindings& symbols);

}  // namespace kiln::passes
