// CPU references of the routing ops (ir/ops/routing.cc, docs/moe.md) against hand-computed
// values and plain loops written here; their bad-input errors. Finite-difference checks of the
// gradient rules are in gradient_check_test.cc, with every other rule.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

using A = Attribute;

Attribute i(int64_t v) { return Attribute(v); }

double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

// Expects `call` to fail with a message naming its op and containing `what`.
void expectError(const OpCall& call, const std::string& what) {
  auto r = run(call);
  ASSERT_FALSE(r) << call.name << " should fail with: " << what;
  EXPECT_NE(r.status().message().find(call.name), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
}

std::vector<HostTensor> runAll(const OpCall& call) {
  auto r = run(call);
  if (!r) {
    ADD_FAILURE() << call.name << ": " << r.status().str();
    return {};
  }
  return *r;
}

// ---- Generic selection ------------------------------------------------------------------------

TEST(TopKCpu, LastAxisDescendingWithTiesToTheLowerIndex) {
  auto r = runAll({"kiln.topk", {f32({2, 4}, {1, 3, 3, 0, 5, -1, 2, 5})}, {{"k", i(3)}}});
  ASSERT_EQ(r.size(), 2u);
  expectTensor(r[0], {2, 3}, {3, 3, 1, 5, 5, 2});
  EXPECT_EQ(r[1].view.dtype, DType::i32);
  expectTensor(r[1], {2, 3}, {1, 2, 0, 0, 3, 2}, 0);
}

TEST(TopKCpu, MiddleAxisAgainstASortedCopy) {
  // x[a, b, c] over b for each (a, c); the test sorts each column itself.
  std::vector<double> v = {0.5, -2, 4, 1, 0.5, 7, 3, 3, -1, 6, 2, 0, 9, 8, 1, 1, 0, 2, 5, 3, 2, 2, 7, -4};
  auto r = runAll({"kiln.topk", {f64({2, 4, 3}, v)}, {{"k", i(2)}, {"axis", i(1)}}});
  ASSERT_EQ(r.size(), 2u);
  std::vector<double> want_v(12), want_i(12);
  for (int a = 0; a < 2; ++a)
    for (int c = 0; c < 3; ++c) {
      std::vector<int> order = {0, 1, 2, 3};
      std::stable_sort(order.begin(), order.end(),
                       [&](int p, int q) { return v[(a * 4 + p) * 3 + c] > v[(a * 4 + q) * 3 + c]; });
      for (int j = 0; j < 2; ++j) {
        want_v[(a * 2 + j) * 3 + c] = v[(a * 4 + order[j]) * 3 + c];
        want_i[(a * 2 + j) * 3 + c] = order[j];
      }
    }
  expectTensor(r[0], {2, 2, 3}, want_v, 0);
  expectTensor(r[1], {2, 2, 3}, want_i, 0);
}

TEST(TakeAlongAxisCpu, MiddleAxisAgainstAPlainLoop) {
  std::vector<double> x = {0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15};          // [2, 3, 2]
  std::vector<double> idx = {2, 0, 0, 0, 1, 2, 0, 1, 2, 2, 1, 1, 1, 0, 0, 0};  // [2, 4, 2]
  std::vector<double> want(16);
  for (int a = 0; a < 2; ++a)
    for (int m = 0; m < 4; ++m)
      for (int c = 0; c < 2; ++c) {
        const int t = static_cast<int>(idx[(a * 4 + m) * 2 + c]);
        want[(a * 4 + m) * 2 + c] = x[(a * 3 + t) * 2 + c];
      }
  expectTensor(runOk({"kiln.take_along_axis", {f32({2, 3, 2}, x), i32({2, 4, 2}, idx)}, {{"axis", i(1)}}}),
               {2, 4, 2}, want, 0);
  // Integer payloads move too (the router's expert ids).
  expectTensor(
      runOk({"kiln.take_along_axis", {i32({1, 3}, {7, 8, 9}), i64({1, 2}, {2, 2})}, {{"axis", i(-1)}}}),
      {1, 2}, {9, 9}, 0);
}

TEST(ScatterAlongAxisCpu, RepeatedIndicesAdd) {
  // axis 0 of [2, 2] into size 3: column 0 gets g at rows 2 and 2, column 1 at rows 0 and 1.
  expectTensor(runOk({"kiln.scatter_along_axis",
                      {f32({2, 2}, {1, 2, 10, 20}), i32({2, 2}, {2, 0, 2, 1})},
                      {{"axis", i(0)}, {"size", i(3)}}}),
               {3, 2}, {0, 2, 0, 20, 11, 0});
}

TEST(AlongAxisCpu, IndexOutOfRangeIsARunTimeError) {
  expectError(
      {"kiln.take_along_axis", {f32({2, 3}, {0, 1, 2, 3, 4, 5}), i32({2, 1}, {1, 3})}, {{"axis", i(1)}}},
      "out of range [0, 3)");
  expectError(
      {"kiln.take_along_axis", {f32({2, 3}, {0, 1, 2, 3, 4, 5}), i32({2, 1}, {-1, 0})}, {{"axis", i(1)}}},
      "out of range");
  expectError({"kiln.scatter_along_axis",
               {f32({1, 2}, {1, 2}), i32({1, 2}, {0, 4})},
               {{"axis", i(1)}, {"size", i(4)}}},
              "out of range [0, 4)");
}

// ---- Routing ----------------------------------------------------------------------------------

struct Routed {
  std::vector<double> probs, experts;
};
Routed route(const std::vector<double>& logits, int64_t n, int64_t e, AttrDict attrs,
             const std::vector<double>& bias = {}) {
  std::vector<HostTensor> ops = {f32({n, e}, logits)};
  if (!bias.empty()) ops.push_back(f32({e}, bias));
  auto r = runAll({"kiln.moe_router", ops, std::move(attrs)});
  if (r.size() != 2) return {};
  EXPECT_EQ(r[1].view.dtype, DType::i32);
  return {values(r[0]), values(r[1])};
}

void expectNear(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < got.size(); ++j) EXPECT_NEAR(got[j], want[j], tol) << "at " << j;
}

