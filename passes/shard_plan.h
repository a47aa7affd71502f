// Sharding plans: where each embedding table of a model lives on N ranks, and how its lookups
// travel. The shard pass (passes/shard.cc) rewrites the training step from one; `kiln plan`
// prints one and writes it as plan.json; `kiln train --plan plan.json` reads it back. Without a
// plan file the greedy planner (autoPlan) chooses one over the shared cost model.
//
// The sharding types (TorchRec's names), each a ShardingKind in its own file of passes/sharding/
// (the list: passes/sharding/sharding_types.def):
//   data_parallel   every rank holds the whole table; the row gradients of the global batch
//                   reach every rank (all_gather) and every replica applies the same update.
//   table_wise      one rank holds the whole table; the others send it their ids.
//   row_wise        the rows split in contiguous blocks over `ranks` (block = ceil(rows / k));
//                   ids go to the owner of their row, partial pools come back summed.
//   column_wise     the dim splits into equal shards, shard j on ranks[j] (ascending); every
//                   shard holder gets every id and returns its columns.
//   table_row_wise  row_wise over the ranks of one node (`ranks` lie in one node group of
//                   ranks_per_node): the rows stay on fast intra-node links.
// Dense parameters are always data-parallel (gradients all-reduced in buckets).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/ir.h"
#include "ir/status.h"
#include "ir/target.h"
#include "passes/sharding/sharding_type.h"

namespace kiln::passes {

// "0-7", "3", "0-2,5": ascending ranks read at a glance.
std::string rankList(const std::vector<int>& ranks);
// begin, begin + 1, ..., end - 1.
std::vector<int> rankRange(int begin, int end);

// One piece of a table on one rank: rows [row_begin, row_end) and columns [col_begin, col_end)
// of the global [rows, dim] table. A data_parallel table has one full piece per rank.
struct TableShard {
  int rank = 0;
  int64_t row_begin = 0, row_end = 0;
  int64_t col_begin = 0, col_end = 0;
  int64_t rows() const { return row_end - row_begin; }
  int64_t cols() const { return col_end - col_begin; }
};

// The hottest rows of a table replicated on every rank, the rest sharded by the table's type
// (HugeCTR's hybrid embedding): which rows, and what a sample of the data says they cover.
// `kiln plan --data` (passes/id_frequency.h) chooses them and writes them to plan.json as the
// entry's "hot_rows"; the shard pass looks them up in a replica on every rank.
struct HotRows {
  int64_t rows = 0;           // replicated on every rank
  double id_share = 0;        // of the table's ids, the share that are hot
  double sample_share = 0;    // of the samples, the share whose ids for the table are all hot
  std::vector<int64_t> ids;   // the rows, ascending (empty in a what-if that only counts them)
};

// What the planner and the shard pass know of one embedding table of a module.
struct TableInfo {
  std::string name;  // the kiln.parameter's name, e.g. "tables.3"
  int64_t rows = 0, dim = 0;
  ir::DType dtype = ir::DType::f32;
  int64_t state_bytes_per_row = 0;     // its sparse optimizer's state (rowwise_adagrad: 4)
  double lookups_per_sample = 1;       // ids per sample (the hotness, or max_hotness)
  std::optional<ShardingType> pinned;  // embeddings(..., shard = row_wise) in the model
  std::vector<std::string> ids_inputs; // the data inputs whose ids it looks up (kiln.input names)
  HotRows hot;                         // a what-if's hot rows, given to every model-parallel choice
  // Its hot rows' gradients can be all-reduced as a dense [hot rows, dim] block: an update that
  // leaves a row with zero gradient unchanged (sgd, adagrad, rowwise_adagrad without weight
  // decay). Otherwise (lazy adam) the hot ids and pooled gradients are gathered, as for a
  // data_parallel table.
  bool hot_dense_update = true;
  int64_t bytesPerRow() const;         // weights plus optimizer state
};

// The embedding tables of a module (the embedding parameters of @train_step, else @forward), in
// parameter order.
Expected<std::vector<TableInfo>> tablesOf(const ir::Module& m);

struct TablePlan {
  std::string table;
  ShardingType type = ShardingType::data_parallel;
  std::vector<int> ranks;          // ascending; data_parallel: all ranks
  std::vector<TableShard> shards;  // filled by layoutShards
  std::string reason;              // why the planner chose this ("" for a plan file's entry)
  HotRows hot;                     // none unless a frequency what-if set it
  // De-duplicated routing (kiln.dedup_ids): each rank sends each distinct (cold) id of its batch
  // once, the owners send back one row per distinct id, and the rank pools its samples itself;
  // the rows' gradients go back the same way. Worth it where a batch repeats ids more than a
  // sample holds them (unique_share * ids per sample < 1): `kiln plan --data` measures
  // unique_share, the distinct share of a rank's batch of (cold) ids, and sets dedup where the
  // cost model says it is cheaper. Partitioned types only (table_wise, row_wise,
  // table_row_wise).
  bool dedup = false;
  double unique_share = 1;
  Location loc;                    // the plan file's entry, for completePlan's errors
  const ShardingKind& kind() const { return shardingKind(type); }
};

struct ShardPlan {
  int ranks = 1;
  int ranks_per_node = 0;         // 0: all ranks on one node
  std::vector<TablePlan> tables;  // one per table of the module, in module order
  Location loc;                   // the plan file (its "tables" list), for a missing table
  const TablePlan* find(std::string_view table) const;
};

// The pieces of `t` over its ranks for a table of `info`'s size (its kind's layout): row_wise
// and table_row_wise in contiguous blocks of ceil(rows / k) rows (the last may be shorter, or
// empty), column_wise in k equal column shards, table_wise one piece, data_parallel one full
// piece per rank. None without ranks.
std::vector<TableShard> layoutShards(const TablePlan& t, const TableInfo& info);

// Checks `plan` against the module's tables and fills in every TablePlan's shards: each table
// planned once, ranks in [0, plan.ranks), the right number of ranks for the type, a column split
// that divides the dim, table_row_wise ranks inside one node group. Errors name the table.
// Errors carry the entry's `loc` when it has one (a plan file's), the plan's for a missing table.
// Reorders plan.tables into module order.
Status completePlan(ShardPlan& plan, const std::vector<TableInfo>& tables);

// One entry's checks of completePlan (ranks in range and distinct, then its kind's: the rank
// count and placement for the type, a column split; hot rows ascending within the table and not
// on a replicated table; dedup only on row blocks), normalizing its ranks (sorted; data_parallel
// with none: all ranks). Unlocated.
Status checkTablePlan(TablePlan& t, const TableInfo& info, int ranks, int ranks_per_node);

}  // namespace kiln::passes
