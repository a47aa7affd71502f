// The optimizer step on the GPU, shared by the dense optimizer emitter (optimizer.cc: every
// kiln.optimizer_update of a group as one multi-tensor launch per configuration) and the sparse
// row update of the embedding backward (embedding_sort.cc): one device definition of each
// optimizer's per-element math, in the reference's order of operations (ir/ops/optimizer.cc).
#pragma once

#include <string>

#include "codegen/kernel_ir.h"

namespace kiln::codegen::emit {

// How the address tables name a scalar operand's type (lr, step, gradient scale).
enum ScalarCode : int64_t { kScalarF32, kScalarF64, kScalarBf16, kScalarI32, kScalarI64 };
ScalarCode scalarCode(DType t);
// The device type of a float tensor of the optimizer kernels: float, double or kiln_bf16.
const char* floatCType(DType t);

// The words of one tensor's row of the dense update's address table.
enum DenseWord : int {
  kDenseParam,       // the parameter, updated in place
  kDenseGrad,        // its gradient
  kDenseState0,      // its state slots (0: none)
  kDenseState1,
  kDenseElements,    // elements of the parameter
  kDenseFirstBlock,  // the launch's first block over this tensor; a last row holds the total
  kDenseLr,          // the lr factor, step and gradient scale scalars (scale 0: unscaled)
  kDenseStep,
  kDenseScale,
  kDenseScalarTypes,  // ScalarCode of lr | step << 4 | scale << 8
  kDenseWords = 12,   // words per tensor (two spare)
};
// Elements one block of the dense update steps: 256 threads x 16.
constexpr int64_t kDenseChunk = 4096;

// The device functions (kiln_opt_element, kiln_opt_scalar, kiln_opt_dense), part of every
// module's prelude before the embedding backward's, which calls them.
const std::string& optimizerDeviceFunctions();

}  // namespace kiln::codegen::emit
