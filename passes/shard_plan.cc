#include "passes/shard_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace kiln::passes {
namespace {

// The sparse input feeding `op`'s ids, looking through the single-operand ops (casts, reshapes)
// that may stand between them.
const ir::Op* idsInput(const ir::Op& bag) {
  if (bag.numOperands() < 2) return nullptr;
  const ir::Op* d = bag.operand(1)->definingOp();
  for (int depth = 0; d && depth < 8; ++depth) {
    if (d->is(ir::OpCode::Input)) return d;
    if (d->numOperands() != 1) return nullptr;
    d = d->operand(0)->definingOp();
  }
  return nullptr;
}

Status errAt(std::string msg, const Location& loc) { return Status::error(std::move(msg), loc); }

}  // namespace

std::string rankList(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ",") +
           (j > i ? fmt::format("{}-{}", ranks[i], ranks[j]) : fmt::format("{}", ranks[i]));
    i = j + 1;
  }
  return out;
}

std::vector<int> rankRange(int begin, int end) {
  std::vector<int> out;
  for (int r = begin; r < end; ++r) out.push_back(r);
  return out;
}

int64_t TableInfo::bytesPerRow() const { return dim * ir::dtypeBytes(dtype) + state_bytes_per_row; }

const TablePlan* ShardPlan::find(std::string_view table) const {
  for (const auto& t : tables)
    if (t.table == table) return &t;
  return nullptr;
}

Expected<std::vector<TableInfo>> tablesOf(const ir::Module& m) {
  const ir::Function* f = m.lookup("train_step");
  if (!f) f = m.lookup("forward");
  if (!f || f->body().empty()) return std::vector<TableInfo>{};
  std::vector<TableInfo> out;
  std::map<std::string, size_t, std::less<>> index;
  std::vector<const ir::Op*> states, bags, updates;
  for (const auto& up : f->entry().ops()) {
    const ir::Op& op = *up;
    if (op.is(ir::OpCode::EmbeddingBag)) bags.push_back(&op);
    if (op.is(ir::OpCode::EmbeddingBagUpdate)) updates.push_back(&op);
    if (!op.is(ir::OpCode::Parameter)) continue;
    if (op.hasAttr("state_of")) {
      states.push_back(&op);
      continue;
    }
    if (!op.boolAttr("embedding")) continue;
    const ir::TensorType& t = op.result()->type();
    TableInfo info;
    info.name = op.strAttr("name");
    if (t.rank() != 2 || !t.isStatic())
      return Status::error(
          fmt::format("embedding table '{}' must be a static [rows, dim] tensor, got {}", info.name, t.str()),
          op.location());
    // A shard already (the shard pass ran): its global size.
    std::vector<int64_t> global = op.intsAttr("global_shape");
    info.rows = global.size() == 2 ? global[0] : t.dim(0).size();
    info.dim = global.size() == 2 ? global[1] : t.dim(1).size();
    info.dtype = t.dtype();
    if (op.hasAttr("shard")) {
      std::string s = op.strAttr("shard");
      info.pinned = parseShardingType(s);
      if (!info.pinned)
        return Status::error(fmt::format("embedding table '{}': unknown sharding '{}' (use {})", info.name, s,
                                         shardingNames()),
                             op.location());
    }
    index[info.name] = out.size();
    out.push_back(std::move(info));
  }
  for (const ir::Op* s : states) {
    auto it = index.find(s->strAttr("state_of"));
    if (it == index.end()) continue;  // a dense parameter's state
    TableInfo& info = out[it->second];
    // Per row of the state's own first dim (a shard's state has the shard's rows).
    const ir::TensorType& type = s->result()->type();
    auto bytes = type.bytes({});
    if (!bytes || type.rank() < 1 || !type.dim(0).isStatic() || type.dim(0).size() == 0) continue;
    info.state_bytes_per_row += *bytes / type.dim(0).size();
  }
  // A row with zero gradient stays as it is under sgd and the adagrads (g = 0 moves nothing), not
  // under weight decay or lazy adam's moments: only the former may all-reduce hot rows densely.
  for (const ir::Op* u : updates) {
    auto it = index.find(u->strAttr("table"));
    if (it == index.end()) continue;
    const std::string kind = u->strAttr("optimizer");
    out[it->second].hot_dense_update = (kind == "sgd" || kind == "adagrad" || kind == "rowwise_adagrad") &&
                                       u->floatAttr("weight_decay") == 0 &&
                                       (kind == "sgd" || u->floatAttr("eps", 1e-8) > 0);
  }
  std::vector<int> lookups(out.size(), 0);
  for (const ir::Op* bag : bags) {
    auto it = index.find(bag->strAttr("table"));
    if (it == index.end()) continue;
    TableInfo& info = out[it->second];
    double per_sample = 1;
    if (const ir::Op* in = idsInput(*bag)) {
      info.ids_inputs.push_back(in->strAttr("name"));
      if (in->hasAttr("hotness"))
        per_sample = static_cast<double>(in->intAttr("hotness"));
      else if (in->hasAttr("max_hotness"))
        per_sample = static_cast<double>(in->intAttr("max_hotness"));
    } else {
      const ir::TensorType& ids = bag->operand(1)->type();
      if (ids.rank() == 2 && ids.dim(1).isStatic()) per_sample = static_cast<double>(ids.dim(1).size());
    }
    // A shared table reads the ids of every feature it is applied to.
    info.lookups_per_sample = lookups[it->second]++ == 0 ? per_sample : info.lookups_per_sample + per_sample;
  }
  // A shared table trains by one update of all its lookups, which the shard pass routes only
  // for a replicated table (docs/distributed.md, "Shared tables"): the planner keeps it
  // data_parallel unless the model pins another type, which the shard pass then rejects.
  for (size_t i = 0; i < out.size(); ++i)
    if (lookups[i] > 1 && !out[i].pinned) out[i].pinned = ShardingType::data_parallel;
  return out;
}

