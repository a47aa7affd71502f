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

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "runtime/cpu/executor.h"
#include "tests/nvrtc/fused_groups.h"
#include "tests/nvrtc/op_cases.h"

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

struct ResidualFunction {
  ir::Module module;
  ir::Function* f = nullptr;
  std::map<const ir::Value*, ir::HostTensor> values;  // inputs, then the reference's results
  runtime::cpu::Batch inputs;
  std::vector<ir::Value*> results;  // y, h, gx0, gz
};

// t [B, R], V [R, N], g [B, N]; u [B, K], W [K, M], b [M] with M = N; x0, z [B, N]. B = 300
// (not a tile's multiple), R = 24, K = 36, N = 40.
inline std::unique_ptr<ResidualFunction> buildResidual(const ResidualCase& rc) {
  const int64_t batch = 300, r = 24, k = 36, n = 40;
  auto out = std::make_unique<ResidualFunction>();
  ResidualFunction& rf = *out;
  rf.module.mutableAttrs()["kiln.train"] =
      ir::Attribute(ir::AttrDict{{"precision", ir::Attribute(std::string(rc.precision))}});
  rf.f = &rf.module.addFunction("f");
  rf.f->body().addBlock();
  ir::Builder b(rf.f->entry());
  std::mt19937 rng(31);
  const DType mm = rc.bf16 ? DType::bf16 : DType::f32;
  auto input = [&](const char* name, ir::Shape shape, DType dtype) {
    return addRandomInput(b, rng, rf.values, name, shape, dtype);
  };
  Value* t = input("t", S({batch, r}), mm);
  Value* v = input("v", S({r, n}), mm);
  Value* g = input("g", S({batch, n}), DType::f32);
  Value* u = input("u", S({batch, k}), mm);
  Value* w = input("w", S({k, n}), mm);
  Value* bias = input("b", S({n}), DType::f32);
  Value* x0 = input("x0", S({batch, n}), DType::f32);
  Value* z = input("z", S({batch, n}), DType::f32);
  for (const auto& [val, ten] : rf.values) rf.inputs[val->definingOp()->strAttr("name")] = ten.view;
  std::vector<const ir::Op*> flat;
  auto add = [&](const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto op = b.create(name, operands, std::move(attrs));
    EXPECT_TRUE(op) << op.status().message();
    flat.push_back(*op);
    return (*op)->result();
  };
  auto widened = [&](Value* x) { return rc.bf16 ? add("kiln.cast", {x}, {{"to", Attribute("f32")}}) : x; };
  Value* y = add("kiln.add", {g, widened(add("kiln.matmul", {t, v}))});
  Value* h = add("kiln.relu", {add("kiln.add", {add("kiln.add", {widened(add("kiln.matmul", {u, w})), bias}), y})});
  Value* gx0 = add("kiln.mul", {y, x0});
  Value* gz = add("kiln.mul", {y, z});
  rf.results = {y, h, gx0, gz};
  EXPECT_TRUE(b.createWithTypes("func.return", rf.results, {}));
  rf.f->setResultTypes({y->type(), h->type(), gx0->type(), gz->type()});
  Status ref = referenceRun(flat, {}, rf.values);
  EXPECT_TRUE(ref.isOk()) << ref.message();
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
