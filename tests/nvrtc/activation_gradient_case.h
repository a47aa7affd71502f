// A layer's activation and its backward as autodiff writes them: the forward
// h = act(x W + b) and, from the next layer's gradient g, g_z = activation_grad(h or z, g W2^T),
// built with random inputs and their CPU references, for the tests that run the backward as a
// cuBLASLt DRELU/DGELU epilogue: on the host (simt_gemm_epilogue_test) and on a GPU
// (gpu_fused_test). The fusion pass makes the groups: matmul + bias + relu (writing the ReLU's
// mask) and matmul + activation_grad.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "ir/scalar_fn.h"
#include "tests/nvrtc/case_function.h"

namespace kiln::testing {

struct ActivationGradientCase {
  const char* name;
  const char* activation;  // "relu" or "gelu"
  const char* precision;   // the module's GEMM precision: f32_strict, f32 (TF32) or bf16
  bool bf16 = false;       // the GEMMs read bf16 operands and widen their products at once
  double tol;              // on h and on g W2^T, relative
};

inline const std::vector<ActivationGradientCase>& activationGradientCases() {
  static const std::vector<ActivationGradientCase> cases = {
      {"relu_f32_strict", "relu", "f32_strict", false, 1e-4},
      {"relu_tf32", "relu", "f32", false, 2e-2},
      {"relu_bf16", "relu", "bf16", true, 3e-2},
      {"gelu_f32_strict", "gelu", "f32_strict", false, 1e-4},
      {"gelu_tf32", "gelu", "f32", false, 2e-2},
  };
  return cases;
}

struct ActivationGradientFunction : CaseFunction {
  ir::Value *h = nullptr, *z = nullptr, *gh = nullptr, *gz = nullptr;
};

// x [B, K], W [K, N], b [N]; g [B, P], W2 [N, P]; B = 300 (not a tile's multiple), N = 40 (the
// mask's rows padded to 128 bits; a multiple of 8, as DGELU's input needs), P = 24, K = 36.
// Returns (h, g_z).
inline std::unique_ptr<ActivationGradientFunction> buildActivationGradient(const ActivationGradientCase& ac) {
  const int64_t batch = 300, k = 36, n = 40, p = 24;
  auto out = std::make_unique<ActivationGradientFunction>();
  ActivationGradientFunction& af = *out;
  CaseFunctionBuilder c(af, ac.precision, 23);
  const DType mm = ac.bf16 ? DType::bf16 : DType::f32;
  Value* x = c.input("x", S({batch, k}), mm);
  Value* w = c.input("w", S({k, n}), mm);
  Value* bias = c.input("b", S({n}), DType::f32);
  Value* g = c.input("g", S({batch, p}), mm);
  Value* w2 = c.input("w2", S({n, p}), mm);
  af.z = c.add("kiln.add", {c.widened(c.add("kiln.matmul", {x, w}), ac.bf16), bias});
  af.h = c.add(std::string("kiln.") + ac.activation, {af.z});
  af.gh = c.widened(c.add("kiln.matmul", {g, w2}, {{"transpose_b", Attribute(true)}}), ac.bf16);
  Value* arg = std::string(ac.activation) == "relu" ? af.h : af.z;
  af.gz = c.add("kiln.activation_grad", {arg, af.gh}, {{"activation", Attribute(ac.activation)}});
  c.finish({af.h, af.gz});
  return out;
}

// The run's h against the reference, and its g_z against the reference's g W2^T times the
// derivative: for relu at the run's own h (the mask is the forward GEMM's, and under TF32 or
// bf16 an h near 0 may take the other sign than the CPU's), for gelu at the reference's z.
inline void expectActivationGradientClose(const std::vector<ir::HostTensor>& got,
                                          const ActivationGradientFunction& af, const ActivationGradientCase& ac,
                                          const std::string& where) {
  ASSERT_EQ(got.size(), 2u);
  const std::string what = std::string(ac.name) + " " + where;
  expectClose(got[0].view, af.values.at(af.h).view, ac.tol, what + " h", "the run");
  const ir::TensorView& gh = af.values.at(af.gh).view;
  const ir::TensorView& z = af.values.at(af.z).view;
  const float* h = static_cast<const float*>(got[0].view.data);
  const float* gz = static_cast<const float*>(got[1].view.data);
  int bad = 0, zeroed = 0;
  for (int64_t i = 0; i < gh.numel() && bad < 5; ++i) {
    const double d = std::string(ac.activation) == "relu" ? (h[i] > 0 ? 1.0 : 0.0)
                                                          : ir::scalar::GeluDerivative(readAsDouble(z, i));
    zeroed += d == 0;
    const double want = readAsDouble(gh, i) * d;
    if (!(std::fabs(gz[i] - want) <= ac.tol * (1 + std::fabs(readAsDouble(gh, i))))) {
      ADD_FAILURE() << what << " g_z[" << i << "] = " << gz[i] << ", want " << want;
      ++bad;
    }
  }
  if (std::string(ac.activation) == "relu") {  // the mask's zeros are checked too
    EXPECT_GT(zeroed, gh.numel() / 4) << what;
  }
}

}  // namespace kiln::testing
