// The GEMM precision of a module, from its train block's `precision` (docs/language.md), and what
// it means for one matmul:
//   f32         f32 GEMMs. On a GPU cuBLASLt runs them on the tensor cores in TF32 (inputs
//               rounded to a 10-bit mantissa, f32 accumulation: CUBLAS_COMPUTE_32F_FAST_TF32),
//               as PyTorch does under torch.backends.cuda.matmul.allow_tf32 = True; the CPU has
//               no TF32 unit and runs them in f32.
//   f32_strict  f32 GEMMs in f32 everywhere (CUBLAS_COMPUTE_32F, the CUDA cores on a GPU).
//   bf16        bf16 storage of GEMM inputs and outputs, f32 accumulation, over f32 master
//               weights (the mixed-precision pass, passes/mixed_precision.h).
#pragma once

#include <string_view>

#include "ir/ir.h"

namespace kiln::ir {

// The module's precision: "f32" when its train block names none (or it has no train block).
std::string_view gemmPrecision(const Module& m);
bool isGemmPrecision(std::string_view p);
// "f32, bf16, f32_strict", for error messages.
std::string_view gemmPrecisionNames();

// Whether a GPU may run this kiln.matmul in TF32: f32 inputs, its module's precision f32 (not
// f32_strict), and the op not marked kiln.precision = "f32" (a MoE router's logits GEMM, which
// routing computes in exact f32).
bool allowsTf32(const Op& matmul);

}  // namespace kiln::ir
