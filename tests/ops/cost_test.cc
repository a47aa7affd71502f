// Op costs under symbol bindings, against hand counts.
#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

TEST(OpCost, MatmulIsTwoMNKFlopsAndEveryOperandOnce) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  Value* x =
      (*b.createWithTypes("kiln.input", {}, {TensorType(DType::f32, {Dim::symbol("B"), Dim::fixed(512)})},
                          {{"name", Attribute("x")}}))
          ->result();
  Value* w =
      (*b.createWithTypes("kiln.parameter", {}, {TensorType(DType::f32, {Dim::fixed(256), Dim::fixed(512)})},
                          {{"name", Attribute("w")}}))
          ->result();
  Op* mm = *b.create("kiln.matmul", {x, w}, {{"transpose_b", Attribute(true)}});
  const SymbolBindings syms = {{"B", 1024}};
  OpCost c = mm->def()->cost(*mm, syms);
  EXPECT_DOUBLE_EQ(c.flops, 2.0 * 1024 * 256 * 512);
  EXPECT_DOUBLE_EQ(c.bytes, 4.0 * (1024 * 512 + 256 * 512 + 1024 * 256));

  Op* relu = *b.create("kiln.relu", {mm->result()});
  OpCost r = relu->def()->cost(*relu, syms);
  EXPECT_DOUBLE_EQ(r.flops, 1024.0 * 256);
  EXPECT_DOUBLE_EQ(r.bytes, 2 * 4.0 * 1024 * 256);
}

TEST(OpCost, EmbeddingBagReadsOneRowPerIdAtTheBound) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  Value* t =
      (*b.createWithTypes("kiln.parameter", {}, {TensorType(DType::f32, {Dim::fixed(1000), Dim::fixed(16)})},
                          {{"name", Attribute("t")}}))
          ->result();
  Value* ids =
      (*b.createWithTypes("kiln.input", {}, {TensorType(DType::i64, {Dim::bounded(Dim::symbol("B", 8))})},
                          {{"name", Attribute("ids")}}))
          ->result();
  Value* len = (*b.createWithTypes("kiln.input", {}, {TensorType(DType::i32, {Dim::symbol("B")})},
                                   {{"name", Attribute("len")}}))
                   ->result();
  Op* e = *b.create("kiln.embedding_bag", {t, ids, len});
  OpCost c = e->def()->cost(*e, {{"B", 10}});
  // 80 ids at the bound: 80 rows of 16 floats read and summed; ids, lengths and the result.
  EXPECT_DOUBLE_EQ(c.flops, 80.0 * 16);
  EXPECT_DOUBLE_EQ(c.bytes, 80.0 * 16 * 4 + 80 * 8 + 10 * 4 + 10 * 16 * 4);
}

TEST(OpCost, EveryOpWithAKernelHasACost) {
  for (const OpDef* def : OpRegistry::get().all()) {
    if (def->cpu && !def->has(kSideEffect) && def->name.rfind("test.", 0) != 0) {
      EXPECT_NE(def->cost, nullptr) << def->name << " has a CPU kernel but no cost";
    }
  }
}

}  // namespace
}  // namespace kiln::ir::testing
