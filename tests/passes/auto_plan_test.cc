// The greedy plan (which type each table gets, pins, memory) and the predicted costs against
// the formulas of auto_plan.h evaluated by hand.
#include "passes/auto_plan.h"

#include <gtest/gtest.h>

namespace kiln::passes {
namespace {

TableInfo table(std::string name, int64_t rows, int64_t dim, std::optional<ShardingType> pin = std::nullopt) {
  TableInfo t;
  t.name = std::move(name);
  t.rows = rows;
  t.dim = dim;
  t.state_bytes_per_row = 4;
  t.pinned = pin;
  return t;
}

PlanRequest request(int ranks, int64_t memory = 0) {
  PlanRequest r;
  r.ranks = ranks;
  r.memory_per_rank = memory;
  r.global_batch = 4096;
  r.target = h200Target();
  return r;
}

TEST(AutoPlan, SmallReplicatedLargestRowWiseRestTableWise) {
  // 516 bytes per row: 100 rows are small, 1M rows large.
  std::vector<TableInfo> t = {table("small", 100, 128), table("big", 4000000, 128), table("m1", 1000000, 128),
                              table("m2", 900000, 128), table("m3", 800000, 128)};
  auto p = autoPlan(t, request(4));
  ASSERT_TRUE(p) << p.status().str();
  ASSERT_EQ(p->tables.size(), 5u);
  EXPECT_EQ(p->tables[0].type, ShardingType::data_parallel);
  EXPECT_EQ(p->tables[0].ranks, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p->tables[1].type, ShardingType::row_wise);
  EXPECT_NE(p->tables[1].reason.find("largest"), std::string::npos);
  // The three mid-sized tables each go to a different rank.
  std::vector<int> owners;
  for (size_t i = 2; i < 5; ++i) {
    EXPECT_EQ(p->tables[i].type, ShardingType::table_wise) << p->tables[i].table;
    ASSERT_EQ(p->tables[i].ranks.size(), 1u);
    owners.push_back(p->tables[i].ranks[0]);
    EXPECT_FALSE(p->tables[i].reason.empty());
  }
  std::sort(owners.begin(), owners.end());
  EXPECT_EQ(std::adjacent_find(owners.begin(), owners.end()), owners.end());
  for (const auto& e : p->tables) EXPECT_FALSE(e.shards.empty());
}

TEST(AutoPlan, PinsAreHonoured) {
  std::vector<TableInfo> t = {
      table("rw", 10000, 8, ShardingType::row_wise), table("cw", 10000, 6, ShardingType::column_wise),
      table("dp", 100000, 8, ShardingType::data_parallel), table("tw", 10, 8, ShardingType::table_wise),
      table("trw", 10000, 8, ShardingType::table_row_wise)};
  PlanRequest req = request(4);
  req.ranks_per_node = 2;
  auto p = autoPlan(t, req);
  ASSERT_TRUE(p) << p.status().str();
  EXPECT_EQ(p->tables[0].type, ShardingType::row_wise);
  EXPECT_EQ(p->tables[0].ranks.size(), 4u);
  // dim 6 over 4 ranks does not divide: the largest k that does is 3.
  EXPECT_EQ(p->tables[1].type, ShardingType::column_wise);
  EXPECT_EQ(p->tables[1].ranks.size(), 3u);
  EXPECT_EQ(p->tables[2].type, ShardingType::data_parallel);
  EXPECT_EQ(p->tables[3].type, ShardingType::table_wise);
  EXPECT_EQ(p->tables[4].type, ShardingType::table_row_wise);
  ASSERT_EQ(p->tables[4].ranks.size(), 2u);
  EXPECT_EQ(p->tables[4].ranks[0] / 2, p->tables[4].ranks[1] / 2);
}

TEST(AutoPlan, MemoryShortfallNamesTableAndBytes) {
  // 300000 rows of 20 bytes = 6 MB (not small); row_wise over 2 ranks: 3 MB each.
  std::vector<TableInfo> t = {table("t", 300000, 4)};
  PlanRequest req = request(2, 2999000);
  req.global_batch = 64;
  auto p = autoPlan(t, req);
  ASSERT_FALSE(p);
  EXPECT_NE(p.status().message().find("table 't' does not fit"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("short by 1000 bytes"), std::string::npos) << p.status().message();
  // With 3 MB a rank it fits exactly.
  req.memory_per_rank = 3000000;
  EXPECT_TRUE(autoPlan(t, req));
}

TEST(AutoPlan, TableThatFitsNoRankAloneGoesRowWise) {
  // 412.8 MB and twice 103.2 MB at 170 MB a rank: the largest row-wise takes 103.2 MB of every
  // rank, so neither smaller table fits one rank whole, and both split (25.8 MB a rank each).
  std::vector<TableInfo> t = {table("a", 800000, 128), table("b", 200000, 128), table("c", 200000, 128)};
  auto p = autoPlan(t, request(4, 170000000));
  ASSERT_TRUE(p) << p.status().str();
  EXPECT_EQ(p->tables[0].type, ShardingType::row_wise);
  EXPECT_EQ(p->tables[1].type, ShardingType::row_wise);
  EXPECT_NE(p->tables[1].reason.find("fits no single rank"), std::string::npos);
  EXPECT_EQ(p->tables[2].type, ShardingType::row_wise);
}

TEST(PlanCosts, FormulasByHand) {
  // N = 2, b = 2048, h = 1, d = 4, e = 4.
  std::vector<TableInfo> t = {table("a", 100, 4), table("b", 100, 4)};
  ShardPlan plan;
  plan.ranks = 2;
  TablePlan dp;
  dp.table = "a";
  dp.type = ShardingType::data_parallel;
  TablePlan tw;
  tw.table = "b";
  tw.type = ShardingType::table_wise;
  tw.ranks = {1};
  plan.tables = {dp, tw};
  ASSERT_TRUE(completePlan(plan, t).isOk());
  PlanRequest req = request(2);
  PlanCosts c = planCosts(plan, t, req);
  ASSERT_EQ(c.tables.size(), 2u);
  const double b = 2048;
  // data_parallel: each of 2 ranks (N-1) b (8h + 8 + d e) = 2048 * 32.
  EXPECT_DOUBLE_EQ(c.tables[0].comm_bytes_per_step, 2 * b * 32);
  EXPECT_EQ(c.tables[0].bytes_per_rank, 100 * 20);
  EXPECT_DOUBLE_EQ(c.tables[0].lookups_per_step, 4096);
  // table_wise: the other rank b (16 + 2 * 16), the owner (N-1) times that.
  EXPECT_DOUBLE_EQ(c.tables[1].comm_bytes_per_step, 2 * b * 48);
  ASSERT_EQ(c.ranks.size(), 2u);
  EXPECT_EQ(c.ranks[0].memory_bytes, 2000);
  EXPECT_EQ(c.ranks[1].memory_bytes, 4000);
  // Rank 0's lookups: data_parallel reads b rows of 16 bytes and updates 4096 (2*16 + 2*4 bytes).
  const double lookup0 = (b * 16 + 4096 * 40) / req.target.bytes_per_s;
  EXPECT_NEAR(c.ranks[0].lookup_s, lookup0, 1e-15);
  const double comm0 = b * 32 / req.target.intra_node.bytes_per_s + 2 * req.target.intra_node.latency_s +
                       b * 48 / req.target.intra_node.bytes_per_s + 4 * req.target.intra_node.latency_s;
  EXPECT_NEAR(c.ranks[0].comm_s, comm0, 1e-15);
  EXPECT_NEAR(c.ranks[0].step_s, lookup0 + comm0, 1e-15);
}

}  // namespace
}  // namespace kiln::passes
