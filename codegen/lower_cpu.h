// Lowers a verified Function to a Program for the CPU backend: each op becomes a launch of
// its computation over buffers, sources (kiln.input, kiln.parameter) become buffers held
// outside the arena, and the symbols are bound so that every buffer has a size. Ops carrying
// `kiln.stream = N` (set by a scheduling pass) go to stream N, with record/wait events where a
// value crosses streams and where an in-place update (an optimizer step) must wait for readers
// of the old value on another stream (ir/arena_plan.h's StreamHazards). The memory planner then
// lays out the arena.
#pragma once

#include <string_view>

#include "codegen/memory_planner.h"
#include "codegen/program.h"
#include "ir/ir.h"

namespace kiln::codegen {

// The attribute that marks the launches of one pointwise fusion group (its number, in program
// order): the CPU executor runs them as one loop over the data.
inline constexpr std::string_view kGroupAttr = "kiln.group";

struct CpuLoweringOptions {
  bool plan_memory = true;
  MemoryPlanOptions memory;
};

// Errors (an unbound symbol, an op the table does not know) come back located at the op.
Expected<Program> lowerForCpu(const ir::Function& f, const ir::SymbolBindings& symbols,
                              const CpuLoweringOptions& options = {});

}  // namespace kiln::codegen
