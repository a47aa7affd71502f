// The automatic sharding plan, the predictions `kiln plan` prints, and the reasons behind them.
//
// The cost model. Every prediction covers the embedding part of a step: per rank, the lookups and
// sparse updates it runs (their bytes over the cost table's memory bandwidth, at the lookup
// efficiency of the table's row size and pooling factor) plus the bytes it sends and receives
// (over the intra-node link within a node group, the inter-node link across, at the all_to_all
// efficiency of the message size per peer, plus the link's latency per collective). A plan's
// predicted step is the critical path: the slowest rank's lookups plus communication, not a sum
// over ranks. Per table and step, with N ranks, b = global_batch / N samples per rank, h ids per
// sample, d the dim, e its element bytes, ids and lengths i64 (each type's terms are its kind's,
// ShardingKind::addRankCosts in passes/sharding/):
//   data_parallel   every rank: (N-1) b (8h + 8 + d e)     (all_gather ids, lengths, pooled grads)
//   table_wise      others: b (8h + 8) + 2 b d e; the owner that, times N-1
//   row_wise        every rank: 8 b h + 8 N b + 2 (N-1) b d e (ids to owners, lengths, the
//                   partial pools' reduce_scatter, the gradients' all_gather)
//   column_wise k   every rank: k b (8h + 8) + b d e + b d e (k b d e when the optimizer keeps
//                   per-row state, which needs the full row's gradient)
//   table_row_wise  the holders: row_wise within the group of k ranks (intra-node), plus b d e
//                   pooled back by all_to_all; the others as table_wise's.
// A hybrid table (TablePlan::hot) moves only its cold ids, and pools only for samples with one.
// De-duplicated (TablePlan::dedup, u its distinct share): a rank moves b u h (8 + 2 d e) (its
// distinct ids, their rows back, their gradients out); an owner of a k-way split, besides its
// own, receives the other ranks' share for it: (N-1) / k of that. Its lookups add the rank's own
// pooling from those rows and their gradient, and the sort that finds the distinct ids.
//
// The search (PlanStrategy::search, the default). Each table may be data_parallel, table_wise on
// any rank, row_wise over all ranks, column_wise over k ranks (k a power of two dividing the dim,
// on an aligned block of k ranks) or table_row_wise on any node group. Starting from the greedy
// (largest first: small tables replicated, the largest row-wise, the rest table-wise on the rank
// that keeps the slowest fastest), it applies the best of these local moves until none gains:
// re-place one table (another type or other ranks: a split turns table_wise into row_wise or
// column_wise, a merge the reverse) or swap the owners of two table_wise tables; where the choices
// are few (at most 400 over all tables), re-place two tables at once when no single move gains.
// It runs from several starts (the greedy, both baselines, everything row-wise) and keeps the best. Moves must fit
// every rank's memory. Plans compare by the critical path first, then the total time over ranks,
// then the fullest rank's memory. A second round of the same moves then balances the memory
// (PlanRequest::memory_balance) within kBalanceSlack of the fastest plan's step. Pins (the model's `shard = T`, or a constraints file) restrict
// a table's choices to its type, and to its ranks when the pin names them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/status.h"
#include "ir/target.h"
#include "passes/cost_table.h"
#include "passes/shard_plan.h"

namespace kiln::passes {

enum class PlanStrategy {
  search,          // greedy start, then local moves (the default)
  greedy,          // the greedy start alone
  table_row_wise,  // every table row-wise inside one node group: EMBark's baseline
  torchrec,        // TorchRec's rules: table-wise by greedy perf, the hottest tables row-wise
};
std::string_view strategyName(PlanStrategy s);
std::optional<PlanStrategy> parseStrategy(std::string_view name);

// A table's sharding fixed by a constraints file (`kiln plan --constraints`); the model's own
// pins are TableInfo::pinned. Empty `ranks`: the planner places it.
struct PlanPin {
  std::string table;
  ShardingType type = ShardingType::data_parallel;
  std::vector<int> ranks;
  Location loc;  // the constraints file's entry: the plan prints it as the pin's origin
};

struct PlanRequest {
  int ranks = 1;
  int ranks_per_node = 0;       // 0: one node
  int64_t memory_per_rank = 0;  // bytes for embedding tables and their state; 0 = unlimited
  int64_t global_batch = 4096;
  CostTable costs;              // builtinCostTable(target) unless calibrated
  PlanStrategy strategy = PlanStrategy::search;
  std::vector<PlanPin> pins;
  // After finding its fastest plan, the search moves every rank's embedding memory into
  // [mean / b, mean * b] (give or take a small table; the mean counts each table once) as far as
  // it can while the critical path grows by at most kBalanceSlack: memory left over on one rank
  // is memory the dense part cannot use on the others. 0 turns this off.
  double memory_balance = 1.2;
};

// The request's cost table from the built-in one of `target`.
Expected<PlanRequest> planRequestFor(const Target& target);

struct TableCost {
  int64_t bytes_per_rank = 0;      // weights plus optimizer state on the rank holding the most
  double lookups_per_step = 0;     // ids looked up in the table per global step
  double comm_bytes_per_step = 0;  // bytes sent plus received, summed over the ranks
};

struct RankCost {
  int64_t memory_bytes = 0;  // embedding tables and their optimizer state
  double lookup_s = 0;       // lookups and sparse updates
  double comm_s = 0;         // embedding communication over the links
  double step_s = 0;         // lookup_s + comm_s
};

struct PlanCosts {
  std::vector<TableCost> tables;  // in plan order
  std::vector<RankCost> ranks;
  double step_s() const;              // the critical path: the slowest rank's step_s
  double total_s() const;             // every rank's step_s summed
  int critical_rank() const;          // that rank
  double memory_imbalance() const;    // the fullest rank's memory over the emptiest's (1: even)
  double time_imbalance() const;      // the slowest rank's step over the mean
};

// The predictions for a complete plan (completePlan has filled its shards).
PlanCosts planCosts(const ShardPlan& plan, const std::vector<TableInfo>& tables, const PlanRequest& req);

// The plan of req.strategy, complete (shards filled), in module order, each entry with its
// reason (the search's: the predicted step, and the best alternative's). Errors: a table that
// fits no rank (its name and the shortfall in bytes), a pin that cannot be met.
Expected<ShardPlan> autoPlan(const std::vector<TableInfo>& tables, const PlanRequest& req);

// Every choice the search considers for table `index` of `plan`, the rest of the plan fixed,
// best first: what the predicted step and the fullest rank's memory would be.
struct OptionCost {
  TablePlan option;
  double step_s = 0;
  int64_t max_memory = 0;
  bool fits = true;    // within every rank's memory
  bool chosen = false;
};
std::vector<OptionCost> explainTable(const ShardPlan& plan, const std::vector<TableInfo>& tables,
                                     const PlanRequest& req, size_t index);

// The best plan over every combination of the search's choices, by the search's order (the test
// oracle of small cases). An error when there are more than `max_plans` combinations or none fits.
Expected<ShardPlan> exhaustivePlan(const std::vector<TableInfo>& tables, const PlanRequest& req,
                                   int64_t max_plans = 1000000);

// The share of the predicted step the search may give up for memory balance.
inline constexpr double kBalanceSlack = 0.05;

// Tables of at most this many bytes are replicated (data_parallel) by the greedy.
inline constexpr int64_t kSmallTableBytes = int64_t{4} << 20;

}  // namespace kiln::passes
