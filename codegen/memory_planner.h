// Memory planning: liveness over a Program's global instruction order, then one arena laid
// out by best fit over free intervals, with in-place updates where legal. Runs after the
// symbols are bound (a Program's buffer sizes are concrete), so the peak is known before
// anything runs: `kiln dump FILE --stage=memory --batch B`.
#pragma once

#include <cstdint>
#include <string>

#include "codegen/program.h"

namespace kiln::codegen {

struct MemoryPlanOptions {
  int64_t alignment = 64;  // every arena offset is a multiple of this
  // Let a result write over an operand that dies at its op: elementwise ops whose operand has
  // the result's exact type, and reshapes. Kernels of such ops read element i before writing
  // element i, so sharing storage is safe.
  bool in_place = true;
};

// Fills each buffer's live range (first_use, last_use as instruction seq numbers), the offsets
// and in-place links of arena buffers, and the program's peak_bytes and arena_bytes.
Status planMemory(Program& p, const MemoryPlanOptions& options = {});

// The plan as text: one line per buffer (offset, bytes, live range), then `peak_bytes: N`.
std::string memoryPlanStr(const Program& p);

}  // namespace kiln::codegen