TEST(MoeRouterCpu, SoftmaxAfterSelectionRenormalizesAmongTheChosen) {
  // Row 1 ties experts 0 and 3: the lower index wins.
  Routed r = route({1, 3, 2, 0, 4, 1, 1, 4}, 2, 4, {{"topk", i(2)}});
  EXPECT_EQ(r.experts, (std::vector<double>{1, 2, 0, 3}));
  const double e1 = std::exp(1.0);
  expectNear(r.probs, {e1 / (e1 + 1), 1 / (e1 + 1), 0.5, 0.5});
}

TEST(MoeRouterCpu, BiasShiftsSelectionOnlyAndScaleMultipliesProbs) {
  // Selection by logits + bias = {1, 3, 4, 0}: experts 2 then 1; probs from the raw logits 2, 3.
  Routed r = route({1, 3, 2, 0}, 1, 4, {{"topk", i(2)}, {"scale", A(2.0)}}, {0, 0, 2, 0});
  EXPECT_EQ(r.experts, (std::vector<double>{2, 1}));
  const double e1 = std::exp(1.0);
  expectNear(r.probs, {2 / (e1 + 1), 2 * e1 / (e1 + 1)});
}

TEST(MoeRouterCpu, PreSoftmaxKeepsTheSelectedScores) {
  const std::vector<double> logits = {0.5, -1, 2, 1.5, 0};
  Routed r = route(logits, 1, 5, {{"topk", i(3)}, {"pre_softmax", A(true)}});
  EXPECT_EQ(r.experts, (std::vector<double>{2, 3, 0}));
  double z = 0;
  for (double l : logits) z += std::exp(l);
  expectNear(r.probs, {std::exp(2) / z, std::exp(1.5) / z, std::exp(0.5) / z});
}

TEST(MoeRouterCpu, SigmoidNormalizesOverTheChosenAndTop1KeepsTheScore) {
  Routed r = route({0.5, -1, 2, 1.5}, 1, 4, {{"topk", i(2)}, {"score", A("sigmoid")}});
  EXPECT_EQ(r.experts, (std::vector<double>{2, 3}));
  const double s2 = sigmoid(2), s3 = sigmoid(1.5);
  expectNear(r.probs, {s2 / (s2 + s3), s3 / (s2 + s3)});
  // Top-1 with a bias that moves the choice to expert 3: its own score, unnormalized.
  Routed one = route({0.5, -1, 2, 1.5}, 1, 4, {{"topk", i(1)}, {"score", A("sigmoid")}}, {0, 0, 0, 0.2});
  EXPECT_EQ(one.experts, (std::vector<double>{3}));
  expectNear(one.probs, {s3});
}

