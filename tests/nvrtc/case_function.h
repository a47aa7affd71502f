// A function of one block built op by op from random inputs, with the CPU reference of every op:
// what the fused-group cases share (bias_gradient_case.h, activation_gradient_case.h,
// residual_case.h), which the fusion pass then groups and simt or a GPU runs. The module
// carries the GEMM precision the case is about (kiln.train's `precision`).
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "passes/fusion.h"
#include "runtime/cpu/executor.h"
#include "tests/nvrtc/fused_groups.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {

struct CaseFunction {
  ir::Module module;
  ir::Function* f = nullptr;
  std::map<const ir::Value*, ir::HostTensor> values;  // inputs, then the reference's results
  runtime::cpu::Batch inputs;                          // the inputs by name, as a run takes them

  // The fusion pass over the module, planned for the H200 as the CUDA backend runs it.
  Expected<std::vector<passes::FusionReport>> fuseForGpu() {
    passes::FusionOptions options;
    options.target = h200Target();
    return passes::fuseModule(module, options);
  }
};

class CaseFunctionBuilder {
 public:
  CaseFunctionBuilder(CaseFunction& cf, const char* precision, unsigned seed) : cf_(cf), rng_(seed) {
    cf.module.mutableAttrs()["kiln.train"] =
        ir::Attribute(ir::AttrDict{{"precision", ir::Attribute(std::string(precision))}});
    cf.f = &cf.module.addFunction("f");
    cf.f->body().addBlock();
    b_.setInsertionPointToEnd(cf.f->entry());
  }

  // A kiln.input of normal random values.
  Value* input(const char* name, ir::Shape shape, DType dtype) {
    Value* v = addRandomInput(b_, rng_, cf_.values, name, shape, dtype);
    if (v) cf_.inputs[name] = cf_.values.at(v).view;
    return v;
  }

  // An op whose result type is inferred (the op when it fails to build is null, and the test
  // fails).
  ir::Op* op(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto op = b_.create(name, operands, std::move(attrs));
    EXPECT_TRUE(op) << op.status().message();
    if (!op) return nullptr;
    flat_.push_back(*op);
    return *op;
  }
  Value* add(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    ir::Op* o = op(name, operands, std::move(attrs));
    return o ? o->result() : nullptr;
  }
  // An op of a given result type.
  ir::Op* opOfType(const std::string& name, const std::vector<Value*>& operands, TensorType type) {
    auto op = b_.createWithTypes(name, operands, {std::move(type)});
    EXPECT_TRUE(op) << op.status().message();
    if (!op) return nullptr;
    flat_.push_back(*op);
    return *op;
  }
  // x widened to f32 when `widen`: a bf16 product, as mixed precision writes it.
  Value* widened(Value* x, bool widen) { return widen ? add("kiln.cast", {x}, {{"to", Attribute("f32")}}) : x; }

  // Returns `results` from the function and runs the CPU reference of every op made.
  void finish(const std::vector<Value*>& results) {
    EXPECT_TRUE(b_.createWithTypes("func.return", results, {}));
    std::vector<TensorType> types;
    for (const Value* r : results) types.push_back(r->type());
    cf_.f->setResultTypes(types);
    Status ref = referenceRun(flat_, {}, cf_.values);
    EXPECT_TRUE(ref.isOk()) << ref.message();
  }

 private:
  CaseFunction& cf_;
  ir::Builder b_;
  std::mt19937 rng_;
  std::vector<const ir::Op*> flat_;
};

}  // namespace kiln::testing
