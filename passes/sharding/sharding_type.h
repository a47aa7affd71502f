// Sharding types as one interface each, as TorchRec's sharders are: everything a type decides
// lives in its ShardingKind, in passes/sharding/<type>.cc, and sharding_types.def lists them.
//
//   layout     the pieces of a table over its ranks, how many ranks it takes and where, whether
//              every rank holds it whole or each piece is a block of whole rows;
//   cost       its terms in the planner's cost model (passes/auto_plan.h) and the placements the
//              search offers a table of it;
//   lowering   how the shard pass (passes/shard.cc) distributes a lookup's ids to the holders
//              (by row owner, or to every holder), and how their pools come back and the pooled
//              gradients go out (PoolReturn).
//
// Generic code (completePlan, the cost model and the search, the shard pass, plan.json) asks a
// table's kind (TablePlan::kind()) and compares no types. The greedy planner and the baseline
// strategies of passes/auto_plan.cc name types where choosing one is their policy.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::passes {

struct TableInfo;
struct TablePlan;
struct TableShard;

enum class ShardingType {
#define KILN_SHARDING_TYPE(name, accessor) name,
#include "passes/sharding/sharding_types.def"
};

class ShardingKind;

// The kind of `t`: the registry of sharding_types.def.
const ShardingKind& shardingKind(ShardingType t);
// Every type, in the registry's order.
const std::vector<ShardingType>& shardingTypes();
std::string_view shardingName(ShardingType t);
// "data_parallel" ... "table_row_wise"; nullopt for anything else.
std::optional<ShardingType> parseShardingType(std::string_view name);
// "data_parallel, table_wise, row_wise, column_wise, table_row_wise", for error messages.
std::string_view shardingNames();
// Whether each shard of a `t` table holds a block of whole rows (ShardingKind::rowBlocks).
bool hasRowBlocks(ShardingType t);

// How a lookup's pools come back to the ranks whose samples they are (the output distribution);
// the pooled gradients go out the reverse way to the update.
enum class PoolReturn {
  // Nothing travels: every rank pools its own samples from its replica. The update gathers the
  // global batch's ids and pooled gradients on every rank (all_gather).
  local,
  // Each holder pools every global sample's ids in its rows (0 where it has none) and a
  // reduce_scatter sums the partial pools, each rank keeping its samples'; the gradients come
  // back by all_gather.
  reduce_scatter,
  // Each holder returns to each rank the partial pools of its samples (all_to_all_v), and the
  // rank sums the holders' partials in rank order; each holder gets the gradients of the samples
  // it pooled the same way.
  partial_sums,
  // Each holder returns its columns of each rank's pools (all_to_all_v), set side by side; each
  // holder gets its columns of the gradients, or the whole rows where the optimizer keeps a
  // per-row statistic over every column (rowwise_adagrad).
  column_pieces,
};

// The links of the planner's cost model a kind's traffic goes over.
enum class Link {
  global,  // between any two ranks of the plan: the inter-node link when they span nodes
  node,    // inside one node group
};

// One plan entry's quantities in the planner's cost model, named as in auto_plan.h's formulas, and
// the two ways a rank spends time on the table; a kind states its terms in them
// (ShardingKind::addRankCosts) and the planner sums them.
struct CostTerms {
  int n = 1;            // ranks in the plan
  int k = 0;            // ranks holding the table (TablePlan::ranks)
  double G = 0;         // samples in the global batch
  double b = 0;         // samples per rank: G / n
  double h = 0;         // ids per sample
  double d = 0;         // the dim
  double e = 0;         // bytes per element
  double s = 0;         // optimizer state bytes per row
  double cold_ids = 1;  // the share of the ids that travel (a hybrid table's cold ones)
  double ids = 0;       // bytes of one sample's (cold) ids and its length: 8 h cold_ids + 8
  double de = 0;        // bytes of one sample's pool (or its gradient) where it travels
  // Rank `r`'s forward reads `fwd` rows of `cols` columns; its update reads and writes `upd` rows
  // of `cols` columns and their optimizer state.
  std::function<void(int r, double fwd, double upd, double cols)> lookups;
  // Rank `r` sends and receives `bytes` with `peers` peers over `link`, in `collectives`
  // collectives (each paying the link's latency).
  std::function<void(int r, double bytes, int peers, Link link, int collectives)> comm;
};

