// Sharding plans: the tables of a module, the pieces of each sharding type (against row and
// column ranges written out by hand), and completePlan's checks.
#include "passes/shard_plan.h"

#include <gtest/gtest.h>

#include "ir/parser.h"
#include "passes/shard.h"

namespace kiln::passes {
namespace {

TableInfo table(std::string name, int64_t rows, int64_t dim) {
  TableInfo t;
  t.name = std::move(name);
  t.rows = rows;
  t.dim = dim;
  return t;
}

TablePlan entry(std::string name, ShardingType type, std::vector<int> ranks) {
  TablePlan t;
  t.table = std::move(name);
  t.type = type;
  t.ranks = std::move(ranks);
  return t;
}

void expectShard(const TableShard& s, int rank, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  EXPECT_EQ(s.rank, rank);
  EXPECT_EQ(s.row_begin, r0);
  EXPECT_EQ(s.row_end, r1);
  EXPECT_EQ(s.col_begin, c0);
  EXPECT_EQ(s.col_end, c1);
}

TEST(ShardPlan, Names) {
  for (auto t : {ShardingType::data_parallel, ShardingType::table_wise, ShardingType::row_wise,
                 ShardingType::column_wise, ShardingType::table_row_wise})
    EXPECT_EQ(parseShardingType(shardingName(t)), t);
  EXPECT_EQ(parseShardingType("rows"), std::nullopt);
  EXPECT_EQ(shardingName(ShardingType::table_row_wise), "table_row_wise");
}

TEST(ShardPlan, LayoutDataParallelAndTableWise) {
  TableInfo info = table("t", 10, 4);
  auto dp = layoutShards(entry("t", ShardingType::data_parallel, {0, 1, 2}), info);
  ASSERT_EQ(dp.size(), 3u);
  for (int r = 0; r < 3; ++r) expectShard(dp[static_cast<size_t>(r)], r, 0, 10, 0, 4);
  auto tw = layoutShards(entry("t", ShardingType::table_wise, {2}), info);
  ASSERT_EQ(tw.size(), 1u);
  expectShard(tw[0], 2, 0, 10, 0, 4);
}

TEST(ShardPlan, LayoutRowWiseUnevenAndEmptyLastBlock) {
  // 10 rows over 3 ranks: blocks of 4, the last holds 2.
  auto a = layoutShards(entry("t", ShardingType::row_wise, {0, 1, 2}), table("t", 10, 4));
  ASSERT_EQ(a.size(), 3u);
  expectShard(a[0], 0, 0, 4, 0, 4);
  expectShard(a[1], 1, 4, 8, 0, 4);
  expectShard(a[2], 2, 8, 10, 0, 4);
  // 9 rows over 4 ranks: blocks of 3, so the fourth is empty.
  auto b = layoutShards(entry("t", ShardingType::row_wise, {0, 1, 2, 3}), table("t", 9, 2));
  ASSERT_EQ(b.size(), 4u);
  expectShard(b[2], 2, 6, 9, 0, 2);
  expectShard(b[3], 3, 9, 9, 0, 2);
  EXPECT_EQ(b[3].rows(), 0);
  // table_row_wise lays out the same way over its node's ranks.
  auto c = layoutShards(entry("t", ShardingType::table_row_wise, {4, 5}), table("t", 5, 8));
  ASSERT_EQ(c.size(), 2u);
  expectShard(c[0], 4, 0, 3, 0, 8);
  expectShard(c[1], 5, 3, 5, 0, 8);
}

TEST(ShardPlan, LayoutColumnWise) {
  auto s = layoutShards(entry("t", ShardingType::column_wise, {1, 3}), table("t", 7, 6));
  ASSERT_EQ(s.size(), 2u);
  expectShard(s[0], 1, 0, 7, 0, 3);
  expectShard(s[1], 3, 0, 7, 3, 6);
}

TEST(ShardPlan, CompletePlanFillsShardsInModuleOrder) {
  std::vector<TableInfo> tables = {table("a", 10, 4), table("b", 8, 4)};
  ShardPlan plan;
  plan.ranks = 2;
  plan.tables = {entry("b", ShardingType::row_wise, {1, 0}), entry("a", ShardingType::data_parallel, {})};
  ASSERT_TRUE(completePlan(plan, tables).isOk());
  ASSERT_EQ(plan.tables.size(), 2u);
  EXPECT_EQ(plan.tables[0].table, "a");
  EXPECT_EQ(plan.tables[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.tables[0].shards.size(), 2u);
  EXPECT_EQ(plan.tables[1].ranks, (std::vector<int>{0, 1}));
  expectShard(plan.tables[1].shards[1], 1, 4, 8, 0, 4);
  EXPECT_EQ(plan.find("b"), &plan.tables[1]);
  EXPECT_EQ(plan.find("c"), nullptr);
}

std::string completeError(std::vector<TablePlan> entries, int ranks = 4, int ranks_per_node = 0) {
  std::vector<TableInfo> tables = {table("a", 10, 6), table("b", 8, 4)};
  ShardPlan plan;
  plan.ranks = ranks;
  plan.ranks_per_node = ranks_per_node;
  plan.tables = std::move(entries);
  Status s = completePlan(plan, tables);
  return s.isOk() ? "ok" : s.message();
}

TEST(ShardPlan, CompletePlanErrors) {
  auto dp = [](std::string n) { return entry(std::move(n), ShardingType::data_parallel, {}); };
  EXPECT_EQ(completeError({dp("a"), dp("b")}), "ok");
  EXPECT_NE(completeError({dp("a"), dp("b"), dp("c")}).find("unknown table 'c'"), std::string::npos);
  EXPECT_NE(completeError({dp("a"), dp("b"), dp("a")}).find("table 'a' is planned twice"), std::string::npos);
  EXPECT_NE(completeError({dp("a")}).find("misses table 'b'"), std::string::npos);
  EXPECT_NE(completeError({dp("a"), entry("b", ShardingType::table_wise, {4})})
                .find("rank 4 is out of range [0, 4)"),
            std::string::npos);
  EXPECT_NE(
      completeError({dp("a"), entry("b", ShardingType::table_wise, {0, 1})}).find("exactly 1 rank, got 2"),
      std::string::npos);
  EXPECT_NE(
      completeError({dp("a"), entry("b", ShardingType::data_parallel, {0, 1})}).find("all 4 ranks, got 2"),
      std::string::npos);
  EXPECT_NE(completeError({dp("a"), entry("b", ShardingType::row_wise, {})}).find("at least 1 rank"),
            std::string::npos);
  EXPECT_NE(
      completeError({dp("a"), entry("b", ShardingType::row_wise, {1, 1})}).find("rank 1 is listed twice"),
      std::string::npos);
  // a's dim 6 does not split over 4 ranks; it does over 3.
  EXPECT_NE(completeError({entry("a", ShardingType::column_wise, {0, 1, 2, 3}), dp("b")})
                .find("does not divide its dim 6"),
            std::string::npos);
  EXPECT_EQ(completeError({entry("a", ShardingType::column_wise, {0, 1, 2}), dp("b")}), "ok");
  // table_row_wise inside one node of 2 ranks.
  EXPECT_EQ(completeError({entry("a", ShardingType::table_row_wise, {2, 3}), dp("b")}, 4, 2), "ok");
  EXPECT_NE(
      completeError({entry("a", ShardingType::table_row_wise, {1, 2}), dp("b")}, 4, 2).find("one node of 2"),
      std::string::npos);
  // A plan file's entry locates its error.
  std::vector<TableInfo> tables = {table("a", 10, 6)};
  ShardPlan plan;
  plan.ranks = 2;
  plan.tables = {entry("a", ShardingType::table_wise, {5})};
  plan.tables[0].loc = Location{"plan.json", 3, 7};
  Status s = completePlan(plan, tables);
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.location().line, 3);
  EXPECT_EQ(s.location().col, 7);
}

TEST(ShardPlan, TablesOfATrainingStep) {
  const char* text = R"(module {
  func.func @train_step() -> () {
    %ids0 = "kiln.input"() {hotness = 3, name = "c.0", role = "sparse"} : () -> !kiln.tensor<Bx3xi64>
    %ids1 = "kiln.input"() {max_hotness = 5, name = "c.1", role = "sparse"} : () -> !kiln.tensor<Bx5xi64>
    %t0 = "kiln.parameter"() {embedding = true, init = "zeros", name = "t.0", trainable = true} : () -> !kiln.tensor<50x4xf32>
    %t0s = "kiln.parameter"() {init = "zeros", name = "t.0.rowwise_adagrad_sum", state_of = "t.0", trainable = false} : () -> !kiln.tensor<50xf32>
    %t1 = "kiln.parameter"() {embedding = true, init = "zeros", name = "t.1", shard = "row_wise", trainable = true} : () -> !kiln.tensor<7x8xbf16>
    %w = "kiln.parameter"() {init = "zeros", name = "w", trainable = true} : () -> !kiln.tensor<4xf32>
    %p0 = "kiln.embedding_bag"(%t0, %ids0) {mode = "sum", table = "t.0"} : (!kiln.tensor<50x4xf32>, !kiln.tensor<Bx3xi64>) -> !kiln.tensor<Bx4xf32>
    %p1 = "kiln.embedding_bag"(%t1, %ids1) {mode = "sum", table = "t.1"} : (!kiln.tensor<7x8xbf16>, !kiln.tensor<Bx5xi64>) -> !kiln.tensor<Bx8xbf16>
    return
  }
}
)";
  auto m = ir::parseModule(text);
  ASSERT_TRUE(m) << m.status().str();
  auto t = tablesOf(**m);
  ASSERT_TRUE(t) << t.status().str();
  ASSERT_EQ(t->size(), 2u);
  const TableInfo& a = (*t)[0];
  EXPECT_EQ(a.name, "t.0");
  EXPECT_EQ(a.rows, 50);
  EXPECT_EQ(a.dim, 4);
  EXPECT_EQ(a.state_bytes_per_row, 4);
  EXPECT_EQ(a.lookups_per_sample, 3);
  EXPECT_EQ(a.bytesPerRow(), 4 * 4 + 4);
  EXPECT_FALSE(a.pinned);
  const TableInfo& b = (*t)[1];
  EXPECT_EQ(b.dtype, ir::DType::bf16);
  EXPECT_EQ(b.state_bytes_per_row, 0);
  EXPECT_EQ(b.lookups_per_sample, 5);
  EXPECT_EQ(b.bytesPerRow(), 16);
  EXPECT_EQ(b.pinned, ShardingType::row_wise);
}

