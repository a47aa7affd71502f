// The automatic sharding plan and the predictions `kiln plan` prints. The greedy (issue 13):
// small tables data_parallel (replicating them costs little memory), the largest row_wise over
// every rank, the rest table_wise, each on the rank whose predicted embedding time is lowest and
// which still has the memory. A table pinned in the model (`embeddings(..., shard = T)`) keeps
// its type. Every choice carries its reason.
//
// The predictions cover the embedding part of a step only: per rank, the bytes its lookups and
// sparse updates move over the target's memory bandwidth, plus the bytes it sends and receives
// over the target's links (intra-node within a node group, inter-node across), plus a latency per
// collective. Per table and step, with N ranks, b = global_batch / N samples per rank, h ids per
// sample, d the dim, e its element bytes, ids and lengths i64:
//   data_parallel   every rank: (N-1) b (8h + 8 + d e)     (all_gather ids, lengths, pooled grads)
//   table_wise      others: b (8h + 8) + 2 b d e; the owner that, times N-1
//   row_wise        every rank: 8 b h + 8 N b + 2 (N-1) b d e (ids to owners, lengths, the
//                   partial pools' reduce_scatter, the gradients' all_gather)
//   column_wise k   every rank: k b (8h + 8) + b d e + b d e (k b d e when the optimizer keeps
//                   per-row state, which needs the full row's gradient)
//   table_row_wise  the holders: row_wise within the group of k ranks (intra-node), plus b d e
//                   pooled back by all_to_all; the others as table_wise's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/status.h"
#include "ir/target.h"
#include "passes/shard_plan.h"

namespace kiln::passes {

struct PlanRequest {
  int ranks = 1;
  int ranks_per_node = 0;       // 0: one node
  int64_t memory_per_rank = 0;  // bytes for embedding tables and their state; 0 = unlimited
  int64_t global_batch = 4096;
  Target target;
};

struct TableCost {
  int64_t bytes_per_rank = 0;      // weights plus optimizer state on the rank holding the most
  double lookups_per_step = 0;     // ids looked up in the table per global step
  double comm_bytes_per_step = 0;  // bytes sent plus received, summed over the ranks
};

struct RankCost {
  int64_t memory_bytes = 0;  // embedding tables and their optimizer state
  double lookup_s = 0;       // lookups and sparse updates over the memory bandwidth
  double comm_s = 0;         // embedding communication over the links
  double step_s = 0;         // lookup_s + comm_s
};

struct PlanCosts {
  std::vector<TableCost> tables;  // in plan order
  std::vector<RankCost> ranks;
};

// The predictions for a complete plan (completePlan has filled its shards).
PlanCosts planCosts(const ShardPlan& plan, const std::vector<TableInfo>& tables, const PlanRequest& req);

// The greedy plan, complete (shards filled), in module order. An error names a table that fits
// no rank and the shortfall in bytes.
Expected<ShardPlan> autoPlan(const std::vector<TableInfo>& tables, const PlanRequest& req);

// Tables of at most this many bytes are replicated (data_parallel) by the greedy.
inline constexpr int64_t kSmallTableBytes = int64_t{4} << 20;

}  // namespace kiln::passes
