// MoeStatsWindow against numbers worked out by hand: tokens per expert over a window, the
// dropped fraction, and an expert-parallel layer's tokens per EP rank (issue 15).
#include "driver/moe_stats.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln::driver {
namespace {

using Stats = std::vector<std::pair<std::string, std::vector<double>>>;

ir::AttrDict layer(const std::string& name, int64_t experts, int64_t topk, int64_t ep) {
  ir::AttrDict d{{"name", name}, {"experts", experts}, {"topk", topk}, {"tokens_per_sample", int64_t{1}}};
  if (ep > 0) d["ep"] = ep;  // 0: the entry has no ep, as the shard pass leaves ep = 1 layers
  return d;
}

ir::AttrDict train(const std::vector<ir::AttrDict>& layers) {
  ir::AttrArray moe;
  for (const ir::AttrDict& l : layers) moe.push_back(ir::Attribute(l));
  return ir::AttrDict{{"moe", ir::Attribute(std::move(moe))}};
}

const MoeLayerStats& named(const std::vector<MoeLayerStats>& layers, const std::string& name) {
  for (const MoeLayerStats& s : layers)
    if (s.name == name) return s;
  ADD_FAILURE() << "no layer " << name;
  return layers.front();
}

// Two steps of 4 samples, top-2 over 4 experts, EP 2: moe.0's counts [3, 1, 2, 2] then
// [5, 1, 1, 1] are per step [4, 1, 1.5, 1.5]; EP rank 0 owns experts 0 and 1 (5 tokens a
// step), rank 1 experts 2 and 3 (3 tokens): max/mean 5 / 4 = 1.25.
TEST(MoeStats, TokensPerEpRank) {
  MoeStatsWindow w(train({layer("moe.0", 4, 2, 2), layer("moe.1", 4, 2, 0)}));
  w.add({{"moe.0.counts", {3, 1, 2, 2}}, {"moe.0.aux_loss", {0.01}}, {"moe.1.counts", {2, 2, 2, 2}}}, 4);
  w.add({{"moe.0.counts", {5, 1, 1, 1}}, {"moe.0.aux_loss", {0.03}}, {"moe.1.counts", {2, 2, 2, 2}}}, 4);
  const std::vector<MoeLayerStats> layers = w.take();
  ASSERT_EQ(layers.size(), 2u);

  const MoeLayerStats& a = named(layers, "moe.0");
  EXPECT_EQ(a.ep, 2);
  EXPECT_DOUBLE_EQ(a.min, 1.0);
  EXPECT_DOUBLE_EQ(a.max, 4.0);
  EXPECT_DOUBLE_EQ(a.mean, 2.0);
  // Deviations 2, -1, -0.5, -0.5 from the mean 2: variance 5.5 / 4.
  EXPECT_NEAR(a.cv, std::sqrt(5.5 / 4) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(a.dropped, 0.0);  // 8 tokens kept of 4 samples * 2 slots a step
  ASSERT_EQ(a.rank_tokens.size(), 2u);
  EXPECT_DOUBLE_EQ(a.rank_tokens[0], 5.0);
  EXPECT_DOUBLE_EQ(a.rank_tokens[1], 3.0);
  EXPECT_DOUBLE_EQ(a.rankMaxOverMean(), 1.25);
  EXPECT_NEAR(a.losses.at("aux_loss"), 0.02, 1e-12);

  const MoeLayerStats& b = named(layers, "moe.1");
  EXPECT_EQ(b.ep, 1);
  EXPECT_TRUE(b.rank_tokens.empty());
  EXPECT_DOUBLE_EQ(b.rankMaxOverMean(), 1.0);

  EXPECT_EQ(MoeStatsWindow::progressText(layers),
            " | moe cv 0.59 max/mean 2.00 ep max/mean 1.25 drop 0.0% aux 0.0200");

  json::Json extra = json::Json::object();
  MoeStatsWindow::addToMetrics(layers, extra);
  EXPECT_EQ(extra["moe"]["moe.0"]["ep"], 2);
  EXPECT_EQ(extra["moe"]["moe.0"]["rank_tokens"], json::Json::array({5.0, 3.0}));
  EXPECT_FALSE(extra["moe"]["moe.1"].contains("ep"));
  EXPECT_FALSE(extra["moe"]["moe.1"].contains("rank_tokens"));

  // The window restarted: a new step alone.
  w.add({{"moe.0.counts", {0, 0, 4, 4}}}, 4);
  const std::vector<MoeLayerStats> next = w.take();
  ASSERT_EQ(next.size(), 1u);
  EXPECT_DOUBLE_EQ(next[0].rank_tokens[0], 0.0);
  EXPECT_DOUBLE_EQ(next[0].rank_tokens[1], 8.0);
  EXPECT_DOUBLE_EQ(next[0].rankMaxOverMean(), 2.0);
}

// EP 4 over 8 experts: rank j sums experts 2j and 2j+1. Counts 1..8 give ranks 3, 7, 11, 15,
// mean 9; the progress line shows the worse of two EP layers (15/9 = 1.67 against 1.00).
TEST(MoeStats, LeastBalancedEpLayerInProgress) {
  MoeStatsWindow w(train({layer("moe.0", 8, 2, 4), layer("moe.1", 8, 2, 2)}));
  w.add({{"moe.0.counts", {1, 2, 3, 4, 5, 6, 7, 8}}, {"moe.1.counts", {4, 5, 5, 4, 6, 3, 5, 4}}}, 18);
  const std::vector<MoeLayerStats> layers = w.take();
  const MoeLayerStats& a = named(layers, "moe.0");
  ASSERT_EQ(a.rank_tokens.size(), 4u);
  EXPECT_DOUBLE_EQ(a.rank_tokens[0], 3.0);
  EXPECT_DOUBLE_EQ(a.rank_tokens[1], 7.0);
  EXPECT_DOUBLE_EQ(a.rank_tokens[2], 11.0);
  EXPECT_DOUBLE_EQ(a.rank_tokens[3], 15.0);
  EXPECT_NEAR(a.rankMaxOverMean(), 15.0 / 9.0, 1e-12);
  const MoeLayerStats& b = named(layers, "moe.1");
  EXPECT_DOUBLE_EQ(b.rank_tokens[0], 18.0);
  EXPECT_DOUBLE_EQ(b.rank_tokens[1], 18.0);
  // 36 tokens kept of 18 samples * 2 slots: none dropped. moe.0's cv (spread 1..8) is the larger.
  EXPECT_DOUBLE_EQ(a.dropped, 0.0);
  const std::string text = MoeStatsWindow::progressText(layers);
  EXPECT_NE(text.find(" ep max/mean 1.67 "), std::string::npos) << text;
}

// No EP layer: the progress line is unchanged; an ep that does not split the experts (the
// shard pass refuses one) counts as 1.
TEST(MoeStats, NoEpText) {
  MoeStatsWindow w(train({layer("moe.0", 6, 1, 4)}));
  w.add({{"moe.0.counts", {1, 1, 1, 1, 1, 0}}}, 6);
  const std::vector<MoeLayerStats> layers = w.take();
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].ep, 1);
  EXPECT_TRUE(layers[0].rank_tokens.empty());
  // 5 of 6 slots kept.
  EXPECT_NEAR(layers[0].dropped, 1.0 / 6.0, 1e-12);
  EXPECT_EQ(MoeStatsWindow::progressText(layers).find("ep max/mean"), std::string::npos);
}

}  // namespace
}  // namespace kiln::driver
