// The CUDA emitter registry (codegen/emit/emitter_registry.h) against the op table, as the
// gradient and cost tests check every op for a rule and a cost: every op has a CUDA lowering
// (an expression rule or an op emitter) or an explicit mark saying why it needs none, so an op
// added without one fails here, by name.
#include "codegen/emit/emitter_registry.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "codegen/kernel_lowering.h"
#include "ir/builder.h"
#include "ir/op_def.h"

namespace kiln::testing {
namespace {

using codegen::emit::EmitterRegistry;
using codegen::emit::NoKernel;
using ir::OpDef;
using ir::OpRegistry;

bool registeredByATest(const OpDef& def) { return def.name.rfind("test.", 0) == 0; }

TEST(EmitterRegistry, EveryOpHasACudaLoweringOrANoKernelMark) {
  const EmitterRegistry& r = EmitterRegistry::get();
  for (const OpDef* def : OpRegistry::get().all()) {
    if (registeredByATest(*def)) continue;
    std::string reason;
    const NoKernel mark = r.noKernel(def->opcode, &reason);
    const std::vector<std::string> lowerings = r.loweringsOf(def->opcode);
    EXPECT_TRUE(!lowerings.empty() || mark != NoKernel::kNone)
        << def->name << " has no CUDA lowering: register an expression rule or an op emitter for it in "
        << "codegen/emit/, or mark it in registerNoKernelOps (emitter_registry.cc) with the reason";
    EXPECT_FALSE(!lowerings.empty() && mark != NoKernel::kNone)
        << def->name << " is lowered by " << lowerings.front() << " and also marked as needing no kernel";
    if (mark != NoKernel::kNone) {
      EXPECT_FALSE(reason.empty()) << def->name << "'s no-kernel mark gives no reason";
    }
  }
}

// Registrations name ops by opcode; each must be an op of the table.
TEST(EmitterRegistry, EveryRegisteredOpIsInTheTable) {
  for (ir::OpCode code : EmitterRegistry::get().registeredOps())
    EXPECT_NE(OpRegistry::get().lookup(code), nullptr)
        << "codegen/emit/ registers opcode " << static_cast<int>(code) << ", not an op of the table";
}

// groupOps skips sources and terminators before anything is lowered; the marks say so.
TEST(EmitterRegistry, SourcesAndTerminatorsAreMarkedToRunWithoutAKernel) {
  for (const OpDef* def : OpRegistry::get().all()) {
    if (registeredByATest(*def) || !(def->has(ir::kSource) || def->has(ir::kTerminator))) continue;
    EXPECT_EQ(EmitterRegistry::get().noKernel(def->opcode), NoKernel::kRunsWithout) << def->name;
  }
  EXPECT_EQ(EmitterRegistry::get().noKernel(ir::OpCode::Constant), NoKernel::kRunsWithout);
}

// Fusion forms pointwise groups by ir::isPointwise (passes cannot include codegen); codegen
// computes an op inline when it has an expression rule. The two sets must be one.
TEST(EmitterRegistry, PointwiseOpsAreExactlyTheOpsWithAnExpressionRule) {
  const ir::TensorType t(ir::DType::f32, {ir::Dim::fixed(4)});
  for (const OpDef* def : OpRegistry::get().all()) {
    if (registeredByATest(*def)) continue;
    for (const char* kind : {"sum", "max"}) {  // reduce_grad is pointwise unless it is max's
      auto op = ir::Op::create(def->name, {}, {t}, {{"kind", ir::Attribute(kind)}});
      EXPECT_EQ(ir::isPointwise(*op), EmitterRegistry::get().expressionFor(*op) != nullptr)
          << def->name << " (kind " << kind << "): fusion and codegen disagree on whether it is pointwise";
    }
  }
}

TEST(EmitterRegistry, EveryFusedKindTheBackendRunsHasAnEmitter) {
  const std::vector<std::string> kinds = EmitterRegistry::get().fusedKinds();
  for (const char* kind : {"pointwise", "reduction", "gemm_epilogue", "embedding", "embedding_update"})
    EXPECT_NE(std::find(kinds.begin(), kinds.end(), kind), kinds.end()) << kind;
}

// A "not lowered yet" mark is what the backend does: a group holding the op fails to lower,
// naming it.
TEST(EmitterRegistry, AnOpMarkedNotLoweredFailsToLower) {
  ir::Module module;
  ir::Function& f = module.addFunction("f");
  f.body().addBlock();
  ir::Builder b(f.entry());
  auto x = b.createWithTypes("kiln.input", {},
                             {ir::TensorType(ir::DType::f32, {ir::Dim::fixed(4), ir::Dim::fixed(3)})},
                             {{"name", ir::Attribute("x")}});
  ASSERT_TRUE(x) << x.status().message();
  ASSERT_EQ(EmitterRegistry::get().noKernel(ir::OpCode::AllReduce), NoKernel::kNotLowered);
  const std::vector<ir::Value*> operands = {(*x)->result()};
  auto sum = b.create("kiln.all_reduce", operands, {{"ranks", ir::Attribute(int64_t{2})}});
  ASSERT_TRUE(sum) << sum.status().message();
  const std::vector<const ir::Op*> group = {*sum};
  auto lowered = codegen::lowerGroup(group, {});
  ASSERT_FALSE(lowered);
  EXPECT_NE(lowered.status().message().find("'kiln.all_reduce'"), std::string::npos)
      << lowered.status().message();
  EXPECT_NE(lowered.status().message().find("has no CUDA lowering"), std::string::npos)
      << lowered.status().message();
}

}  // namespace
}  // namespace kiln::testing
