// Fused groups (kiln.fused ops, as the fusion pass builds them) through the CUDA lowering: each
// becomes one unit of GPU work, or is split with its reason. The kernels' math is checked on
// the CPU by the kernel interpreter against the ops' CPU references, run on the unfused ops;
// every value a kernel writes is poisoned (NaN) first.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "codegen/cuda_program.h"
#include "codegen/kernel_lowering.h"
#include "ir/builder.h"
#include "tests/nvrtc/fused_groups.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

using codegen::KernelKind;
using codegen::LoweredGroup;

// Interpreted results against the reference (tests/nvrtc/op_cases.h).
void expectClose(const ir::HostTensor& got, const ir::HostTensor& want, double tol, const std::string& what) {
  testing::expectClose(got.view, want.view, tol, what, "kernel");
}

// A function under construction: inputs filled at random, the reference computed on the flat
// ops before they are fused.
struct FusedCase {
  ir::Module module;
  ir::Function* f = nullptr;
  ir::Builder b;
  ir::SymbolBindings symbols;
  std::mt19937 rng{99};
  std::map<const Value*, ir::HostTensor> inputs;
  std::vector<const ir::Op*> ops;  // the ops under test, in order

  FusedCase() {
    f = &module.addFunction("f");
    f->body().addBlock();
    b.setInsertionPointToEnd(f->entry());
  }
  Value* source(const char* op, const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal,
                int64_t range = 0) {
    auto r = b.createWithTypes(op, {}, {TensorType(t, std::move(shape))}, {{"name", Attribute(name)}});
    EXPECT_TRUE(r) << r.status().message();
    Value* v = (*r)->result();
    auto s = codegen::concreteShape(v->type(), symbols);
    ir::HostTensor h(t, *s);
    fillTensor(h, fill, range, rng);
    inputs[v] = h;
    return v;
  }
  Value* input(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal,
               int64_t range = 0) {
    return source("kiln.input", name, t, std::move(shape), fill, range);
  }
  Value* param(const std::string& name, DType t, ir::Shape shape, Fill fill = Fill::Normal) {
    return source("kiln.parameter", name, t, std::move(shape), fill);
  }
  ir::Op* op(const std::string& name, const std::vector<Value*>& operands, AttrDict attrs = {}) {
    auto r = b.create(name, operands, std::move(attrs));
    EXPECT_TRUE(r) << name << ": " << r.status().message();
    ops.push_back(*r);
    return *r;
  }
  ir::Op* opWithType(const std::string& name, const std::vector<Value*>& operands, TensorType t) {
    auto r = b.createWithTypes(name, operands, {std::move(t)});
    EXPECT_TRUE(r) << name << ": " << r.status().message();
    ops.push_back(*r);
    return *r;
  }
  std::vector<ir::Op*> members() const {
    std::vector<ir::Op*> m;
    for (const ir::Op* op : ops) m.push_back(const_cast<ir::Op*>(op));
    return m;
  }
  // Reference values of every op, from the inputs (parameters updated in a copy).
  std::map<const Value*, ir::HostTensor> reference() {
    std::map<const Value*, ir::HostTensor> v = inputs;
    Status s = referenceRun(ops, symbols, v);
    EXPECT_TRUE(s.isOk()) << s.message();
    return v;
  }
  // Lowers f and runs every group on the CPU; returns the values of f's body.
  std::map<const Value*, ir::HostTensor> interpret(const std::vector<LoweredGroup>& groups) {
    std::map<const Value*, ir::HostTensor> v = inputs;
    Status s = interpretFunction(groups, symbols, v, poison);
    EXPECT_TRUE(s.isOk()) << s.message();
    return v;
  }
};

TEST(FusedKernels, ReductionGroupEndingInSumToIsOneKernel) {
  FusedCase c;
  Value* x = c.input("x", DType::f32, S({6, 5, 4}));
  Value* bias = c.input("bias", DType::f32, S({4}));
  Value* y = c.input("y", DType::f32, S({5, 4}));
  Value* s = c.op("kiln.add", {x, bias})->result();
  Value* r = c.op("kiln.relu", {s})->result();
  Value* m = c.op("kiln.mul", {r, y})->result();
  // The bias gradient of a broadcast: summed over the batch and the middle dim.
  Value* sum = c.opWithType("kiln.sum_to", {m}, TensorType(DType::f32, S({1, 4})))->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {sum}, {}));
  auto want = c.reference();
  ir::Op* fused = fuseOps(*c.f, c.members(), "reduction");
  ASSERT_EQ(fused->numResults(), 1u);

  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_EQ(groups->size(), 1u);
  const LoweredGroup& g = groups->front();
  EXPECT_EQ(g.fused_kind, "reduction");
  EXPECT_TRUE(g.split_reason.empty()) << g.split_reason;
  ASSERT_EQ(g.kernels.size(), 1u);
  // Leading dims folded: threads on consecutive columns; 30 rows are one slab.
  EXPECT_EQ(g.kernels[0].kind, KernelKind::ColumnReduce);
  // Only the inputs and the sum touch memory: the chain is computed inline.
  EXPECT_EQ(g.buffers.size(), 4u);
  auto got = c.interpret(*groups);
  expectClose(got.at(fused->result()), want.at(sum), 1e-5, "sum_to");
}

