// CPU reference of matmul, reduce, reduce_grad and softmax against naive loops and hand values.
#include <cmath>
#include <random>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

std::vector<double> randomValues(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = u(rng);
  return v;
}

// out[b][i][j] = sum_k A[b][i][k] B[b][k][j] with A, B given as accessor lambdas.
template <class A, class B>
std::vector<double> naiveMatmul(int64_t batch, int64_t m, int64_t n, int64_t k, A a, B b) {
  std::vector<double> out;
  for (int64_t t = 0; t < batch; ++t)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p) s += a(t, i, p) * b(t, p, j);
        out.push_back(s);
      }
  return out;
}

TEST(MatmulCpu, HandValues) {
  auto a = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  auto b = f32({3, 2}, {7, 8, 9, 10, 11, 12});
  expectTensor(runOk({"kiln.matmul", {a, b}}), {2, 2}, {58, 64, 139, 154});
}

TEST(MatmulCpu, EveryTransposeCombination) {
  std::mt19937 rng(7);
  const int64_t m = 3, n = 4, k = 5;
  auto av = randomValues(m * k, rng), bv = randomValues(k * n, rng);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      // Store A as [M,K] or [K,M], B as [K,N] or [N,K], holding the same logical matrices.
      std::vector<double> as(static_cast<size_t>(m * k)), bs(static_cast<size_t>(k * n));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t p = 0; p < k; ++p)
          as[static_cast<size_t>(ta ? p * m + i : i * k + p)] = av[static_cast<size_t>(i * k + p)];
      for (int64_t p = 0; p < k; ++p)
        for (int64_t j = 0; j < n; ++j)
          bs[static_cast<size_t>(tb ? j * k + p : p * n + j)] = bv[static_cast<size_t>(p * n + j)];
      auto want = naiveMatmul(
          1, m, n, k, [&](int64_t, int64_t i, int64_t p) { return av[static_cast<size_t>(i * k + p)]; },
          [&](int64_t, int64_t p, int64_t j) { return bv[static_cast<size_t>(p * n + j)]; });
      OpCall call{"kiln.matmul",
                  {f64(ta ? std::vector<int64_t>{k, m} : std::vector<int64_t>{m, k}, as),
                   f64(tb ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n}, bs)},
                  {{"transpose_a", Attribute(ta)}, {"transpose_b", Attribute(tb)}}};
      expectTensor(runOk(call), {m, n}, want, 1e-12);
    }
}

TEST(MatmulCpu, BatchDimsBroadcast) {
  std::mt19937 rng(8);
  const int64_t batch = 2, m = 2, n = 3, k = 4;
  auto av = randomValues(batch * m * k, rng), bv = randomValues(k * n, rng);
  auto want = naiveMatmul(
      batch, m, n, k,
      [&](int64_t t, int64_t i, int64_t p) { return av[static_cast<size_t>((t * m + i) * k + p)]; },
      [&](int64_t, int64_t p, int64_t j) { return bv[static_cast<size_t>(p * n + j)]; });
  expectTensor(runOk({"kiln.matmul", {f64({batch, m, k}, av), f64({1, k, n}, bv)}}), {batch, m, n}, want,
               1e-12);
}

TEST(ReduceCpu, SumMeanMaxOverAxes) {
  auto x = f32({2, 3}, {1, 5, 3, -4, 2, 0});
  auto reduce = [&](const char* kind, std::vector<int64_t> axes, bool keep) {
    return runOk(
        {"kiln.reduce",
         {x},
         {{"kind", Attribute(kind)}, {"axes", Attribute::ints(axes)}, {"keepdims", Attribute(keep)}}});
  };
  expectTensor(reduce("sum", {1}, false), {2}, {9, -2});
  expectTensor(reduce("sum", {0}, true), {1, 3}, {-3, 7, 3});
  expectTensor(reduce("mean", {0, 1}, false), {}, {7.0 / 6});
  expectTensor(reduce("max", {-1}, true), {2, 1}, {5, 2});
  expectTensor(reduce("max", {0}, false), {3}, {1, 5, 3});
  expectTensor(runOk({"kiln.reduce",
                      {i64({3}, {4, -9, 2})},
                      {{"kind", Attribute("sum")}, {"axes", Attribute::ints({0})}}}),
               {}, {-3});
}

TEST(ReduceCpu, ReduceGradSpreadsTheGradient) {
  TensorType x23(DType::f64, {Dim::fixed(2), Dim::fixed(3)});
  OpCall mean{
      "kiln.reduce_grad", {f64({2}, {3, 6})}, {{"kind", Attribute("mean")}, {"axes", Attribute::ints({1})}}};
  mean.result_types = {x23};
  expectTensor(runOk(mean), {2, 3}, {1, 1, 1, 2, 2, 2});
  // max: ties share the gradient.
  OpCall mx{"kiln.reduce_grad",
            {f64({1, 3}, {4, 8, 6}), f64({2, 3}, {1, 5, 3, 1, 2, 3}), f64({1, 3}, {1, 5, 3})},
            {{"kind", Attribute("max")}, {"axes", Attribute::ints({0})}, {"keepdims", Attribute(true)}}};
  mx.result_types = {x23};
  expectTensor(runOk(mx), {2, 3}, {2, 8, 3, 2, 0, 3});
}

TEST(SoftmaxCpu, RowsSumToOneAndLargeInputsAreStable) {
  auto r = values(runOk({"kiln.softmax", {f32({2, 3}, {0, 1, 2, 1000, 1000, 1000})}}));
  double e = std::exp(1.0), e2 = std::exp(2.0), z = 1 + e + e2;
  std::vector<double> want = {1 / z, e / z, e2 / z, 1.0 / 3, 1.0 / 3, 1.0 / 3};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(r[i], want[i], 1e-6);
}

TEST(SoftmaxCpu, AlongTheFirstAxis) {
  auto r = values(runOk({"kiln.softmax", {f64({2, 2}, {0, 5, 0, 5})}, {{"axis", Attribute(int64_t{0})}}}));
  for (double v : r) EXPECT_NEAR(v, 0.5, 1e-12);
}

}  // namespace
}  // namespace kiln::ir::testing
