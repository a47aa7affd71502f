// Frequency curves (against hand counts and against the analytic shares of a power law) and the
// hybrid what-if: the hot rows' cost terms against the formulas of auto_plan.h by hand, and the
// choice of hot rows within memory.
#include "passes/id_frequency.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace kiln::passes {
namespace {

IdSample sampleOf(const std::vector<std::vector<int64_t>>& samples) {
  IdSample s;
  for (const auto& ids : samples) s.addSample(ids.data(), static_cast<int64_t>(ids.size()));
  return s;
}

TEST(FrequencyCurve, RanksOnTheFirstHalfMeasuresOnTheSecond) {
  // Ranking half: row 7 twice, rows 1 and 2 once (ties by row). Measuring half: 7, 7, 1 and a row
  // the ranking half never saw.
  const IdSample s = sampleOf({{7}, {7}, {1}, {2}, {7}, {7}, {1}, {9}});
  const FrequencyCurve c = frequencyCurve(s, 100);
  EXPECT_EQ(c.hot_order, (std::vector<int64_t>{7, 1, 2}));
  EXPECT_EQ(c.hot_counts, (std::vector<int64_t>{2, 1, 1}));
  EXPECT_EQ(c.samples, 4);
  EXPECT_EQ(c.ids, 4);
  EXPECT_EQ(c.distinct, 4);
  EXPECT_DOUBLE_EQ(c.idShare(0), 0);
  EXPECT_DOUBLE_EQ(c.idShare(1), 0.5);
  EXPECT_DOUBLE_EQ(c.idShare(2), 0.75);
  // Row 9 is in no hot set the ranking half can name, however large.
  EXPECT_DOUBLE_EQ(c.idShare(3), 0.75);
  EXPECT_DOUBLE_EQ(c.idShare(1000), 0.75);
  EXPECT_DOUBLE_EQ(c.sampleShare(1), 0.5);
}

TEST(FrequencyCurve, ASampleIsHotOnlyWhenAllItsIdsAre) {
  // Ranking: 3 (3 times), 4 (2), 5 (1). Measuring: {3, 4} hot from 2 rows up, {3, 5} from 3, {3}
  // from 1, {} always (no ids, no pool to fetch).
  const IdSample s = sampleOf({{3, 4}, {3, 4, 5}, {3}, {}, {3, 4}, {3, 5}, {3}, {}});
  const FrequencyCurve c = frequencyCurve(s, 10);
  EXPECT_EQ(c.hot_order, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_DOUBLE_EQ(c.sampleShare(1), 0.5);   // {3} and {}
  EXPECT_DOUBLE_EQ(c.sampleShare(2), 0.75);  // and {3, 4}
  EXPECT_DOUBLE_EQ(c.sampleShare(3), 1.0);
  EXPECT_DOUBLE_EQ(c.idShare(1), 3.0 / 5);
  EXPECT_DOUBLE_EQ(c.idShare(2), 4.0 / 5);
}

TEST(FrequencyCurve, PowerLawSharesMatchTheAnalyticOnes) {
  // Row r drawn with probability (r + 1)^-1 / H(R): the top h rows hold H(h) / H(R) of the ids.
  const int64_t rows = 1000;
  std::vector<double> weights;
  for (int64_t r = 0; r < rows; ++r) weights.push_back(1.0 / static_cast<double>(r + 1));
  std::discrete_distribution<int64_t> draw(weights.begin(), weights.end());
  std::mt19937_64 rng(7);
  IdSample s;
  for (int i = 0; i < 400000; ++i) {
    const int64_t id = draw(rng);
    s.addSample(&id, 1);
  }
  const FrequencyCurve c = frequencyCurve(s, rows);
  auto harmonic = [](int64_t n) {
    double h = 0;
    for (int64_t k = 1; k <= n; ++k) h += 1.0 / static_cast<double>(k);
    return h;
  };
  for (int64_t h : {1, 10, 100}) {
    EXPECT_NEAR(c.idShare(h), harmonic(h) / harmonic(rows), 0.01) << h << " hot rows";
    EXPECT_DOUBLE_EQ(c.sampleShare(h), c.idShare(h)) << "one id per sample";
  }
}

PlanRequest flatRequest(int ranks, int64_t batch) {
  PlanRequest r;
  r.ranks = ranks;
  r.global_batch = batch;
  r.costs.target = "flat";
  r.costs.device_bytes_per_s = 1e12;
  r.costs.host_bytes_per_s = 1e11;
  r.costs.intra_node = {1e9, 1e-5};
  r.costs.inter_node = {1e9, 1e-5};
  r.costs.lookup_efficiency.x = {64};
  r.costs.lookup_efficiency.y = {1};
  r.costs.lookup_efficiency.z = {{0.5}};
  r.costs.a2a_efficiency.x = {1024};
  r.costs.a2a_efficiency.y = {1};
  return r;
}

ShardPlan tableWisePlan(const TableInfo& t, int ranks) {
  ShardPlan plan;
  plan.ranks = ranks;
  TablePlan tp;
  tp.table = t.name;
  tp.type = ShardingType::table_wise;
  tp.ranks = {0};
  plan.tables.push_back(tp);
  EXPECT_TRUE(completePlan(plan, {t}).isOk());
  return plan;
}

TableInfo table(int64_t rows, int64_t dim) {
  TableInfo t;
  t.name = "t";
  t.rows = rows;
  t.dim = dim;
  t.state_bytes_per_row = 4;
  return t;
}

TEST(HybridCost, AllHotLeavesOnlyLengthsAndTheHotGradients) {
  // 2 ranks, b = 512 samples each, one id each, dim 8 f32 (32 bytes), 4 hot rows holding every id
  // and sample. Table-wise traffic left: each rank's lengths, 8 b (no sample has a cold id, so no
  // pool travels). The hot gradients: a dense all-reduce moves 2 (n-1)/n * 4 * 32 = 128 bytes a
  // rank.
  TableInfo t = table(1000, 8);
  ShardPlan plan = tableWisePlan(t, 2);
  plan.tables[0].hot = {4, 1.0, 1.0};
  const PlanCosts c = planCosts(plan, {t}, flatRequest(2, 1024));
  EXPECT_DOUBLE_EQ(c.tables[0].comm_bytes_per_step, 2 * 8 * 512.0 + 2 * 128.0);
  // Under lazy adam the hot ids and pooled gradients are gathered instead, as a data_parallel
  // table's: (n-1) b (8 h + 8 + d e) = 512 * 48 a rank.
  t.hot_dense_update = false;
  EXPECT_DOUBLE_EQ(planCosts(plan, {t}, flatRequest(2, 1024)).tables[0].comm_bytes_per_step,
                   2 * 8 * 512.0 + 2 * 48 * 512.0);
  // The replica on every rank: 4 rows of 32 weight bytes and 4 state bytes; the owner also holds
  // the whole table.
  EXPECT_EQ(c.ranks[1].memory_bytes, 4 * 36);
  EXPECT_EQ(c.ranks[0].memory_bytes, 1000 * 36 + 4 * 36);
}

TEST(HybridCost, NoHotShareCostsTheReplicaAndItsExchange) {
  const TableInfo t = table(1000, 8);
  ShardPlan plan = tableWisePlan(t, 2);
  const double plain = planCosts(plan, {t}, flatRequest(2, 1024)).tables[0].comm_bytes_per_step;
  // Table-wise by hand: each side moves b (8 h + 8 + 2 d e) = 512 * 80.
  EXPECT_DOUBLE_EQ(plain, 2 * 512 * 80.0);
  plan.tables[0].hot = {4, 0, 0};
  EXPECT_DOUBLE_EQ(planCosts(plan, {t}, flatRequest(2, 1024)).tables[0].comm_bytes_per_step, plain + 2 * 128.0);
}

TEST(HybridEstimate, ReplicatesTheHotRowsWhenTheyCarryTheTraffic) {
  // 95% of the ids on 4 rows of a 100000-row table, the rest spread thin.
  std::mt19937_64 rng(3);
  IdSample s;
  for (int i = 0; i < 20000; ++i) {
    const int64_t id = rng() % 100 < 95 ? static_cast<int64_t>(rng() % 4) : 4 + static_cast<int64_t>(rng() % 99996);
    s.addSample(&id, 1);
  }
  TableInfo t = table(100000, 64);
  const ShardPlan plan = tableWisePlan(t, 4);
  PlanRequest req = flatRequest(4, 65536);
  const auto est = estimateHybrid(plan, {t}, {frequencyCurve(s, t.rows)}, req);
  ASSERT_EQ(est.size(), 1u);
  EXPECT_GE(est[0].hot.rows, 4);
  EXPECT_GT(est[0].hot.id_share, 0.9);
  EXPECT_LT(est[0].hybrid_bytes, 0.2 * est[0].plain_bytes);
  // The rows written to the plan: the hottest, ascending.
  ASSERT_EQ(static_cast<int64_t>(est[0].hot.ids.size()), est[0].hot.rows);
  EXPECT_TRUE(std::is_sorted(est[0].hot.ids.begin(), est[0].hot.ids.end()));
  EXPECT_EQ(std::vector<int64_t>(est[0].hot.ids.begin(), est[0].hot.ids.begin() + 4),
            (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(est[0].replica_bytes, est[0].hot.rows * t.bytesPerRow());
  EXPECT_LT(planCosts(withHotRows(plan, est), {t}, req).step_s(), planCosts(plan, {t}, req).step_s());
  // Every count considered is listed, 0 and then the powers of two, and none that fits beats the
  // chosen one's step.
  ASSERT_GE(est[0].candidates.size(), 4u);
  bool listed = false;
  const double chosen_step = planCosts(withHotRows(plan, est), {t}, req).step_s();
  for (size_t k = 0; k < est[0].candidates.size(); ++k) {
    const HotCandidate& c = est[0].candidates[k];
    EXPECT_EQ(c.hot.rows, k == 0 ? 0 : int64_t{1} << (k - 1));
    listed |= c.hot.rows == est[0].hot.rows;
    if (c.fits) {
      EXPECT_GE(c.step_s, chosen_step * (1 - 1e-3));
    }
  }
  EXPECT_TRUE(listed);

  // Without the memory for a replica beside the whole table, nothing is replicated.
  req.memory_per_rank = t.rows * t.bytesPerRow();
  const auto tight = estimateHybrid(plan, {t}, {frequencyCurve(s, t.rows)}, req);
  EXPECT_EQ(tight[0].hot.rows, 0);
  ASSERT_EQ(tight[0].candidates.size(), 2u);  // none, and one row that does not fit: the end
  EXPECT_FALSE(tight[0].candidates[1].fits);
  EXPECT_DOUBLE_EQ(tight[0].hybrid_bytes, tight[0].plain_bytes);
}

TEST(HybridEstimate, UniformIdsAndReplicatedTablesGetNone) {
  std::mt19937_64 rng(5);
  IdSample s;
  for (int i = 0; i < 20000; ++i) {
    const int64_t id = static_cast<int64_t>(rng() % 100000);
    s.addSample(&id, 1);
  }
  TableInfo t = table(100000, 64);
  const auto est = estimateHybrid(tableWisePlan(t, 4), {t}, {frequencyCurve(s, t.rows)}, flatRequest(4, 65536));
  EXPECT_EQ(est[0].hot.rows, 0);

  ShardPlan dp = tableWisePlan(t, 4);
  dp.tables[0].type = ShardingType::data_parallel;
  dp.tables[0].ranks = {0, 1, 2, 3};
  ASSERT_TRUE(completePlan(dp, {t}).isOk());
  EXPECT_EQ(estimateHybrid(dp, {t}, {frequencyCurve(s, t.rows)}, flatRequest(4, 65536))[0].hot.rows, 0);
}

TEST(FrequencyCurve, UniqueShareCountsRepeatsWithinARanksBatch) {
  // Ranking half: 5 three times, 6 once. Measuring half, in batches of 2 samples: {7, 7} and
  // {7, 8}: 3 distinct of 4 ids; over the whole half as one batch {7, 8}: 2 of 4.
  const IdSample s = sampleOf({{5}, {5}, {5}, {6}, {7}, {7}, {7}, {8}});
  EXPECT_DOUBLE_EQ(frequencyCurve(s, 10, 2).uniqueShare(0), 0.75);
  EXPECT_DOUBLE_EQ(frequencyCurve(s, 10, 0).uniqueShare(0), 0.5);
  EXPECT_DOUBLE_EQ(frequencyCurve(s, 10, 1).uniqueShare(0), 1.0);
  // Hot rows leave the cold ids' share alone when none of them is hot ...
  EXPECT_DOUBLE_EQ(frequencyCurve(s, 10, 2).uniqueShare(2), 0.75);
  // ... and take their ids out of both counts when they are: 5 hot leaves {6} cold, {6, 6, 9}.
  const IdSample t = sampleOf({{5}, {5}, {6}, {9}, {5}, {6}, {6}, {9}});
  EXPECT_DOUBLE_EQ(frequencyCurve(t, 10, 0).uniqueShare(0), 3.0 / 4);  // 5, 6, 9 of 4 ids
  EXPECT_DOUBLE_EQ(frequencyCurve(t, 10, 0).uniqueShare(1), 2.0 / 3);  // 6, 9 of 3 cold ids
}

// De-duplicated routing by hand: a rank moves b u h (8 + 2 d e); the owner of a table_wise
// table receives the other ranks' share: (N - 1) times that.
TEST(DedupCost, MovesEachRanksDistinctIdsAndTheirRows) {
  const TableInfo t = table(1000, 8);
  ShardPlan plan = tableWisePlan(t, 2);
  plan.tables[0].dedup = true;
  plan.tables[0].unique_share = 0.25;
  // 2 ranks of b = 512, one id a sample, dim 8 f32: 512 * 0.25 * (8 + 64) a rank.
  EXPECT_DOUBLE_EQ(planCosts(plan, {t}, flatRequest(2, 1024)).tables[0].comm_bytes_per_step, 2 * 128 * 72.0);
  // All distinct: more than the plain route (512 * 80 a rank) only by what the lengths saved.
  plan.tables[0].unique_share = 1;
  EXPECT_DOUBLE_EQ(planCosts(plan, {t}, flatRequest(2, 1024)).tables[0].comm_bytes_per_step, 2 * 512 * 72.0);
}

TEST(ChooseDedup, RepeatedIdsAreDeduplicatedSpreadOnesAreNot) {
  // One id a sample from 50 rows: a rank's batch of 32768 repeats each many times. Four ids a
  // sample from 10^8 rows: hardly a repeat, and four rows would come back for each pool.
  std::mt19937_64 rng(9);
  IdSample few, spread;
  for (int i = 0; i < 20000; ++i) {
    const auto a = static_cast<int64_t>(rng() % 50);
    few.addSample(&a, 1);
    int64_t b[4];
    for (int64_t& id : b) id = static_cast<int64_t>(rng() % 100000000);
    spread.addSample(b, 4);
  }
  TableInfo t = table(100000000, 64);
  const PlanRequest req = flatRequest(2, 65536);
  ShardPlan plan = tableWisePlan(t, 2);
  const std::vector<DedupChoice> choices = chooseDedup(plan, {t}, {frequencyCurve(few, t.rows, 32768)}, req);
  EXPECT_TRUE(plan.tables[0].dedup);
  ASSERT_EQ(choices.size(), 1u);
  EXPECT_TRUE(choices[0].considered && choices[0].chosen);
  EXPECT_LT(choices[0].dedup_step_s, choices[0].plain_step_s);
  EXPECT_LT(choices[0].dedup_bytes, choices[0].plain_bytes);
  EXPECT_NEAR(plan.tables[0].unique_share, 50.0 / 10000, 1e-9);  // 50 distinct of the measured 10000
  t.lookups_per_sample = 4;
  chooseDedup(plan, {t}, {frequencyCurve(spread, t.rows, 32768)}, req);
  EXPECT_FALSE(plan.tables[0].dedup);
  EXPECT_DOUBLE_EQ(plan.tables[0].unique_share, 1);
  // A table without a sample keeps the plain route.
  plan.tables[0].dedup = true;
  EXPECT_FALSE(chooseDedup(plan, {t}, {FrequencyCurve{}}, req)[0].considered);
  EXPECT_FALSE(plan.tables[0].dedup);
}

}  // namespace
}  // namespace kiln::passes
