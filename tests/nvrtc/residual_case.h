// The adds a GEMM's epilogue takes as cuBLASLt's C (beta = 1), and the sibling kernel after them,
// as a DCN cross layer's backward writes them: from the next layer's gradient g and the GEMM
// product p = t V,
//   y   = g + p               (the gradient of x over the skip and the product: C = g)
//   h   = relu(u W + b + y)   (a residual before the bias and the activation: C = y)
//   gx0 = y * x0, gz = y * z  (two products of y: one pointwise kernel reading y once)
// built with random inputs and their CPU references, for the tests that run it on the host
// (simt_gemm_epilogue_test) and on a GPU (gpu_fused_test).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/nvrtc/case_function.h"

namespace kiln::testing {

struct ResidualCase {
  const char* name;
  const char* precision;  // the module's GEMM precision: f32_strict, f32 (TF32) or bf16
  bool bf16 = false;      // the GEMMs read bf16 operands and widen their products at once
  double tol;             // relative
};

inline const std::vector<ResidualCase>& residualCases() {
  static const std::vector<ResidualCase> cases = {
      {"f32_strict", "f32_strict", false, 1e-4},
      {"tf32", "f32", false, 2e-2},
      // h sums two bf16 products (y carries the first), each rounded to bf16 by the reference and
      // kept in f32 by cuBLASLt's accumulator: twice the single product's 3e-2.
      {"bf16", "bf16", true, 6e-2},
  };
  return cases;
}

struct ResidualFunction : CaseFunction {
  std::vector<ir::Value*> results;  // y, h, gx0, gz
};

// t [B, R], V [R, N], g [B, N]; u [B, K], W [K, M], b [M] with M = N; x0, z [B, N]. B = 300
// (not a tile's multiple), R = 24, K = 36, N = 40.
inline std::unique_ptr<ResidualFunction> buildResidual(const ResidualCase& rc) {
  const int64_t batch = 300, r = 24, k = 36, n = 40;
  auto out = std::make_unique<ResidualFunction>();
  CaseFunctionBuilder c(*out, rc.precision, 31);
  const DType mm = rc.bf16 ? DType::bf16 : DType::f32;
  Value* t = c.input("t", S({batch, r}), mm);
  Value* v = c.input("v", S({r, n}), mm);
  Value* g = c.input("g", S({batch, n}), DType::f32);
  Value* u = c.input("u", S({batch, k}), mm);
  Value* w = c.input("w", S({k, n}), mm);
  Value* bias = c.input("b", S({n}), DType::f32);
  Value* x0 = c.input("x0", S({batch, n}), DType::f32);
  Value* z = c.input("z", S({batch, n}), DType::f32);
  Value* y = c.add("kiln.add", {g, c.widened(c.add("kiln.matmul", {t, v}), rc.bf16)});
  Value* p = c.widened(c.add("kiln.matmul", {u, w}), rc.bf16);
  Value* h = c.add("kiln.relu", {c.add("kiln.add", {c.add("kiln.add", {p, bias}), y})});
  out->results = {y, h, c.add("kiln.mul", {y, x0}), c.add("kiln.mul", {y, z})};
  c.finish(out->results);
  return out;
}

inline void expectResidualClose(const std::vector<ir::HostTensor>& got, const ResidualFunction& rf,
                                const ResidualCase& rc, const std::string& where) {
  ASSERT_EQ(got.size(), rf.results.size());
  const char* names[] = {"y", "h", "gx0", "gz"};
  for (size_t i = 0; i < got.size(); ++i)
    expectClose(got[i].view, rf.values.at(rf.results[i]).view, rc.tol,
                std::string(rc.name) + " " + where + " " + names[i], "the run");
}

}  // namespace kiln::testing
