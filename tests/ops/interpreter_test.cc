// The reference interpreter: multi-op functions, source binding errors, symbols, in-place
// updates by side-effecting ops, and regions of fused groups.
#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

TensorType f32Type(Shape s) { return TensorType(DType::f32, std::move(s)); }

// @f(x: Bx2, w: 3x2, b: 3) = relu(x w^T + b)
struct Mlp {
  Module m;
  Function* f = nullptr;
  Mlp() {
    f = &m.addFunction("f");
    Builder b(f->entry());
    b.setLocation({"mlp.kiln", 4, 7});
    Value* x = (*b.createWithTypes("kiln.input", {}, {f32Type({Dim::symbol("B"), Dim::fixed(2)})},
                                   {{"name", Attribute("x")}}))
                   ->result();
    Value* w = (*b.createWithTypes("kiln.parameter", {}, {f32Type({Dim::fixed(3), Dim::fixed(2)})},
                                   {{"name", Attribute("w")}}))
                   ->result();
    Value* bias =
        (*b.createWithTypes("kiln.parameter", {}, {f32Type({Dim::fixed(3)})}, {{"name", Attribute("b")}}))
            ->result();
    Value* h = *b.createValue("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}});
    Value* z = *b.createValue("kiln.add", {h, bias});
    Value* r = *b.createValue("kiln.relu", {z});
    f->setResultTypes({r->type()});
    (void)b.createWithTypes("func.return", {r}, {});
  }
};

TEST(Interpreter, RunsAFunctionOpByOp) {
  Mlp mlp;
  ASSERT_TRUE(verify(*mlp.f));
  std::map<std::string, HostTensor> in = {
      {"x", f32({2, 2}, {1, 2, -1, 0})}, {"w", f32({3, 2}, {1, 0, 0, 1, 1, 1})}, {"b", f32({3}, {0, -5, 1})}};
  auto r = interpret(*mlp.f, in, {{"B", 2}});
  ASSERT_TRUE(r) << r.status().str();
  ASSERT_EQ(r->size(), 1u);
  // x w^T = [[1, 2, 3], [-1, 0, -1]]; + b = [[1, -3, 4], [-1, -5, 0]]; relu.
  expectTensor((*r)[0], {2, 3}, {1, 0, 4, 0, 0, 0});
}

TEST(Interpreter, FreesIntermediatesOnlyAfterTheirLastUse) {
  // e = exp(x) is used twice, then a dead neg(e) runs, then y = e + e is returned with e.
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  Value* x = (*b.createWithTypes("kiln.input", {}, {f32Type({Dim::fixed(2)})}, {{"name", Attribute("x")}}))
                 ->result();
  Value* e = *b.createValue("kiln.exp", {x});
  (void)b.createValue("kiln.neg", {e});
  Value* y = *b.createValue("kiln.add", {e, e});
  Value* z = *b.createValue("kiln.mul", {y, x});
  f.setResultTypes({z->type(), e->type()});
  (void)b.createWithTypes("func.return", {z, e}, {});
  auto r = interpret(f, {{"x", f32({2}, {0, 1})}}, {});
  ASSERT_TRUE(r) << r.status().str();
  expectTensor((*r)[0], {2}, {0, 2 * 2.718281828});
  expectTensor((*r)[1], {2}, {1, 2.718281828});
}

TEST(Interpreter, MissingOrMisshapenSourcesAreLocatedErrors) {
  Mlp mlp;
  std::map<std::string, HostTensor> in = {{"x", f32({2, 2}, {1, 2, -1, 0})},
                                          {"w", f32({3, 2}, {1, 0, 0, 1, 1, 1})}};
  auto missing = interpret(*mlp.f, in, {{"B", 2}});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("no tensor named 'b'"), std::string::npos)
      << missing.status().str();
  EXPECT_EQ(missing.status().location().line, 4);
  in["b"] = f32({4}, {0, 0, 0, 0});
  auto wrong = interpret(*mlp.f, in, {{"B", 2}});
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.status().message().find("'b' is f32[4] but 'kiln.parameter' declares !kiln.tensor<3xf32>"),
            std::string::npos)
      << wrong.status().str();
  in["b"] = f32({3}, {0, 0, 0});
  auto batch = interpret(*mlp.f, in, {{"B", 3}});  // x has 2 rows, B says 3
  ASSERT_FALSE(batch);
  auto unbound = interpret(*mlp.f, in, {});
  ASSERT_FALSE(unbound);
  EXPECT_NE(unbound.status().message().find("symbol 'B'"), std::string::npos) << unbound.status().str();
}

