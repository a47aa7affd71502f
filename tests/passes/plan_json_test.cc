// plan.json: a round trip, and every bad plan's located error (line and column written out by
// hand for each file text).
#include "passes/plan_json.h"

#include <gtest/gtest.h>

#include "passes/auto_plan.h"

namespace kiln::passes {
namespace {

std::vector<TableInfo> twoTables() {
  TableInfo a;
  a.name = "tables.0";
  a.rows = 10;
  a.dim = 6;
  TableInfo b = a;
  b.name = "tables.1";
  b.dim = 4;
  return {a, b};
}

// The error's "file:line:col: message" of loading `text` against twoTables() on 4 ranks.
std::string loadError(const std::string& text, int ranks = 4) {
  auto p = loadPlanJson(text, "plan.json", twoTables(), ranks);
  if (p) return "ok";
  const Status& s = p.status();
  return fmt::format("{}:{}:{}: {}", s.location().file, s.location().line, s.location().col, s.message());
}

std::string withTables(const std::string& entries) {
  return "{\"format\": \"kiln-plan-1\", \"ranks\": 4,\n \"tables\": [\n" + entries + "\n]}\n";
}

const char* kDp0 = R"(  {"table": "tables.0", "sharding": "data_parallel"})";
const char* kRw1 = R"(  {"table": "tables.1", "sharding": "row_wise", "ranks": [0, 1, 2, 3]})";

TEST(PlanJson, RoundTrip) {
  ShardPlan plan;
  plan.ranks = 4;
  plan.ranks_per_node = 2;
  TablePlan a;
  a.table = "tables.0";
  a.type = ShardingType::column_wise;
  a.ranks = {0, 2, 3};
  a.reason = "a \"quoted\" reason";
  TablePlan b;
  b.table = "tables.1";
  b.type = ShardingType::table_row_wise;
  b.ranks = {2, 3};
  plan.tables = {a, b};
  PlanCosts costs;
  costs.tables = {{100, 5, 7}, {200, 6, 8}};
  costs.ranks.resize(4);
  std::string text = writePlanJson(plan, &costs);
  EXPECT_NE(text.find("\"format\": \"kiln-plan-1\""), std::string::npos);
  EXPECT_NE(text.find("\"bytes_per_rank\": 100"), std::string::npos);
  auto back = loadPlanJson(text, "plan.json", twoTables(), 4);
  ASSERT_TRUE(back) << back.status().str();
  EXPECT_EQ(back->ranks_per_node, 2);
  ASSERT_EQ(back->tables.size(), 2u);
  EXPECT_EQ(back->tables[0].type, ShardingType::column_wise);
  EXPECT_EQ(back->tables[0].ranks, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(back->tables[0].shards.size(), 3u);
  EXPECT_EQ(back->tables[1].type, ShardingType::table_row_wise);
  EXPECT_EQ(back->tables[1].ranks, (std::vector<int>{2, 3}));
}

TEST(PlanJson, LocatedErrors) {
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" + kRw1)), "ok");
  // Line 3 holds the first entry, line 4 the second; entries start at column 3.
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" + kRw1 + ",\n" +
                                 R"(  {"table": "tables.9", "sharding": "table_wise", "ranks": [0]})")),
            "plan.json:5:3: unknown table 'tables.9' (the model's tables: tables.0, tables.1)");
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" + kRw1 + ",\n" + kDp0)),
            "plan.json:5:3: table 'tables.0' is planned twice (first at plan.json:3:3)");
  EXPECT_EQ(loadError(withTables(kDp0)), "plan.json:2:12: the plan misses table 'tables.1'");
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" +
                                 R"(  {"table": "tables.1", "sharding": "table_wise", "ranks": [4]})")),
            "plan.json:4:61: table 'tables.1': rank 4 is out of range [0, 4)");
  EXPECT_EQ(
      loadError(withTables(std::string(kDp0) + ",\n" +
                           R"(  {"table": "tables.1", "sharding": "rows", "ranks": [1]})")),
      "plan.json:4:37: table 'tables.1': unknown sharding 'rows' (use data_parallel, table_wise, row_wise, "
      "column_wise, table_row_wise)");
  EXPECT_EQ(loadError(withTables(
                std::string(R"(  {"table": "tables.0", "sharding": "column_wise", "ranks": [0, 1, 2, 3]})") +
                ",\n" + kRw1)),
            "plan.json:3:3: table 'tables.0': column_wise over 4 ranks does not divide its dim 6");
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" +
                                 R"(  {"table": "tables.1", "sharding": "table_wise", "ranks": [1, 2]})")),
            "plan.json:4:3: table 'tables.1': table_wise needs exactly 1 rank, got 2");
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" + kRw1), 8),
            "plan.json:1:36: the plan is for 4 ranks but the run has 8 (--ranks)");
  EXPECT_EQ(loadError("{\"format\": \"kiln-plan-1\",\n  \"ranks\": 4 \"tables\": []}"),
            "plan.json:2:14: malformed JSON: expected ',' or '}'");
  EXPECT_EQ(loadError("{\"format\": \"kiln-plan-2\", \"ranks\": 4, \"tables\": []}"),
            "plan.json:1:12: unknown plan format (expected \"kiln-plan-1\")");
  EXPECT_EQ(loadError(withTables(std::string(kDp0) + ",\n" +
                                 R"(  {"table": "tables.1", "sharding": "row_wise", "ranks": [0, "1"]})")),
            "plan.json:4:62: a rank must be an integer, got a string");
}

}  // namespace
}  // namespace kiln::passes
