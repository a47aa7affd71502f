// CPU reference of the data movement ops (and sum_to, pad, scatter_add) against hand values.
#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

TensorType ty(DType t, std::vector<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return TensorType(t, s);
}

TEST(ShapeCpu, Broadcast) {
  OpCall call{"kiln.broadcast", {f32({2, 1}, {1, 2})}};
  call.result_types = {ty(DType::f32, {3, 2, 2})};
  expectTensor(runOk(call), {3, 2, 2}, {1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2, 2});
}

TEST(ShapeCpu, BroadcastToASymbolicBatch) {
  OpCall call{"kiln.broadcast", {f32({3}, {1, 2, 3})}};
  call.result_types = {TensorType(DType::f32, {Dim::symbol("B"), Dim::fixed(3)})};
  call.symbols = {{"B", 2}};
  expectTensor(runOk(call), {2, 3}, {1, 2, 3, 1, 2, 3});
}

TEST(ShapeCpu, Reshape) {
  OpCall call{"kiln.reshape", {i64({2, 3}, {1, 2, 3, 4, 5, 6})}};
  call.result_types = {ty(DType::i64, {3, 2})};
  expectTensor(runOk(call), {3, 2}, {1, 2, 3, 4, 5, 6});
}

TEST(ShapeCpu, ReshapeKeepsABoundedDimAtItsRunTimeSize) {
  // ids ?(8) -> ?(8)x1 with 5 ids present at run time.
  OpCall call{"kiln.reshape", {i64({5}, {1, 2, 3, 4, 5})}};
  Dim n = Dim::bounded(Dim::fixed(8));
  call.operand_types = {TensorType(DType::i64, {n})};
  call.result_types = {TensorType(DType::i64, {n, Dim::fixed(1)})};
  expectTensor(runOk(call), {5, 1}, {1, 2, 3, 4, 5});
}

TEST(ShapeCpu, Transpose) {
  // x[i][j][k] = 100 i + 10 j + k with shape [2, 3, 2]; perm [2, 0, 1] -> out[k][i][j].
  std::vector<double> x;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 2; ++k) x.push_back(100 * i + 10 * j + k);
  std::vector<double> want;
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j) want.push_back(100 * i + 10 * j + k);
  expectTensor(runOk({"kiln.transpose", {f64({2, 3, 2}, x)}, {{"perm", Attribute::ints({2, 0, 1})}}}),
               {2, 2, 3}, want);
}

TEST(ShapeCpu, ConcatAlongEachAxis) {
  auto a = f32({2, 2}, {1, 2, 3, 4});
  auto b = f32({2, 1}, {5, 6});
  expectTensor(runOk({"kiln.concat", {a, b}, {{"axis", Attribute(int64_t{1})}}}), {2, 3}, {1, 2, 5, 3, 4, 6});
  auto c = f32({1, 2}, {7, 8});
  expectTensor(runOk({"kiln.concat", {a, c}, {{"axis", Attribute(int64_t{0})}}}), {3, 2}, {1, 2, 3, 4, 7, 8});
}

