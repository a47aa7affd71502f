// `kiln dump FILE --stage=cuda`: the CUDA source of a model's training step (or @forward when
// the model has no train block), as the CUDA backend generates it.
#pragma once

#include <ostream>

#include "ir/ir.h"
#include "tools/dump_optimize.h"

namespace kiln::cli {

// Builds @train_step when needed (for options.target, remat under options.memory_budget), lowers
// it at options.batch and prints, per group of ops, the kernels (or the cuBLASLt GEMM) it
// becomes, then the whole module; with `resources`, instead of the module, what ptxas reports
// for each kernel compiled for the target's architecture (registers, shared memory, spills) and
// how many of its blocks an SM holds at once. Returns an exit code.
int printCudaStage(ir::Module& module, const OptimizeOptions& options, std::ostream& out, std::ostream& err,
                   bool resources = false);


}  // namespace kiln::cli
