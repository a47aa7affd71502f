// cuBLASLt's bias-gradient epilogues (BGRADA/BGRADB) as simt emulates them, against plain loops;
// then a linear layer's weight and bias gradients through the fusion pass, the CUDA lowering and
// the CUDA program on the host (one cuBLASLt call), against the unfused ops' CPU references.
// Then a layer's activation backward as the DRELU/DGELU epilogue of the GEMM that makes its
// output gradient; last, matrices added in GEMM epilogues as cuBLASLt's C (beta = 1) and the
// sibling kernel reading their sum. gpu_fused_test runs the last three comparisons through the
// real cuBLASLt.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codegen/kernel_lowering.h"
#include "passes/fusion.h"
#include "runtime/cuda/cublaslt.h"
#include "tests/nvrtc/activation_gradient_case.h"
#include "tests/nvrtc/bias_gradient_case.h"
#include "tests/nvrtc/op_cases.h"
#include "tests/nvrtc/residual_case.h"
#include "tests/simt/host_program.h"

namespace kiln::testing {
namespace {

using codegen::Epilogue;
using codegen::GemmShape;

// op(X)[r, c] of a row-major matrix stored [rows, cols] (transposed: stored [c, r]).
double at(const ir::HostTensor& t, bool transposed, int64_t r, int64_t c) {
  const int64_t cols = t.view.shape[1];
  const int64_t i = transposed ? c * cols + r : r * cols + c;
  return t.view.dtype == DType::bf16 ? ir::bf16ToFloat(static_cast<const uint16_t*>(t.view.data)[i])
                                     : static_cast<const float*>(t.view.data)[i];
}

TEST(SimtCublasLt, BiasGradientEpiloguesMatchLoops) {
  std::mt19937 rng(5);
  const int64_t m = 13, n = 7, k = 37;  // k not a multiple of the eight running sums
  for (Epilogue e : {Epilogue::BiasGradA, Epilogue::BiasGradB})
    for (DType t : {DType::f32, DType::bf16})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          const std::string what = fmt::format("{} {} A{} B{}", codegen::epilogueName(e), ir::dtypeName(t),
                                               ta ? "^T" : "", tb ? "^T" : "");
          GemmShape s;
          s.m = m, s.n = n, s.k = k;
          s.transpose_a = ta, s.transpose_b = tb;
          s.a_type = s.b_type = t;
          s.c_type = s.bias_type = DType::f32;
          s.epilogue = e;
          ir::HostTensor a(t, ta ? std::vector<int64_t>{k, m} : std::vector<int64_t>{m, k});
          ir::HostTensor b(t, tb ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n});
          fillTensor(a, Fill::Normal, 0, rng);
          fillTensor(b, Fill::Normal, 0, rng);
          ir::HostTensor c(DType::f32, {m, n});
          const int64_t len = e == Epilogue::BiasGradA ? m : n;
          std::vector<float> grad(static_cast<size_t>(len) + 1, -7.0f);  // one past the end stays
          simt::gemmAsCublasLt(s, a.view.data, b.view.data, c.view.data, grad.data());
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              double want = 0;
              for (int64_t l = 0; l < k; ++l) want += at(a, ta, i, l) * at(b, tb, l, j);
              ASSERT_NEAR(static_cast<const float*>(c.view.data)[i * n + j], want,
                          1e-4 * (1 + std::fabs(want)))
                  << what << " C[" << i << ", " << j << "]";
            }
          for (int64_t i = 0; i < len; ++i) {
            double want = 0;
            for (int64_t l = 0; l < k; ++l)
              want += e == Epilogue::BiasGradA ? at(a, ta, i, l) : at(b, tb, l, i);
            ASSERT_NEAR(grad[static_cast<size_t>(i)], want, 1e-5 * (1 + std::fabs(want)))
                << what << " grad " << i;
          }
          EXPECT_EQ(grad[static_cast<size_t>(len)], -7.0f) << what << ": wrote past the gradient";
        }
}

class SimtBiasGradient : public ::testing::TestWithParam<BiasGradientCase> {};