TEST(ShapeCpu, Slice) {
  auto x = f32({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  expectTensor(runOk({"kiln.slice",
                      {x},
                      {{"axis", Attribute(int64_t{1})},
                       {"start", Attribute(int64_t{1})},
                       {"limit", Attribute(int64_t{3})}}}),
               {2, 2}, {1, 2, 5, 6});
  expectTensor(runOk({"kiln.slice",
                      {x},
                      {{"axis", Attribute(int64_t{0})},
                       {"start", Attribute(int64_t{1})},
                       {"limit", Attribute(int64_t{2})}}}),
               {1, 4}, {4, 5, 6, 7});
}

TEST(ShapeCpu, Pad) {
  auto x = f32({2, 2}, {1, 2, 3, 4});
  expectTensor(runOk({"kiln.pad",
                      {x},
                      {{"axis", Attribute(int64_t{1})},
                       {"low", Attribute(int64_t{1})},
                       {"high", Attribute(int64_t{2})}}}),
               {2, 5}, {0, 1, 2, 0, 0, 0, 3, 4, 0, 0});
}

TEST(ShapeCpu, GatherRowsAndColumns) {
  auto x = f32({3, 2}, {1, 2, 3, 4, 5, 6});
  expectTensor(runOk({"kiln.gather", {x, i64({2, 2}, {2, 0, 1, 1})}}), {2, 2, 2}, {5, 6, 1, 2, 3, 4, 3, 4});
  expectTensor(runOk({"kiln.gather", {x, i32({3}, {1, 0, 1})}, {{"axis", Attribute(int64_t{1})}}}), {3, 3},
               {2, 1, 2, 4, 3, 4, 6, 5, 6});
}

TEST(ShapeCpu, GatherOutOfRangeNamesIndexAndPosition) {
  auto r = run({"kiln.gather", {f32({3, 2}, {1, 2, 3, 4, 5, 6}), i64({2, 2}, {0, 1, 3, 0})}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("index 3 at position [1, 0] is out of range [0, 3)"), std::string::npos)
      << r.status().message();
}

TEST(ShapeCpu, ScatterAddAccumulatesDuplicates) {
  auto base = f32({3, 2}, {1, 1, 1, 1, 1, 1});
  auto idx = i64({3}, {2, 0, 2});
  auto upd = f32({3, 2}, {1, 2, 3, 4, 5, 6});
  expectTensor(runOk({"kiln.scatter_add", {base, idx, upd}}), {3, 2}, {4, 5, 1, 1, 7, 9});
}

TEST(ShapeCpu, SumToReducesBroadcastDims) {
  auto g = f64({2, 2, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  OpCall to_row{"kiln.sum_to", {g}};
  to_row.result_types = {ty(DType::f64, {3})};
  expectTensor(runOk(to_row), {3}, {22, 26, 30});
  OpCall to_col{"kiln.sum_to", {g}};
  to_col.result_types = {ty(DType::f64, {2, 1})};
  expectTensor(runOk(to_col), {2, 1}, {1 + 2 + 3 + 7 + 8 + 9, 4 + 5 + 6 + 10 + 11 + 12});
}

TEST(ShapeCpu, SumToRejectsANonBroadcastTarget) {
  OpCall call{"kiln.sum_to", {f32({2, 3}, {1, 2, 3, 4, 5, 6})}};
  call.result_types = {ty(DType::f32, {2})};
  EXPECT_FALSE(run(call));
}

TEST(ShapeCpu, Cast) {
  expectTensor(runOk({"kiln.cast", {f32({4}, {1.7, -1.7, 0, 3})}, {{"to", Attribute("i32")}}}), {4},
               {1, -1, 0, 3});
  auto b = runOk({"kiln.cast", {f32({3}, {0.5, 0, -2})}, {{"to", Attribute("i1")}}});
  EXPECT_EQ(b.view.dtype, DType::i1);
  expectTensor(b, {3}, {1, 0, 1});
  expectTensor(runOk({"kiln.cast", {i64({2}, {123456789012LL, -5})}, {{"to", Attribute("f64")}}}), {2},
               {123456789012.0, -5});
  // bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1.
  auto h = runOk({"kiln.cast", {f32({2}, {1.0 + 1.0 / 512, 3.0})}, {{"to", Attribute("bf16")}}});
  EXPECT_EQ(h.view.dtype, DType::bf16);
  expectTensor(h, {2}, {1.0, 3.0}, 0);
}

TEST(ShapeCpu, ConstantSplatAndArray) {
  OpCall splat{"kiln.constant", {}, {{"value", Attribute(2.5)}}};
  splat.result_types = {TensorType(DType::f32, {Dim::symbol("B"), Dim::fixed(2)})};
  splat.symbols = {{"B", 3}};
  expectTensor(runOk(splat), {3, 2}, {2.5, 2.5, 2.5, 2.5, 2.5, 2.5});
  OpCall arr{"kiln.constant", {}, {{"value", Attribute(AttrArray{Attribute(int64_t{4}), Attribute(-1.5)})}}};
  arr.result_types = {ty(DType::f64, {2})};
  expectTensor(runOk(arr), {2}, {4, -1.5});
}

}  // namespace
}  // namespace kiln::ir::testing
