// Scheduling: orders each function's ops to shorten lifetimes and assigns independent work to
// streams.
//  - Order: a list scheduler over the block's dependences (dependence.h). Among the ready ops
//    it prefers one that frees more bytes than it allocates (its operands die there), else the
//    earliest in the current order; recomputed ops (remat) are never pulled early, which would
//    undo them. The new order is kept only if the estimated planned peak does not grow.
//  - Streams: the embedding work, which only meets the dense network through one concat and
//    one gradient, runs on stream 1 (`kiln.stream = 1`: lookups over the model's sources, the
//    sparse updates and the gradient slices that feed them); everything else on stream 0.
//    codegen turns a value that crosses streams into a record/wait event pair.
#pragma once

#include <cstdint>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"

namespace kiln::passes {

// Schedules one function (order, then streams) for `target` under `symbols` (unbound ones at
// the cost model's default); returns whether anything changed.
Expected<bool> scheduleFunction(ir::Function& f, const ir::SymbolBindings& symbols,
                                const Target& target = cpuTarget());

// The planned peak `f` would have once scheduled, computed on a copy: what a percentage memory
// budget refers to when remat runs before the schedule.
Expected<int64_t> scheduledPeakBytes(const ir::Function& f, const ir::SymbolBindings& symbols,
                                     const Target& target = cpuTarget());

}  // namespace kiln::passes
