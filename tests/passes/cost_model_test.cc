// The shared cost model against hand-computed times and bytes.
#include "passes/cost_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>

#include "ir/builder.h"

namespace kiln::passes {
namespace {

using ir::Dim;
using ir::DType;
using ir::TensorType;

TEST(CostModel, TimeIsTheSlowerOfComputeAndMemoryPlusLaunches) {
  CostModel h200(h200Target(), {});
  // 786 TFLOP of GEMM takes one second on tensor cores; 4.3 TB one second of bandwidth.
  EXPECT_NEAR(h200.time({7.86e14, 7.86e14, 0, 1}), 1.0 + 4e-6, 1e-12);
  EXPECT_NEAR(h200.time({0, 0, 4.3e12, 1}), 1.0 + 4e-6, 1e-12);
  // 60 TFLOP of vector math (1 s) against 8.6 TB of traffic (2 s): memory bound.
  EXPECT_NEAR(h200.time({6.0e13, 0, 8.6e12, 1}), 2.0 + 4e-6, 1e-12);
  // Launches add up; no work at all costs nothing.
  EXPECT_NEAR(h200.time({0, 0, 0, 3}), 12e-6, 1e-15);
  EXPECT_EQ(h200.time({}), 0.0);
  CostModel cpu(cpuTarget(), {});
  EXPECT_NEAR(cpu.time({2.0e11, 2.0e11, 0, 0}), 1.0, 1e-12);
}

// A sparse update reads and writes each touched row with its state once (duplicates combined,
// never more rows than the table has) and reads every occurrence's gradient row and id.
double updateBytes(int64_t rows) {
  ir::Module m;
  ir::Function& f = m.addFunction("f");
  ir::Builder b(f.entry());
  auto value = [&](const char* kind, const char* name, TensorType t) {
    return (*b.createWithTypes(kind, {}, {std::move(t)}, {{"name", ir::Attribute(name)}}))->result();
  };
  ir::Value* table = value("kiln.parameter", "t", TensorType(DType::f32, {Dim::fixed(rows), Dim::fixed(8)}));
  ir::Value* ids = value("kiln.input", "ids", TensorType(DType::i64, {Dim::fixed(4), Dim::fixed(3)}));
  ir::Value* grad = value("kiln.input", "g", TensorType(DType::f32, {Dim::fixed(4), Dim::fixed(8)}));
  ir::Value* state = value("kiln.parameter", "t.rowwise_adagrad_sum", TensorType(DType::f32, {Dim::fixed(rows)}));
  ir::Value* lr = value("kiln.input", "lr", TensorType(DType::f32, {}));
  ir::Value* step = value("kiln.input", "step", TensorType(DType::f32, {}));
  ir::AttrDict attrs = {{"optimizer", ir::Attribute("rowwise_adagrad")}, {"lr", ir::Attribute(0.1)}};
  auto op = b.createWithTypes("kiln.embedding_bag_update", {table, ids, grad, state, lr, step}, {}, attrs);
  EXPECT_TRUE(op) << op.status().str();
  if (!op) return 0;
  return CostModel(h200Target(), {}).opCost(**op).bytes;
}

TEST(CostModel, ASparseUpdateMovesEachTouchedRowAndItsRowwiseStateOnce) {
  // 12 ids over 100 rows: 12 rows of 8 f32 and one f32 of state, read and written (864 bytes);
  // 12 gradient rows (384) and 12 i64 ids (96).
  EXPECT_DOUBLE_EQ(updateBytes(100), 2 * 12 * 36 + 384 + 96);
  // Over 5 rows, at most 5 are touched.
  EXPECT_DOUBLE_EQ(updateBytes(5), 2 * 5 * 36 + 384 + 96);
}

TEST(CostModel, TargetsByName) {
  EXPECT_EQ(targetByName("h200")->name, "h200");
  EXPECT_EQ(targetByName("cpu")->name, "cpu");
  auto bad = targetByName("tpu");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("cpu, h200"), std::string::npos);
}

struct Chain {
  ir::Module m;
  ir::Op *add = nullptr, *relu = nullptr;
  Chain() {
    ir::Function& f = m.addFunction("f");
    ir::Builder b(f.entry());
    TensorType t(DType::f32, {Dim::symbol("B"), Dim::fixed(64)});
    ir::Value* x = (*b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute("x")}}))->result();
    ir::Value* y = (*b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute("y")}}))->result();
    add = *b.create("kiln.add", {x, y});
    relu = *b.create("kiln.relu", {add->result()});
    (void)b.createWithTypes("func.return", {relu->result()}, {});
    f.setResultTypes({t});
  }
};

