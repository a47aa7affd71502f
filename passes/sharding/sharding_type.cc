// The registry of sharding types (sharding_types.def) and the defaults of ShardingKind.
#include "passes/sharding/sharding_type.h"

#include <fmt/format.h>

#include <algorithm>

#include "passes/shard_plan.h"

namespace kiln::passes {

#define KILN_SHARDING_TYPE(name, accessor) const ShardingKind& accessor();
#include "passes/sharding/sharding_types.def"

namespace {

struct Entry {
  std::string_view name;
  const ShardingKind& (*kind)();
};

constexpr Entry kRegistry[] = {
#define KILN_SHARDING_TYPE(name, accessor) {#name, &accessor},
#include "passes/sharding/sharding_types.def"
};

const Entry& entry(ShardingType t) { return kRegistry[static_cast<size_t>(t)]; }

}  // namespace

const ShardingKind& shardingKind(ShardingType t) { return entry(t).kind(); }

const std::vector<ShardingType>& shardingTypes() {
  static const std::vector<ShardingType> types = [] {
    std::vector<ShardingType> out;
    for (size_t i = 0; i < std::size(kRegistry); ++i) out.push_back(static_cast<ShardingType>(i));
    return out;
  }();
  return types;
}

std::string_view shardingName(ShardingType t) { return entry(t).name; }

std::optional<ShardingType> parseShardingType(std::string_view name) {
  for (ShardingType t : shardingTypes())
    if (shardingName(t) == name) return t;
  return std::nullopt;
}

std::string_view shardingNames() {
  static const std::string names = [] {
    std::string out;
    for (ShardingType t : shardingTypes()) out += (out.empty() ? "" : ", ") + std::string(shardingName(t));
    return out;
  }();
  return names;
}

bool hasRowBlocks(ShardingType t) { return shardingKind(t).rowBlocks(); }

std::string ShardingKind::describe(const std::vector<int>& ranks) const {
  return fmt::format("{} over {}", name(), rankList(ranks));
}

std::vector<int> ShardingKind::uniformRanks(const TableInfo&, UniformPlacement& at) const {
  return rankRange(0, at.ranks);
}

std::vector<TableShard> rowBlockLayout(const std::vector<int>& ranks, const TableInfo& info) {
  std::vector<TableShard> out;
  const int64_t k = static_cast<int64_t>(ranks.size());
  const int64_t block = (info.rows + k - 1) / k;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t begin = std::min(j * block, info.rows), end = std::min((j + 1) * block, info.rows);
    out.push_back({ranks[static_cast<size_t>(j)], begin, end, 0, info.dim});
  }
  return out;
}

}  // namespace kiln::passes
