// table_wise: one rank holds the whole table (TorchRec's table-wise sharding).
//
// Every rank sends the owner its samples' ids (bucketize_ids, all_to_all of the lengths,
// all_to_all_v of the ids); the owner pools all N * B samples and returns each rank its B pools,
// and the gradients come back the same way to its sparse update. Cheap links for a table few ids
// a sample touch; the owner does all of its lookups.
#include <fmt/format.h>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

class TableWise final : public ShardingKind {
 public:
  TableWise() : ShardingKind(ShardingType::table_wise) {}

  bool rowBlocks() const override { return true; }

  Status checkRanks(TablePlan& t, const TableInfo&, int, int) const override {
    if (t.ranks.size() != 1)
      return Status::error(
          fmt::format("table '{}': table_wise needs exactly 1 rank, got {}", t.table, t.ranks.size()));
    return Status::ok();
  }

  std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const override {
    return {{ranks[0], 0, info.rows, 0, info.dim}};
  }

  std::string describe(const std::vector<int>& ranks) const override {
    return fmt::format("table_wise on rank {}", ranks.empty() ? -1 : ranks[0]);
  }

  std::vector<std::vector<int>> candidateRanks(const TableInfo&, bool, int ranks, int) const override {
    std::vector<std::vector<int>> out;
    for (int r = 0; r < ranks; ++r) out.push_back({r});
    return out;
  }

  // Round robin: table i on rank i mod N.
  std::vector<int> uniformRanks(const TableInfo&, UniformPlacement& at) const override {
    return {static_cast<int>(at.index % static_cast<size_t>(at.ranks))};
  }

  // The others: b (8h + 8) + 2 b d e (ids out, pools back, gradients out); the owner looks up the
  // global batch and moves N-1 times that.
  void addRankCosts(const CostTerms& c, int r, bool holds) const override {
    if (holds) {
      c.lookups(r, c.G * c.h * c.cold_ids, c.G * c.h * c.cold_ids, c.d);
      if (c.n > 1) c.comm(r, (c.n - 1) * c.b * (c.ids + 2 * c.de), c.n - 1, Link::global, 4);
    } else {
      c.comm(r, c.b * (c.ids + 2 * c.de), 1, Link::global, 4);
    }
  }

  PoolReturn poolReturn(const TablePlan&, int) const override { return PoolReturn::partial_sums; }
};

}  // namespace

const ShardingKind& tableWiseKind() {
  static const TableWise kind;
  return kind;
}

}  // namespace kiln::passes