// Where `--sharding TYPE` puts each table when every table takes one type (the tests' and
// `kiln opt`'s plan), the tables visited in module order.
struct UniformPlacement {
  int ranks = 1;
  int ranks_per_node = 1;  // the node groups' size (all ranks on one node: `ranks`)
  size_t index = 0;        // the table's, in module order
  int next = 0;            // a cursor a type may carry from one table to the next
};

// One sharding type. Each is a stateless singleton (its file's accessor), so kinds compare by
// address and live for the program.
class ShardingKind {
 public:
  explicit ShardingKind(ShardingType type) : type_(type) {}
  ShardingKind(const ShardingKind&) = delete;
  ShardingKind& operator=(const ShardingKind&) = delete;
  virtual ~ShardingKind() = default;

  ShardingType type() const { return type_; }
  std::string_view name() const { return shardingName(type_); }

  // ---- Layout

  // Every rank holds the whole table: its lookups stay local, and it takes no hot rows (every row
  // is on every rank already) and no ranks in a plan file.
  virtual bool replicated() const { return false; }
  // Each piece is a block of whole rows, so every id has one owner: ids are routed to the owner of
  // their row (made local to its block) and may be de-duplicated (TablePlan::dedup), and a sample
  // that sent an owner no ids gets no pool back from it (a hybrid table's compaction).
  virtual bool rowBlocks() const { return false; }
  // Checks the ranks of `t` (sorted, distinct and within [0, ranks) already) against the type:
  // how many, and where. May fill them in (data_parallel without ranks: all). Errors name the
  // table and are unlocated.
  virtual Status checkRanks(TablePlan& t, const TableInfo& info, int ranks, int ranks_per_node) const = 0;
  // The pieces of a table of `info`'s size over `ranks`, which checkRanks accepted.
  virtual std::vector<TableShard> layout(const std::vector<int>& ranks, const TableInfo& info) const = 0;
  // "row_wise over 0-7": a placement as the planner's reasons and errors name it.
  virtual std::string describe(const std::vector<int>& ranks) const;

  // ---- Planning

  // The placements the search offers a table of this type, in the order it tries them. `pinned`:
  // the model or a constraint fixes the table to this type, so a placement the search would
  // otherwise leave out as never better is offered too.
  virtual std::vector<std::vector<int>> candidateRanks(const TableInfo& info, bool pinned, int ranks,
                                                       int ranks_per_node) const = 0;
  // The ranks of table `at.index` (of `info`) when every table takes this type. All ranks unless
  // the type says otherwise.
  virtual std::vector<int> uniformRanks(const TableInfo& info, UniformPlacement& at) const;
  // Rank `rank`'s lookups and traffic for the table's (cold) ids, pools and gradients, `holds`
  // whether the rank holds a piece of it. The hot rows' terms and those of de-duplicated routing
  // are the planner's own: they do not depend on the type.
  virtual void addRankCosts(const CostTerms& c, int rank, bool holds) const = 0;

  // ---- Lowering

  // How `t`'s pools come back on a run of `ranks` ranks, and its pooled gradients go out.
  virtual PoolReturn poolReturn(const TablePlan& t, int ranks) const = 0;

 private:
  ShardingType type_;
};

// Contiguous blocks of ceil(rows / k) whole rows over k ranks, the last shorter (or empty):
// TorchRec's row-wise layout, which row_wise and table_row_wise share.
std::vector<TableShard> rowBlockLayout(const std::vector<int>& ranks, const TableInfo& info);

}  // namespace kiln::passes