TEST_P(SimtBiasGradient, OneCublasLtCallMatchesCpuReference) {
  const BiasGradientCase bc = GetParam();
  auto bf = buildBiasGradient(bc);
  // The fusion pass groups them; the lowering makes the group one cuBLASLt call.
  auto r = bf->fuseForGpu();
  ASSERT_TRUE(r) << r.status().message();
  auto groups = codegen::lowerFunction(*bf->f, {});
  ASSERT_TRUE(groups) << groups.status().message();
  int bias_gradient_gemms = 0;
  for (const codegen::LoweredGroup& lg : *groups) {
    EXPECT_TRUE(lg.split_reason.empty()) << lg.split_reason;
    bias_gradient_gemms += lg.gemm && lg.gemm_call.bias_gradient_of == (bc.g_as_a ? 'a' : 'b');
  }
  EXPECT_EQ(bias_gradient_gemms, 1) << passes::explainFusion(*r);
  auto program = simt::HostProgram::create(*bf->f, {});
  ASSERT_TRUE(program) << program.status().message();
  EXPECT_EQ((*program)->numGemms(), 1);
  EXPECT_EQ((*program)->numKernels(), bc.bf16 ? 1 : 0) << "only the narrowing cast of g is a kernel";
  runtime::ParameterStore params;
  auto out = (*program)->run(bf->inputs, params, 1);
  ASSERT_TRUE(out) << out.status().message();
  expectBiasGradientsClose(*out, *bf, bc, "simt");
}

INSTANTIATE_TEST_SUITE_P(Layouts, SimtBiasGradient, ::testing::ValuesIn(biasGradientCases()),
                         [](const ::testing::TestParamInfo<BiasGradientCase>& i) {
                           return std::string(i.param.name);
                         });

class SimtActivationGradient : public ::testing::TestWithParam<ActivationGradientCase> {};

TEST_P(SimtActivationGradient, DerivativeInTheGemmEpilogueMatchesCpuReference) {
  const ActivationGradientCase ac = GetParam();
  const bool relu = std::string(ac.activation) == "relu";
  auto af = buildActivationGradient(ac);
  auto r = af->fuseForGpu();
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(af->h->definingOp()->boolAttr("kiln.relu_mask"), relu) << "the forward ReLU writes its mask";
  auto groups = codegen::lowerFunction(*af->f, {});
  ASSERT_TRUE(groups) << groups.status().message();
  int backward = 0, masks = 0;
  for (const codegen::LoweredGroup& lg : *groups) {
    EXPECT_TRUE(lg.split_reason.empty()) << lg.split_reason;
    backward += lg.gemm && lg.gemm_call.activation_grad == ac.activation;
    masks += lg.gemm && lg.gemm_call.writes_relu_mask;
  }
  EXPECT_EQ(backward, 1) << passes::explainFusion(*r);
  EXPECT_EQ(masks, relu ? 1 : 0);
  auto program = simt::HostProgram::create(*af->f, {});
  ASSERT_TRUE(program) << program.status().message();
  EXPECT_EQ((*program)->numGemms(), 2);
  EXPECT_EQ((*program)->numKernels(), relu ? 0 : 1) << "only the forward GELU is a kernel";
  runtime::ParameterStore params;
  auto out = (*program)->run(af->inputs, params, 1);
  ASSERT_TRUE(out) << out.status().message();
  expectActivationGradientClose(*out, *af, ac, "simt");
}

INSTANTIATE_TEST_SUITE_P(Activations, SimtActivationGradient, ::testing::ValuesIn(activationGradientCases()),
                         [](const ::testing::TestParamInfo<ActivationGradientCase>& i) {
                           return std::string(i.param.name);
                         });

class SimtResidual : public ::testing::TestWithParam<ResidualCase> {};

TEST_P(SimtResidual, MatrixAddedAsCMatchesCpuReference) {
  const ResidualCase rc = GetParam();
  auto rf = buildResidual(rc);
  auto r = rf->fuseForGpu();
  ASSERT_TRUE(r) << r.status().message();
  auto groups = codegen::lowerFunction(*rf->f, {});
  ASSERT_TRUE(groups) << groups.status().message();
  int residuals = 0;
  for (const codegen::LoweredGroup& lg : *groups) residuals += lg.gemm && lg.gemm_call.residual >= 0;
  EXPECT_EQ(residuals, 2) << passes::explainFusion(*r);
  auto program = simt::HostProgram::create(*rf->f, {});
  ASSERT_TRUE(program) << program.status().message();
  EXPECT_EQ((*program)->numGemms(), 2);
  EXPECT_EQ((*program)->numKernels(), 1) << "the two products of y are one sibling kernel\n"
                                         << passes::explainFusion(*r);
  runtime::ParameterStore params;
  auto out = (*program)->run(rf->inputs, params, 1);
  ASSERT_TRUE(out) << out.status().message();
  expectResidualClose(*out, *rf, rc, "simt");
}

INSTANTIATE_TEST_SUITE_P(Precisions, SimtResidual, ::testing::ValuesIn(residualCases()),
                         [](const ::testing::TestParamInfo<ResidualCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace kiln::testing
