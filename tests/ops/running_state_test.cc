// The CPU references of hashed crosses and of running state (ir/ops/random.cc,
// ir/ops/running_state.cc), against numbers worked out here: splitmix64 written from its
// published definition, and the estimator's and batch norm's updates step by step.
#include <cmath>
#include <map>

#include "ir/random.h"
#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

using A = Attribute;

// Vigna's splitmix64 output for one state: add the gamma, then two xor-shift-multiply rounds.
uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The documented cross: h = mix(salt), then h = mix(h xor id) per feature, as a signed
// remainder moved into [0, buckets).
int64_t expectedCross(const std::vector<int64_t>& ids, int64_t salt, int64_t buckets) {
  uint64_t h = splitmix(static_cast<uint64_t>(salt));
  for (int64_t id : ids) h = splitmix(h ^ static_cast<uint64_t>(id));
  const auto s = static_cast<int64_t>(h);
  const int64_t r = s % buckets;
  return r < 0 ? r + buckets : r;
}

TEST(HashCross, HashesEachRowOfIdsIntoTheBuckets) {
  const HostTensor a = i64({5, 1}, {0, 1, 2, 123456789, -7});
  const HostTensor b = i32({5, 1}, {0, 0, 5, 42, 3});
  const HostTensor out =
      runOk({"kiln.hash_cross", {a, b}, {{"buckets", A(int64_t{1000})}, {"salt", A(int64_t{9})}}});
  ASSERT_EQ(out.view.dtype, DType::i64);
  const std::vector<double> got = values(out);
  const std::vector<int64_t> av = {0, 1, 2, 123456789, -7}, bv = {0, 0, 5, 42, 3};
  for (size_t i = 0; i < av.size(); ++i) {
    EXPECT_EQ(static_cast<int64_t>(got[i]), expectedCross({av[i], bv[i]}, 9, 1000)) << i;
    EXPECT_GE(got[i], 0);
    EXPECT_LT(got[i], 1000);
  }
  // The crossed pair is ordered, and another salt is another hash.
  const HostTensor ba =
      runOk({"kiln.hash_cross", {b, a}, {{"buckets", A(int64_t{1000})}, {"salt", A(int64_t{9})}}});
  const HostTensor other =
      runOk({"kiln.hash_cross", {a, b}, {{"buckets", A(int64_t{1000})}, {"salt", A(int64_t{10})}}});
  EXPECT_NE(values(ba), got);
  EXPECT_NE(values(other), got);
}

TEST(HashCross, SpreadsDistinctPairsOverTheBuckets) {
  // 40 x 50 distinct pairs into 64 buckets: every bucket is used, none holds many more than its share.
  std::vector<double> x, y;
  for (int i = 0; i < 40; ++i)
    for (int j = 0; j < 50; ++j) {
      x.push_back(i);
      y.push_back(j);
    }
  const auto n = static_cast<int64_t>(x.size());
  const HostTensor out =
      runOk({"kiln.hash_cross", {i64({n}, x), i64({n}, y)}, {{"buckets", A(int64_t{64})}}});
  std::vector<int> count(64, 0);
  for (double v : values(out)) ++count[static_cast<size_t>(v)];
  for (int c : count) {
    EXPECT_GT(c, 0);
    EXPECT_LT(c, 2 * 2000 / 64);
  }
}

TEST(HashCross, BadOperandsAreErrors) {
  auto bad = run({"kiln.hash_cross", {i64({3}, {1, 2, 3}), i64({2}, {1, 2})}, {{"buckets", A(int64_t{8})}}});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("one shape"), std::string::npos) << bad.status().str();
  auto floats = run({"kiln.hash_cross", {f32({2}, {1, 2}), i64({2}, {1, 2})}, {{"buckets", A(int64_t{8})}}});
  ASSERT_FALSE(floats);
  EXPECT_NE(floats.status().message().find("integer ids"), std::string::npos) << floats.status().str();
  auto none = run({"kiln.hash_cross", {i64({2}, {1, 2}), i64({2}, {1, 2})}, {{"buckets", A(int64_t{0})}}});
  ASSERT_FALSE(none);
  EXPECT_NE(none.status().message().find("buckets must be positive"), std::string::npos)
      << none.status().str();
}

TEST(RunningStat, SelectsTheBatchStatisticInTrainingAndTheRunningOneElse) {
  const HostTensor batch = f32({3}, {1, 2, 3});
  const HostTensor running = f32({3}, {-1, -2, -3});
  expectTensor(runOk({"kiln.running_stat", {batch, running}, {{"training", A(true)}}}), {3}, {1, 2, 3}, 0);
  expectTensor(runOk({"kiln.running_stat", {batch, running}}), {3}, {-1, -2, -3}, 0);
  auto bad = run({"kiln.running_stat", {f32({2}, {1, 2}), running}});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("floats of one type"), std::string::npos) << bad.status().str();
}

