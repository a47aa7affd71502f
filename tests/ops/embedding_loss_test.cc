// CPU reference of embedding_bag (both id layouts, sum/mean, weights, errors) and the losses.
#include <cmath>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

// table row r = [10 r, 10 r + 1]
HostTensor table4x2() { return f32({4, 2}, {0, 1, 10, 11, 20, 21, 30, 31}); }

TEST(EmbeddingBagCpu, FixedHotnessSumAndMean) {
  auto ids = i64({2, 2}, {1, 3, 0, 0});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids}}), {2, 2}, {40, 42, 0, 2});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids}, {{"mode", Attribute("mean")}}}), {2, 2},
               {20, 21, 0, 1});
}

TEST(EmbeddingBagCpu, Bf16TableComputesInF32) {
  auto table = tensor(DType::bf16, {3, 2}, {1, 2, 3, 4, 0.5, 0.25});
  auto r = runOk({"kiln.embedding_bag", {table, i64({1, 3}, {0, 1, 2})}});
  EXPECT_EQ(r.view.dtype, DType::bf16);
  expectTensor(r, {1, 2}, {4.5, 6.25}, 0);
}

TEST(EmbeddingBagCpu, PerIdWeights) {
  auto ids = i32({2, 2}, {1, 3, 2, 0});
  auto w = f32({2, 2}, {0.5, 2, -1, 1});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids, w}}), {2, 2}, {65, 67.5, -20, -20});
}

TEST(EmbeddingBagCpu, FlatIdsWithLengthsIncludingAnEmptyBag) {
  auto ids = i64({4}, {2, 1, 3, 3});
  auto lengths = i32({3}, {1, 0, 3});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids, lengths}}), {3, 2}, {20, 21, 0, 0, 70, 73});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids, lengths}, {{"mode", Attribute("mean")}}}),
               {3, 2}, {20, 21, 0, 0, 70.0 / 3, 73.0 / 3});
  auto w = f32({4}, {1, 1, 2, -1});
  expectTensor(runOk({"kiln.embedding_bag", {table4x2(), ids, lengths, w}}), {3, 2}, {20, 21, 0, 0, 40, 42});
}

TEST(EmbeddingBagCpu, BoundedIdsUseTheirRunTimeCount) {
  // ids: ?(8) with 3 present; lengths [2] says 2 + 1.
  OpCall call{"kiln.embedding_bag", {table4x2(), i64({3}, {0, 1, 2}), i32({2}, {2, 1})}};
  call.operand_types = {typeOf(table4x2()), TensorType(DType::i64, {Dim::bounded(Dim::fixed(8))}),
                        TensorType(DType::i32, {Dim::fixed(2)})};
  expectTensor(runOk(call), {2, 2}, {10, 12, 20, 21});
}

TEST(EmbeddingBagCpu, OutOfRangeIdNamesTableIdAndPosition) {
  auto r = run(
      {"kiln.embedding_bag", {table4x2(), i64({2, 2}, {1, 3, 0, 4})}, {{"table", Attribute("tables.3")}}});
  ASSERT_FALSE(r);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("tables.3"), std::string::npos) << m;
  EXPECT_NE(m.find("id 4 at position [1, 1] is out of range [0, 4)"), std::string::npos) << m;
  auto neg = run({"kiln.embedding_bag", {table4x2(), i64({2}, {-1, 0}), i32({2}, {1, 1})}});
  ASSERT_FALSE(neg);
  EXPECT_NE(neg.status().message().find("id -1 at position [0]"), std::string::npos)
      << neg.status().message();
}

