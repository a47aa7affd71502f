// The CPU backend's GEMMs (runtime/cpu/gemm.h) against an independent f64 product, and the CPU
// feature detection (runtime/cpu/cpu_features.h) against the kernel's /proc/cpuinfo.
#include "runtime/cpu/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "ir/tensor_view.h"
#include "runtime/cpu/cpu_features.h"

namespace kiln::runtime::cpu {
namespace {

// ---- CPU features -----------------------------------------------------------------------------

std::string cpuinfoFlags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1);
  return "";
}

TEST(CpuFeatures, MatchProcCpuinfo) {
  const std::string flags = cpuinfoFlags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  const CpuFeatures want = featuresFromCpuinfoFlags(flags);
  const CpuFeatures& have = hostCpu();
  EXPECT_EQ(have.sse42, want.sse42);
  EXPECT_EQ(have.avx2, want.avx2);
  EXPECT_EQ(have.fma, want.fma);
  EXPECT_EQ(have.avx512f, want.avx512f);
  EXPECT_EQ(have.avx512bw, want.avx512bw);
  EXPECT_EQ(have.avx512vl, want.avx512vl);
  EXPECT_EQ(have.avx512_bf16, want.avx512_bf16);
  EXPECT_EQ(have.amx_tile, want.amx_tile);
  EXPECT_EQ(have.amx_bf16, want.amx_bf16);
  EXPECT_EQ(have.isaLevel(), want.isaLevel()) << "cpuinfo flags:" << flags;
}

TEST(CpuFeatures, LevelsFromFlags) {
  EXPECT_EQ(featuresFromCpuinfoFlags("fpu sse4_2").isaLevel(), "sse4.2");
  EXPECT_EQ(featuresFromCpuinfoFlags("sse4_2 avx avx2 fma").isaLevel(), "avx2");
  EXPECT_EQ(featuresFromCpuinfoFlags("avx2 fma avx512f avx512bw avx512vl").isaLevel(), "avx512");
  EXPECT_EQ(featuresFromCpuinfoFlags("avx2 fma avx512f avx512bw avx512vl avx512_bf16").summary(), "avx512+bf16");
  EXPECT_EQ(featuresFromCpuinfoFlags("avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16").summary(),
            "avx512+amx-bf16");
  EXPECT_EQ(featuresFromCpuinfoFlags("").isaLevel(), "generic");
  EXPECT_LT(isaRank("avx2"), isaRank("avx512"));
  EXPECT_LT(isaRank("avx512-bf16"), isaRank("amx"));
}

// oneDNN dispatches at the CPU's own level: a CPU it does not know (the failure that left
// OpenBLAS on its SSE3 kernels) fails here, and `kiln version` warns about it.
TEST(CpuFeatures, OnednnRunsAtTheCpusLevel) {
  if (std::getenv("ONEDNN_MAX_CPU_ISA")) GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA caps oneDNN in this run";
  EXPECT_EQ(onednnIsa().level, hostCpu().isaLevel()) << gemmImplementation();
  EXPECT_TRUE(cpuLibraryWarnings().empty()) << cpuLibraryWarnings().front();
}

// ---- GEMMs ------------------------------------------------------------------------------------

float roundBf16(float v) { return ir::bf16ToFloat(ir::floatToBf16(v)); }

struct Matrix {
  int64_t rows = 0, cols = 0, ld = 0;
  ir::DType t = ir::DType::f32;
  std::vector<float> f;      // f32 storage, or the bf16 values widened
  std::vector<uint16_t> h;   // bf16 storage
  double at(int64_t r, int64_t c) const { return f[static_cast<size_t>(r * ld + c)]; }
  const void* data() const { return t == ir::DType::bf16 ? static_cast<const void*>(h.data()) : f.data(); }
  void* data() { return t == ir::DType::bf16 ? static_cast<void*>(h.data()) : f.data(); }
  float load(int64_t i) const { return t == ir::DType::bf16 ? ir::bf16ToFloat(h[static_cast<size_t>(i)]) : f[static_cast<size_t>(i)]; }
};

