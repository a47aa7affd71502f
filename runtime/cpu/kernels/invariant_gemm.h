// A batch-invariant f32 GEMM: every element of C is accumulated by one fused multiply-add per k,
// in k order from zero, whatever M, the row's place among them, or the thread count. So a
// sample's scores do not depend on the batch it is computed in: `kiln predict --batch 1` and
// `--batch 1024`, and `kiln serve`'s dynamically merged batches, give the same bits. (A tuned
// GEMM does not promise that: its small-matrix paths, K blocking by thread count and edge tiles
// may change the rounding with M, as OpenBLAS's did.) The forward pass of eval, predict and serve
// runs its f32 matmuls here (ExecutorOptions::batch_invariant); training runs oneDNN (gemm.h).
#pragma once

#include <cstdint>

#include "runtime/cpu/thread_pool.h"

namespace kiln::runtime::cpu {

// C[m, n] = A · B with A = a[m, k] (ta: a[k, m]) and B = b[k, n] (tb: b[n, k]), row-major, C
// overwritten. An AVX-512 or AVX2/FMA kernel where the CPU has one; elsewhere the same arithmetic
// in scalar std::fma, so the bits do not depend on the CPU either.
void invariantSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b,
                    float* c, ThreadPool& pool);

// The reference: one std::fma chain per element (tests).
void invariantSgemmReference(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
                             const float* b, float* c);

}  // namespace kiln::runtime::cpu
