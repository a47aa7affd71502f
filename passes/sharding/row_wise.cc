// row_wise: the rows in contiguous blocks over k ranks (TorchRec's row-wise sharding).
//
// Each id goes to the owner of its row, made local to its block (bucketize_ids by row starts,
// all_to_all of the per-owner lengths, all_to_all_v of the ids); each owner pools every global
// sample's ids in its block. Over all ranks the partial pools are reduce-scattered (each rank
// sums its samples') and the gradients all-gathered; over fewer ranks, or where only some samples
// send an owner ids (a hybrid table's), they return by all_to_all_v. The rows and lookups of a
// large table spread evenly; every rank moves a pool per sample.
#include <fmt/format.h>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

class RowWise final : public ShardingKind {
 public:
  RowWise() : ShardingKind(ShardingType::row_wise) {}

  bool rowBlocks() const override { return true; }

  Status checkRanks(TablePlan& t, const TableInfo&, int, int) const override {
    if (t.ranks.empty())
      return Status::error(fmt::format("table '{}': row_wise needs at least 1 rank", t.table));
    return Status::ok();
  }

  std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const override {
    return rowBlockLayout(ranks, info);
  }

  std::vector<std::vector<int>> candidateRanks(const TableInfo&, bool, int ranks, int) const override {
    return {rankRange(0, ranks)};
  }

  // A holder: 8 b h + 8 N b + 2 (N-1) b d e (ids to the owners, lengths, the partial pools'
  // reduce_scatter, the gradients' all_gather) and 1/k of the global batch's lookups; a rank
  // outside the blocks sends its ids and takes pools and gradients as table_wise's others do.
  void addRankCosts(const CostTerms& c, int r, bool holds) const override {
    if (holds) c.lookups(r, c.G * c.h * c.cold_ids / c.k, c.G * c.h * c.cold_ids / c.k, c.d);
    if (c.n <= 1) return;
    if (holds)
      c.comm(r, 8 * c.b * c.h * c.cold_ids + 8.0 * c.n * c.b + 2.0 * (c.n - 1) * c.b * c.de, c.n - 1,
             Link::global, 4);
    else
      c.comm(r, c.b * (c.ids + 2 * c.de), c.k, Link::global, 4);
  }

  // A reduce_scatter sums every rank's partials, which needs every rank to hold a block and every
  // sample's pool to travel (no hot rows, no de-duplication).
  PoolReturn poolReturn(const TablePlan& t, int ranks) const override {
    const bool every_rank = static_cast<int>(t.ranks.size()) == ranks;
    return every_rank && t.hot.ids.empty() && !t.dedup ? PoolReturn::reduce_scatter
                                                       : PoolReturn::partial_sums;
  }
};

}  // namespace

const ShardingKind& rowWiseKind() {
  static const RowWise kind;
  return kind;
}

}  // namespace kiln::passes