TEST(FusedKernels, BagsAndConcatWriteTheConcatenationInOneLookupKernel) {
  FusedCase c;
  const int64_t batch = 7;
  Value* dense = c.input("dense", DType::f32, S({batch, 3}));
  Value* t0 = c.param("tables.0", DType::f32, S({10, 4}));
  Value* t1 = c.param("tables.1", DType::f32, S({6, 40}));
  Value* ids0 = c.input("cats.0", DType::i64, S({batch, 2}), Fill::Ids, 10);
  Value* ids1 = c.input("cats.1", DType::i32, S({batch, 3}), Fill::Ids, 6);
  Value* e0 = c.op("kiln.embedding_bag", {t0, ids0})->result();
  Value* e1 = c.op("kiln.embedding_bag", {t1, ids1}, {{"mode", Attribute("mean")}})->result();
  Value* cat = c.op("kiln.concat", {dense, e0, e1}, {{"axis", Attribute(int64_t{1})}})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {cat}, {}));
  auto want = c.reference();
  ir::Op* fused = fuseOps(*c.f, c.members(), "embedding");

  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_EQ(groups->size(), 1u);
  const LoweredGroup& g = groups->front();
  EXPECT_TRUE(g.split_reason.empty()) << g.split_reason;
  // The lookup kernel for both tables, and one copy of the dense columns.
  ASSERT_EQ(g.kernels.size(), 2u);
  EXPECT_EQ(g.kernels[0].kind, KernelKind::EmbeddingForward);
  EXPECT_EQ(g.kernels[0].tables.size(), 2u);
  EXPECT_EQ(g.kernels[0].tables[1].out_offset, 3 + 4);
  // Buffers are the function's values: the tables and ids as the fused op's operands.
  for (const codegen::GroupBuffer& b : g.buffers)
    if (b.value) {
      EXPECT_EQ(b.value->parentBlock(), &c.f->entry()) << b.name;
    }
  auto got = c.interpret(*groups);
  expectClose(got.at(fused->result()), want.at(cat), 1e-6, "concat");
}

