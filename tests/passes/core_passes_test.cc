// The first passes on IR built in memory: shape inference after an input's type changes, and
// how CSE, DCE and canonicalize treat side effects and regions. (Their IR-in, IR-out cases
// are the lit tests in tests/lit/passes.)
#include <gtest/gtest.h>

#include <cmath>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/pass.h"

namespace kiln::passes {
namespace {

using ir::Op;
using ir::TensorType;
using ir::Value;

TensorType type(std::string_view body) { return *ir::parseTensorTypeBody(body); }

// Test-only ops: one that writes state (and so must survive CSE and DCE even when unused and
// equal to another), and one that holds a region.
void registerTestOps() {
  static bool done = [] {
    ir::OpRegistry::get().add({.name = "test.effect",
                               .summary = "writes state",
                               .min_operands = 1,
                               .max_operands = 1,
                               .num_results = 1,
                               .traits = ir::kSideEffect | ir::kTypeGiven});
    ir::OpRegistry::get().add({.name = "test.group",
                               .summary = "holds a region",
                               .min_operands = 0,
                               .max_operands = -1,
                               .num_results = -1,
                               .traits = ir::kPure | ir::kTypeGiven});
    return true;
  }();
  (void)done;
}

Expected<bool> runPass(std::string_view name, ir::Module& m) {
  auto p = createPass(name);
  EXPECT_NE(p, nullptr) << name;
  auto r = p->run(m);
  if (r.isOk()) {
    Status v = ir::verify(m);
    EXPECT_TRUE(v.isOk()) << name << " left invalid IR: " << v.str() << "\n" << ir::printModule(m);
  }
  return r;
}

constexpr const char* kMlp =
    "func.func @forward() -> !kiln.tensor<Bx4xf32> {\n"
    "  %x = \"kiln.input\"() {name = \"x\"} : () -> !kiln.tensor<Bx13xf32>\n"
    "  %w = \"kiln.parameter\"() {name = \"w\"} : () -> !kiln.tensor<4x13xf32>\n"
    "  %y = \"kiln.matmul\"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx13xf32>, !kiln.tensor<4x13xf32>) "
    "-> !kiln.tensor<Bx4xf32>\n"
    "  %r = \"kiln.relu\"(%y) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>\n"
    "  return %r : !kiln.tensor<Bx4xf32>\n"
    "}\n";

TEST(ShapeInference, PropagatesAChangedInputType) {
  auto m = ir::parseModule(kMlp, "mlp.mlir").take();
  ir::Function* f = m->lookup("forward");
  Op* input = f->entry().opList()[0];
  input->result()->setType(type("16*Tx13xf32"));
  EXPECT_FALSE(ir::verify(*m).isOk());  // stale types downstream
  auto changed = runPass("shape-inference", *m);
  ASSERT_TRUE(changed.isOk()) << changed.status().str();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(f->entry().opList()[2]->result()->type().str(), "!kiln.tensor<16*Tx4xf32>");
  EXPECT_EQ(f->entry().opList()[3]->result()->type().str(), "!kiln.tensor<16*Tx4xf32>");
  ASSERT_EQ(f->resultTypes().size(), 1u);
  EXPECT_EQ(f->resultTypes()[0].str(), "!kiln.tensor<16*Tx4xf32>");
  // A second run has nothing to do.
  auto again = runPass("shape-inference", *m);
  ASSERT_TRUE(again.isOk());
  EXPECT_FALSE(*again);
}

TEST(ShapeInference, FailsAtTheOpThatNoLongerFits) {
  auto m = ir::parseModule(kMlp, "mlp.mlir").take();
  ir::Function* f = m->lookup("forward");
  f->entry().opList()[0]->result()->setType(type("Bx12xf32"));  // 12 features against a 4x13 weight
  auto p = createPass("shape-inference");
  auto r = p->run(*m);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().location().file, "mlp.mlir");
  EXPECT_EQ(r.status().location().line, 4);  // the matmul
  EXPECT_EQ(r.status().location().col, 3);
  EXPECT_NE(r.status().message().find("kiln.matmul"), std::string::npos) << r.status().str();
}

TEST(ShapeInference, RechecksOpsWithStatedTypes) {
  auto m = ir::parseModule(
               "func.func @f(%x: !kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx2x3xf32> {\n"
               "  %e = \"kiln.exp\"(%x) : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx6xf32>\n"
               "  %r = \"kiln.reshape\"(%e) : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx2x3xf32>\n"
               "  return %r : !kiln.tensor<Bx2x3xf32>\n"
               "}\n",
               "r.mlir")
               .take();
  m->lookup("f")->entry().argument(0)->setType(type("Bx7xf32"));
  auto p = createPass("shape-inference");
  auto r = p->run(*m);
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().location().line, 3);
  EXPECT_NE(r.status().message().find("'kiln.reshape' changes the element count"), std::string::npos)
      << r.status().str();
}

