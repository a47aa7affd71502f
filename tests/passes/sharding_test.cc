// The registry of sharding types (passes/sharding/sharding_types.def) and each kind's layout,
// checks and choices, against expectations written out independently: every cell of a small
// table mapped to the ranks that hold it, the ranks' counts of TorchRec's rules.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

TableInfo table(int64_t rows, int64_t dim) {
  TableInfo t;
  t.name = "t";
  t.rows = rows;
  t.dim = dim;
  return t;
}

TablePlan entry(ShardingType type, std::vector<int> ranks) {
  TablePlan t;
  t.table = "t";
  t.type = type;
  t.ranks = std::move(ranks);
  return t;
}

// Which ranks hold each (row, column) cell of the pieces.
using Cells = std::map<std::pair<int64_t, int64_t>, std::multiset<int>>;
Cells cellsOf(const std::vector<TableShard>& shards) {
  Cells out;
  for (const TableShard& s : shards)
    for (int64_t r = s.row_begin; r < s.row_end; ++r)
      for (int64_t c = s.col_begin; c < s.col_end; ++c) out[{r, c}].insert(s.rank);
  return out;
}

// Every cell of a rows x dim table held by `owner(row, col)`.
template <typename Owner>
Cells expectedCells(int64_t rows, int64_t dim, Owner owner) {
  Cells out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < dim; ++c) out[{r, c}] = owner(r, c);
  return out;
}

TEST(ShardingRegistry, EveryKindRoundTripsItsName) {
  const std::vector<std::string> documented = {"data_parallel", "table_wise", "row_wise", "column_wise",
                                               "table_row_wise"};
  ASSERT_EQ(shardingTypes().size(), documented.size());
  std::string joined;
  for (size_t i = 0; i < documented.size(); ++i) {
    const ShardingType t = shardingTypes()[i];
    const ShardingKind& kind = shardingKind(t);
    EXPECT_EQ(kind.type(), t);
    EXPECT_EQ(kind.name(), documented[i]);
    EXPECT_EQ(shardingName(t), documented[i]);
    EXPECT_EQ(parseShardingType(documented[i]), t);
    EXPECT_EQ(&shardingKind(*parseShardingType(kind.name())), &kind);
    joined += (i ? ", " : "") + documented[i];
  }
  EXPECT_EQ(shardingNames(), joined);
  EXPECT_EQ(parseShardingType("rows"), std::nullopt);
  EXPECT_EQ(parseShardingType(""), std::nullopt);
}

TEST(ShardingRegistry, Properties) {
  // What generic code asks instead of comparing types.
  struct Expect {
    ShardingType type;
    bool replicated, row_blocks;
    PoolReturn back;  // over 2 of 4 ranks
  };
  for (const Expect& e : {Expect{ShardingType::data_parallel, true, false, PoolReturn::local},
                          Expect{ShardingType::table_wise, false, true, PoolReturn::partial_sums},
                          Expect{ShardingType::row_wise, false, true, PoolReturn::partial_sums},
                          Expect{ShardingType::column_wise, false, false, PoolReturn::column_pieces},
                          Expect{ShardingType::table_row_wise, false, true, PoolReturn::partial_sums}}) {
    const ShardingKind& kind = shardingKind(e.type);
    SCOPED_TRACE(std::string(kind.name()));
    EXPECT_EQ(kind.replicated(), e.replicated);
    EXPECT_EQ(kind.rowBlocks(), e.row_blocks);
    EXPECT_EQ(hasRowBlocks(e.type), e.row_blocks);
    EXPECT_EQ(kind.poolReturn(entry(e.type, {0, 1}), 4), e.back);
  }
  // Row blocks over every rank reduce-scatter their partial pools, unless a hybrid table's or a
  // de-duplicated one's pools travel only for some samples.
  const ShardingKind& rw = shardingKind(ShardingType::row_wise);
  TablePlan all = entry(ShardingType::row_wise, {0, 1, 2, 3});
  EXPECT_EQ(rw.poolReturn(all, 4), PoolReturn::reduce_scatter);
  TablePlan hybrid = all;
  hybrid.hot.ids = {3};
  EXPECT_EQ(rw.poolReturn(hybrid, 4), PoolReturn::partial_sums);
  TablePlan dedup = all;
  dedup.dedup = true;
  EXPECT_EQ(rw.poolReturn(dedup, 4), PoolReturn::partial_sums);
  // table_row_wise over one node of all ranks still sums the partials itself.
  EXPECT_EQ(
      shardingKind(ShardingType::table_row_wise).poolReturn(entry(ShardingType::table_row_wise, {0, 1}), 2),
      PoolReturn::partial_sums);
}