TEST(Interpreter, KernelErrorsCarryTheOpLocation) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  Value* t = (*b.createWithTypes("kiln.parameter", {}, {f32Type({Dim::fixed(4), Dim::fixed(2)})},
                                 {{"name", Attribute("t")}}))
                 ->result();
  Value* ids = (*b.createWithTypes("kiln.input", {}, {TensorType(DType::i64, {Dim::fixed(1), Dim::fixed(1)})},
                                   {{"name", Attribute("ids")}}))
                   ->result();
  b.setLocation({"model.kiln", 12, 3});
  Value* e = *b.createValue("kiln.embedding_bag", {t, ids}, {{"table", Attribute("tables.0")}});
  f.setResultTypes({e->type()});
  (void)b.createWithTypes("func.return", {e}, {});
  auto r = interpret(f, {{"t", f32({4, 2}, {0, 0, 0, 0, 0, 0, 0, 0})}, {"ids", i64({1, 1}, {9})}}, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().location().str(), "model.kiln:12:3");
  EXPECT_NE(r.status().str().find("tables.0"), std::string::npos) << r.status().str();
}

// A side-effecting test op that adds its second operand into its first, in place.
Status cpuAddInto(const Op&, const std::vector<const TensorView*>& in, const std::vector<TensorView*>&,
                  const CpuContext&) {
  float* dst = in[0]->as<float>();
  for (int64_t i = 0; i < in[0]->numel(); ++i) dst[i] += in[1]->as<float>()[i];
  return Status::ok();
}

TEST(Interpreter, SideEffectingOpsUpdateTheCallersTensorsInPlace) {
  OpRegistry::get().add({.name = "test.add_into",
                         .summary = "p += g (test only)",
                         .min_operands = 2,
                         .max_operands = 2,
                         .num_results = 0,
                         .traits = kSideEffect | kTypeGiven,
                         .cpu = cpuAddInto});
  Module m;
  Function& f = m.addFunction("step");
  Builder b(f.entry());
  Value* p =
      (*b.createWithTypes("kiln.parameter", {}, {f32Type({Dim::fixed(2)})}, {{"name", Attribute("p")}}))
          ->result();
  Value* g = (*b.createWithTypes("kiln.input", {}, {f32Type({Dim::fixed(2)})}, {{"name", Attribute("g")}}))
                 ->result();
  ASSERT_TRUE(b.createWithTypes("test.add_into", {p, g}, {}));
  (void)b.createWithTypes("func.return", {}, {});
  std::map<std::string, HostTensor> state = {{"p", f32({2}, {1, 2})}, {"g", f32({2}, {10, 20})}};
  ASSERT_TRUE(interpretInPlace(f, state, {}));
  ASSERT_TRUE(interpretInPlace(f, state, {}));
  expectTensor(state["p"], {2}, {21, 42});
  // The copying form leaves the caller's tensors alone.
  ASSERT_TRUE(interpret(f, state, {}));
  expectTensor(state["p"], {2}, {21, 42});
}

TEST(Interpreter, RunsTheRegionOfAFusedGroup) {
  OpRegistry::get().add({.name = "test.group",
                         .summary = "a fused group (test only)",
                         .min_operands = 0,
                         .max_operands = -1,
                         .num_results = -1,
                         .traits = kPure | kTypeGiven});
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  Value* x = (*b.createWithTypes("kiln.input", {}, {f32Type({Dim::fixed(3)})}, {{"name", Attribute("x")}}))
                 ->result();
  auto group = Op::create("test.group", {x}, {f32Type({Dim::fixed(3)})});
  Block& body = group->addRegion().addBlock();
  Value* arg = body.addArgument(f32Type({Dim::fixed(3)}));
  Builder inner(body);
  Value* e = *inner.createValue("kiln.exp", {arg});
  Value* n = *inner.createValue("kiln.neg", {e});
  (void)inner.createWithTypes("kiln.yield", {n}, {});
  Op* g = b.insert(std::move(group));
  f.setResultTypes({g->result()->type()});
  (void)b.createWithTypes("func.return", {g->result()}, {});
  auto r = interpret(f, {{"x", f32({3}, {0, 1, -1})}}, {});
  ASSERT_TRUE(r) << r.status().str();
  expectTensor((*r)[0], {3}, {-1, -2.718281828, -0.3678794412});
}

}  // namespace
}  // namespace kiln::ir::testing
