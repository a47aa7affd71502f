#include "passes/shard_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

#include "ir/op_def.h"

namespace kiln::passes {
namespace {

constexpr std::pair<ShardingType, std::string_view> kNames[] = {
    {ShardingType::data_parallel, "data_parallel"}, {ShardingType::table_wise, "table_wise"},
    {ShardingType::row_wise, "row_wise"},           {ShardingType::column_wise, "column_wise"},
    {ShardingType::table_row_wise, "table_row_wise"},
};

}  // namespace

std::string_view shardingName(ShardingType t) {
  for (const auto& [type, name] : kNames)
    if (type == t) return name;
  return "?";
}

std::optional<ShardingType> parseShardingType(std::string_view name) {
  for (const auto& [type, n] : kNames)
    if (n == name) return type;
  return std::nullopt;
}

std::string_view shardingNames() { return "data_parallel, table_wise, row_wise, column_wise, table_row_wise"; }

int64_t TableInfo::bytesPerRow() const {
  return dim * static_cast<int64_t>(ir::dtypeBytes(dtype)) + state_bytes_per_row;
}

const TablePlan* ShardPlan::find(std::string_view table) const {
  for (const TablePlan& t : tables)
    if (t.table == table) return &t;
  return nullptr;
}

Expected<std::vector<TableInfo>> tablesOf(const ir::Module& m) {
  const ir::Function* f = m.lookup("train_step");
  if (!f) f = m.lookup("forward");
  if (!f || f->body().empty()) return std::vector<TableInfo>{};
  std::vector<TableInfo> tables;
  std::map<std::string, size_t> index;
  std::vector<const ir::Op*> states;
  for (const ir::Op* op : f->entry().opList()) {
    if (!op->is(ir::OpCode::Parameter)) continue;
    if (op->hasAttr("state_of")) {
      states.push_back(op);
      continue;
    }
    if (!op->boolAttr("embedding")) continue;
    const ir::TensorType& t = op->result()->type();
    if (t.rank() != 2 || !t.isStatic())
      return Status::errorf("embedding table '{}' must have a static [rows, dim] type, got {}", op->strAttr("name"),
                            t.str());
    TableInfo info;
    info.name = op->strAttr("name");
    // A shard already (the shard pass ran): its global size.
    std::vector<int64_t> global = op->intsAttr("global_shape");
    info.rows = global.size() == 2 ? global[0] : t.dim(0).size();
    info.dim = global.size() == 2 ? global[1] : t.dim(1).size();
    info.dtype = t.dtype();
    if (std::string pin = op->strAttr("shard"); !pin.empty()) {
      info.pinned = parseShardingType(pin);
      if (!info.pinned)
        return Status::errorf("table '{}': unknown sharding '{}' (use {})", info.name, pin, shardingNames())
            .withLocation(op->location());
    }
    index[info.name] = tables.size();
    tables.push_back(std::move(info));
  }
  for (const ir::Op* s : states) {
    auto it = index.find(s->strAttr("state_of"));
    if (it == index.end()) continue;
    TableInfo& t = tables[it->second];
    const ir::TensorType& type = s->result()->type();
    auto n = type.numElements({});
    if (n && t.rows > 0 && type.rank() >= 1 && type.dim(0).isStatic())
      t.state_bytes_per_row += *n / type.dim(0).size() * static_cast<int64_t>(ir::dtypeBytes(type.dtype()));
  }
  // Ids per sample: the hotness of the input each table's lookups read.
  for (const ir::Op* op : f->entry().opList()) {
    if (!op->is(ir::OpCode::EmbeddingBag)) continue;
    auto it = index.find(op->strAttr("table"));
    if (it == index.end()) continue;
    const ir::Op* input = op->operand(1)->definingOp();
    if (!input) continue;
    const int64_t h = input->intAttr("hotness", input->intAttr("max_hotness", 1));
    tables[it->second].lookups_per_sample = static_cast<double>(std::max<int64_t>(h, 1));
  }
  return tables;
}

std::vector<TableShard> layoutShards(const TablePlan& t, const TableInfo& info) {
  std::vector<TableShard> shards;
  const int64_t k = static_cast<int64_t>(t.ranks.size());
  auto whole = [&](int rank) { return TableShard{rank, 0, info.rows, 0, info.dim}; };
  switch (t.type) {
    case ShardingType::data_parallel:
    case ShardingType::table_wise:
      for (int r : t.ranks) shards.push_back(whole(r));
      break;
    case ShardingType::row_wise:
    case ShardingType::table_row_wise: {
      // TorchRec's blocks: ceil(rows / k) rows each, the last shorter (or empty).
      const int64_t block = k > 0 ? (info.rows + k - 1) / k : 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t begin = std::min(info.rows, j * block), end = std::min(info.rows, (j + 1) * block);
        shards.push_back({t.ranks[static_cast<size_t>(j)], begin, end, 0, info.dim});
      }
      break;
    }
    case ShardingType::column_wise: {
      const int64_t cols = k > 0 ? info.dim / k : 0;
      for (int64_t j = 0; j < k; ++j)
        shards.push_back({t.ranks[static_cast<size_t>(j)], 0, info.rows, j * cols, (j + 1) * cols});
      break;
    }
  }
  return shards;
}

