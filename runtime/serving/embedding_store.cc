#include "runtime/serving/embedding_store.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>

namespace kiln::serving {

struct EmbeddingStore::Table {
  std::unique_ptr<RowCache> cache;
  std::unique_ptr<HostRowStore> host;
  std::atomic<uint64_t> persistent_lookups{0};
  std::atomic<uint64_t> persistent_hits{0};
};

namespace {

Status checkFraction(const char* name, double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    return Status::errorf("{} must be in [0, 1], not {}", name, fraction);
  return Status::ok();
}

// ceil(fraction * rows), forgiving the rounding of the fraction's binary form (0.07 * 100 is
// 7.000000000000001 in doubles, which must give 7 rows, not 8).
int64_t tierRows(double fraction, int64_t rows) {
  double want = fraction * static_cast<double>(rows);
  auto n = static_cast<int64_t>(std::ceil(want * (1.0 - 1e-12)));
  return std::clamp<int64_t>(n, 0, rows);
}

// Copies rows from[i] (dim floats each) of `from` to rows at[i] of `to`.
void scatterRows(const float* from, std::span<const size_t> at, int64_t dim, float* to) {
  for (size_t i = 0; i < at.size(); ++i) std::copy_n(from + i * dim, dim, to + at[i] * dim);
}

}  // namespace

EmbeddingStore::EmbeddingStore(std::vector<TableInfo> tables, std::unique_ptr<RocksDbStore> persistent)
    : tables_(std::move(tables)), persistent_(std::move(persistent)) {}

EmbeddingStore::~EmbeddingStore() = default;

Expected<std::unique_ptr<EmbeddingStore>> EmbeddingStore::make(std::vector<TableInfo> tables,
                                                               std::unique_ptr<RocksDbStore> persistent,
                                                               const StoreOptions& options) {
  KILN_RETURN_IF_ERROR(checkTables(tables));
  KILN_RETURN_IF_ERROR(checkFraction("cache_fraction", options.cache_fraction));
  KILN_RETURN_IF_ERROR(checkFraction("host_fraction", options.host_fraction));
  if (!persistent && options.host_fraction != 1.0)
    return Status::errorf(
        "host_fraction is {}, but without a persistent store (--store) the host tier holds every row: it "
        "must be 1",
        options.host_fraction);
  if (options.shards < 0)
    return Status::errorf("shards must be 0 (automatic) or positive, not {}", options.shards);
  std::unique_ptr<EmbeddingStore> store(new EmbeddingStore(std::move(tables), std::move(persistent)));
  for (const TableInfo& t : store->tables_) {
    auto tiers = std::make_unique<Table>();
    tiers->cache = std::make_unique<RowCache>(tierRows(options.cache_fraction, t.rows), t.dim, options.policy,
                                              options.shards);
    if (store->persistent_)
      tiers->host = std::make_unique<HostRowStore>(tierRows(options.host_fraction, t.rows), t.dim,
                                                   options.policy, options.shards);
    else
      tiers->host = HostRowStore::wholeTable(t.rows, t.dim, options.shards);
    store->tiers_.push_back(std::move(tiers));
  }
  if (store->persistent_) store->version_.store(store->persistent_->version());
  return store;
}

Expected<std::unique_ptr<EmbeddingStore>> EmbeddingStore::inMemory(std::vector<TableInfo> tables,
                                                                   const StoreOptions& options) {
  return make(std::move(tables), nullptr, options);
}

Expected<std::unique_ptr<EmbeddingStore>> EmbeddingStore::overStore(std::unique_ptr<RocksDbStore> store,
                                                                    const StoreOptions& options) {
  if (!store) return Status::error("overStore needs a persistent store");
  std::vector<TableInfo> tables = store->tables();
  return make(std::move(tables), std::move(store), options);
}

int EmbeddingStore::tableIndex(std::string_view name) const {
  for (size_t t = 0; t < tables_.size(); ++t)
    if (tables_[t].name == name) return static_cast<int>(t);
  return -1;
}

Status EmbeddingStore::checkIds(int table, std::span<const int64_t> ids) const {
  if (table < 0 || table >= static_cast<int>(tables_.size()))
    return Status::errorf("no embedding table {} (there are {})", table, tables_.size());
  const TableInfo& t = tables_[table];
  for (int64_t id : ids)
    if (id < 0 || id >= t.rows)
      return Status::errorf("table '{}': row id {} is out of range [0, {})", t.name, id, t.rows);
  return Status::ok();
}

Status EmbeddingStore::loadRows(int table, int64_t first_id, int64_t count, const float* rows) {
  std::unique_lock lock(update_mu_);
  if (persistent_)
    return Status::errorf(
        "loadRows fills in-memory stores; the rows of the store in {} are written with apply",
        persistent_->dir());
  if (table < 0 || table >= static_cast<int>(tables_.size()))
    return Status::errorf("no embedding table {} (there are {})", table, tables_.size());
  const TableInfo& t = tables_[table];
  if (first_id < 0 || count < 0 || count > t.rows - first_id)
    return Status::errorf("table '{}': rows [{}, {} + {}) are out of range [0, {})", t.name, first_id,
                          first_id, count, t.rows);
  std::vector<int64_t> ids(count);
  std::iota(ids.begin(), ids.end(), first_id);
  Table& tiers = *tiers_[table];
  if (!tiers.host->insert(ids, rows))
    return Status::errorf("table '{}': the host tier is full ({} rows)", t.name, tiers.host->capacity());
  tiers.cache->update(ids, rows);
  return Status::ok();
}

Status EmbeddingStore::lookup(int table, std::span<const int64_t> ids, float* out) {
  std::shared_lock lock(update_mu_);
  KILN_RETURN_IF_ERROR(checkIds(table, ids));
  const TableInfo& info = tables_[table];
  Table& tiers = *tiers_[table];
  const int64_t dim = info.dim;

  std::vector<uint8_t> found(ids.size(), 0);
  if (tiers.cache->lookup(ids, out, found) == ids.size()) return Status::ok();

  // The cache's misses, asked of the host tier.
  std::vector<size_t> miss_at;
  for (size_t i = 0; i < ids.size(); ++i)
    if (!found[i]) miss_at.push_back(i);
  std::vector<int64_t> miss_ids(miss_at.size());
  for (size_t i = 0; i < miss_at.size(); ++i) miss_ids[i] = ids[miss_at[i]];
  std::vector<float> miss_rows(miss_at.size() * dim);
  std::vector<uint8_t> miss_found(miss_at.size(), 0);
  tiers.host->lookup(miss_ids, miss_rows.data(), miss_found);

  // The host's misses, asked of the persistent store.
  std::vector<size_t> deep_at;
  for (size_t i = 0; i < miss_at.size(); ++i)
    if (!miss_found[i]) deep_at.push_back(i);
  if (!deep_at.empty()) {
    if (!persistent_)
      return Status::errorf("table '{}': row {} was never loaded", info.name, miss_ids[deep_at[0]]);
    std::vector<int64_t> deep_ids(deep_at.size());
    for (size_t i = 0; i < deep_at.size(); ++i) deep_ids[i] = miss_ids[deep_at[i]];
    std::vector<float> deep_rows(deep_at.size() * dim);
    std::vector<uint8_t> deep_found;
    KILN_RETURN_IF_ERROR(persistent_->getRows(table, deep_ids, deep_rows.data(), deep_found));
    size_t hits = 0;
    for (uint8_t f : deep_found) hits += f;
    tiers.persistent_lookups.fetch_add(deep_ids.size(), std::memory_order_relaxed);
    tiers.persistent_hits.fetch_add(hits, std::memory_order_relaxed);
    for (size_t i = 0; i < deep_ids.size(); ++i)
      if (!deep_found[i])
        return Status::errorf("table '{}': row {} is not in the store in {}", info.name, deep_ids[i],
                              persistent_->dir());
    tiers.host->insert(deep_ids, deep_rows.data());
    scatterRows(deep_rows.data(), deep_at, dim, miss_rows.data());
  }
  tiers.cache->insert(miss_ids, miss_rows.data());
  scatterRows(miss_rows.data(), miss_at, dim, out);
  return Status::ok();
}

Status EmbeddingStore::apply(const std::vector<RowUpdate>& updates, int64_t version) {
  std::unique_lock lock(update_mu_);
  for (const RowUpdate& u : updates) {
    KILN_RETURN_IF_ERROR(checkIds(u.table, u.ids));
    const TableInfo& t = tables_[u.table];
    if (u.rows.size() != u.ids.size() * static_cast<size_t>(t.dim))
      return Status::errorf("update of table '{}': {} ids need {} floats (dim {}), not {}", t.name,
                            u.ids.size(), u.ids.size() * t.dim, t.dim, u.rows.size());
  }
  if (persistent_) {
    std::vector<RowWrite> writes;
    for (const RowUpdate& u : updates) writes.push_back(RowWrite{u.table, u.ids, u.rows.data()});
    KILN_RETURN_IF_ERROR(persistent_->write(writes, version));
  }
  for (const RowUpdate& u : updates) {
    Table& tiers = *tiers_[u.table];
    if (persistent_) {
      tiers.host->update(u.ids, u.rows.data());
    } else if (!tiers.host->insert(u.ids, u.rows.data())) {
      return Status::errorf("table '{}': the host tier is full ({} rows)", tables_[u.table].name,
                            tiers.host->capacity());
    }
    tiers.cache->update(u.ids, u.rows.data());
  }
  version_.store(version, std::memory_order_release);
  return Status::ok();
}

int64_t EmbeddingStore::version() const { return version_.load(std::memory_order_acquire); }

Status EmbeddingStore::setVersion(int64_t version) {
  std::unique_lock lock(update_mu_);
  if (persistent_) KILN_RETURN_IF_ERROR(persistent_->setVersion(version));
  version_.store(version, std::memory_order_release);
  return Status::ok();
}

std::vector<EmbeddingStore::TableCounters> EmbeddingStore::counters() const {
  std::vector<TableCounters> all;
  for (const auto& tiers : tiers_) {
    TableCounters c;
    RowTierCounters cache = tiers->cache->counters();
    RowTierCounters host = tiers->host->counters();
    c.cache = {cache.lookups, cache.hits, cache.evictions};
    c.host = {host.lookups, host.hits, host.evictions};
    c.persistent.lookups = tiers->persistent_lookups.load(std::memory_order_relaxed);
    c.persistent.hits = tiers->persistent_hits.load(std::memory_order_relaxed);
    all.push_back(c);
  }
  return all;
}

std::vector<EmbeddingStore::TableResidency> EmbeddingStore::residency() const {
  std::vector<TableResidency> all;
  for (const auto& tiers : tiers_) {
    TableResidency r;
    r.cache_capacity = tiers->cache->capacity();
    r.cache_rows = tiers->cache->size();
    r.host_capacity = tiers->host->capacity();
    r.host_rows = tiers->host->size();
    all.push_back(r);
  }
  return all;
}

}  // namespace kiln::serving