TEST(FusedKernels, EmbeddingUpdateGroupReadsTheConcatenatedGradient) {
  FusedCase c;
  const int64_t batch = 9;
  Value* t0 = c.param("tables.0", DType::f32, S({5, 4}));
  Value* t1 = c.param("tables.1", DType::f32, S({8, 6}));
  Value* s1 = c.param("tables.1.rowwise_adagrad_sum", DType::f32, S({8}), Fill::Positive);
  Value* ids0 = c.input("cats.0", DType::i64, S({batch, 3}), Fill::Ids, 5);
  Value* ids1 = c.input("cats.1", DType::i64, S({batch, 2}), Fill::Ids, 8);
  Value* t2 = c.param("tables.2", DType::f32, S({6, 3}));
  Value* ids2 = c.input("cats.2", DType::i32, S({batch, 1}), Fill::Ids, 6);
  Value* grad = c.input("grad", DType::f32, S({batch, 16}));
  Value* lr = c.input("lr", DType::f32, {}, Fill::Positive);
  Value* step = c.input("step", DType::f32, {}, Fill::Ids, 4);
  auto slice = [&](int64_t start, int64_t limit) {
    return c
        .op("kiln.slice", {grad},
            {{"axis", Attribute(int64_t{1})}, {"start", Attribute(start)}, {"limit", Attribute(limit)}})
        ->result();
  };
  Value* g0 = slice(3, 7);
  c.op("kiln.embedding_bag_update", {t0, ids0, g0, lr, step},
       {{"optimizer", Attribute("sgd")}, {"lr", Attribute(0.1)}});
  Value* g1 = slice(7, 13);
  c.op("kiln.embedding_bag_update", {t1, ids1, g1, s1, lr, step},
       {{"optimizer", Attribute("rowwise_adagrad")}, {"lr", Attribute(0.05)}});
  Value* g2 = slice(13, 16);
  c.op("kiln.embedding_bag_update", {t2, ids2, g2, lr, step}, {{"optimizer", Attribute("sgd")}, {"lr", Attribute(0.1)}});
  fuseOps(*c.f, c.members(), "embedding_update");

  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_EQ(groups->size(), 1u);
  const LoweredGroup& g = groups->front();
  EXPECT_TRUE(g.split_reason.empty()) << g.split_reason;
  // ONE sorted backward for all tables (keys, one radix pass: scan and scatter, the segments:
  // count, scan and list), then one fused sum-and-update launch per optimizer configuration:
  // the two sgd tables at lr 0.1 share one though the rowwise_adagrad table sits between them.
  // No slice copies. The kernels are CUDA source: simt_embedding_backward_test runs such groups
  // against the CPU reference.
  ASSERT_EQ(g.kernels.size(), 8u);
  for (const codegen::Kernel& k : g.kernels) EXPECT_EQ(k.kind, codegen::KernelKind::Source) << k.name;
  EXPECT_EQ(g.kernels[6].name, "embedding_update_sgd");
  EXPECT_EQ(g.kernels[7].name, "embedding_update_rowwise_adagrad");
  // Tables [0, 2), then [2, 3) (after the batch, the id bits and the widest row).
  EXPECT_NE(g.kernels[6].source.find("b5, 9LL, 3, 6LL, 0, 2,"), std::string::npos) << g.kernels[6].source;
  EXPECT_NE(g.kernels[7].source.find("b5, 9LL, 3, 6LL, 2, 3,"), std::string::npos) << g.kernels[7].source;
}

// Builds matmul(x, w^T) + b, then `act`, fused as a gemm_epilogue group.
LoweredGroup lowerGemmEpilogue(FusedCase& c, const char* act, std::vector<LoweredGroup>* all = nullptr) {
  Value* x = c.input("x", DType::f32, S({8, 5}));
  Value* w = c.param("w", DType::f32, S({3, 5}));
  Value* bias = c.param("b", DType::f32, S({3}));
  Value* mm = c.op("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}})->result();
  Value* y = c.op("kiln.add", {mm, bias})->result();
  Value* z = c.op(act, {y})->result();
  EXPECT_TRUE(c.b.createWithTypes("func.return", {z}, {}));
  fuseOps(*c.f, c.members(), "gemm_epilogue");
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  EXPECT_TRUE(groups) << groups.status().message();
  if (all) *all = *groups;
  return groups->front();
}

TEST(FusedKernels, GemmEpilogueIsOneCublasLtCall) {
  FusedCase c;
  std::vector<LoweredGroup> groups;
  LoweredGroup g = lowerGemmEpilogue(c, "kiln.relu", &groups);
  ASSERT_EQ(groups.size(), 1u);
  ASSERT_NE(g.gemm, nullptr);
  EXPECT_TRUE(g.kernels.empty());
  EXPECT_EQ(g.gemm_call.activation, "relu");
  ASSERT_GE(g.gemm_call.bias, 0);
  EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.bias)].name, "b");
  // C is the fused op's result: what the function returns.
  const ir::Value* ret = c.f->returnOp()->operand(0);
  EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.c)].value, ret);
  EXPECT_TRUE(g.buffers[static_cast<size_t>(g.gemm_call.c)].defined);
}

TEST(FusedKernels, GemmEpilogueCublasLtCannotRunIsSplitWithItsReason) {
  FusedCase c;
  std::vector<LoweredGroup> groups;
  lowerGemmEpilogue(c, "kiln.sigmoid", &groups);
  // The GEMM alone, then bias add + sigmoid as one pointwise kernel.
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_NE(groups[0].gemm, nullptr);
  EXPECT_EQ(groups[0].gemm_call.bias, -1);
  EXPECT_EQ(groups[1].kernels.size(), 1u);
  for (const LoweredGroup& g : groups) {
    EXPECT_EQ(g.fused_index, 0);
    EXPECT_NE(g.split_reason.find("kiln.sigmoid"), std::string::npos) << g.split_reason;
  }
}

