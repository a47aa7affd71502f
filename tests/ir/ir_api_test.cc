// The IR's object API: the builder, use lists, replaceAllUsesWith, erase, clone.
#include <gtest/gtest.h>

#include "ir/builder.h"
#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/printer.h"
#include "ir/verifier.h"

namespace kiln::ir {
namespace {

TensorType f32(Shape s) { return TensorType(DType::f32, std::move(s)); }

// @f(%x: Bx4, %w: 8x4) -> Bx8 = relu(matmul(x, w^T))
struct Fixture {
  Module m;
  Function* f;
  Value* x;
  Value* w;
  Op* mm;
  Op* relu;
  Fixture() {
    f = &m.addFunction("f");
    x = f->entry().addArgument(f32({Dim::symbol("B"), Dim::fixed(4)}), "x");
    w = f->entry().addArgument(f32({Dim::fixed(8), Dim::fixed(4)}), "w");
    Builder b(f->entry());
    mm = *b.create("kiln.matmul", {x, w}, {{"transpose_b", true}});
    relu = *b.create("kiln.relu", {mm->result()});
    b.insert(Op::create("func.return", {relu->result()}, {}));
    f->setResultTypes({relu->result()->type()});
  }
};

TEST(IrApi, BuilderInfersTypesAndAppliesDefaults) {
  Fixture fx;
  EXPECT_EQ(fx.mm->result()->type().str(), "!kiln.tensor<Bx8xf32>");
  // transpose_a was not given: the op table's default is filled in.
  ASSERT_TRUE(fx.mm->hasAttr("transpose_a"));
  EXPECT_FALSE(fx.mm->boolAttr("transpose_a", true));
  EXPECT_TRUE(fx.mm->boolAttr("transpose_b"));
  EXPECT_TRUE(verify(fx.m).isOk()) << verify(fx.m).str();
}

TEST(IrApi, BuilderReportsErrorsAtItsLocation) {
  Module m;
  Function& f = m.addFunction("f");
  Value* a = f.entry().addArgument(f32({Dim::fixed(3)}));
  Value* b = f.entry().addArgument(f32({Dim::fixed(4)}));
  Builder builder(f.entry());
  builder.setLocation(Location{"model.kiln", 7, 9});
  auto op = builder.create("kiln.add", {a, b});
  ASSERT_FALSE(op.isOk());
  EXPECT_EQ(op.status().location().line, 7);
  EXPECT_EQ(op.status().location().col, 9);
  EXPECT_NE(op.status().message().find("kiln.add"), std::string::npos) << op.status().str();
  EXPECT_TRUE(f.entry().empty());  // nothing was inserted
}

TEST(IrApi, UseListsTrackOperands) {
  Fixture fx;
  ASSERT_EQ(fx.x->uses().size(), 1u);
  EXPECT_EQ(fx.x->uses()[0].user, fx.mm);
  EXPECT_EQ(fx.x->uses()[0].operand_index, 0u);
  EXPECT_EQ(fx.w->uses()[0].operand_index, 1u);
  ASSERT_EQ(fx.mm->result()->uses().size(), 1u);
  EXPECT_EQ(fx.mm->result()->uses()[0].user, fx.relu);

  // An op using the same value twice records two uses.
  Builder b(fx.f->entry());
  b.setInsertionPoint(fx.f->returnOp());
  Op* add = *b.create("kiln.add", {fx.relu->result(), fx.relu->result()});
  EXPECT_EQ(fx.relu->result()->uses().size(), 3u);  // return, add #0, add #1
  add->setOperand(1, fx.mm->result());
  EXPECT_EQ(fx.relu->result()->uses().size(), 2u);
  EXPECT_EQ(fx.mm->result()->uses().size(), 2u);
  fx.f->entry().erase(add);
  EXPECT_EQ(fx.relu->result()->uses().size(), 1u);
  EXPECT_EQ(fx.mm->result()->uses().size(), 1u);
}

TEST(IrApi, ReplaceAllUsesWith) {
  Fixture fx;
  Builder b(fx.f->entry());
  b.setInsertionPoint(fx.f->returnOp());
  Value* t = *b.createValue("kiln.tanh", {fx.mm->result()});
  fx.relu->result()->replaceAllUsesWith(t);
  EXPECT_FALSE(fx.relu->result()->hasUses());
  EXPECT_EQ(fx.f->returnOp()->operand(0), t);
  fx.f->entry().erase(fx.relu);
  EXPECT_TRUE(verify(fx.m).isOk()) << verify(fx.m).str();
  EXPECT_EQ(fx.f->numOps(), 3u);  // matmul, tanh, return
}

TEST(IrApi, EraseAndRemove) {
  Fixture fx;
  size_t before = fx.f->numOps();
  // remove() detaches without destroying: the op can go back in.
  Op* ret = fx.f->returnOp();
  std::unique_ptr<Op> detached = fx.f->entry().remove(ret);
  EXPECT_EQ(fx.f->numOps(), before - 1);
  EXPECT_EQ(detached->parentBlock(), nullptr);
  EXPECT_FALSE(verify(fx.m).isOk());  // no terminator now
  fx.f->entry().push_back(std::move(detached));
  EXPECT_TRUE(verify(fx.m).isOk());
}

TEST(IrApi, CloneFunctionIsDeepAndIndependent) {
  Fixture fx;
  Function& g = cloneFunction(*fx.f, fx.m, "g");
  EXPECT_TRUE(verify(fx.m).isOk()) << verify(fx.m).str();
  // Same text apart from the name.
  std::string f_text = printFunction(*fx.f), g_text = printFunction(g);
  EXPECT_EQ(g_text.substr(g_text.find('(')), f_text.substr(f_text.find('(')));
  // No value is shared: the clone's ops use the clone's arguments.
  Op* g_mm = g.entry().opList()[0];
  EXPECT_EQ(g_mm->operand(0), g.entry().argument(0));
  EXPECT_NE(g_mm->operand(0), fx.x);
  EXPECT_EQ(fx.x->uses().size(), 1u);
  // Editing the clone leaves the original alone.
  g_mm->setAttr("transpose_b", false);
  EXPECT_TRUE(fx.mm->boolAttr("transpose_b"));
}

TEST(IrApi, WalkVisitsNestedRegionsInOrder) {
  Module m;
  Function& f = m.addFunction("f");
  Value* x = f.entry().addArgument(f32({Dim::fixed(2)}), "x");
  auto outer = Op::create("kiln.exp", {x}, {f32({Dim::fixed(2)})});
  Op* o = f.entry().push_back(std::move(outer));
  Block& inner = o->addRegion().addBlock();
  inner.push_back(Op::create("kiln.neg", {x}, {f32({Dim::fixed(2)})}));
  f.entry().push_back(Op::create("kiln.relu", {o->result()}, {f32({Dim::fixed(2)})}));
  std::vector<std::string> names;
  f.walk([&](Op& op) { names.push_back(op.name()); });
  EXPECT_EQ(names, (std::vector<std::string>{"kiln.exp", "kiln.neg", "kiln.relu"}));
  EXPECT_EQ(inner.opList()[0]->parentFunction(), &f);
}

TEST(IrApi, ModuleLookupAndErase) {
  Module m;
  m.addFunction("a");
  m.addFunction("b");
  EXPECT_NE(m.lookup("b"), nullptr);
  EXPECT_EQ(m.lookup("c"), nullptr);
  m.eraseFunction("a");
  EXPECT_EQ(m.functions().size(), 1u);
  EXPECT_EQ(m.lookup("a"), nullptr);
}

}  // namespace
}  // namespace kiln::ir
