#include <cmath>
#include <random>

#include "runtime/metrics.h"
#include "test_util.h"

namespace kiln::runtime {
namespace {

// The definition: over all (positive, negative) pairs, 1 when the positive scores higher,
// 1/2 on a tie.
double pairwiseAuc(const std::vector<float>& s, const std::vector<float>& l) {
  double wins = 0, pairs = 0;
  for (size_t i = 0; i < s.size(); ++i)
    for (size_t j = 0; j < s.size(); ++j)
      if (l[i] == 1 && l[j] == 0) {
        pairs += 1;
        wins += s[i] > s[j] ? 1.0 : s[i] == s[j] ? 0.5 : 0.0;
      }
  return wins / pairs;
}

TEST(Metrics, AucByHand) {
  EXPECT_DOUBLE_EQ(rocAuc(std::vector<float>{0.1f, 0.4f, 0.35f, 0.8f}, std::vector<float>{0, 0, 1, 1}), 0.75);
  EXPECT_DOUBLE_EQ(rocAuc(std::vector<float>{0.5f, 0.5f, 0.5f}, std::vector<float>{0, 1, 1}), 0.5);
  EXPECT_DOUBLE_EQ(rocAuc(std::vector<float>{3, 2, 1}, std::vector<float>{1, 0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(rocAuc(std::vector<float>{3, 2, 1}, std::vector<float>{0, 1, 1}), 0.0);
  EXPECT_TRUE(std::isnan(rocAuc(std::vector<float>{1, 2}, std::vector<float>{1, 1})));
  EXPECT_TRUE(std::isnan(rocAuc(std::vector<float>{}, std::vector<float>{})));
}

TEST(Metrics, AucMatchesPairwiseCountWithTies) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    size_t n = 1 + rng() % 400;
    int levels = 1 + static_cast<int>(rng() % 12);  // few distinct scores: many ties
    std::vector<float> s(n), l(n);
    for (size_t i = 0; i < n; ++i) {
      s[i] = static_cast<float>(rng() % static_cast<unsigned>(levels)) * 0.25f - 1.0f;
      l[i] = static_cast<float>((rng() % 3 == 0) || (s[i] > 0 && rng() % 2));
    }
    bool both = std::count(l.begin(), l.end(), 1.0f) > 0 && std::count(l.begin(), l.end(), 0.0f) > 0;
    if (!both) continue;
    EXPECT_NEAR(rocAuc(s, l), pairwiseAuc(s, l), 1e-12) << "trial " << trial;
    AucAccumulator acc;
    acc.add(std::span(s).first(n / 2), std::span(l).first(n / 2));
    acc.add(std::span(s).subspan(n / 2), std::span(l).subspan(n / 2));
    EXPECT_NEAR(acc.auc(), pairwiseAuc(s, l), 1e-12);
  }
}

TEST(Metrics, AccuracyAndRunningMean) {
  std::vector<float> s = {0.9f, 0.2f, 0.5f, 0.49f}, l = {1, 1, 1, 0};
  EXPECT_DOUBLE_EQ(accuracy(s, l), 0.75);  // 0.9 right, 0.2 wrong, 0.5 right, 0.49 right
  std::vector<float> logits = {2, -1, 0, -0.1f};
  EXPECT_DOUBLE_EQ(accuracy(logits, l, 0.0f), 0.75);
  RunningMean m;
  EXPECT_EQ(m.mean(), 0.0);
  m.add(1.0);
  m.add(4.0, 3.0);
  EXPECT_DOUBLE_EQ(m.mean(), 13.0 / 4.0);
  m.reset();
  m.add(2.0);
  EXPECT_DOUBLE_EQ(m.mean(), 2.0);
}

TEST(Metrics, WritesJsonLines) {
  data::testing::TempDir dir;
  std::string path = dir.file("m.jsonl");
  {
    auto w = MetricsWriter::open(path);
    ASSERT_TRUE(w.isOk());
    ASSERT_TRUE((*w)->write(MetricsRecord{.step = 10, .loss = 0.5, .samples_per_s = 1234.5}).isOk());
    MetricsRecord r{.step = 20, .loss = 0.25, .samples_per_s = 2000, .auc = 0.75};
    r.extra["epoch"] = 1;
    ASSERT_TRUE((*w)->write(r).isOk());
  }
  EXPECT_EQ(data::testing::readFile(path),
            "{\"step\":10,\"loss\":0.5,\"samples_per_s\":1234.5}\n"
            "{\"step\":20,\"loss\":0.25,\"samples_per_s\":2000,\"auc\":0.75,\"epoch\":1}\n");
  {
    auto w = MetricsWriter::open(path, /*append=*/true);
    ASSERT_TRUE((*w)->write(MetricsRecord{.step = 30, .loss = std::nan(""), .samples_per_s = 1}).isOk());
  }
  std::string text = data::testing::readFile(path);
  EXPECT_EQ(text.substr(text.rfind('{')), "{\"step\":30,\"loss\":null,\"samples_per_s\":1}\n");
  EXPECT_FALSE(MetricsWriter::open(dir.file("no/such/m.jsonl")).isOk());
}

}  // namespace
}  // namespace kiln::runtime