TEST(ShapeInference, KeepsShardingWhenTheRankSurvives) {
  auto m = ir::parseModule(kMlp, "mlp.mlir").take();
  ir::Function* f = m->lookup("forward");
  Op* relu = f->entry().opList()[3];
  relu->result()->setType(type("Bx4xf32, shard<2x1>"));
  f->entry().opList()[0]->result()->setType(type("Tx13xf32"));
  ASSERT_TRUE(runPass("shape-inference", *m).isOk());
  EXPECT_EQ(relu->result()->type().str(), "!kiln.tensor<Tx4xf32, shard<2x1>>");
}

// @f(%x) with two equal side-effecting ops whose results are unused, and two equal pure ops.
std::unique_ptr<ir::Module> effects() {
  registerTestOps();
  auto m = std::make_unique<ir::Module>();
  ir::Function& f = m->addFunction("f");
  Value* x = f.entry().addArgument(type("4xf32"), "x");
  for (int i = 0; i < 2; ++i) f.entry().push_back(Op::create("test.effect", {x}, {type("4xf32")}));
  Op* e1 = f.entry().push_back(Op::create("kiln.exp", {x}, {type("4xf32")}));
  Op* e2 = f.entry().push_back(Op::create("kiln.exp", {x}, {type("4xf32")}));
  Op* s = f.entry().push_back(Op::create("kiln.add", {e1->result(), e2->result()}, {type("4xf32")}));
  f.entry().push_back(Op::create("func.return", {s->result()}, {}));
  f.setResultTypes({type("4xf32")});
  return m;
}

size_t count(ir::Module& m, std::string_view name) {
  size_t n = 0;
  for (auto& f : m.functions()) f->walk([&](Op& op) { n += op.name() == name; });
  return n;
}

TEST(CSE, NeverMergesSideEffects) {
  auto m = effects();
  auto r = runPass("cse", *m);
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(*r);
  EXPECT_EQ(count(*m, "test.effect"), 2u);
  EXPECT_EQ(count(*m, "kiln.exp"), 1u);
}

TEST(DCE, NeverRemovesSideEffects) {
  auto m = effects();
  ASSERT_TRUE(runPass("cse", *m).isOk());
  auto r = runPass("dce", *m);
  ASSERT_TRUE(r.isOk());
  EXPECT_FALSE(*r);  // the exp is used; the effects stay
  EXPECT_EQ(count(*m, "test.effect"), 2u);
}

// @f(%x): a group whose body recomputes exp(%x) twice, next to an exp(%x) outside it.
std::unique_ptr<ir::Module> grouped() {
  registerTestOps();
  auto m = std::make_unique<ir::Module>();
  ir::Function& f = m->addFunction("f");
  Value* x = f.entry().addArgument(type("4xf32"), "x");
  Op* outer = f.entry().push_back(Op::create("kiln.exp", {x}, {type("4xf32")}));
  for (int g = 0; g < 2; ++g) {
    Op* group = f.entry().push_back(Op::create("test.group", {x}, {type("4xf32")}));
    ir::Block& body = group->addRegion().addBlock();
    Value* in = body.addArgument(type("4xf32"), "in");
    Op* a = body.push_back(Op::create("kiln.exp", {in}, {type("4xf32")}));
    Op* b = body.push_back(Op::create("kiln.exp", {in}, {type("4xf32")}));
    Op* c = body.push_back(Op::create("kiln.exp", {x}, {type("4xf32")}));  // captures %x
    Op* one = body.push_back(Op::create("kiln.constant", {}, {type("f32")}, {{"value", 1.0}}));
    Op* mul = body.push_back(Op::create("kiln.mul", {a->result(), one->result()}, {type("4xf32")}));
    Op* s = body.push_back(Op::create("kiln.add", {mul->result(), b->result()}, {type("4xf32")}));
    Op* t = body.push_back(Op::create("kiln.add", {s->result(), c->result()}, {type("4xf32")}));
    body.push_back(Op::create("kiln.yield", {t->result()}, {}));
  }
  std::vector<Op*> ops = f.entry().opList();
  Op* sum =
      f.entry().push_back(Op::create("kiln.add", {ops[1]->result(), ops[2]->result()}, {type("4xf32")}));
  Op* all = f.entry().push_back(Op::create("kiln.add", {sum->result(), outer->result()}, {type("4xf32")}));
  f.entry().push_back(Op::create("func.return", {all->result()}, {}));
  f.setResultTypes({type("4xf32")});
  EXPECT_TRUE(ir::verify(*m).isOk()) << ir::verify(*m).str();
  return m;
}