TEST(MoeRouterCpu, GroupLimitedRoutingPicksTheBestGroupsFirst) {
  // 4 groups of 2; each group's score is the sum of its top 2 sigmoids: group 0 = s(5) + s(-5)
  // = 1, group 1 = 2 s(3) ~ 1.905, group 2 = s(4) + s(2.9) ~ 1.930, group 3 = 1. Groups 2 and 1
  // win, so expert 0 (the best logit) is not eligible.
  const std::vector<double> logits = {5, -5, 3, 3, 4, 2.9, 0, 0};
  Routed r =
      route(logits, 1, 8, {{"topk", i(4)}, {"score", A("sigmoid")}, {"groups", i(4)}, {"group_topk", i(2)}});
  EXPECT_EQ(r.experts, (std::vector<double>{4, 2, 3, 5}));
  double sum = 0;
  for (int e : {4, 2, 3, 5}) sum += sigmoid(logits[e]);
  expectNear(r.probs, {sigmoid(4) / sum, sigmoid(3) / sum, sigmoid(3) / sum, sigmoid(2.9) / sum});
  // Without groups, expert 0 is first.
  Routed flat = route(logits, 1, 8, {{"topk", i(4)}, {"score", A("sigmoid")}});
  EXPECT_EQ(flat.experts, (std::vector<double>{0, 4, 2, 3}));
}

TEST(MoeRouterCpu, RouterGradIsZeroOffTheChosenExperts) {
  // Softmax over the chosen: d logits = p (dp - <p, dp>) on experts 1 and 2 only.
  auto g = runOk({"kiln.moe_router_grad",
                  {f32({1, 4}, {1, 3, 2, 0}), i32({1, 2}, {1, 2}), f32({1, 2}, {1, 0})},
                  {{"topk", i(2)}}});
  const double p = std::exp(1.0) / (std::exp(1.0) + 1);
  expectTensor(g, {1, 4}, {0, p * (1 - p), -p * (1 - p), 0});
}

// ---- Balancing losses -------------------------------------------------------------------------

// coeff * E * sum_i f_i P_i per sequence of `t` tokens, averaged over sequences: the doc's formula
// written out directly.
double auxLossByFormula(const std::vector<double>& logits, const std::vector<int>& experts, int n, int e,
                        int k, int t, double coeff, bool sigmoid_scores) {
  double total = 0;
  for (int s = 0; s < n / t; ++s) {
    std::vector<double> f(e, 0), p(e, 0);
    for (int tok = s * t; tok < (s + 1) * t; ++tok) {
      for (int j = 0; j < k; ++j) f[experts[tok * k + j]] += 1.0 / (t * k);
      std::vector<double> sc(e);
      double sum = 0;
      for (int x = 0; x < e; ++x) {
        sc[x] = sigmoid_scores ? sigmoid(logits[tok * e + x]) : std::exp(logits[tok * e + x]);
        sum += sc[x];
      }
      for (int x = 0; x < e; ++x) p[x] += sc[x] / (sigmoid_scores ? sum + 1e-20 : sum) / t;
    }
    double dot = 0;
    for (int x = 0; x < e; ++x) dot += f[x] * p[x];
    total += coeff * e * dot;
  }
  return total / (n / t);
}

TEST(MoeAuxLossCpu, PerBatchAndPerSequenceAgainstTheFormula) {
  const std::vector<double> logits = {0.1, 2, -1, 0.5, 1, 1, 0, -2, 3, 0.2, 0.4, 1, -0.5, 0, 2, 1};
  const std::vector<int> experts = {1, 3, 0, 1, 0, 3, 2, 3};
  const HostTensor ids = i32({4, 2}, {1, 3, 0, 1, 0, 3, 2, 3});
  for (const char* score : {"softmax", "sigmoid"})
    for (int t : {0, 2, 1}) {
      auto loss = runOk({"kiln.moe_aux_loss",
                         {f32({4, 4}, logits), ids},
                         {{"coeff", A(0.01)}, {"score", A(score)}, {"topk", i(2)}, {"seq_len", i(t)}}});
      const double want =
          auxLossByFormula(logits, experts, 4, 4, 2, t ? t : 4, 0.01, std::string(score) == "sigmoid");
      expectTensor(loss, {}, {want}, 1e-6);
    }
}

