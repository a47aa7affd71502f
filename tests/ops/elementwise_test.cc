// CPU reference of the elementwise ops against hand-computed values.
#include <cmath>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

OpCall binary(const char* name, HostTensor a, HostTensor b) { return {name, {std::move(a), std::move(b)}}; }
OpCall unary(const char* name, HostTensor a) { return {name, {std::move(a)}}; }

TEST(ElementwiseCpu, AddBroadcastsRowAndColumn) {
  // [2,3] + [3]
  expectTensor(runOk(binary("kiln.add", f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({3}, {10, 20, 30}))), {2, 3},
               {11, 22, 33, 14, 25, 36});
  // [2,1] + [1,3] -> [2,3]
  expectTensor(runOk(binary("kiln.add", f32({2, 1}, {1, 2}), f32({1, 3}, {10, 20, 30}))), {2, 3},
               {11, 21, 31, 12, 22, 32});
  // scalar + [2]
  expectTensor(runOk(binary("kiln.add", f64({}, {0.5}), f64({2}, {1, 2}))), {2}, {1.5, 2.5});
}

TEST(ElementwiseCpu, IntegerArithmetic) {
  expectTensor(runOk(binary("kiln.mul", i64({3}, {2, -3, 4}), i64({3}, {5, 6, -7}))), {3}, {10, -18, -28});
  expectTensor(runOk(binary("kiln.sub", i32({2}, {2, 3}), i32({1}, {5}))), {2}, {-3, -2});
  expectTensor(runOk(binary("kiln.max", i32({2}, {2, 9}), i32({2}, {5, 1}))), {2}, {5, 9});
  expectTensor(runOk(unary("kiln.abs", i64({2}, {-4, 3}))), {2}, {4, 3});
}

TEST(ElementwiseCpu, Arithmetic) {
  auto a = f32({4}, {1, -2, 3, 0.5});
  auto b = f32({4}, {2, 4, -1, 0.25});
  expectTensor(runOk(binary("kiln.sub", a, b)), {4}, {-1, -6, 4, 0.25});
  expectTensor(runOk(binary("kiln.mul", a, b)), {4}, {2, -8, -3, 0.125});
  expectTensor(runOk(binary("kiln.div", a, b)), {4}, {0.5, -0.5, -3, 2});
  expectTensor(runOk(binary("kiln.max", a, b)), {4}, {2, 4, 3, 0.5});
  expectTensor(runOk(binary("kiln.min", a, b)), {4}, {1, -2, -1, 0.25});
  expectTensor(runOk(binary("kiln.pow", f64({3}, {2, 9, 4}), f64({3}, {3, 0.5, -1}))), {3}, {8, 3, 0.25});
}

TEST(ElementwiseCpu, EluAndPrelu) {
  // alpha (e^x - 1) = 0.5 (e^-1 - 1) below zero; 0 at zero from either branch.
  expectTensor(runOk(binary("kiln.elu", f64({3}, {-1, 0, 2}), f64({}, {0.5}))), {3},
               {-0.31606027941427883, 0, 2});
  expectTensor(runOk(binary("kiln.elu", f32({2}, {-20, 1.5}), f32({}, {1}))), {2},
               {-0.9999999979388464, 1.5});
  // A per-channel slope along the last dim.
  expectTensor(runOk(binary("kiln.prelu", f64({2, 3}, {-2, 0.5, -1, 3, -4, 0}), f64({3}, {0.25, 0.1, 2}))),
               {2, 3}, {-0.5, 0.5, -2, 3, -0.4, 0});
  // One shared slope.
  expectTensor(runOk(binary("kiln.prelu", f32({3}, {-8, 8, -0.5}), f32({1}, {0.25}))), {3}, {-2, 8, -0.125});
}