TEST(CSE, MergesInsideARegionButNeverAcrossItsBoundary) {
  auto m = grouped();
  ASSERT_TRUE(runPass("cse", *m).isOk());
  ir::Function* f = m->lookup("f");
  std::vector<Op*> ops = f->entry().opList();
  // Both groups stay (ops with regions are not merged), the outer exp stays.
  EXPECT_EQ(count(*m, "test.group"), 2u);
  for (int g = 1; g <= 2; ++g) {
    ir::Block& body = ops[g]->regions()[0]->front();
    // exp(%in) twice became once; exp(%x) inside the region was not replaced by the outer one.
    size_t exps = 0;
    for (Op* op : body.opList()) exps += op->name() == "kiln.exp";
    EXPECT_EQ(exps, 2u) << ir::printModule(*m);
    for (Op* op : body.opList())
      for (Value* v : op->operands()) EXPECT_NE(v, ops[0]->result()) << "the region captured the outer exp";
  }
}

TEST(Canonicalize, RewritesInsideRegions) {
  auto m = grouped();
  auto r = runPass("canonicalize", *m);
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(*r);
  // The mul by one is gone from both bodies, and so is the constant it used.
  EXPECT_EQ(count(*m, "kiln.mul"), 0u);
  EXPECT_EQ(count(*m, "kiln.constant"), 0u);
}

TEST(DCE, RemovesDeadOpsInsideRegionsAndWholeDeadGroups) {
  auto m = grouped();
  ir::Function* f = m->lookup("f");
  // Make the second group dead: the final sum reads the first group twice.
  std::vector<Op*> ops = f->entry().opList();
  Op* sum = ops[3];
  sum->setOperand(1, ops[1]->result());
  auto r = runPass("dce", *m);
  ASSERT_TRUE(r.isOk());
  EXPECT_TRUE(*r);
  EXPECT_EQ(count(*m, "test.group"), 1u);
}

// Folding agrees with the same arithmetic done here in float.
TEST(Canonicalize, FoldsUnaryOpsLikeFloatMath) {
  struct Case {
    const char* op;
    double x;
    double want;
  };
  const double x = 0.75;
  const Case cases[] = {
      {"kiln.exp", x, std::exp(x)},
      {"kiln.log", x, std::log(x)},
      {"kiln.sqrt", x, std::sqrt(x)},
      {"kiln.rsqrt", x, 1 / std::sqrt(x)},
      {"kiln.sigmoid", -x, 1 / (1 + std::exp(x))},
      {"kiln.tanh", x, std::tanh(x)},
      {"kiln.relu", -x, 0.0},
      {"kiln.abs", -x, x},
      {"kiln.silu", x, x / (1 + std::exp(-x))},
      {"kiln.gelu", x, 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))},
  };
  for (const Case& c : cases) {
    ir::Module m;
    ir::Function& f = m.addFunction("f");
    Op* k = f.entry().push_back(Op::create("kiln.constant", {}, {type("3xf32")}, {{"value", c.x}}));
    Op* u = f.entry().push_back(Op::create(c.op, {k->result()}, {type("3xf32")}));
    f.entry().push_back(Op::create("func.return", {u->result()}, {}));
    f.setResultTypes({type("3xf32")});
    ASSERT_TRUE(runPass("canonicalize", m).isOk());
    std::vector<Op*> ops = f.entry().opList();
    ASSERT_EQ(ops.size(), 2u) << c.op;
    ASSERT_EQ(ops[0]->name(), "kiln.constant") << c.op;
    EXPECT_EQ(ops[0]->floatAttr("value"), static_cast<double>(static_cast<float>(c.want))) << c.op;
  }
}

}  // namespace
}  // namespace kiln::passes
