#include "runtime/cpu/kernels/invariant_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln::runtime::cpu {
namespace {

// A panel holds kPanel columns of B, k-major: panel[kk * kPanel + j] = B(kk, j0 + j), zero past n.
constexpr int64_t kPanel = 16;
// Rows a tile computes at once: with AVX2, 6 x 16 = 12 accumulators of 8 lanes, enough to hide
// the FMA latency; with AVX-512, 12 rows of one 16-lane accumulator each.
constexpr int64_t kRows = 6;
constexpr int64_t kRows512 = 12;

inline float elemA(bool ta, const float* a, int64_t m, int64_t k, int64_t i, int64_t kk) {
  return ta ? a[kk * m + i] : a[i * k + kk];
}

void packPanel(bool tb, const float* b, int64_t n, int64_t k, int64_t j0, float* panel) {
  const int64_t cols = std::min(kPanel, n - j0);
  for (int64_t kk = 0; kk < k; ++kk) {
    float* dst = panel + kk * kPanel;
    for (int64_t j = 0; j < cols; ++j) dst[j] = tb ? b[(j0 + j) * k + kk] : b[kk * n + j0 + j];
    for (int64_t j = cols; j < kPanel; ++j) dst[j] = 0.0f;
  }
}

// One tile of `Rows` rows (at most kRows) against one packed panel, written to out[Rows][kPanel].
// A's rows are walked by pointer: `step` apart within a row (1, or m when A is transposed) and
// `row_step` apart between rows.
template <int64_t Rows>
__attribute__((target("avx2,fma"))) void tileAvx2(const float* a, int64_t step, int64_t row_step, int64_t k,
                                                   const float* panel, float* out) {
  // Unrolled, so that the 2 * Rows accumulators live in registers.
  __m256 lo[Rows], hi[Rows];
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk, a += step, panel += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(panel);
    const __m256 b1 = _mm256_loadu_ps(panel + 8);
#pragma GCC unroll 8
    for (int64_t r = 0; r < Rows; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * row_step);
      lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < Rows; ++r) {
    _mm256_storeu_ps(out + r * kPanel, lo[r]);
    _mm256_storeu_ps(out + r * kPanel + 8, hi[r]);
  }
}

// The same tile with AVX-512: each row's 16 columns in one register. Every element is still one
// fma per k, in k order from zero, so the bits equal the AVX2 and scalar tiles'.
template <int64_t Rows>
__attribute__((target("avx512f"))) void tileAvx512(const float* a, int64_t step, int64_t row_step, int64_t k,
                                                    const float* panel, float* out) {
  __m512 acc[Rows];
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk, a += step, panel += kPanel) {
    const __m512 b = _mm512_loadu_ps(panel);
#pragma GCC unroll 16
    for (int64_t r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * row_step]), b, acc[r]);
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

void tileScalar(bool ta, const float* a, int64_t m, int64_t k, int64_t i0, int64_t rows, const float* panel,
                float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kPanel; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk)
        acc = std::fma(elemA(ta, a, m, k, i0 + r, kk), panel[kk * kPanel + j], acc);
      out[r * kPanel + j] = acc;
    }
}

using TileFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, float*);

bool haveAvx2Fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

bool haveAvx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

}  // namespace

void invariantSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b,
                    float* c, ThreadPool& pool) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(c, c + m * n, 0.0f);
    return;
  }
  static constexpr TileFn kTiles[kRows + 1] = {nullptr,     tileAvx2<1>, tileAvx2<2>, tileAvx2<3>,
                                               tileAvx2<4>, tileAvx2<5>, tileAvx2<6>};
  static constexpr TileFn kTiles512[kRows512 + 1] = {
      nullptr,        tileAvx512<1>, tileAvx512<2>, tileAvx512<3>,  tileAvx512<4>,  tileAvx512<5>, tileAvx512<6>,
      tileAvx512<7>,  tileAvx512<8>, tileAvx512<9>, tileAvx512<10>, tileAvx512<11>, tileAvx512<12>};
  const bool avx512 = haveAvx512(), avx2 = haveAvx2Fma();
  const TileFn* tiles = avx512 ? kTiles512 : kTiles;
  const int64_t tile_rows = avx512 ? kRows512 : kRows;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Each task packs its panels of B once and sweeps every row over them: B's panel stays in the
  // L2 cache while A streams. The split over tasks changes no element's arithmetic.
  pool.parallelFor(panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(static_cast<size_t>(k * kPanel));
    float out[kRows512 * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t j0 = p * kPanel, cols = std::min(kPanel, n - j0);
      packPanel(tb, b, n, k, j0, panel.data());
      for (int64_t i0 = 0; i0 < m; i0 += tile_rows) {
        const int64_t rows = std::min(tile_rows, m - i0);
        if (avx2 || avx512)
          tiles[rows](ta ? a + i0 : a + i0 * k, ta ? m : 1, ta ? 1 : k, k, panel.data(), out);
        else
          tileScalar(ta, a, m, k, i0, rows, panel.data(), out);
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(c + (i0 + r) * n + j0, out + r * kPanel, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  });
}

void invariantSgemmReference(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
                             const float* b, float* c) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk)
        acc = std::fma(ta ? a[kk * m + i] : a[i * k + kk], tb ? b[j * k + kk] : b[kk * n + j], acc);
      c[i * n + j] = acc;
    }
}

}  // namespace kiln::runtime::cpu