// --sharding column_wise: each table over the most ranks that divide its dim, the blocks taken in
// turn from where the previous table's ended, so that every rank holds columns (issue 35 item
// 13: on 3 ranks every table sat on ranks 0-1 and rank 2 held no embeddings).
TEST(ShardPlan, ColumnWiseEveryTableSpreadsOverAllRanks) {
  ShardOptions o;
  o.ranks = 3;
  o.sharding = "column_wise";
  // dim 4 splits over 2 of the 3 ranks: blocks {0,1}, {2,0}, {1,2}.
  auto plan = planFor({table("a", 10, 4), table("b", 10, 4), table("c", 10, 4)}, o);
  ASSERT_TRUE(plan) << plan.status().message();
  ASSERT_EQ(plan->tables.size(), 3u);
  EXPECT_EQ(plan->tables[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(plan->tables[1].ranks, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan->tables[2].ranks, (std::vector<int>{1, 2}));
  std::vector<int64_t> columns(3);
  for (const TablePlan& t : plan->tables)
    for (const TableShard& s : t.shards) columns[static_cast<size_t>(s.rank)] += s.cols();
  EXPECT_EQ(columns, (std::vector<int64_t>{4, 4, 4}));
  // dim 6 on 4 ranks: 3 ranks each; dim 5 on 4 ranks: 1 rank, the next in turn.
  o.ranks = 4;
  plan = planFor({table("a", 10, 6), table("b", 10, 6), table("c", 10, 5), table("d", 10, 6)}, o);
  ASSERT_TRUE(plan) << plan.status().message();
  EXPECT_EQ(plan->tables[0].ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(plan->tables[1].ranks, (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(plan->tables[2].ranks, (std::vector<int>{2}));
  EXPECT_EQ(plan->tables[3].ranks, (std::vector<int>{0, 1, 3}));
  expectShard(plan->tables[1].shards[0], 0, 0, 10, 0, 2);
  expectShard(plan->tables[1].shards[2], 3, 0, 10, 4, 6);
  // A dim that every rank count divides keeps the whole world.
  plan = planFor({table("a", 10, 8), table("b", 10, 8)}, o);
  ASSERT_TRUE(plan) << plan.status().message();
  for (const TablePlan& t : plan->tables) EXPECT_EQ(t.ranks, (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace kiln::passes