Status completePlan(ShardPlan& plan, const std::vector<TableInfo>& tables) {
  if (plan.ranks < 1) return Status::errorf("a plan needs ranks >= 1, got {}", plan.ranks);
  if (plan.ranks_per_node < 0 || (plan.ranks_per_node > 0 && plan.ranks % plan.ranks_per_node != 0))
    return Status::errorf("{} ranks do not divide into nodes of {}", plan.ranks, plan.ranks_per_node);
  std::map<std::string, const TableInfo*> known;
  for (const TableInfo& t : tables) known[t.name] = &t;
  std::set<std::string> seen;
  for (TablePlan& t : plan.tables) {
    auto it = known.find(t.table);
    if (it == known.end()) return Status::errorf("the plan names table '{}', which the model does not have", t.table);
    if (!seen.insert(t.table).second) return Status::errorf("table '{}' is planned twice", t.table);
    const TableInfo& info = *it->second;
    if (t.type == ShardingType::data_parallel && t.ranks.empty())
      for (int r = 0; r < plan.ranks; ++r) t.ranks.push_back(r);
    std::sort(t.ranks.begin(), t.ranks.end());
    if (std::adjacent_find(t.ranks.begin(), t.ranks.end()) != t.ranks.end())
      return Status::errorf("table '{}' lists a rank twice", t.table);
    for (int r : t.ranks)
      if (r < 0 || r >= plan.ranks)
        return Status::errorf("table '{}' is placed on rank {}, but the run has ranks 0 to {}", t.table, r,
                              plan.ranks - 1);
    const size_t k = t.ranks.size();
    const std::string_view type = shardingName(t.type);
    if (k == 0) return Status::errorf("table '{}' ({}) needs at least one rank", t.table, type);
    if (t.type == ShardingType::data_parallel && static_cast<int>(k) != plan.ranks)
      return Status::errorf("table '{}' is data_parallel: it lives on every rank, not on {} of {}", t.table, k,
                            plan.ranks);
    if (t.type == ShardingType::table_wise && k != 1)
      return Status::errorf("table '{}' is table_wise: it lives on one rank, not {}", t.table, k);
    if (t.type == ShardingType::column_wise && info.dim % static_cast<int64_t>(k) != 0)
      return Status::errorf("table '{}' is column_wise over {} ranks, but its dim {} does not divide by {}", t.table,
                            k, info.dim, k);
    if (t.type == ShardingType::table_row_wise) {
      const int per_node = plan.ranks_per_node > 0 ? plan.ranks_per_node : plan.ranks;
      if (t.ranks.front() / per_node != t.ranks.back() / per_node)
        return Status::errorf("table '{}' is table_row_wise: its ranks must lie in one node of {} ranks, but {} and {} "
                              "do not",
                              t.table, per_node, t.ranks.front(), t.ranks.back());
    }
    t.shards = layoutShards(t, info);
  }
  for (const TableInfo& t : tables)
    if (!seen.count(t.name)) return Status::errorf("the plan does not place table '{}'", t.name);
  return Status::ok();
}

}  // namespace kiln::passes
