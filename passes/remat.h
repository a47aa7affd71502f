// Rematerialization under a memory budget (XLA's HloRematerialization, Inductor's activation
// budget): on @train_step, values live across the op where the live bytes peak are dropped and
// recomputed right before their next reader, their producing op cloned there (the clone carries
// `kiln.recompute = true`; producers of operands no longer live are cloned along). Each step
// tries the best candidates (bytes freed at the peak per second of recomputation, by the shared
// cost model) on the planned-peak estimate (peak_memory.h) and keeps the one that lowers it most
// per second, until the peak fits; docs/passes.md tells the whole rule.
// Must run after CSE, which would merge the clones back (passes.def asserts the order). The pass
// takes the budget as its option: `remat{budget=60%}` (`kiln train --memory-budget 60%`).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"

namespace kiln::passes {

// "60%" (of the unbudgeted peak) or a byte count ("4000000000"); an error, starting with
// `what` (the flag or option that gave the text), says what was wrong.
Expected<int64_t> parseMemoryBudget(std::string_view text, int64_t unbudgeted_peak,
                                    std::string_view what = "--memory-budget");

struct RematReport {
  int64_t peak_before = 0, peak_after = 0, budget = 0;
  double recompute_flops = 0;
  std::vector<std::string> recomputed;  // "%x = kiln.relu"
  bool fits() const { return peak_after <= budget; }
};

// Rematerializes @train_step until its estimated peak fits `budget` ("60%" or bytes) under
// `symbols` (unbound symbols at the cost model's default), pricing recomputation at `target`'s
// rates. No @train_step: nothing to do.
Expected<RematReport> rematerialize(ir::Module& m, std::string_view budget, const ir::SymbolBindings& symbols,
                                    const Target& target = cpuTarget());

// Flops of the ops marked `kiln.recompute` in a function.
double recomputeFlops(const ir::Function& f, const ir::SymbolBindings& symbols);

}  // namespace kiln::passes
