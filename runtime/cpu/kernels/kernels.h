// Fast CPU kernels: the ops where a tuned implementation pays (GEMMs through BLAS, threaded
// elementwise, reductions, embedding lookups and the optimizer steps). The executor uses one when it supports the
// op's types and falls back to the op table's CPU reference hook otherwise, so every op runs.
//
// Contract shared with the reference hooks: result views arrive at their bound shape with
// storage for it; a kernel sets each result's actual shape. Elementwise kernels and reshape
// may find a result aliasing an operand of the same type (an in-place update planned by the
// memory planner); they read element i before writing element i.
#pragma once

#include <string_view>
#include <vector>

#include "ir/op_def.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/gemm.h"
#include "runtime/cpu/thread_pool.h"

namespace kiln::runtime::cpu {

struct KernelContext {
  ThreadPool* pool = nullptr;  // never null when called by the executor
  const ir::SymbolBindings* symbols = nullptr;
  // f32 matmuls through the batch-invariant GEMM (invariant_gemm.h) instead of the BLAS.
  bool batch_invariant = false;
};

using KernelFn = Status (*)(const ir::Op& op, const std::vector<const ir::TensorView*>& operands,
                            const std::vector<ir::TensorView*>& results, const KernelContext& ctx);
// Whether a kernel handles this op instance (its dtypes, its attributes).
using SupportsFn = bool (*)(const ir::Op& op);

struct FastKernel {
  const char* name;  // for logs: "onednn_matmul"
  KernelFn run;
  SupportsFn supports;
};

// The fast kernel for this op instance, or nullptr.
const FastKernel* findFastKernel(const ir::Op& op);

// Registration, one function per family file in runtime/cpu/kernels/.
struct KernelTable;
void addKernel(KernelTable& t, ir::OpCode op, FastKernel k);
void registerElementwiseKernels(KernelTable& t);  // elementwise.cc
void registerMatmulKernels(KernelTable& t);       // matmul.cc
void registerReduceKernels(KernelTable& t);       // reduce.cc
void registerEmbeddingKernels(KernelTable& t);    // embedding_bag.cc
void registerEmbeddingUpdateKernels(KernelTable& t);  // embedding_update.cc: the sparse optimizer step
void registerOptimizerKernels(KernelTable& t);     // optimizer_update.cc: the dense optimizer step
void registerDataKernels(KernelTable& t);         // data.cc: constant, reshape, cast
void registerMoeKernels(KernelTable& t);          // moe.cc: grouped GEMMs and the token permutes

// A kiln.matmul with the epilogue the executor fused into it (the bias add and activation that
// alone read its result, after a widening cast of a bf16 product): y = act(a b + bias) in one
// oneDNN product. `y` may be f32 where a and b are bf16: the accumulator is stored once, without
// the product's rounding to bf16 in between (XLA's "excess precision", as the CUDA backend's
// cuBLASLt epilogue does).
struct MatmulEpilogue {
  const ir::TensorView* bias = nullptr;  // [n], in y's dtype; null: none
  GemmActivation act = GemmActivation::none;
};
// Whether runMatmulEpilogue takes this matmul: f32 or bf16, and a batch that folds into M.
bool matmulTakesEpilogue(const ir::Op& matmul);
Status runMatmulEpilogue(const ir::Op& matmul, const ir::TensorView& a, const ir::TensorView& b,
                         const MatmulEpilogue& e, ir::TensorView& y, const KernelContext& ctx);

// Element access with f32 compute over f32 / bf16 / f64 storage.
inline float loadF(const void* p, ir::DType t, int64_t i) {
  switch (t) {
    case ir::DType::bf16: return ir::bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case ir::DType::f64: return static_cast<float>(static_cast<const double*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
inline void storeF(void* p, ir::DType t, int64_t i, float v) {
  switch (t) {
    case ir::DType::bf16: static_cast<uint16_t*>(p)[i] = ir::floatToBf16(v); break;
    case ir::DType::f64: static_cast<double*>(p)[i] = v; break;
    default: static_cast<float*>(p)[i] = v;
  }
}
inline bool isF32OrBf16(ir::DType t) { return t == ir::DType::f32 || t == ir::DType::bf16; }

}  // namespace kiln::runtime::cpu
