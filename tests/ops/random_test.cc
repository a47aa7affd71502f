// kiln.dropout's CPU reference: the identity outside training; in training a counter-based mask
// of about p zeros, the kept elements scaled by 1 / (1 - p), the same mask for the same (seed,
// step, salt) and another for another step. The random numbers are checked against splitmix64
// written out here from its published definition, and its published first output.
#include "ir/random.h"

#include <cmath>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

HostTensor stepTensor(double step) { return f32({}, {step}); }

HostTensor ones(int64_t n) { return f32({n}, std::vector<double>(static_cast<size_t>(n), 1.0)); }

OpCall trainingDropout(HostTensor x, double p, double step, int64_t seed = 11, int64_t salt = 3) {
  return {"kiln.dropout",
          {std::move(x), stepTensor(step)},
          {{"p", Attribute(p)},
           {"seed", Attribute(seed)},
           {"salt", Attribute(salt)},
           {"training", Attribute(true)}}};
}

// Sebastiano Vigna's splitmix64 step: state += gamma, then the two xor-shift-multiply rounds.
uint64_t referenceSplitMix(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TEST(RandomNumbers, SplitMixMatchesItsDefinition) {
  // The first output of splitmix64 seeded with 0, as published with the generator.
  EXPECT_EQ(splitMix64(0), 0xE220A8397B1DCDAFull);
  // Element i of a stream is output i + 1 of splitmix64 seeded with the stream (state advanced
  // by gamma before each output), so element 0 is the first output.
  const uint64_t stream = randomStream(5, 7, 9);
  uint64_t state = stream;
  for (int64_t i = 0; i < 5; ++i) {
    const uint64_t h = referenceSplitMix(state);
    EXPECT_EQ(uniformAt(stream, i), static_cast<double>(h >> 11) / 9007199254740992.0) << i;
  }
}

TEST(Dropout, IsTheIdentityOutsideTraining) {
  HostTensor x = f32({2, 3}, {1, -2, 3, -4, 5, -6});
  expectTensor(runOk({"kiln.dropout", {x}, {{"p", Attribute(0.5)}}}), {2, 3}, {1, -2, 3, -4, 5, -6}, 0);
  // training = false with a step operand, and p = 0 in training, too.
  expectTensor(
      runOk({"kiln.dropout", {x, stepTensor(4)}, {{"p", Attribute(0.9)}, {"training", Attribute(false)}}}),
      {2, 3}, {1, -2, 3, -4, 5, -6}, 0);
  expectTensor(runOk(trainingDropout(x, 0.0, 4)), {2, 3}, {1, -2, 3, -4, 5, -6}, 0);
}

TEST(Dropout, DropsAboutPAndKeepsTheMean) {
  constexpr int64_t n = 200000;
  for (double p : {0.1, 0.5, 0.8}) {
    HostTensor y = runOk(trainingDropout(ones(n), p, 17));
    const std::vector<double> v = values(y);
    int64_t zeros = 0;
    double sum = 0;
    const float kept = static_cast<float>(1.0 / (1.0 - p));
    for (double e : v) {
      if (e == 0)
        ++zeros;
      else
        EXPECT_EQ(e, kept);
      sum += e;
    }
    // Binomial: 5 standard deviations of the fraction and of the mean.
    const double sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(static_cast<double>(zeros) / n, p, 5 * sd) << "p = " << p;
    EXPECT_NEAR(sum / n, 1.0, 5 * sd / (1 - p)) << "p = " << p;
  }
}

TEST(Dropout, MaskIsAFunctionOfSeedStepSaltAndElement) {
  constexpr int64_t n = 4096;
  const double p = 0.5;
  auto mask = [&](double step, int64_t seed, int64_t salt) {
    std::vector<double> v = values(runOk(trainingDropout(ones(n), p, step, seed, salt)));
    std::vector<bool> m;
    for (double e : v) m.push_back(e != 0);
    return m;
  };
  auto differing = [](const std::vector<bool>& a, const std::vector<bool>& b) {
    int64_t d = 0;
    for (size_t i = 0; i < a.size(); ++i) d += a[i] != b[i];
    return static_cast<double>(d) / static_cast<double>(a.size());
  };
  const std::vector<bool> base = mask(3, 11, 3);
  EXPECT_EQ(mask(3, 11, 3), base);  // the same coordinates, recomputed
  // Another step, seed or salt: an independent mask differs in about 2 p (1 - p) = half.
  EXPECT_NEAR(differing(mask(4, 11, 3), base), 0.5, 0.05);
  EXPECT_NEAR(differing(mask(3, 12, 3), base), 0.5, 0.05);
  EXPECT_NEAR(differing(mask(3, 11, 4), base), 0.5, 0.05);
  // The mask of element i does not depend on the tensor's size or shape.
  std::vector<double> small = values(runOk(trainingDropout(ones(100), p, 3, 11, 3)));
  for (size_t i = 0; i < small.size(); ++i) EXPECT_EQ(small[i] != 0, base[i]) << i;
  // Element i is kept exactly when the splitmix64 stream of (seed, step, salt) says so.
  const uint64_t stream = randomStream(11, 3, 3);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(base[static_cast<size_t>(i)], uniformAt(stream, i) >= p) << i;
}

TEST(Dropout, BadInputIsAnError) {
  HostTensor x = f32({2}, {1, 2});
  auto p_high = run({"kiln.dropout", {x}, {{"p", Attribute(1.0)}}});
  ASSERT_FALSE(p_high);
  EXPECT_NE(p_high.status().message().find("p must lie in [0, 1), got 1"), std::string::npos)
      << p_high.status().message();
  EXPECT_FALSE(run({"kiln.dropout", {x}, {{"p", Attribute(-0.1)}}}));
  auto no_step = run({"kiln.dropout", {x}, {{"p", Attribute(0.5)}, {"training", Attribute(true)}}});
  ASSERT_FALSE(no_step);
  EXPECT_NE(no_step.status().message().find("needs the step operand"), std::string::npos)
      << no_step.status().message();
  auto bad_step = run(trainingDropout(x, 0.5, 2.5));
  ASSERT_FALSE(bad_step);
  EXPECT_NE(bad_step.status().message().find("not a whole number"), std::string::npos)
      << bad_step.status().message();
  EXPECT_FALSE(run({"kiln.dropout", {i64({2}, {1, 2})}, {{"p", Attribute(0.5)}}}));
}

}  // namespace
}  // namespace kiln::ir::testing