TEST(MoeAuxLossCpu, BalancedRoutingOfUniformScoresGivesCoeff) {
  // f_i = 1/E and P_i = 1/E: coeff * E * E / E^2 = coeff.
  auto loss = runOk({"kiln.moe_aux_loss",
                     {f32({2, 2}, {0, 0, 0, 0}), i32({2, 1}, {0, 1})},
                     {{"coeff", A(0.25)}, {"score", A("softmax")}, {"topk", i(1)}}});
  expectTensor(loss, {}, {0.25});
}

// With counts: f_i = counts_i / sum(counts) (0 when the sum is 0); P_i this batch's mean score.
double auxLossWithCounts(const std::vector<double>& logits, const std::vector<double>& counts, int n, int e,
                         double coeff, bool sigmoid_scores) {
  double total = 0;
  for (double c : counts) total += c;
  double loss = 0;
  for (int x = 0; x < e; ++x) {
    double p = 0;
    for (int tok = 0; tok < n; ++tok) {
      double sum = 0;
      for (int y = 0; y < e; ++y)
        sum += sigmoid_scores ? sigmoid(logits[tok * e + y]) : std::exp(logits[tok * e + y]);
      const double score = sigmoid_scores ? sigmoid(logits[tok * e + x]) : std::exp(logits[tok * e + x]);
      p += score / (sigmoid_scores ? sum + 1e-20 : sum) / n;
    }
    loss += (total > 0 ? counts[x] / total : 0.0) * p;
  }
  return coeff * e * loss;
}

TEST(MoeAuxLossCpu, GivenCountsReplaceThisBatchsLoad) {
  const std::vector<double> logits = {0.1, 2, -1, 0.5, 1, 1, 0, -2, 3, 0.2, 0.4, 1};
  const HostTensor ids = i32({3, 2}, {1, 3, 0, 1, 0, 3});
  for (const char* score : {"softmax", "sigmoid"})
    for (DType t : {DType::i32, DType::i64})
      for (const std::vector<double>& counts : {std::vector<double>{7, 0, 2, 3}, {0, 0, 0, 0}}) {
        auto loss = runOk({"kiln.moe_aux_loss",
                           {f32({3, 4}, logits), ids, tensor(t, {4}, counts)},
                           {{"coeff", A(0.01)}, {"score", A(score)}, {"topk", i(2)}}});
        const double want = auxLossWithCounts(logits, counts, 3, 4, 0.01, std::string(score) == "sigmoid");
        expectTensor(loss, {}, {want}, 1e-6);
      }
}

// Two ranks, each with half the batch: given the whole batch's counts, the mean of their losses
// is the whole batch's own loss (Megatron's global-batch load balancing).
TEST(MoeAuxLossCpu, HalvesWithTheWholeBatchsCountsAverageToTheWholeBatchsLoss) {
  std::mt19937 rng(31);
  const int64_t n = 8, e = 4, k = 2;
  std::uniform_real_distribution<double> u(-2, 2);
  std::uniform_int_distribution<int> pick(0, e - 1);
  std::vector<double> logits(n * e), ids(n * k), counts(e, 0);
  for (double& v : logits) v = u(rng);
  for (double& id : ids) {
    id = pick(rng);
    counts[static_cast<size_t>(id)] += 1;
  }
  const AttrDict attrs = {{"coeff", A(0.3)}, {"score", A("softmax")}, {"topk", i(k)}};
  const double whole =
      values(runOk({"kiln.moe_aux_loss", {f64({n, e}, logits), i32({n, k}, ids)}, attrs}))[0];
  double mean = 0;
  for (int64_t half = 0; half < 2; ++half) {
    const auto part = [&](const std::vector<double>& v, int64_t w) {
      return std::vector<double>(v.begin() + half * n / 2 * w, v.begin() + (half + 1) * n / 2 * w);
    };
    mean += values(runOk({"kiln.moe_aux_loss",
                          {f64({n / 2, e}, part(logits, e)), i32({n / 2, k}, part(ids, k)), i64({e}, counts)},
                          attrs}))[0] /
            2;
  }
  EXPECT_NEAR(mean, whole, 1e-6);
  // Each half's own loss (without the counts) is not the whole batch's: the counts matter.
  const double own =
      values(runOk({"kiln.moe_aux_loss",
                    {f64({n / 2, e}, std::vector<double>(logits.begin(), logits.begin() + n / 2 * e)),
                     i32({n / 2, k}, std::vector<double>(ids.begin(), ids.begin() + n / 2 * k))},
                    attrs}))[0];
  const double own_with_counts = values(
      runOk({"kiln.moe_aux_loss",
             {f64({n / 2, e}, std::vector<double>(logits.begin(), logits.begin() + n / 2 * e)),
              i32({n / 2, k}, std::vector<double>(ids.begin(), ids.begin() + n / 2 * k)), i64({e}, counts)},
             attrs}))[0];
  EXPECT_GT(std::abs(own - own_with_counts), 1e-6);
}