TEST(ShardingRegistry, EachKindLaysOutASmallTable) {
  // 10 rows, dim 6.
  const TableInfo info = table(10, 6);
  auto layout = [&](ShardingType type, std::vector<int> ranks) {
    TablePlan t = entry(type, std::move(ranks));
    EXPECT_TRUE(checkTablePlan(t, info, 6, 0)) << shardingName(type);
    return cellsOf(layoutShards(t, info));
  };
  // Every rank every cell.
  EXPECT_EQ(layout(ShardingType::data_parallel, {}),
            expectedCells(10, 6, [](int64_t, int64_t) { return std::multiset<int>{0, 1, 2, 3, 4, 5}; }));
  // One rank every cell.
  EXPECT_EQ(layout(ShardingType::table_wise, {4}),
            expectedCells(10, 6, [](int64_t, int64_t) { return std::multiset<int>{4}; }));
  // ceil(10 / 3) = 4 rows a block: rows 0-3 on rank 1, 4-7 on rank 3, 8-9 on rank 5.
  auto rows_1_3_5 = [](int64_t row, int64_t) { return std::multiset<int>{row < 4 ? 1 : row < 8 ? 3 : 5}; };
  EXPECT_EQ(layout(ShardingType::row_wise, {5, 1, 3}), expectedCells(10, 6, rows_1_3_5));
  EXPECT_EQ(layout(ShardingType::table_row_wise, {1, 3, 5}), expectedCells(10, 6, rows_1_3_5));
  // 6 / 3 = 2 columns a piece: columns 0-1 on rank 0, 2-3 on rank 2, 4-5 on rank 4.
  EXPECT_EQ(layout(ShardingType::column_wise, {4, 0, 2}), expectedCells(10, 6, [](int64_t, int64_t col) {
              return std::multiset<int>{static_cast<int>(col / 2) * 2};
            }));
}

TEST(ShardingRegistry, EachKindChecksItsRanks) {
  const TableInfo info = table(10, 6);
  auto check = [&](ShardingType type, std::vector<int> ranks, int nranks = 4, int per_node = 0) {
    TablePlan t = entry(type, std::move(ranks));
    Status s = checkTablePlan(t, info, nranks, per_node);
    return s ? std::string("ok") : s.message();
  };
  EXPECT_EQ(check(ShardingType::data_parallel, {0, 1}),
            "table 't': data_parallel runs on all 4 ranks, got 2");
  EXPECT_EQ(check(ShardingType::table_wise, {0, 1}), "table 't': table_wise needs exactly 1 rank, got 2");
  EXPECT_EQ(check(ShardingType::row_wise, {}), "table 't': row_wise needs at least 1 rank");
  EXPECT_EQ(check(ShardingType::column_wise, {0, 1, 2, 3}),
            "table 't': column_wise over 4 ranks does not divide its dim 6");
  EXPECT_EQ(check(ShardingType::table_row_wise, {1, 2}, 4, 2),
            "table 't': table_row_wise ranks must lie in one node of 2 ranks; rank 1 is on node 0, rank 2 on "
            "node 1");
  EXPECT_EQ(check(ShardingType::table_row_wise, {2, 3}, 4, 2), "ok");
}

TEST(ShardingRegistry, UniformPlacementOfSharding) {
  // `--sharding TYPE` over 3 tables of dim 4 on 3 ranks (docs/distributed.md, "Plans").
  auto placed = [](ShardingType type, int ranks, int per_node) {
    std::vector<std::vector<int>> out;
    UniformPlacement at;
    at.ranks = ranks;
    at.ranks_per_node = per_node;
    for (size_t i = 0; i < 3; ++i) {
      at.index = i;
      out.push_back(shardingKind(type).uniformRanks(table(100, 4), at));
    }
    return out;
  };
  using V = std::vector<std::vector<int>>;
  EXPECT_EQ(placed(ShardingType::table_wise, 3, 3), (V{{0}, {1}, {2}}));
  EXPECT_EQ(placed(ShardingType::row_wise, 3, 3), (V{{0, 1, 2}, {0, 1, 2}, {0, 1, 2}}));
  EXPECT_EQ(placed(ShardingType::data_parallel, 3, 3), (V{{0, 1, 2}, {0, 1, 2}, {0, 1, 2}}));
  // Ranks 0-1, then 2 and 0, then 1-2.
  EXPECT_EQ(placed(ShardingType::column_wise, 3, 3), (V{{0, 1}, {2, 0}, {1, 2}}));
  // The nodes of 2 in turn.
  EXPECT_EQ(placed(ShardingType::table_row_wise, 4, 2), (V{{0, 1}, {2, 3}, {0, 1}}));
}