// Builds @f over named f32 inputs with one in-place op, runs it over `tensors`.
void runInPlace(const std::string& op, const std::vector<std::pair<std::string, TensorType>>& inputs,
                const AttrDict& attrs, std::map<std::string, HostTensor>& tensors) {
  Module m;
  Function& f = m.addFunction("f");
  Builder b(f.entry());
  std::vector<Value*> operands;
  for (const auto& [name, type] : inputs) {
    auto in = b.createWithTypes("kiln.input", {}, {type}, {{"name", A(name)}});
    ASSERT_TRUE(in) << in.status().str();
    operands.push_back((*in)->result());
  }
  auto up = b.create(op, operands, attrs);
  ASSERT_TRUE(up) << up.status().str();
  EXPECT_EQ(writtenOperands(**up), (std::vector<unsigned>{0}));
  ASSERT_TRUE(b.createWithTypes("func.return", {}, {}));
  ASSERT_TRUE(verify(f));
  auto r = interpretInPlace(f, tensors, {});
  ASSERT_TRUE(r) << r.status().str();
}

TensorType f32Type(std::vector<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return TensorType(DType::f32, s);
}

TEST(RunningStatUpdate, MovesTheRunningStatisticByMomentum) {
  std::map<std::string, HostTensor> t = {{"running", f32({3}, {0, 1, 10})}, {"batch", f32({3}, {4, 1, 0})}};
  runInPlace("kiln.running_stat_update", {{"running", f32Type({3})}, {"batch", f32Type({3})}},
             {{"momentum", A(0.25)}}, t);
  // 0.75 * running + 0.25 * batch.
  expectTensor(t["running"], {3}, {1, 1, 7.5});
}

TEST(FrequencyEstimator, EstimatesPeriodsAndLogQ) {
  // State rows: (last step seen, period). Three rows; ids map to row id % 3.
  std::map<std::string, HostTensor> t = {{"state", f32({3, 2}, {0, 0, 0, 0, 0, 0})}};
  const TensorType state = f32Type({3, 2});
  const TensorType ids4(DType::i64, {Dim::fixed(4)});
  auto step = [&](double s, std::vector<double> ids) {
    t["ids"] = i64({4}, ids);
    t["step"] = f32({}, {s});
    runInPlace("kiln.frequency_update", {{"state", state}, {"ids", ids4}, {"step", f32Type({})}},
               {{"alpha", A(0.5)}}, t);
  };
  // Step 2: ids 0, 3 and 0 are row 0, id 1 row 1; first sightings take (t - last) / count.
  step(2, {0, 3, 1, 0});
  expectTensor(t["state"], {3, 2}, {2, 2.0 / 3, 2, 2, 0, 0});
  // Step 6: row 0 once more: period = 0.5 * 2/3 + 0.5 * (6 - 2) / 1; row 2 first seen.
  step(6, {3, 2, 2, 5});  // row 0 once, row 2 three times
  expectTensor(t["state"], {3, 2}, {6, 0.5 * 2.0 / 3 + 0.5 * 4, 2, 2, 6, 2}, 1e-6);

  // log q = -log(period); a row never seen takes the prior period.
  HostTensor fresh = f32({3, 2}, {6, 0.5 * 2.0 / 3 + 0.5 * 4, 2, 2, 0, 0});
  const HostTensor lq =
      runOk({"kiln.log_frequency", {i64({4, 1}, {0, 4, 2, -1}), fresh}, {{"prior", A(100.0)}}});
  // id -1 is row 2 (-1 mod 3).
  expectTensor(lq, {4, 1},
               {-std::log(0.5 * 2.0 / 3 + 0.5 * 4), -std::log(2.0), -std::log(100.0), -std::log(100.0)},
               1e-6);
}

TEST(FrequencyEstimator, BadStateAndStepAreErrors) {
  auto bad = run({"kiln.log_frequency", {i64({2}, {1, 2}), f32({3, 3}, std::vector<double>(9, 0))}});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("f32[H, 2]"), std::string::npos) << bad.status().str();
  auto prior = run({"kiln.log_frequency",
                    {i64({2}, {1, 2}), f32({3, 2}, std::vector<double>(6, 0))},
                    {{"prior", A(0.5)}}});
  ASSERT_FALSE(prior);
  EXPECT_NE(prior.status().message().find("prior"), std::string::npos) << prior.status().str();
}

}  // namespace
}  // namespace kiln::ir::testing