TEST(MoeZLossCpu, MeanSquaredLogSumExp) {
  const std::vector<double> logits = {0, 1, 2, -1, 0.5, 3};
  double want = 0;
  for (int n = 0; n < 2; ++n) {
    double z = 0;
    for (int e = 0; e < 3; ++e) z += std::exp(logits[n * 3 + e]);
    want += std::log(z) * std::log(z) / 2;
  }
  expectTensor(runOk({"kiln.moe_z_loss", {f32({2, 3}, logits)}, {{"coeff", A(0.1)}}}), {}, {0.1 * want});
}

// ---- Dispatch ---------------------------------------------------------------------------------

struct Dispatched {
  std::vector<double> rows, offsets, counts;
  std::vector<int64_t> rows_shape;
};
Dispatched dispatch(const HostTensor& experts, const HostTensor& probs, AttrDict attrs) {
  auto r = runAll({"kiln.moe_dispatch", {experts, probs}, std::move(attrs)});
  if (r.size() != 3) return {};
  return {values(r[0]), values(r[1]), values(r[2]), r[0].view.shape};
}

// 4 tokens, top-2 of 3 experts: expert 0 has slots 0, 4, 7; expert 1 has 3, 6; expert 2 has 1, 2, 5.
HostTensor slotExperts() { return i32({4, 2}, {0, 2, 2, 1, 0, 2, 1, 0}); }
HostTensor slotProbs() { return f32({4, 2}, {0.9, 0.1, 0.6, 0.4, 0.3, 0.7, 0.5, 0.3}); }

TEST(MoeDispatchCpu, DroplessIsAStableExpertMajorPermutation) {
  Dispatched d = dispatch(slotExperts(), slotProbs(), {{"experts", i(3)}});
  EXPECT_EQ(d.rows_shape, (std::vector<int64_t>{8}));
  EXPECT_EQ(d.rows, (std::vector<double>{0, 4, 7, 3, 6, 1, 2, 5}));
  EXPECT_EQ(d.offsets, (std::vector<double>{0, 3, 5, 8}));
  EXPECT_EQ(d.counts, (std::vector<double>{3, 2, 3}));
}

TEST(MoeDispatchCpu, CapacityDropsByPositionOrByProbs) {
  // C = ceil(8 / 3 * 0.5) = 2.
  Dispatched pos = dispatch(slotExperts(), slotProbs(),
                            {{"experts", i(3)}, {"capacity_factor", A(0.5)}, {"drop_policy", A("position")}});
  EXPECT_EQ(pos.rows, (std::vector<double>{0, 4, 3, 6, 1, 2}));
  EXPECT_EQ(pos.offsets, (std::vector<double>{0, 2, 4, 6}));
  EXPECT_EQ(pos.counts, (std::vector<double>{2, 2, 2}));
  // By probs: expert 0 keeps slot 0 (0.9) and slot 4 over slot 7 (a 0.3 tie: the lower slot);
  // expert 2 keeps slots 2 and 5 (0.6, 0.7) over slot 1 (0.1), in token order.
  Dispatched by_probs =
      dispatch(slotExperts(), slotProbs(), {{"experts", i(3)}, {"capacity_factor", A(0.5)}});
  EXPECT_EQ(by_probs.rows, (std::vector<double>{0, 4, 3, 6, 2, 5}));
  EXPECT_EQ(by_probs.counts, (std::vector<double>{2, 2, 2}));
  // A capacity above every expert's load drops nothing.
  Dispatched roomy = dispatch(slotExperts(), slotProbs(), {{"experts", i(3)}, {"capacity_factor", A(1.0)}});
  EXPECT_EQ(roomy.rows, (std::vector<double>{0, 4, 7, 3, 6, 1, 2, 5}));
}

