// The in-memory tiers of the serving embedding store (embedding_store.h): a cache of row slots
// allocated once (RowCache) and a host hash map of rows (HostRowStore). Both map a row id to
// `dim` floats, are sharded by a hash of the id (a mutex and a share of the capacity per shard,
// so concurrent batches rarely wait on one another) and evict by LRU or LFU when full.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::serving {

// Which row a full tier gives up for a new one.
//   Lru: the row used least recently.
//   Lfu: the row used the fewest times since it was inserted (its insertion counts as one use);
//        among those, the one used least recently.
// A use is a hit of a lookup; inserting or updating a row that is present is not a use.
enum class EvictionPolicy { Lru, Lfu };

std::string_view evictionPolicyName(EvictionPolicy policy);
// "lru" or "lfu".
Expected<EvictionPolicy> parseEvictionPolicy(std::string_view name);

namespace detail {
class RowShard;
}

// What a tier has done since it was made.
struct RowTierCounters {
  uint64_t lookups = 0;    // ids asked of the tier
  uint64_t hits = 0;       // of those, found
  uint64_t evictions = 0;  // rows given up for new ones
};

// The common body of RowCache and HostRowStore. Every method may be called from many threads at
// once; a batch locks each shard it touches once.
class RowTier {
 public:
  ~RowTier();
  RowTier(const RowTier&) = delete;
  RowTier& operator=(const RowTier&) = delete;

  int64_t dim() const { return dim_; }
  // Rows it can hold (0: the tier is off, holds nothing and counts nothing).
  int64_t capacity() const { return capacity_; }
  bool enabled() const { return capacity_ > 0; }
  int shardCount() const { return static_cast<int>(shards_.size()); }
  // Rows it holds now.
  int64_t size() const;

  // For each i, copies the row of ids[i] to out + i*dim and sets found[i] = 1 if the tier holds
  // it (a use), else sets found[i] = 0 and leaves that row of out alone. Returns the hits.
  size_t lookup(std::span<const int64_t> ids, float* out, std::span<uint8_t> found);
  // Stores rows + i*dim as the row of ids[i], evicting as the policy says when a shard is full; a
  // row that is present is overwritten. Returns false if some row found no room (only a tier that
  // does not evict can be full).
  bool insert(std::span<const int64_t> ids, const float* rows);
  // Overwrites the rows of those ids[i] that the tier holds (rows + i*dim); inserts none. Returns
  // how many it overwrote.
  size_t update(std::span<const int64_t> ids, const float* rows);

  // One-row forms of lookup and insert.
  bool get(int64_t id, float* out);
  bool put(int64_t id, const float* row);
  // Whether the tier holds `id`; not a use, not counted.
  bool contains(int64_t id) const;

  RowTierCounters counters() const;

 protected:
  // capacity rows of dim floats in `shards` shards (0: one per 64 rows of capacity, at most 16).
  // evict: give up rows for new ones when a shard is full (else the capacity is a limit on the
  // whole tier, which holds every row it is given up to it). preallocate: every slot's floats are
  // allocated now, else as rows arrive.
  RowTier(int64_t capacity, int64_t dim, EvictionPolicy policy, bool evict, bool preallocate, int shards);

 private:
  size_t shardOf(int64_t id) const;

  int64_t capacity_;
  int64_t dim_;
  bool evict_;
  std::vector<std::unique_ptr<detail::RowShard>> shards_;
  // Rows held: a tier that does not evict checks its capacity against it before inserting.
  std::atomic<int64_t> size_{0};
  std::atomic<uint64_t> lookups_{0}, hits_{0}, evictions_{0};
};

// The top tier: `capacity` row slots allocated once (a flat array of capacity*dim floats split
// among the shards) and an id -> slot index.
class RowCache : public RowTier {
 public:
  RowCache(int64_t capacity, int64_t dim, EvictionPolicy policy, int shards = 0)
      : RowTier(capacity, dim, policy, /*evict=*/true, /*preallocate=*/true, shards) {}
};

// The middle tier: a concurrent hash map id -> row. Over a persistent store it caches `capacity`
// rows, evicting by `policy`; without one it holds every row of the table (capacity = rows, and it
// never evicts).
class HostRowStore : public RowTier {
 public:
  // A cache of `capacity` rows over a persistent store.
  HostRowStore(int64_t capacity, int64_t dim, EvictionPolicy policy, int shards = 0)
      : RowTier(capacity, dim, policy, /*evict=*/true, /*preallocate=*/false, shards) {}
  // Every row of a table of `rows` rows; insert returns false past that many.
  static std::unique_ptr<HostRowStore> wholeTable(int64_t rows, int64_t dim, int shards = 0) {
    return std::unique_ptr<HostRowStore>(new HostRowStore(rows, dim, shards));
  }

 private:
  HostRowStore(int64_t rows, int64_t dim, int shards)
      : RowTier(rows, dim, EvictionPolicy::Lru, /*evict=*/false, /*preallocate=*/false, shards) {}
};

}  // namespace kiln::serving