Matrix randomMatrix(int64_t rows, int64_t cols, int64_t ld, ir::DType t, std::mt19937& rng) {
  Matrix m{rows, cols, ld, t, {}, {}};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  m.f.resize(static_cast<size_t>(rows * ld));
  for (float& v : m.f) v = t == ir::DType::bf16 ? roundBf16(u(rng)) : u(rng);
  if (t == ir::DType::bf16)
    for (float v : m.f) m.h.push_back(ir::floatToBf16(v));
  return m;
}

double activation(GemmActivation act, double v) {
  switch (act) {
    case GemmActivation::none: return v;
    case GemmActivation::relu: return v > 0 ? v : 0;
    case GemmActivation::gelu_tanh: return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    case GemmActivation::silu: return v / (1 + std::exp(-v));
  }
  return v;
}

struct Case {
  bool ta, tb;
  int64_t m, n, k, pad;  // pad: extra elements at the end of each stored row
  ir::DType in, out;
  bool bias = false, residual = false, accumulate = false;
  GemmActivation act = GemmActivation::none;
};

// Runs one case and compares it with the product summed in f64 from the same (rounded) inputs.
void check(const Case& c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "ta " << c.ta << " tb " << c.tb << " m " << c.m << " n " << c.n << " k "
                                    << c.k << " pad " << c.pad << " " << ir::dtypeName(c.in) << "->"
                                    << ir::dtypeName(c.out) << " act " << static_cast<int>(c.act));
  std::mt19937 rng(seed);
  const Matrix a = c.ta ? randomMatrix(c.k, c.m, c.m + c.pad, c.in, rng) : randomMatrix(c.m, c.k, c.k + c.pad, c.in, rng);
  const Matrix b = c.tb ? randomMatrix(c.n, c.k, c.k + c.pad, c.in, rng) : randomMatrix(c.k, c.n, c.n + c.pad, c.in, rng);
  const int64_t ldc = c.n + c.pad;
  Matrix out = randomMatrix(c.m, c.n, ldc, c.out, rng);  // the old C (accumulate) and the padding
  const Matrix old = out;
  const Matrix bias = randomMatrix(1, c.n, c.n, c.out, rng);
  const Matrix residual = randomMatrix(c.m, c.n, ldc, c.out, rng);

  GemmDesc d;
  d.ta = c.ta;
  d.tb = c.tb;
  d.m = c.m;
  d.n = c.n;
  d.k = c.k;
  d.lda = a.ld;
  d.ldb = b.ld;
  d.ldc = ldc;
  d.a = d.b = c.in;
  d.c = c.out;
  d.bias = c.bias;
  d.residual = c.residual;
  d.accumulate = c.accumulate;
  d.act = c.act;
  ThreadPool pool(2);
  ASSERT_TRUE(gemm(d, {a.data(), b.data(), out.data(), bias.data(), residual.data()}, &pool).isOk());

  // bf16 results are rounded once (2^-8 relative); f32 ones accumulate rounding over k.
  const double rel = c.out == ir::DType::bf16 ? 1.0 / 128 : 2e-6 * std::sqrt(static_cast<double>(c.k) + 1);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double sum = 0, mag = 0;
      for (int64_t kk = 0; kk < c.k; ++kk) {
        const double p = (c.ta ? a.at(kk, i) : a.at(i, kk)) * (c.tb ? b.at(j, kk) : b.at(kk, j));
        sum += p;
        mag += std::fabs(p);
      }
      if (c.bias) sum += bias.at(0, j), mag += std::fabs(bias.at(0, j));
      if (c.accumulate) sum += old.at(i, j), mag += std::fabs(old.at(i, j));
      double want = activation(c.act, sum);
      if (c.residual) want += residual.at(i, j), mag += std::fabs(residual.at(i, j));
      ASSERT_NEAR(out.load(i * ldc + j), want, rel * (mag + 1e-3)) << "at " << i << ", " << j;
    }
  // The padding past n in each row of C is not written.
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = c.n; j < ldc; ++j) ASSERT_EQ(out.load(i * ldc + j), old.load(i * ldc + j));
}

