// The reference interpreter: runs a function op by op on the CPU with each op's reference kernel
// (the `cpu` hook of the op table). It is the oracle for gradient checks and for the CPU and
// CUDA runtimes; it favours being obviously right over being fast.
//
// Sources (kiln.input, kiln.parameter) bind by their `name` attribute; each bound tensor must
// have the declared element type and a shape that fits the declared one under the symbol
// bindings (a bounded dim may be smaller than its bound). kiln.constant materializes its value.
// Results are allocated at their bound size and kernels shrink data-dependent dims. An op that
// holds a region and has no kernel of its own (a fused group) runs its region, whose kiln.yield
// gives its results. Errors carry the failing op's location.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"

namespace kiln::ir {

class RankGroup;

struct InterpretOptions {
  // This rank's group, for the collective ops (ir/collective.h): running one function on N
  // threads, each with its rank's group, computes the collectives for real. Null: one rank.
  RankGroup* ranks = nullptr;
};

// Runs `f` on copies of the given tensors and returns the operands of its func.return.
Expected<std::vector<HostTensor>> interpret(
    const Function& f, const std::map<std::string, HostTensor>& inputs_and_params_by_name,
    const SymbolBindings& symbols, const InterpretOptions& options = {});

// Same, but sources see the caller's tensors themselves, so side-effecting ops (optimizer
// updates, trait kSideEffect) update parameters and optimizer state in `tensors` in place.
Expected<std::vector<HostTensor>> interpretInPlace(const Function& f,
                                                   std::map<std::string, HostTensor>& tensors,
                                                   const SymbolBindings& symbols,
                                                   const InterpretOptions& options = {});

}  // namespace kiln::ir