TEST(ShardingRegistry, CandidatePlacements) {
  using V = std::vector<std::vector<int>>;
  auto offered = [](ShardingType type, int64_t dim, bool pinned, int ranks, int per_node) {
    return shardingKind(type).candidateRanks(table(100, dim), pinned, ranks, per_node);
  };
  EXPECT_EQ(offered(ShardingType::data_parallel, 8, false, 4, 0), (V{{0, 1, 2, 3}}));
  EXPECT_EQ(offered(ShardingType::table_wise, 8, false, 3, 0), (V{{0}, {1}, {2}}));
  EXPECT_EQ(offered(ShardingType::row_wise, 8, false, 3, 0), (V{{0, 1, 2}}));
  // Aligned blocks of 2 and 4 ranks, powers of two dividing the dim.
  EXPECT_EQ(offered(ShardingType::column_wise, 8, false, 4, 0), (V{{0, 1}, {2, 3}, {0, 1, 2, 3}}));
  EXPECT_EQ(offered(ShardingType::column_wise, 6, false, 4, 0), (V{{0, 1}, {2, 3}}));
  // No power of two divides 9: only a pinned table splits, over the most ranks that divide it.
  EXPECT_EQ(offered(ShardingType::column_wise, 9, false, 4, 0), V{});
  EXPECT_EQ(offered(ShardingType::column_wise, 9, true, 4, 0), (V{{0, 1, 2}}));
  // Each node group; with one node only when pinned.
  EXPECT_EQ(offered(ShardingType::table_row_wise, 8, false, 4, 2), (V{{0, 1}, {2, 3}}));
  EXPECT_EQ(offered(ShardingType::table_row_wise, 8, false, 4, 0), V{});
  EXPECT_EQ(offered(ShardingType::table_row_wise, 8, true, 4, 0), (V{{0, 1, 2, 3}}));
}

TEST(ShardingRegistry, CostTermsFollowTheFormulas) {
  // auto_plan.h's bytes per rank and step, N = 4 ranks, b = 1024 samples a rank, h = 2 ids a
  // sample, d = 16 columns of e = 4 bytes, no optimizer state, every id cold: one sample's ids
  // and length are 8 h + 8 = 24 bytes, its pool d e = 64.
  CostTerms c;
  c.n = 4, c.G = 4096, c.b = 1024, c.h = 2, c.d = 16, c.e = 4, c.s = 0;
  c.cold_ids = 1, c.ids = 24, c.de = 64;
  struct Traffic {
    double global = 0, node = 0;
  };
  auto traffic = [&](ShardingType type, std::vector<int> ranks) {
    std::vector<Traffic> out(4);
    c.k = static_cast<int>(ranks.size());
    c.lookups = [](int, double, double, double) {};
    c.comm = [&](int r, double bytes, int, Link link, int) {
      (link == Link::node ? out[static_cast<size_t>(r)].node : out[static_cast<size_t>(r)].global) += bytes;
    };
    std::set<int> holds(ranks.begin(), ranks.end());
    for (int r = 0; r < 4; ++r) shardingKind(type).addRankCosts(c, r, holds.count(r) > 0);
    return out;
  };
  const double b = 1024;
  // data_parallel: (N-1) b (8h + 8 + d e) on every rank.
  for (const Traffic& t : traffic(ShardingType::data_parallel, {0, 1, 2, 3}))
    EXPECT_EQ(t.global, 3 * b * (24 + 64));
  // table_wise on rank 2: b (8h + 8) + 2 b d e on the others, N-1 times that on the owner.
  auto tw = traffic(ShardingType::table_wise, {2});
  EXPECT_EQ(tw[0].global, b * 24 + 2 * b * 64);
  EXPECT_EQ(tw[2].global, 3 * (b * 24 + 2 * b * 64));
  // row_wise over all: 8 b h + 8 N b + 2 (N-1) b d e.
  for (const Traffic& t : traffic(ShardingType::row_wise, {0, 1, 2, 3}))
    EXPECT_EQ(t.global, 8 * b * 2 + 8 * 4 * b + 2 * 3 * b * 64);
  // column_wise over 2: k b (8h + 8) + b d e + b d e on every rank.
  for (const Traffic& t : traffic(ShardingType::column_wise, {0, 1}))
    EXPECT_EQ(t.global, 2 * b * 24 + 2 * b * 64);
  // table_row_wise over ranks 0-1: inside the group row_wise's terms for G / k samples a holder,
  // then b (8h + 8) + 2 b d e to and from every rank; the others as table_wise's others.
  auto trw = traffic(ShardingType::table_row_wise, {0, 1});
  const double gb = 4096 / 2;
  EXPECT_EQ(trw[0].node, 8 * gb * 2 + 8 * 2 * gb + 2 * 1 * gb * 64);
  EXPECT_EQ(trw[0].global, b * 24 + 2 * b * 64);
  EXPECT_EQ(trw[3].node, 0);
  EXPECT_EQ(trw[3].global, b * 24 + 2 * b * 64);
}

TEST(ShardingRegistry, Describe) {
  EXPECT_EQ(shardingKind(ShardingType::data_parallel).describe({0, 1, 2}), "data_parallel");
  EXPECT_EQ(shardingKind(ShardingType::table_wise).describe({3}), "table_wise on rank 3");
  EXPECT_EQ(shardingKind(ShardingType::row_wise).describe({0, 1, 2, 3}), "row_wise over 0-3");
  EXPECT_EQ(shardingKind(ShardingType::column_wise).describe({2, 3}), "column_wise over 2-3");
}

}  // namespace
}  // namespace kiln::passes
