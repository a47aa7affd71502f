// The CPU backend's GEMMs: every f32 and bf16 matrix product (kiln.matmul, the MoE grouped
// GEMMs, the calibration probes) goes through gemm() here, which runs a oneDNN matmul primitive
// (docs/dependencies.md). oneDNN picks its kernels from the CPU's features at run time: AMX or
// AVX512-BF16 for bf16, AVX-512 or AVX2 for f32, whatever the CPU's model number. A primitive is
// created once per GemmDesc and cached for the life of the process (as the NVRTC kernel cache
// keys kernels by their source). Where oneDNN has only its reference (loop) implementation for a
// desc, e.g. bf16 on a CPU without AVX-512, the product runs in f32 over widened copies instead,
// and a warning names the case once (no silent slow path: docs/runtime.md).
//
// f64 products (gradient checks) run a plain blocked loop: oneDNN has no f64 matmul, and no
// model trains in f64.
#pragma once

#include <cstdint>
#include <string>

#include "ir/status.h"
#include "ir/types.h"
#include "runtime/cpu/thread_pool.h"

namespace kiln::runtime::cpu {

// The activation of a GEMM epilogue, applied after the bias.
enum class GemmActivation : uint8_t { none, relu, gelu_tanh, silu };

// C = act(op(A) · op(B) + bias [+ C]) + residual over row-major operands; op(A) is [m, k], op(B) is
// [k, n]. A is stored [m, k] (ta: [k, m]) with rows lda apart, B [k, n] (tb: [n, k]) with rows
// ldb apart, C and the residual [m, n] with rows ldc apart. A and B are both f32 or both bf16;
// C is f32 or bf16; the product accumulates in f32 and is rounded once into C.
struct GemmDesc {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: the packed stride
  ir::DType a = ir::DType::f32, b = ir::DType::f32, c = ir::DType::f32;
  bool bias = false;      // bias[n], in C's dtype
  bool residual = false;  // residual[m, n] with rows ldc apart, in C's dtype
  bool accumulate = false;  // add C's old value to the product (BLAS's beta = 1)
  GemmActivation act = GemmActivation::none;

  // A plain product of packed operands, all of one storage type, no epilogue.
  static GemmDesc plain(ir::DType t, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
    GemmDesc d;
    d.ta = ta;
    d.tb = tb;
    d.m = m;
    d.n = n;
    d.k = k;
    d.a = d.b = d.c = t;
    return d;
  }

  bool operator==(const GemmDesc&) const = default;
};

struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const void* bias = nullptr;
  const void* residual = nullptr;
};

// Runs one product: split into row (or column) blocks over `pool`'s threads when it is large
// enough, each block one single-threaded oneDNN call; on the calling thread alone without a
// pool. An error for a desc no implementation takes (mixed input dtypes, a non-float dtype);
// never for a shape: m, n or k of zero give what the math says.
//
// oneDNN never threads a product itself: its OpenMP workers spin between parallel regions, and
// with a build on the same 2 cores a training run took 7x as long as alone (sharing the cores
// explains 2x of it); the runtime's own pool sleeps when idle.
Status gemm(const GemmDesc& d, const GemmOperands& x, ThreadPool* pool = nullptr);

// The f64 product C = op(A) · op(B) (packed strides), for the gradient checks.
void gemmF64(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* c);

// What runs the products in this process, for `kiln version` and the progress header:
// "onednn 2.6.3 (avx512_core_bf16)".
std::string gemmImplementation();

// The level oneDNN dispatches to in this process, in CpuFeatures::isaLevel()'s terms, with
// oneDNN's own name for it and its version.
struct OnednnIsa {
  std::string version;  // "2.6.3"
  std::string name;     // "avx512_core_bf16"
  std::string level;    // "avx512-bf16"
};
OnednnIsa onednnIsa();

// The implementation oneDNN chose for a desc ("brg:avx512_core_bf16", "gemm:jit", ...), or
// "f32-widened (...)" where the desc runs through the widened fallback; for tests and --profile.
Expected<std::string> gemmKernelName(const GemmDesc& d);

}  // namespace kiln::runtime::cpu