TEST(EmbeddingBagCpu, LengthsThatDoNotCoverTheIdsAreAnError) {
  auto r = run({"kiln.embedding_bag", {table4x2(), i64({3}, {0, 1, 2}), i32({2}, {1, 1})}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("lengths add up to 2 but there are 3 ids"), std::string::npos)
      << r.status().message();
}

TEST(JaggedToPaddedCpu, PadsWithZerosAndKeepsTheFirstLengthIds) {
  // Bags {5, 6}, {}, {7, 8, 9}: the third is longer than 2 and keeps 7, 8.
  OpCall call{"kiln.jagged_to_padded",
              {i64({5}, {5, 6, 7, 8, 9}), i32({3}, {2, 0, 3})},
              {{"length", Attribute(int64_t{2})}}};
  expectTensor(runOk(call), {3, 2}, {5, 6, 0, 0, 7, 8});
  OpCall wide{
      "kiln.jagged_to_padded", {i64({3}, {4, 1, 2}), i32({2}, {1, 2})}, {{"length", Attribute(int64_t{3})}}};
  expectTensor(runOk(wide), {2, 3}, {4, 0, 0, 1, 2, 0});
}

TEST(JaggedToPaddedCpu, BadLengthsAreErrors) {
  auto neg = run(
      {"kiln.jagged_to_padded", {i64({2}, {1, 2}), i32({2}, {-1, 3})}, {{"length", Attribute(int64_t{2})}}});
  ASSERT_FALSE(neg);
  EXPECT_NE(neg.status().message().find("length -1 of sample 0 is negative"), std::string::npos)
      << neg.status().message();
  auto over = run(
      {"kiln.jagged_to_padded", {i64({2}, {1, 2}), i32({2}, {1, 2})}, {{"length", Attribute(int64_t{2})}}});
  ASSERT_FALSE(over);
  EXPECT_NE(over.status().message().find("add up to 3 but there are 2 ids"), std::string::npos)
      << over.status().message();
}

TEST(EmbeddingBagCpu, WeightGradIsRowDotGradOut) {
  auto ids = i64({2, 2}, {1, 3, 2, 0});
  auto g = f32({2, 2}, {1, -1, 2, 0.5});
  // bag 0: row1.(1,-1) = -1, row3.(1,-1) = -1; bag 1: row2.(2,.5) = 50.5, row0.(2,.5) = 0.5
  expectTensor(runOk({"kiln.embedding_bag_weight_grad", {table4x2(), ids, g}}), {2, 2}, {-1, -1, 50.5, 0.5});
  expectTensor(runOk({"kiln.embedding_bag_weight_grad", {table4x2(), ids, g}, {{"mode", Attribute("mean")}}}),
               {2, 2}, {-0.5, -0.5, 25.25, 0.25});
}

TEST(EmbeddingBagCpu, DenseGradSumsEachIdsBagGradient) {
  // Bags [2], [], [1, 3, 3]: row 2 gets bag 0's gradient, row 1 bag 2's, row 3 twice bag 2's.
  auto ids = i64({4}, {2, 1, 3, 3});
  auto lengths = i32({3}, {1, 0, 3});
  auto g = f32({3, 2}, {1, 2, 5, 5, -1, 0.5});
  const AttrDict rows{{"rows", Attribute(int64_t{4})}};
  expectTensor(runOk({"kiln.embedding_bag_dense_grad", {ids, lengths, g}, rows}), {4, 2},
               {0, 0, -1, 0.5, 1, 2, -2, 1});
  AttrDict mean = rows;
  mean["mode"] = Attribute("mean");
  expectTensor(runOk({"kiln.embedding_bag_dense_grad", {ids, lengths, g}, mean}), {4, 2},
               {0, 0, -1.0 / 3, 0.5 / 3, 1, 2, -2.0 / 3, 1.0 / 3});
  // [B, H] ids, and an id beyond the rows.
  expectTensor(runOk({"kiln.embedding_bag_dense_grad", {i64({2, 1}, {0, 0}), f32({2, 1}, {3, 4})},
                      {{"rows", Attribute(int64_t{2})}}}),
               {2, 1}, {7, 0});
  auto bad = run({"kiln.embedding_bag_dense_grad", {i64({2, 1}, {0, 5}), f32({2, 1}, {3, 4})},
                  {{"rows", Attribute(int64_t{2})}, {"table", Attribute("t.hot")}}});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("t.hot"), std::string::npos) << bad.status().message();
}

// Without `rows`, the block has as many rows as the ids reach (a de-duplicated lookup's rows).
TEST(EmbeddingBagCpu, DenseGradWithoutRowsEndsAtTheLargestId) {
  auto ids = i64({4}, {2, 1, 0, 2});
  auto lengths = i32({2}, {1, 3});
  auto g = f32({2, 2}, {1, 2, 5, -5});
  // Row 0: bag 1; row 1: bag 1; row 2: bags 0 and 1.
  expectTensor(runOk({"kiln.embedding_bag_dense_grad", {ids, lengths, g}}), {3, 2}, {5, -5, 5, -5, 6, -3});
  expectTensor(runOk({"kiln.embedding_bag_dense_grad", {i64({0}, {}), i32({2}, {0, 0}), g}}), {0, 2}, {});
}

