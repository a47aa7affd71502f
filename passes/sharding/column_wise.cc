// column_wise: the dim in k equal pieces, piece j on the j-th rank (TorchRec's column-wise
// sharding).
//
// Every id goes to each of the k holders (bucketize_ids in replicate mode); each pools its
// columns for every global sample and returns each rank its columns, which the rank sets side by
// side. Each holder gets its columns of the gradients, or the whole rows under rowwise_adagrad
// (whose per-row statistic spans every column; every holder then keeps the same copy of it). A
// wide table's lookups and memory split without splitting its ids.
#include <fmt/format.h>

#include <algorithm>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

// The most ranks, at most `ranks`, whose column pieces divide `dim`.
int widestSplit(int64_t dim, int ranks) {
  int k = ranks;
  while (k > 1 && dim % k != 0) --k;
  return k;
}

class ColumnWise final : public ShardingKind {
 public:
  ColumnWise() : ShardingKind(ShardingType::column_wise) {}

  Status checkRanks(TablePlan& t, const TableInfo& info, int, int) const override {
    const int k = static_cast<int>(t.ranks.size());
    if (k < 1) return Status::error(fmt::format("table '{}': column_wise needs at least 1 rank", t.table));
    if (info.dim % k != 0)
      return Status::error(fmt::format("table '{}': column_wise over {} ranks does not divide its dim {}",
                                       t.table, k, info.dim));
    return Status::ok();
  }

  std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const override {
    std::vector<TableShard> out;
    const int64_t k = static_cast<int64_t>(ranks.size());
    const int64_t w = info.dim / k;
    for (int64_t j = 0; j < k; ++j)
      out.push_back({ranks[static_cast<size_t>(j)], 0, info.rows, j * w, (j + 1) * w});
    return out;
  }

  // Each aligned block of k ranks, k a power of two that divides the dim; a table pinned
  // column_wise whose dim no power of two divides splits over the most ranks that divide it.
  std::vector<std::vector<int>> candidateRanks(const TableInfo& info, bool pinned, int ranks,
                                               int) const override {
    std::vector<std::vector<int>> out;
    if (ranks <= 1) return out;
    for (int k = 2; k <= ranks; k *= 2) {
      if (info.dim % k != 0) continue;
      for (int first = 0; first + k <= ranks; first += k) out.push_back(rankRange(first, first + k));
    }
    if (out.empty() && pinned) out.push_back(rankRange(0, widestSplit(info.dim, ranks)));
    return out;
  }

  // Over as many ranks as divide the dim, the tables' blocks in turn (wrapping around), so that
  // the tables fill every rank rather than all starting at rank 0.
  std::vector<int> uniformRanks(const TableInfo& info, UniformPlacement& at) const override {
    const int k = widestSplit(info.dim, at.ranks);
    const int first = at.next;
    at.next = (at.next + k) % at.ranks;
    std::vector<int> out;
    for (int r = 0; r < k; ++r) out.push_back((first + r) % at.ranks);
    return out;
  }

  // Every rank: k b (8h + 8) (its ids to every holder) + b d e (its columns back) + b d e for the
  // gradients (k b d e when the optimizer keeps per-row state, which needs the whole row's); a
  // holder looks up its columns for the global batch.
  void addRankCosts(const CostTerms& c, int r, bool holds) const override {
    const double cols = c.d / c.k;
    if (holds) c.lookups(r, c.G * c.h * c.cold_ids, c.G * c.h * c.cold_ids, cols);
    const double grads = c.s > 0 ? c.k * c.b * c.de : c.b * c.de;
    if (c.n > 1) c.comm(r, c.k * c.b * c.ids + c.b * c.de + grads, std::max(c.k, c.n - 1), Link::global, 4);
  }

  PoolReturn poolReturn(const TablePlan&, int) const override { return PoolReturn::column_pieces; }
};

}  // namespace

const ShardingKind& columnWiseKind() {
  static const ColumnWise kind;
  return kind;
}

}  // namespace kiln::passes