TEST(CostModel, AGroupReadsEachInputOnceAndKeepsInnerValuesOutOfMemory) {
  Chain c;
  const double tensor = 1024.0 * 64 * 4;  // one f32[1024, 64]
  CostModel cost(h200Target(), {{"B", 1024}});
  GroupCost add = cost.opCost(*c.add);
  EXPECT_EQ(add.flops, 1024.0 * 64);
  EXPECT_EQ(add.bytes, 3 * tensor);  // reads x and y, writes the sum
  EXPECT_EQ(add.launches, 1);
  GroupCost relu = cost.opCost(*c.relu);
  EXPECT_EQ(relu.bytes, 2 * tensor);
  GroupCost both = cost.groupCost({c.add, c.relu});
  EXPECT_EQ(both.bytes, 3 * tensor);  // the sum never reaches memory
  EXPECT_EQ(both.flops, add.flops + relu.flops);
  EXPECT_EQ(both.launches, 1);
  // Saved: one launch and the sum's write and read.
  EXPECT_NEAR(cost.fusionBenefit({c.add, c.relu}), 2 * tensor / 4.3e12 + 4e-6, 1e-12);
}

TEST(CostModel, UnboundSymbolsTakeTheDefault) {
  Chain c;
  CostModel unbound(h200Target(), {});
  CostModel bound(h200Target(), {{"B", CostModel::kDefaultSymbolValue}});
  EXPECT_EQ(unbound.opCost(*c.add).bytes, bound.opCost(*c.add).bytes);
  EXPECT_GT(unbound.opCost(*c.add).bytes, 0);
}

TEST(CostModel, SourcesAndTerminatorsLaunchNothing) {
  Chain c;
  CostModel cost(h200Target(), {});
  const ir::Function& f = *c.m.lookup("f");
  EXPECT_EQ(cost.opCost(*f.entry().ops().front()).launches, 0);
  EXPECT_EQ(cost.opCost(*f.returnOp()).launches, 0);
}

// A GPU multiplies bf16 on its tensor cores, f32 there too in TF32 (precision f32, the default)
// and on its CUDA cores under f32_strict; the CPU's GEMMs run all three at one rate. The GEMMs
// are compute bound here.
TEST(CostModel, GemmsRunAtTheRateOfTheirInputDtypeAndPrecision) {
  struct Case {
    DType dtype;
    const char* precision;
    double h200_rate;
  };
  for (const Case& k : {Case{DType::f32, "f32", 3.96e14}, Case{DType::f32, "f32_strict", 6.0e13},
                        Case{DType::bf16, "f32", 7.86e14}}) {
    ir::Module m;
    m.mutableAttrs()["kiln.train"] = ir::Attribute(ir::AttrDict{{"precision", ir::Attribute(std::string(k.precision))}});
    ir::Function& f = m.addFunction("f");
    ir::Builder b(f.entry());
    TensorType t(k.dtype, {Dim::fixed(1024), Dim::fixed(1024)});
    ir::Value* a = (*b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute("a")}}))->result();
    ir::Value* w = (*b.createWithTypes("kiln.input", {}, {t}, {{"name", ir::Attribute("w")}}))->result();
    auto mm = b.create("kiln.matmul", {a, w});
    ASSERT_TRUE(mm) << mm.status().message();
    const double flops = 2.0 * 1024 * 1024 * 1024;
    GroupCost c = CostModel(h200Target(), {}).opCost(**mm);
    EXPECT_EQ(c.gemm_flops, flops);
    EXPECT_EQ(c.f32_gemm_flops, k.dtype == DType::f32 ? flops : 0.0);
    EXPECT_EQ(c.tf32_gemm_flops, k.dtype == DType::f32 && std::string(k.precision) == "f32" ? flops : 0.0);
    const std::string what = fmt::format("{} at precision {}", ir::dtypeName(k.dtype), k.precision);
    EXPECT_NEAR(CostModel(h200Target(), {}).time(c), flops / k.h200_rate + 4e-6, 1e-12) << what;
    EXPECT_NEAR(CostModel(cpuTarget(), {}).time(c), flops / 2.0e11 + 2e-6, 1e-12) << what;
  }
}

}  // namespace
}  // namespace kiln::passes