TEST(FusedKernels, WidenedBf16ProductIsTheAccumulatorOfOneCublasLtCall) {
  // Mixed precision's cast(matmul(bf16, bf16), f32) + bias, relu: ONE cuBLASLt call, bf16 in,
  // f32 out, bias and relu in its f32 epilogue (the product's bf16 rounding skipped).
  FusedCase c;
  Value* x = c.input("x", DType::bf16, S({8, 5}));
  Value* w = c.param("w", DType::bf16, S({3, 5}));
  Value* bias = c.param("b", DType::f32, S({3}));
  Value* mm = c.op("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}})->result();
  Value* wide = c.op("kiln.cast", {mm}, {{"to", Attribute("f32")}})->result();
  Value* y = c.op("kiln.add", {wide, bias})->result();
  Value* z = c.op("kiln.relu", {y})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {z}, {}));
  fuseOps(*c.f, c.members(), "gemm_epilogue");
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_EQ(groups->size(), 1u);
  const LoweredGroup& g = groups->front();
  EXPECT_TRUE(g.split_reason.empty()) << g.split_reason;
  ASSERT_NE(g.gemm, nullptr);
  EXPECT_EQ(g.gemm_call.activation, "relu");
  ASSERT_GE(g.gemm_call.bias, 0);
  EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.a)].dtype, DType::bf16);
  EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.c)].dtype, DType::f32);
  EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.c)].value, c.f->returnOp()->operand(0));
}

TEST(FusedKernels, Bf16ProductWidenedAfterTheBiasIsSplit) {
  // matmul(bf16) + bf16 bias, then widened: the sum was rounded to bf16 before the cast, which
  // cuBLASLt's f32 output would not do: split, with the reason.
  FusedCase c;
  Value* x = c.input("x", DType::bf16, S({8, 5}));
  Value* w = c.param("w", DType::bf16, S({3, 5}));
  Value* bias = c.param("b", DType::bf16, S({3}));
  Value* mm = c.op("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}})->result();
  Value* y = c.op("kiln.add", {mm, bias})->result();
  Value* wide = c.op("kiln.cast", {y}, {{"to", Attribute("f32")}})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {wide}, {}));
  fuseOps(*c.f, c.members(), "gemm_epilogue");
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_GE(groups->size(), 2u);
  EXPECT_NE(groups->front().split_reason.find("widens a bf16 product"), std::string::npos)
      << groups->front().split_reason;
}

// A weight gradient and its bias gradient beside it (the fusion pass's group): ONE cuBLASLt call
// whose epilogue writes the sum over K of the operand the sum_to folds; `which` picks g as A
// (g^T x, the form autodiff writes) or as B (x^T g).
LoweredGroup lowerBiasGradient(FusedCase& c, char which, bool narrowed, std::vector<LoweredGroup>* all) {
  const DType t = narrowed ? DType::bf16 : DType::f32;
  Value* g = c.input("g", DType::f32, S({8, 3}));
  Value* x = c.input("x", t, S({8, 5}));
  std::vector<ir::Op*> members;
  ir::Op* sum = c.opWithType("kiln.sum_to", {g}, TensorType(DType::f32, S({3})));
  members.push_back(sum);
  Value* gm = narrowed ? c.op("kiln.cast", {g}, {{"to", Attribute("bf16")}})->result() : g;
  ir::Op* mm = which == 'a' ? c.op("kiln.matmul", {gm, x}, {{"transpose_a", Attribute(true)}})
                            : c.op("kiln.matmul", {x, gm}, {{"transpose_a", Attribute(true)}});
  members.push_back(mm);
  Value* dw = mm->result();
  if (narrowed) {
    ir::Op* wide = c.op("kiln.cast", {dw}, {{"to", Attribute("f32")}});
    members.push_back(wide);
    dw = wide->result();
  }
  EXPECT_TRUE(c.b.createWithTypes("func.return", {dw, sum->result()}, {}));
  fuseOps(*c.f, members, "gemm_epilogue");
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  EXPECT_TRUE(groups) << groups.status().message();
  *all = *groups;
  return groups->back();
}