TEST(MoeDispatchCpu, PaddingFillsEveryExpertToCapacityAndIsNotCounted) {
  // C = ceil(8 / 3 * 1.5) = 4; a static N gives the exact bound E*C = 12.
  auto r = runAll({"kiln.moe_dispatch",
                   {slotExperts(), slotProbs()},
                   {{"experts", i(3)}, {"capacity_factor", A(1.5)}, {"pad_to_capacity", A(true)}}});
  ASSERT_EQ(r.size(), 3u);
  expectTensor(r[0], {12}, {0, 4, 7, -1, 3, 6, -1, -1, 1, 2, 5, -1}, 0);
  expectTensor(r[1], {4}, {0, 4, 8, 12}, 0);
  expectTensor(r[2], {3}, {3, 2, 3}, 0);
  // Dropping and padding together, with an expert that gets nothing: C = ceil(8 / 4 * 0.5) = 1.
  Dispatched d = dispatch(slotExperts(), slotProbs(),
                          {{"experts", i(4)},
                           {"capacity_factor", A(0.5)},
                           {"drop_policy", A("position")},
                           {"pad_to_capacity", A(true)}});
  EXPECT_EQ(d.rows, (std::vector<double>{0, 3, 1, -1}));
  EXPECT_EQ(d.offsets, (std::vector<double>{0, 1, 2, 3, 4}));
  EXPECT_EQ(d.counts, (std::vector<double>{1, 1, 1, 0}));
}

TEST(MoeDispatchCpu, BoundedRowTypes) {
  auto rowsType = [](AttrDict attrs) {
    Module m;
    Function& f = m.addFunction("f");
    Builder b(f.entry());
    auto e = b.createWithTypes(
        "kiln.input", {}, {TensorType(DType::i32, {Dim::symbol("B", 4), Dim::fixed(2)})}, {{"name", A("e")}});
    auto p = b.createWithTypes(
        "kiln.input", {}, {TensorType(DType::f32, {Dim::symbol("B", 4), Dim::fixed(2)})}, {{"name", A("p")}});
    EXPECT_TRUE(e && p);
    auto op = b.create("kiln.moe_dispatch", {(*e)->result(), (*p)->result()}, std::move(attrs));
    EXPECT_TRUE(op) << op.status().str();
    return op ? (*op)->result(0)->type().str() : std::string();
  };
  EXPECT_EQ(rowsType({{"experts", i(3)}}), "!kiln.tensor<?(8*B)xi32>");
  EXPECT_EQ(rowsType({{"experts", i(3)}, {"capacity_factor", A(0.5)}}), "!kiln.tensor<?(8*B)xi32>");
  // f = ceil(2 * 1.5) = 3: (f + E) * 4 = 24 per B, at least E * C = 3 * ceil(8B / 3 * 1.5) for B >= 1.
  EXPECT_EQ(rowsType({{"experts", i(3)}, {"capacity_factor", A(1.5)}, {"pad_to_capacity", A(true)}}),
            "!kiln.tensor<?(24*B)xi32>");
}

TEST(MoeDispatchCpu, SymbolicTokensRunWithinTheBound) {
  // N = 4*B with B = 1: the rows' buffer holds the bound 24 and the run-time rows are E*C = 12.
  const Shape slots = {Dim::symbol("B", 4), Dim::fixed(2)};
  OpCall call{"kiln.moe_dispatch",
              {slotExperts(), slotProbs()},
              {{"experts", i(3)}, {"capacity_factor", A(1.5)}, {"pad_to_capacity", A(true)}},
              {TensorType(DType::i32, slots), TensorType(DType::f32, slots)}};
  call.symbols = {{"B", 1}};
  auto r = runAll(call);
  ASSERT_EQ(r.size(), 3u);
  expectTensor(r[0], {12}, {0, 4, 7, -1, 3, 6, -1, -1, 1, 2, 5, -1}, 0);
}