// The dense gradient is the table's gradient of sum(embedding_bag(table, ids) * g): central
// differences of the lookup itself, element by element.
TEST(EmbeddingBagCpu, DenseGradMatchesFiniteDifferencesOfTheLookup) {
  auto ids = i64({5}, {0, 2, 2, 4, 1});
  auto lengths = i32({3}, {2, 2, 1});
  auto g = f64({3, 3}, {0.3, -1, 2, 0.5, 0.25, -0.75, 1.5, 0, -2});
  std::vector<double> w(15);
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(1.0 + static_cast<double>(i));
  for (const char* mode : {"sum", "mean"}) {
    auto grad = runOk({"kiln.embedding_bag_dense_grad", {ids, lengths, g},
                       {{"rows", Attribute(int64_t{5})}, {"mode", Attribute(mode)}}});
    auto loss = [&](const std::vector<double>& table) {
      auto pooled = runOk({"kiln.embedding_bag", {f64({5, 3}, table), ids, lengths}, {{"mode", Attribute(mode)}}});
      double l = 0;
      for (int64_t i = 0; i < 9; ++i) l += pooled.as<double>()[i] * g.as<double>()[i];
      return l;
    };
    for (size_t i = 0; i < w.size(); ++i) {
      std::vector<double> up = w, down = w;
      up[i] += 1e-4, down[i] -= 1e-4;
      EXPECT_NEAR(grad.as<double>()[i], (loss(up) - loss(down)) / 2e-4, 1e-8) << mode << " element " << i;
    }
  }
}

double bce(double x, double y) {
  return -(y * std::log(1 / (1 + std::exp(-x))) + (1 - y) * std::log(1 - 1 / (1 + std::exp(-x))));
}

TEST(LossCpu, BceWithLogitsMatchesTheNaiveFormula) {
  auto x = f64({2, 2}, {0.5, -1, 2, 0});
  auto y = f64({2, 2}, {1, 0, 0, 1});
  double sum = bce(0.5, 1) + bce(-1, 0) + bce(2, 0) + bce(0, 1);
  expectTensor(runOk({"kiln.bce_with_logits", {x, y}}), {}, {sum / 4}, 1e-12);
  expectTensor(runOk({"kiln.bce_with_logits", {x, y}, {{"reduction", Attribute("sum")}}}), {}, {sum}, 1e-12);
  auto r = runOk({"kiln.bce_with_logits", {f32({2}, {0.5, -1}), f32({2}, {1, 0})}});
  EXPECT_EQ(r.view.dtype, DType::f32);
}

TEST(LossCpu, BceWithLogitsIsStableForHugeLogits) {
  // Loss of a confidently wrong logit is |x|; of a confidently right one, 0.
  auto r = values(runOk({"kiln.bce_with_logits",
                         {f32({2}, {1000, -1000}), f32({2}, {0, 0})},
                         {{"reduction", Attribute("sum")}}}));
  EXPECT_NEAR(r[0], 1000, 1e-3);
}

TEST(LossCpu, BceGradIsSigmoidMinusLabelOverCount) {
  auto x = f64({2}, {0, 2});
  auto y = f64({2}, {1, 0});
  double s2 = 1 / (1 + std::exp(-2.0));
  expectTensor(runOk({"kiln.bce_with_logits_grad", {x, y, f64({}, {3})}}), {2},
               {3 * (0.5 - 1) / 2, 3 * s2 / 2}, 1e-12);
}

TEST(LossCpu, SoftmaxCrossEntropyWithClassIdsAndProbabilities) {
  auto x = f64({2, 3}, {1, 2, 3, 0, 0, 0});
  double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)), lse1 = std::log(3.0);
  expectTensor(runOk({"kiln.softmax_cross_entropy", {x, i64({2}, {2, 0})}}), {}, {((lse0 - 3) + lse1) / 2},
               1e-12);
  auto p = f64({2, 3}, {0.5, 0.5, 0, 0, 0, 1});
  double want = -(0.5 * (1 - lse0) + 0.5 * (2 - lse0)) - (0 - lse1);
  expectTensor(runOk({"kiln.softmax_cross_entropy", {x, p}, {{"reduction", Attribute("sum")}}}), {}, {want},
               1e-12);
  // Large logits: no overflow.
  auto big = values(runOk({"kiln.softmax_cross_entropy", {f32({1, 2}, {1000, 0}), i32({1}, {0})}}));
  EXPECT_NEAR(big[0], 0, 1e-6);
}

TEST(LossCpu, SoftmaxCrossEntropyGrad) {
  auto x = f64({1, 2}, {0, std::log(3.0)});  // softmax = [0.25, 0.75]
  expectTensor(runOk({"kiln.softmax_cross_entropy_grad", {x, i64({1}, {0}), f64({}, {2})}}), {1, 2},
               {2 * (0.25 - 1), 2 * 0.75}, 1e-12);
}

TEST(LossCpu, ClassIdOutOfRangeIsAnError) {
  auto r = run({"kiln.softmax_cross_entropy", {f32({2, 3}, {0, 0, 0, 0, 0, 0}), i64({2}, {1, 3})}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("label 3 at position [1] is out of range [0, 3)"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace kiln::ir::testing
