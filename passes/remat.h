// Rematerialization under a memory budget (XLA's HloRematerialization, Inductor's activation
// budget): on @train_step, forward activations that stay live into the backward pass are
// dropped and recomputed there, their producing op cloned right before the first backward use
// (the clone carries `kiln.recompute = true`). Greedy by bytes freed per flop added, each step
// kept only if the estimated planned peak (peak_memory.h) drops, until the peak fits.
// Must run after CSE, which would merge the clones back (passes.def asserts the order).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::passes {

// "60%" (of the unbudgeted peak) or a byte count ("4000000000"); an error says what was wrong.
Expected<int64_t> parseMemoryBudget(std::string_view text, int64_t unbudgeted_peak);

struct RematReport {
  int64_t peak_before = 0, peak_after = 0, budget = 0;
  double recompute_flops = 0;
  std::vector<std::string> recomputed;  // "%x = kiln.relu"
  bool fits() const { return peak_after <= budget; }
};

// Rematerializes @train_step until its estimated peak fits `budget` ("60%" or bytes) under
// `symbols` (unbound symbols at the cost model's default). No @train_step: nothing to do.
Expected<RematReport> rematerialize(ir::Module& m, std::string_view budget, const ir::SymbolBindings& symbols);

// Flops of the ops marked `kiln.recompute` in a function.
double recomputeFlops(const ir::Function& f, const ir::SymbolBindings& symbols);

}  // namespace kiln::passes
