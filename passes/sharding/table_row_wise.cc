// table_row_wise: row_wise over the ranks of one node group (TorchRec's table-row-wise sharding).
//
// The rows lie in row_wise's blocks over ranks of one node (`ranks_per_node`), so the ids and
// partial pools of the global batch cross only the fast intra-node links between the holders;
// every rank's pools come back by all_to_all_v (B rows from each holder) and the rank sums the
// partials in rank order, the gradients going back to each holder the same way.
#include <fmt/format.h>

#include <algorithm>

#include "passes/shard_plan.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {
namespace {

class TableRowWise final : public ShardingKind {
 public:
  TableRowWise() : ShardingKind(ShardingType::table_row_wise) {}

  bool rowBlocks() const override { return true; }

  Status checkRanks(TablePlan& t, const TableInfo&, int, int ranks_per_node) const override {
    if (t.ranks.empty())
      return Status::error(fmt::format("table '{}': table_row_wise needs at least 1 rank", t.table));
    if (ranks_per_node <= 0) return Status::ok();
    const int node = t.ranks.front() / ranks_per_node;
    for (int r : t.ranks)
      if (r / ranks_per_node != node)
        return Status::error(
            fmt::format("table '{}': table_row_wise ranks must lie in one node of {} ranks; "
                        "rank {} is on node {}, rank {} on node {}",
                        t.table, ranks_per_node, t.ranks.front(), node, r, r / ranks_per_node));
    return Status::ok();
  }

  std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const override {
    return rowBlockLayout(ranks, info);
  }

  // Each node group. With one node that is row_wise's layout with more traffic, so it is offered
  // only to a table pinned table_row_wise.
  std::vector<std::vector<int>> candidateRanks(const TableInfo&, bool pinned, int ranks,
                                               int ranks_per_node) const override {
    std::vector<std::vector<int>> out;
    const int g = ranks_per_node > 0 ? std::min(ranks_per_node, ranks) : ranks;
    if (g < ranks || pinned)
      for (int first = 0; first < ranks; first += g)
        out.push_back(rankRange(first, std::min(ranks, first + g)));
    return out;
  }

  // The nodes in turn.
  std::vector<int> uniformRanks(const TableInfo&, UniformPlacement& at) const override {
    const int per_node = at.ranks_per_node;
    const int first = static_cast<int>(at.index % static_cast<size_t>(at.ranks / per_node)) * per_node;
    std::vector<int> out;
    for (int r = 0; r < per_node; ++r) out.push_back((first + r) % at.ranks);
    return out;
  }

  // A holder: row_wise's terms inside the group for the global batch (G / k samples a holder,
  // intra-node), plus b d e pooled back to its ranks (and gradients out) by all_to_all; the other
  // ranks as table_wise's others, over k holders.
  void addRankCosts(const CostTerms& c, int r, bool holds) const override {
    if (holds) {
      c.lookups(r, c.G * c.h * c.cold_ids / c.k, c.G * c.h * c.cold_ids / c.k, c.d);
      const double gb = c.G / c.k;
      if (c.k > 1)
        c.comm(r, 8 * gb * c.h * c.cold_ids + 8.0 * c.k * gb + 2.0 * (c.k - 1) * gb * c.de, c.k - 1,
               Link::node, 3);
      if (c.n > 1) c.comm(r, c.b * (c.ids + 2 * c.de), c.n - 1, Link::global, 2);
    } else if (c.n > 1) {
      c.comm(r, c.b * (c.ids + 2 * c.de), c.k, Link::global, 4);
    }
  }

  PoolReturn poolReturn(const TablePlan&, int) const override { return PoolReturn::partial_sums; }
};

}  // namespace

const ShardingKind& tableRowWiseKind() {
  static const TableRowWise kind;
  return kind;
}

}  // namespace kiln::passes
