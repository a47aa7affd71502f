// data_parallel: every rank holds the whole table (TorchRec's data-parallel sharding).
//
// Its lookups stay local. The update gathers the global batch's ids and pooled gradients on
// every rank (all_gather) and every replica applies the same sparse update, so the replicas stay
// equal without all-reducing a dense [rows, dim] gradient: no lookup traffic, a gradient
// exchange that grows with the ranks. For small tables, and for shared tables, whose one update
// reads every feature's lookups (only a replica applies it as it is).
#include <fmt/format.h>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

class DataParallel final : public ShardingKind {
 public:
  DataParallel() : ShardingKind(ShardingType::data_parallel) {}

  bool replicated() const override { return true; }

  Status checkRanks(TablePlan& t, const TableInfo&, int ranks, int) const override {
    const int k = static_cast<int>(t.ranks.size());
    if (k != 0 && k != ranks)
      return Status::error(
          fmt::format("table '{}': data_parallel runs on all {} ranks, got {}", t.table, ranks, k));
    t.ranks = rankRange(0, ranks);
    return Status::ok();
  }

  std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const override {
    std::vector<TableShard> out;
    for (int r : ranks) out.push_back({r, 0, info.rows, 0, info.dim});
    return out;
  }

  std::string describe(const std::vector<int>&) const override { return std::string(name()); }

  std::vector<std::vector<int>> candidateRanks(const TableInfo&, bool, int ranks, int) const override {
    return {rankRange(0, ranks)};
  }

  // Every rank looks up its own samples and updates with the global batch's rows, and gathers
  // the other ranks' ids, lengths and pooled gradients: (N-1) b (8h + 8 + d e).
  void addRankCosts(const CostTerms& c, int r, bool) const override {
    c.lookups(r, c.b * c.h, c.G * c.h, c.d);
    if (c.n > 1) c.comm(r, (c.n - 1) * c.b * (8 * c.h + 8 + c.d * c.e), c.n - 1, Link::global, 2);
  }

  PoolReturn poolReturn(const TablePlan&, int) const override { return PoolReturn::local; }
};

}  // namespace

const ShardingKind& dataParallelKind() {
  static const DataParallel kind;
  return kind;
}

}  // namespace kiln::passes