TEST(FusedKernels, BiasGradientIsTheWeightGradientGemmsEpilogue) {
  for (char which : {'a', 'b'})
    for (bool narrowed : {false, true}) {
      const std::string what = fmt::format("g as {}{}", which, narrowed ? ", bf16" : "");
      FusedCase c;
      std::vector<LoweredGroup> groups;
      LoweredGroup g = lowerBiasGradient(c, which, narrowed, &groups);
      ASSERT_EQ(groups.size(), narrowed ? 2u : 1u) << what;  // the narrowing cast is its own kernel
      EXPECT_TRUE(g.split_reason.empty()) << what << ": " << g.split_reason;
      ASSERT_NE(g.gemm, nullptr) << what;
      EXPECT_TRUE(g.kernels.empty()) << what;
      EXPECT_EQ(g.gemm_call.bias_gradient_of, which) << what;
      EXPECT_TRUE(g.gemm_call.activation.empty()) << what;
      ASSERT_GE(g.gemm_call.bias, 0) << what;
      const codegen::GroupBuffer& db = g.buffers[static_cast<size_t>(g.gemm_call.bias)];
      EXPECT_TRUE(db.written && db.defined) << what;
      EXPECT_EQ(db.dtype, DType::f32) << what;
      EXPECT_EQ(db.elements, 3) << what;
      EXPECT_EQ(g.buffers[static_cast<size_t>(g.gemm_call.c)].dtype, DType::f32) << what;
      // The step carries the epilogue for the runtime.
      auto built = codegen::buildCudaProgram(*c.f, groups, c.symbols);
      ASSERT_TRUE(built) << built.status().message();
      const codegen::CudaStep& step = built->steps[built->group_steps.back().first];
      ASSERT_TRUE(step.isGemm());
      EXPECT_EQ(step.gemm.epilogue,
                which == 'a' ? codegen::Epilogue::BiasGradA : codegen::Epilogue::BiasGradB);
      EXPECT_GE(step.args[3], 0);
    }
}

TEST(FusedKernels, SumToThatIsNoBiasGradientOfTheGemmIsSplit) {
  // sum_to(g) beside g w (no transpose: K is g's trailing dim), grouped by hand: cuBLASLt
  // cannot write that fold, so the group splits with the reason and both still run.
  FusedCase c;
  Value* g = c.input("g", DType::f32, S({8, 3}));
  Value* w = c.param("w", DType::f32, S({3, 5}));
  ir::Op* sum = c.opWithType("kiln.sum_to", {g}, TensorType(DType::f32, S({3})));
  ir::Op* mm = c.op("kiln.matmul", {g, w});
  ASSERT_TRUE(c.b.createWithTypes("func.return", {mm->result(), sum->result()}, {}));
  fuseOps(*c.f, {sum, mm}, "gemm_epilogue");
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  ASSERT_EQ(groups->size(), 2u);
  for (const LoweredGroup& lg : *groups)
    EXPECT_NE(lg.split_reason.find("does not fold the K dim"), std::string::npos) << lg.split_reason;
}

TEST(FusedKernels, OuterValueSeesThroughFusedRegions) {
  FusedCase c;
  Value* x = c.input("x", DType::f32, S({4}));
  Value* a = c.op("kiln.exp", {x})->result();
  Value* r = c.op("kiln.neg", {a})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {r}, {}));
  ir::Op* fused = fuseOps(*c.f, {a->definingOp(), r->definingOp()}, "pointwise");
  ir::Block& body = fused->regions().front()->front();
  EXPECT_EQ(codegen::outerValue(body.argument(0)), x);
  EXPECT_EQ(codegen::outerValue(r), fused->result());
  EXPECT_EQ(codegen::outerValue(a), a);  // not yielded: stays inside
  EXPECT_EQ(codegen::outerValue(x), x);
}

// Hand-computed: DLRM's interaction backward adds pair gradients into a [batch, F*F] matrix;
// repeated indices must accumulate.
TEST(FusedKernels, ScatterAddByHand) {
  FusedCase c;
  Value* base = c.input("base", DType::f32, S({2, 4}));
  Value* idx = c.input("idx", DType::i64, S({3}));
  Value* upd = c.input("upd", DType::f32, S({2, 3}));
  Value* out = c.op("kiln.scatter_add", {base, idx, upd}, {{"axis", Attribute(int64_t{1})}})->result();
  ASSERT_TRUE(c.b.createWithTypes("func.return", {out}, {}));
  float b0[8] = {1, 2, 3, 4, 5, 6, 7, 8}, u0[6] = {10, 20, 30, 40, 50, 60};
  int64_t i0[3] = {2, 0, 2};
  std::memcpy(c.inputs.at(base).view.data, b0, sizeof(b0));
  std::memcpy(c.inputs.at(idx).view.data, i0, sizeof(i0));
  std::memcpy(c.inputs.at(upd).view.data, u0, sizeof(u0));
  auto groups = codegen::lowerFunction(*c.f, c.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  auto got = c.interpret(*groups);
  const float* r = got.at(out).as<float>();
  const float want[8] = {1 + 20, 2, 3 + 10 + 30, 4, 5 + 50, 6, 7 + 40 + 60, 8};
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(r[i], want[i]) << i;
}

}  // namespace
}  // namespace kiln::testing