TEST(Gemm, TransposesStridesAndDtypes) {
  uint32_t seed = 1;
  for (ir::DType in : {ir::DType::f32, ir::DType::bf16})
    for (ir::DType out : {ir::DType::f32, ir::DType::bf16}) {
      if (in == ir::DType::f32 && out == ir::DType::bf16) continue;
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (int64_t pad : {0, 3}) check({ta, tb, 37, 29, 53, pad, in, out}, seed++);
    }
}

TEST(Gemm, Epilogues) {
  uint32_t seed = 100;
  for (ir::DType in : {ir::DType::f32, ir::DType::bf16})
    for (GemmActivation act : {GemmActivation::none, GemmActivation::relu, GemmActivation::gelu_tanh,
                               GemmActivation::silu}) {
      Case c{false, true, 33, 65, 40, 0, in, in};
      c.bias = true;
      c.act = act;
      check(c, seed++);
      c.residual = true;
      check(c, seed++);
    }
  Case acc{true, false, 16, 24, 31, 2, ir::DType::f32, ir::DType::f32};
  acc.accumulate = true;
  check(acc, seed++);
  acc.bias = acc.residual = true;
  acc.act = GemmActivation::relu;
  check(acc, seed++);
}

TEST(Gemm, EmptyDims) {
  // k = 0: the product is zero and C is the epilogue over zeros; m or n = 0 writes nothing.
  Case c{false, false, 5, 7, 0, 0, ir::DType::f32, ir::DType::f32};
  c.bias = true;
  c.act = GemmActivation::relu;
  check(c, 7);
  check({false, false, 0, 7, 4, 0, ir::DType::f32, ir::DType::f32}, 8);
  check({true, true, 6, 0, 4, 0, ir::DType::bf16, ir::DType::bf16}, 9);
}

TEST(Gemm, LargeShapesOverThreads) {
  check({false, false, 300, 257, 511, 0, ir::DType::f32, ir::DType::f32}, 11);
  check({false, true, 256, 300, 640, 0, ir::DType::bf16, ir::DType::bf16}, 12);
  check({true, false, 512, 128, 1000, 0, ir::DType::bf16, ir::DType::f32}, 13);
}

TEST(Gemm, RejectsMixedInputs) {
  GemmDesc d;
  d.m = d.n = d.k = 4;
  d.a = ir::DType::f32;
  d.b = ir::DType::bf16;
  float x[16] = {};
  EXPECT_FALSE(gemm(d, {x, x, x}).isOk());
}

// The products use the CPU's vector units: no reference loops where the CPU has AVX2 (f32) or
// native bf16 (bf16).
TEST(Gemm, NoReferenceKernels) {
  GemmDesc d;
  d.m = 256;
  d.n = 512;
  d.k = 384;
  if (hostCpu().avx2) {
    auto name = gemmKernelName(d);
    ASSERT_TRUE(name.isOk());
    EXPECT_EQ(name->find("ref"), std::string::npos) << *name;
  }
  d.a = d.b = d.c = ir::DType::bf16;
  auto name = gemmKernelName(d);
  ASSERT_TRUE(name.isOk());
  if (hostCpu().nativeBf16())
    EXPECT_EQ(name->find("ref"), std::string::npos) << *name;
  else
    EXPECT_TRUE(name->find("ref") == std::string::npos || name->rfind("f32-widened", 0) == 0) << *name;
}

TEST(Gemm, F64Loops) {
  const int64_t m = 3, n = 4, k = 5;
  std::vector<double> a(m * k), b(k * n), c(m * n);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.5 * static_cast<double>(i) - 2;
  for (size_t i = 0; i < b.size(); ++i) b[i] = 1.0 / static_cast<double>(i + 1);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      gemmF64(ta, tb, m, n, k, a.data(), b.data(), c.data());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (int64_t kk = 0; kk < k; ++kk)
            want += (ta ? a[kk * m + i] : a[i * k + kk]) * (tb ? b[j * k + kk] : b[kk * n + j]);
          EXPECT_DOUBLE_EQ(c[i * n + j], want);
        }
    }
}

}  // namespace
}  // namespace kiln::runtime::cpu