TEST(MoeDispatchCpu, RandomRoutingsKeepTheHighestProbsInTokenOrder) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int n = 1 + trial % 7, k = 1 + trial % 3, e = 2 + trial % 5;
    std::vector<double> experts(n * k), probs(n * k);
    for (int s = 0; s < n * k; ++s) {
      experts[s] = static_cast<double>(rng() % e);
      probs[s] = static_cast<double>(rng() % 4) / 4;  // coarse: many ties
    }
    const double cf = 0.25 * (1 + trial % 4);
    const int capacity = static_cast<int>(std::ceil(n * k * cf / e));
    Dispatched d =
        dispatch(i32({n, k}, experts), f32({n, k}, probs),
                 {{"experts", i(e)}, {"capacity_factor", A(cf)}, {"pad_to_capacity", A(trial % 2 == 0)}});
    ASSERT_EQ(static_cast<int>(d.offsets.size()), e + 1);
    EXPECT_EQ(d.offsets.back(), static_cast<double>(d.rows.size()));
    for (int x = 0; x < e; ++x) {
      std::vector<int> kept;
      for (int r = static_cast<int>(d.offsets[x]); r < d.offsets[x + 1]; ++r)
        if (d.rows[r] >= 0) kept.push_back(static_cast<int>(d.rows[r]));
      if (trial % 2 == 0) {
        EXPECT_EQ(d.offsets[x + 1] - d.offsets[x], capacity);
      }
      EXPECT_EQ(d.counts[x], static_cast<double>(kept.size()));
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
      std::vector<int> mine;
      for (int s = 0; s < n * k; ++s)
        if (experts[s] == x) mine.push_back(s);
      EXPECT_EQ(kept.size(), std::min<size_t>(mine.size(), capacity));
      // Every dropped slot ranks below every kept one: lower prob, or equal prob and later.
      for (int s : mine) {
        if (std::find(kept.begin(), kept.end(), s) != kept.end()) continue;
        for (int q : kept) EXPECT_TRUE(probs[q] > probs[s] || (probs[q] == probs[s] && q < s));
      }
    }
  }
}

// ---- Expert bias update -----------------------------------------------------------------------

TEST(MoeExpertBiasUpdateCpu, MovesTowardTheMeanLoadInPlace) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  auto bias =
      b.createWithTypes("kiln.input", {}, {TensorType(DType::f32, {Dim::fixed(4)})}, {{"name", A("bias")}});
  auto counts =
      b.createWithTypes("kiln.input", {}, {TensorType(DType::i32, {Dim::fixed(4)})}, {{"name", A("counts")}});
  ASSERT_TRUE(bias && counts);
  auto up =
      b.create("kiln.moe_expert_bias_update", {(*bias)->result(), (*counts)->result()}, {{"rate", A(0.01)}});
  ASSERT_TRUE(up) << up.status().str();
  EXPECT_EQ(writtenOperands(**up), (std::vector<unsigned>{0}));
  ASSERT_TRUE(b.createWithTypes("func.return", {}, {}));
  ASSERT_TRUE(verify(f));
  std::map<std::string, HostTensor> tensors = {{"bias", f32({4}, {0.1, 0.2, 0.3, 0.4})},
                                               {"counts", i32({4}, {4, 1, 2, 1})}};
  auto r = interpretInPlace(f, tensors, {});
  ASSERT_TRUE(r) << r.status().str();
  // mean 2: overloaded expert 0 goes down, 1 and 3 up, 2 (at the mean) stays.
  expectTensor(tensors["bias"], {4}, {0.09, 0.21, 0.3, 0.41});
}

// ---- Bad input --------------------------------------------------------------------------------

