// The embedding tables of `kiln serve`, served from three tiers like HugeCTR's Hierarchical
// Parameter Server: a cache of row slots (RowCache), a host hash map (HostRowStore) and, with
// --store, every row in RocksDB (RocksDbStore). A lookup asks each tier in turn for what the one
// above did not hold and copies each row it finds into the tiers above it.
//
// Exactness comes first: the server compares its scores bit for bit with the un-tiered path. A
// row comes back as the bytes last stored or applied, whatever the tier sizes and eviction history:
// rows are only ever copied whole between tiers, and an update overwrites every tier that holds
// the row while no lookup runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <span>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "runtime/serving/rocksdb_store.h"
#include "runtime/serving/row_store.h"

namespace kiln::serving {

struct StoreOptions {
  double cache_fraction = 1.0;  // cache rows = ceil(fraction * rows) per table (0: no cache)
  double host_fraction = 1.0;   // host rows = ceil(fraction * rows); must be 1 without a persistent store
  EvictionPolicy policy = EvictionPolicy::Lru;
  int shards = 0;  // shards per tier (0: from the tier's capacity)
};

class EmbeddingStore {
 public:
  // Every table's rows in the host tier (no persistent store): the caller fills them with loadRows.
  static Expected<std::unique_ptr<EmbeddingStore>> inMemory(std::vector<TableInfo> tables,
                                                            const StoreOptions& options);
  // Over a persistent store, which it owns; starts at the store's version.
  static Expected<std::unique_ptr<EmbeddingStore>> overStore(std::unique_ptr<RocksDbStore> store,
                                                             const StoreOptions& options);
  ~EmbeddingStore();

  const std::vector<TableInfo>& tables() const { return tables_; }
  int tableIndex(std::string_view name) const;  // -1 if none
  // The persistent tier, or null for an in-memory store.
  RocksDbStore* persistent() const { return persistent_.get(); }

  // In-memory stores only: stores rows first_id .. first_id+count-1 of `table` (count*dim floats,
  // row-major) in the host tier, overwriting them in the cache if there.
  Status loadRows(int table, int64_t first_id, int64_t count, const float* rows);

  // Writes the row of each ids[i] of `table` to out + i*dim. ids are in [0, rows) (else an error
  // naming the table and the id) and, for the counters to mean ids, distinct. Tier by tier: cache,
  // host, persistent; a row found below a tier is inserted into it (evicting as needed). Many
  // lookups may run at once.
  Status lookup(int table, std::span<const int64_t> ids, float* out);

  // New values of rows of one table: rows holds ids.size() rows of dim floats.
  struct RowUpdate {
    int table = 0;
    std::vector<int64_t> ids;
    std::vector<float> rows;
  };
  // Applies `updates`, in order, as model version `version`. With a persistent store, its rows and
  // the version are written first, in one WriteBatch (all or nothing; on failure no tier changes).
  // Then rows the host and cache tiers hold are overwritten in place; absent ones are not inserted
  // (an in-memory store's host tier, which holds every row, takes them all). Waits for running
  // lookups and holds new ones back until done.
  Status apply(const std::vector<RowUpdate>& updates, int64_t version);

  int64_t version() const;
  // With a persistent store, also writes the version there.
  Status setVersion(int64_t version);

  // What each tier of a table was asked (ids), found, and evicted. Atomic counters, read without
  // stopping lookups.
  struct TierCounters {
    uint64_t lookups = 0, hits = 0, evictions = 0;
  };
  struct TableCounters {
    TierCounters cache, host, persistent;
  };
  std::vector<TableCounters> counters() const;

  // Rows each tier of a table can hold and holds (for /metrics). The persistent tier holds them all.
  struct TableResidency {
    int64_t cache_capacity = 0, cache_rows = 0;
    int64_t host_capacity = 0, host_rows = 0;
  };
  std::vector<TableResidency> residency() const;

 private:
  struct Table;
  EmbeddingStore(std::vector<TableInfo> tables, std::unique_ptr<RocksDbStore> persistent);
  static Expected<std::unique_ptr<EmbeddingStore>> make(std::vector<TableInfo> tables,
                                                        std::unique_ptr<RocksDbStore> persistent,
                                                        const StoreOptions& options);
  Status checkIds(int table, std::span<const int64_t> ids) const;

  std::vector<TableInfo> tables_;
  std::vector<std::unique_ptr<Table>> tiers_;
  std::unique_ptr<RocksDbStore> persistent_;
  std::atomic<int64_t> version_{0};
  // Lookups share it; apply, loadRows and setVersion hold it alone.
  mutable std::shared_mutex update_mu_;
};

}  // namespace kiln::serving
