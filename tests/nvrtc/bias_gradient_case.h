// A linear layer's weight and bias gradients as autodiff writes them, db = sum_to(g) and
// dW = g^T x (or x^T g), built with random inputs and the unfused ops' CPU references, for the
// tests that run them as ONE cuBLASLt call with a bias-gradient epilogue: on the host
// (simt_gemm_epilogue_test) and on a GPU (gpu_fused_test).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "tests/nvrtc/case_function.h"

namespace kiln::testing {

struct BiasGradientCase {
  const char* name;
  const char* precision;  // the module's GEMM precision: f32_strict, f32 (TF32) or bf16
  bool g_as_a = true;     // g^T x; else x^T g
  bool bf16 = false;      // the GEMM reads g narrowed to bf16 and widens its product at once
  double dw_tol;
};

inline const std::vector<BiasGradientCase>& biasGradientCases() {
  static const std::vector<BiasGradientCase> cases = {
      {"g_as_a_f32_strict", "f32_strict", true, false, 1e-4},
      {"g_as_b_f32_strict", "f32_strict", false, false, 1e-4},
      {"g_as_a_tf32", "f32", true, false, 2e-2},
      {"g_as_a_bf16", "bf16", true, true, 3e-2},
  };
  return cases;
}

struct BiasGradientFunction : CaseFunction {
  std::vector<ir::Op*> group;  // the ops of the gemm_epilogue group: sum_to, matmul (, cast)
  ir::Value* g = nullptr;
  ir::HostTensor want_dw, want_db;
};

// g [300, 24] and x [300, 40]: the GEMM's K is the batch, 300 (not a multiple of a tile).
inline std::unique_ptr<BiasGradientFunction> buildBiasGradient(const BiasGradientCase& bc) {
  const int64_t batch = 300, n = 24, k = 40;
  auto out = std::make_unique<BiasGradientFunction>();
  BiasGradientFunction& bf = *out;
  CaseFunctionBuilder c(bf, bc.precision, 17);
  bf.g = c.input("g", S({batch, n}), DType::f32);
  Value* x = c.input("x", S({batch, k}), bc.bf16 ? DType::bf16 : DType::f32);
  auto member = [&](ir::Op* op) {
    bf.group.push_back(op);
    return op ? op->result() : nullptr;
  };
  Value* db = member(c.opOfType("kiln.sum_to", {bf.g}, TensorType(DType::f32, S({n}))));
  Value* gm = bc.bf16 ? c.add("kiln.cast", {bf.g}, {{"to", Attribute("bf16")}}) : bf.g;
  Value* dw = member(bc.g_as_a ? c.op("kiln.matmul", {gm, x}, {{"transpose_a", Attribute(true)}})
                               : c.op("kiln.matmul", {x, gm}, {{"transpose_a", Attribute(true)}}));
  if (bc.bf16) dw = member(c.op("kiln.cast", {dw}, {{"to", Attribute("f32")}}));
  c.finish({dw, db});
  bf.want_dw = bf.values.at(dw);
  bf.want_db = bf.values.at(db);
  return out;
}

// The run's dW and db against the references. db is an f32 sum of the values the GEMM reads:
// under bf16 those are g rounded to bf16, so each term may be half a bf16 step (2^-9 relative)
// off the CPU's f32 g; the bound is that times the sum of |g| down the column. Under TF32,
// whether cuBLASLt sums g or g rounded to TF32 is not documented: 2^-11 allows either.
inline void expectBiasGradientsClose(const std::vector<ir::HostTensor>& got, const BiasGradientFunction& bf,
                                     const BiasGradientCase& bc, const std::string& where) {
  ASSERT_EQ(got.size(), 2u);
  expectClose(got[0].view, bf.want_dw.view, bc.dw_tol, std::string(bc.name) + " dW", where.c_str());
  const int64_t batch = bf.values.at(bf.g).view.shape[0], n = bf.values.at(bf.g).view.shape[1];
  const float* db = static_cast<const float*>(got[1].view.data);
  const float* want = static_cast<const float*>(bf.want_db.view.data);
  const float* g = static_cast<const float*>(bf.values.at(bf.g).view.data);
  for (int64_t j = 0; j < n; ++j) {
    double magnitude = 0;
    for (int64_t i = 0; i < batch; ++i) magnitude += std::fabs(g[i * n + j]);
    const double relative = bc.bf16                                     ? std::ldexp(1.0, -9)
                            : std::string(bc.precision) == "f32_strict" ? 1e-6
                                                                        : std::ldexp(1.0, -11);
    const double allowed = relative * magnitude + 1e-6;
    EXPECT_NEAR(db[j], want[j], allowed) << where << " " << bc.name << " db[" << j << "]";
  }
}

}  // namespace kiln::testing