TEST(RoutingErrors, VerifierRejectsBadAttributesAndTypes) {
  const HostTensor logits = f32({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  expectError({"kiln.moe_router", {logits}, {{"topk", i(5)}}}, "1 <= topk <= E = 4");
  expectError({"kiln.moe_router", {logits}, {{"topk", i(2)}, {"groups", i(3)}}},
              "groups >= 1 dividing E = 4");
  expectError({"kiln.moe_router", {logits}, {{"topk", i(3)}, {"groups", i(2)}, {"group_topk", i(2)}}},
              "divide by group_topk");
  expectError({"kiln.moe_router", {logits}, {{"topk", i(2)}, {"groups", i(2)}, {"group_topk", i(3)}}},
              "group_topk <= groups");
  expectError({"kiln.moe_router", {i32({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7})}, {{"topk", i(2)}}}, "f32");
  expectError({"kiln.moe_router", {logits, f64({4}, {0, 0, 0, 0})}, {{"topk", i(2)}}}, "bias");
  expectError({"kiln.moe_router", {logits}, {{"topk", i(2)}, {"score", A("relu")}}}, "relu");
  expectError({"kiln.topk", {logits}, {{"k", i(5)}}}, "k <= 4");
  expectError({"kiln.moe_aux_loss",
               {logits, i64({2, 2}, {0, 1, 2, 3})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(2)}}},
              "i32");
  expectError({"kiln.moe_aux_loss",
               {f32({3, 4}, std::vector<double>(12, 0)), i32({3, 2}, {0, 1, 2, 3, 0, 1})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(2)}, {"seq_len", i(2)}}},
              "sequences");
  const AttrDict aux = {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(1)}};
  expectError({"kiln.moe_aux_loss", {logits, i32({2, 1}, {0, 1}), f32({4}, {1, 1, 1, 1})}, aux},
              "counts must be i32 or i64 [4]");
  expectError({"kiln.moe_aux_loss", {logits, i32({2, 1}, {0, 1}), i64({3}, {1, 1, 1})}, aux},
              "counts must be i32 or i64 [4]");
  expectError({"kiln.moe_aux_loss",
               {logits, i32({2, 1}, {0, 1}), i64({4}, {1, 1, 1, 1})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(1)}, {"seq_len", i(1)}}},
              "counts only for the per-batch loss (seq_len = 0)");
  expectError({"kiln.moe_aux_loss_grad",
               {logits, i32({2, 1}, {0, 1}), f32({}, {1}), i64({4}, {1, 1, 1, 1})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(1)}, {"seq_len", i(2)}}},
              "counts only for the per-batch loss");
  expectError(
      {"kiln.moe_dispatch", {f32({2, 2}, {0, 1, 2, 3}), f32({2, 2}, {0, 1, 2, 3})}, {{"experts", i(4)}}},
      "i32");
  expectError({"kiln.moe_dispatch",
               {i32({2, 2}, {0, 1, 2, 3}), f32({2, 2}, {0, 1, 2, 3})},
               {{"experts", i(4)}, {"pad_to_capacity", A(true)}}},
              "capacity_factor > 0");
  expectError({"kiln.take_along_axis", {logits, f32({2, 1}, {0, 1})}, {{"axis", i(1)}}}, "i32 or i64");
}

TEST(RoutingErrors, ExpertIdsOutOfRangeAreRunTimeErrors) {
  expectError({"kiln.moe_dispatch", {i32({2, 1}, {0, 7}), f32({2, 1}, {1, 1})}, {{"experts", i(4)}}},
              "expert 7 at [1, 0] is out of range [0, 4)");
  expectError({"kiln.moe_aux_loss",
               {f32({1, 2}, {0, 0}), i32({1, 1}, {-1})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(1)}}},
              "out of range [0, 2)");
  expectError(
      {"kiln.moe_router_grad", {f32({1, 2}, {0, 0}), i32({1, 1}, {2}), f32({1, 1}, {1})}, {{"topk", i(1)}}},
      "out of range [0, 2)");
  expectError({"kiln.moe_router", {f32({1, 2}, {0, NAN})}, {{"topk", i(1)}}}, "NaN");
  expectError({"kiln.moe_aux_loss",
               {f32({1, 2}, {0, 0}), i32({1, 1}, {0}), i32({2}, {3, -1})},
               {{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", i(1)}}},
              "counts[1] = -1 is negative");
}

}  // namespace
}  // namespace kiln::ir::testing