std::vector<TableShard> layoutShards(const TablePlan& t, const TableInfo& info) {
  if (t.ranks.empty()) return {};
  return t.kind().layout(t.ranks, info);
}

Status checkTablePlan(TablePlan& t, const TableInfo& info, int ranks, int ranks_per_node) {
  for (int r : t.ranks)
    if (r < 0 || r >= ranks)
      return Status::error(fmt::format("table '{}': rank {} is out of range [0, {})", t.table, r, ranks));
  std::sort(t.ranks.begin(), t.ranks.end());
  if (std::adjacent_find(t.ranks.begin(), t.ranks.end()) != t.ranks.end())
    return Status::error(fmt::format("table '{}': rank {} is listed twice", t.table,
                                     *std::adjacent_find(t.ranks.begin(), t.ranks.end())));
  const ShardingKind& kind = t.kind();
  KILN_RETURN_IF_ERROR(kind.checkRanks(t, info, ranks, ranks_per_node));
  const std::vector<int64_t>& hot = t.hot.ids;
  if (!hot.empty() && kind.replicated())
    return Status::error(
        fmt::format("table '{}' is {}: every row is on every rank already, so it takes no hot_rows", t.table,
                    kind.name()));
  for (size_t i = 0; i < hot.size(); ++i)
    if (hot[i] < 0 || hot[i] >= info.rows || (i > 0 && hot[i] <= hot[i - 1]))
      return Status::error(fmt::format("table '{}': hot_rows must be distinct rows in [0, {}), ascending; "
                                       "entry {} is {}",
                                       t.table, info.rows, i, hot[i]));
  if (!hot.empty()) t.hot.rows = static_cast<int64_t>(hot.size());
  if (t.dedup && !kind.rowBlocks()) {
    std::string row_blocks;
    for (ShardingType type : shardingTypes())
      if (hasRowBlocks(type))
        row_blocks += (row_blocks.empty() ? "" : ", ") + std::string(shardingName(type));
    return Status::error(fmt::format("table '{}' is {}: only row blocks ({}) route de-duplicated ids",
                                     t.table, kind.name(), row_blocks));
  }
  return Status::ok();
}

Status completePlan(ShardPlan& plan, const std::vector<TableInfo>& tables) {
  if (plan.ranks < 1) return errAt(fmt::format("a plan needs at least 1 rank, got {}", plan.ranks), plan.loc);
  if (plan.ranks_per_node < 0 || (plan.ranks_per_node > 0 && plan.ranks % plan.ranks_per_node != 0))
    return errAt(fmt::format("{} ranks do not divide into nodes of {}", plan.ranks, plan.ranks_per_node),
                 plan.loc);
  std::map<std::string, size_t, std::less<>> index;
  for (size_t i = 0; i < tables.size(); ++i) index[tables[i].name] = i;
  std::vector<int> entry_of(tables.size(), -1);
  for (size_t e = 0; e < plan.tables.size(); ++e) {
    TablePlan& t = plan.tables[e];
    auto it = index.find(t.table);
    if (it == index.end()) {
      std::string known;
      for (size_t i = 0; i < tables.size() && i < 8; ++i) known += (i ? ", " : "") + tables[i].name;
      if (tables.size() > 8) known += ", ...";
      return errAt(fmt::format("unknown table '{}' (the model's tables: {})", t.table, known), t.loc);
    }
    if (entry_of[it->second] >= 0) {
      const Location& first = plan.tables[static_cast<size_t>(entry_of[it->second])].loc;
      return errAt(fmt::format("table '{}' is planned twice{}", t.table,
                               first.known() ? fmt::format(" (first at {})", first.str()) : ""),
                   t.loc);
    }
    entry_of[it->second] = static_cast<int>(e);
    Status s = checkTablePlan(t, tables[it->second], plan.ranks, plan.ranks_per_node);
    if (!s) return errAt(s.message(), t.loc);
    t.shards = layoutShards(t, tables[it->second]);
  }
  std::vector<TablePlan> ordered;
  for (size_t i = 0; i < tables.size(); ++i) {
    if (entry_of[i] < 0) return errAt(fmt::format("the plan misses table '{}'", tables[i].name), plan.loc);
    ordered.push_back(std::move(plan.tables[static_cast<size_t>(entry_of[i])]));
  }
  plan.tables = std::move(ordered);
  return Status::ok();
}

}  // namespace kiln::passes