TEST(ElementwiseCpu, UnaryMath) {
  auto x = f64({3}, {-1, 0, 2});
  expectTensor(runOk(unary("kiln.neg", x)), {3}, {1, 0, -2});
  expectTensor(runOk(unary("kiln.abs", x)), {3}, {1, 0, 2});
  expectTensor(runOk(unary("kiln.exp", x)), {3}, {0.36787944117144233, 1, 7.38905609893065});
  expectTensor(runOk(unary("kiln.relu", x)), {3}, {0, 0, 2});
  expectTensor(runOk(unary("kiln.tanh", x)), {3}, {-0.7615941559557649, 0, 0.9640275800758169});
  expectTensor(runOk(unary("kiln.sigmoid", x)), {3}, {0.2689414213699951, 0.5, 0.8807970779778823});
  expectTensor(runOk(unary("kiln.silu", x)), {3}, {-0.2689414213699951, 0, 1.7615941559557646});
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) at -1, 0, 2
  expectTensor(runOk(unary("kiln.gelu", x)), {3}, {-0.15880800939172324, 0, 1.9545976940877752});
  // log(1 + e^x) and x relu6(x + 3) / 6
  expectTensor(runOk(unary("kiln.softplus", x)), {3},
               {0.31326168751822286, 0.6931471805599453, 2.1269280110429727});
  expectTensor(runOk(unary("kiln.hardswish", f64({4}, {-4, -1, 2, 5}))), {4}, {0, -1.0 / 3, 5.0 / 3, 5});
  auto p = f64({3}, {1, 4, 0.25});
  expectTensor(runOk(unary("kiln.log", p)), {3}, {0, 1.3862943611198906, -1.3862943611198906});
  expectTensor(runOk(unary("kiln.sqrt", p)), {3}, {1, 2, 0.5});
  expectTensor(runOk(unary("kiln.rsqrt", p)), {3}, {1, 0.5, 2});
}

TEST(ElementwiseCpu, SigmoidIsStableForLargeInputs) {
  auto r = values(runOk(unary("kiln.sigmoid", f32({2}, {-1000, 1000}))));
  EXPECT_EQ(r[0], 0.0);
  EXPECT_EQ(r[1], 1.0);
  auto s = values(runOk(unary("kiln.silu", f32({1}, {-1000}))));
  EXPECT_FALSE(std::isnan(s[0]));
}

TEST(ElementwiseCpu, Bf16StorageComputesInF32) {
  auto r =
      runOk(binary("kiln.add", tensor(DType::bf16, {2}, {1.5, -2}), tensor(DType::bf16, {2}, {0.25, 8})));
  EXPECT_EQ(r.view.dtype, DType::bf16);
  expectTensor(r, {2}, {1.75, 6});
}

TEST(ElementwiseCpu, CompareEveryPredicate) {
  auto a = f32({3}, {1, 2, 3});
  auto b = f32({1}, {2});
  std::map<std::string, std::vector<double>> want = {{"eq", {0, 1, 0}}, {"ne", {1, 0, 1}}, {"lt", {1, 0, 0}},
                                                     {"le", {1, 1, 0}}, {"gt", {0, 0, 1}}, {"ge", {0, 1, 1}}};
  for (const auto& [pred, expected] : want) {
    auto r = runOk({"kiln.compare", {a, b}, {{"predicate", Attribute(pred)}}});
    EXPECT_EQ(r.view.dtype, DType::i1);
    expectTensor(r, {3}, expected);
  }
}

TEST(ElementwiseCpu, SelectBroadcastsAllThree) {
  auto c = tensor(DType::i1, {2, 1}, {1, 0});
  auto a = f32({1, 3}, {1, 2, 3});
  auto b = f32({}, {-1});
  expectTensor(runOk({"kiln.select", {c, a, b}}), {2, 3}, {1, 2, 3, -1, -1, -1});
}

TEST(ElementwiseCpu, ActivationGradIsDyTimesDerivative) {
  auto x = f64({3}, {-1, 0.5, 2});
  auto dy = f64({3}, {2, 3, -1});
  expectTensor(runOk({"kiln.activation_grad", {x, dy}, {{"activation", Attribute("relu")}}}), {3},
               {0, 3, -1});
  // silu'(x) = s (1 + x (1 - s)), s = sigmoid(x)
  std::vector<double> want;
  for (double v : {-1.0, 0.5, 2.0}) {
    double s = 1 / (1 + std::exp(-v));
    want.push_back(s * (1 + v * (1 - s)));
  }
  expectTensor(runOk({"kiln.activation_grad", {x, dy}, {{"activation", Attribute("silu")}}}), {3},
               {2 * want[0], 3 * want[1], -want[2]});
}

TEST(ElementwiseCpu, RuntimeBroadcastMismatchIsAnError) {
  // Bounded dims agree at compile time but not at run time.
  Dim n = Dim::bounded(Dim::fixed(4));
  OpCall call{"kiln.add", {f32({3}, {1, 2, 3}), f32({2}, {1, 2})}};
  call.operand_types = {TensorType(DType::f32, {n}), TensorType(DType::f32, {n})};
  auto r = run(call);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("do not broadcast"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace kiln::ir::testing
