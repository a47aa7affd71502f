// The tiered embedding store of `kiln serve`: the row cache and host tier (eviction, counters,
// concurrency), the RocksDB tier (layout, errors, atomic writes) and the store over all three.
// Every row is checked bit for bit against a plain copy of the table kept by the test.
#include "runtime/serving/embedding_store.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <rocksdb/c.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

namespace kiln::serving {
namespace {

namespace fs = std::filesystem;

// A table of rows*dim floats with random bits: NaNs with all sorts of payloads, infinities,
// subnormals. A few fixed values make sure of the awkward ones.
std::vector<float> randomTable(int64_t rows, int64_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> table(rows * dim);
  for (float& v : table) v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  const uint32_t awkward[] = {0x80000000u /* -0.0 */, 0x7fc12345u /* quiet NaN, payload */,
                              0x7f800001u /* signalling NaN */, 0xffbfffffu /* negative NaN */,
                              0x00000001u /* smallest subnormal */};
  for (size_t i = 0; i < std::size(awkward) && i < table.size(); ++i)
    table[i] = std::bit_cast<float>(awkward[i]);
  return table;
}

// `count` distinct ids in [0, rows), in random order.
std::vector<int64_t> uniqueIds(std::mt19937& rng, int64_t rows, size_t count) {
  std::vector<int64_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  for (size_t i = 0; i < count; ++i) {
    std::uniform_int_distribution<int64_t> pick(static_cast<int64_t>(i), rows - 1);
    std::swap(all[i], all[pick(rng)]);
  }
  all.resize(count);
  return all;
}

// The rows of `ids` gathered from `table`.
std::vector<float> gather(const std::vector<float>& table, int64_t dim, std::span<const int64_t> ids) {
  std::vector<float> rows(ids.size() * dim);
  for (size_t i = 0; i < ids.size(); ++i)
    std::copy_n(table.data() + ids[i] * dim, dim, rows.data() + i * dim);
  return rows;
}

// How many of the rows in `got` (row i for ids[i]) differ in any bit from the table's.
size_t mismatches(const std::vector<float>& table, int64_t dim, std::span<const int64_t> ids,
                  const float* got) {
  size_t bad = 0;
  for (size_t i = 0; i < ids.size(); ++i)
    if (std::memcmp(got + i * dim, table.data() + ids[i] * dim, dim * sizeof(float)) != 0) ++bad;
  return bad;
}

bool sameBits(const float* a, const float* b, int64_t dim) {
  return std::memcmp(a, b, dim * sizeof(float)) == 0;
}

std::vector<float> rowOf(float seed, int64_t dim) {
  std::vector<float> row(dim);
  for (int64_t d = 0; d < dim; ++d) row[d] = seed + 0.25f * static_cast<float>(d);
  return row;
}

// ---------------------------------------------------------------------------------------------
// RowCache

TEST(RowCacheTest, LruEvictsTheLeastRecentlyUsedRow) {
  RowCache cache(3, 2, EvictionPolicy::Lru, /*shards=*/1);
  for (int64_t id : {1, 2, 3}) ASSERT_TRUE(cache.put(id, rowOf(id, 2).data()));
  std::vector<float> out(2);
  ASSERT_TRUE(cache.get(1, out.data()));  // order of use, oldest first: 2 3 1
  EXPECT_TRUE(sameBits(out.data(), rowOf(1, 2).data(), 2));
  ASSERT_TRUE(cache.put(4, rowOf(4, 2).data()));  // evicts 2
  EXPECT_FALSE(cache.contains(2));
  EXPECT_TRUE(cache.contains(1) && cache.contains(3) && cache.contains(4));
  ASSERT_TRUE(cache.get(3, out.data()));          // 1 4 3
  ASSERT_TRUE(cache.put(5, rowOf(5, 2).data()));  // evicts 1
  EXPECT_FALSE(cache.contains(1));
  EXPECT_TRUE(cache.contains(3) && cache.contains(4) && cache.contains(5));
  // Re-inserting a present row overwrites it and is not a use: 4 is still the oldest.
  ASSERT_TRUE(cache.put(4, rowOf(40, 2).data()));
  ASSERT_TRUE(cache.put(6, rowOf(6, 2).data()));  // evicts 4
  EXPECT_FALSE(cache.contains(4));
  EXPECT_FALSE(cache.get(2, out.data()));
  EXPECT_EQ(cache.size(), 3);
  RowTierCounters c = cache.counters();
  EXPECT_EQ(c.lookups, 3u);
  EXPECT_EQ(c.hits, 2u);
  EXPECT_EQ(c.evictions, 3u);
}

TEST(RowCacheTest, LfuEvictsTheLeastFrequentlyUsedRow) {
  RowCache cache(3, 2, EvictionPolicy::Lfu, /*shards=*/1);
  std::vector<float> out(2);
  for (int64_t id : {1, 2, 3}) ASSERT_TRUE(cache.put(id, rowOf(id, 2).data()));  // uses 1 1 1
  ASSERT_TRUE(cache.get(1, out.data()));
  ASSERT_TRUE(cache.get(1, out.data()));
  ASSERT_TRUE(cache.get(2, out.data()));          // uses: 1:3 2:2 3:1
  ASSERT_TRUE(cache.put(4, rowOf(4, 2).data()));  // evicts 3, the least used
  EXPECT_FALSE(cache.contains(3));
  ASSERT_TRUE(cache.get(4, out.data()));
  ASSERT_TRUE(cache.get(4, out.data()));  // uses: 1:3 2:2 4:3
  EXPECT_TRUE(sameBits(out.data(), rowOf(4, 2).data(), 2));
  ASSERT_TRUE(cache.put(5, rowOf(5, 2).data()));  // evicts 2
  EXPECT_FALSE(cache.contains(2));
  EXPECT_TRUE(cache.contains(1) && cache.contains(4) && cache.contains(5));
  // A new row is the least used at once: the next insertion evicts it, not the old favourites.
  ASSERT_TRUE(cache.put(6, rowOf(6, 2).data()));  // evicts 5
  EXPECT_FALSE(cache.contains(5));
  EXPECT_TRUE(cache.contains(1) && cache.contains(4) && cache.contains(6));
  RowTierCounters c = cache.counters();
  EXPECT_EQ(c.lookups, 5u);
  EXPECT_EQ(c.hits, 5u);
  EXPECT_EQ(c.evictions, 3u);
}

TEST(RowCacheTest, LfuBreaksTiesByLeastRecentUse) {
  RowCache cache(2, 1, EvictionPolicy::Lfu, /*shards=*/1);
  float v = 0, out = 0;
  ASSERT_TRUE(cache.put(10, &v));
  ASSERT_TRUE(cache.put(20, &v));
  ASSERT_TRUE(cache.get(10, &out));
  ASSERT_TRUE(cache.get(20, &out));  // both used twice; 10 less recently
  ASSERT_TRUE(cache.put(30, &v));
  EXPECT_FALSE(cache.contains(10));
  EXPECT_TRUE(cache.contains(20) && cache.contains(30));
}

TEST(RowCacheTest, ShardedCacheHoldsItsCapacityWithExactRows) {
  const int64_t dim = 4, rows = 1000;
  std::vector<float> table = randomTable(rows, dim, 1);
  RowCache cache(100, dim, EvictionPolicy::Lru, /*shards=*/4);
  EXPECT_EQ(cache.shardCount(), 4);
  std::vector<int64_t> ids(rows);
  std::iota(ids.begin(), ids.end(), 0);
  ASSERT_TRUE(cache.insert(ids, table.data()));
  // 1000 hashed ids fill each shard's share of 25.
  EXPECT_EQ(cache.size(), 100);
  EXPECT_EQ(cache.counters().evictions, 900u);
  std::vector<float> out(rows * dim);
  std::vector<uint8_t> found(rows);
  EXPECT_EQ(cache.lookup(ids, out.data(), found), 100u);
  std::vector<int64_t> held;
  for (int64_t id = 0; id < rows; ++id) {
    EXPECT_EQ(found[id] != 0, cache.contains(id));
    if (found[id]) {
      held.push_back(id);
      EXPECT_TRUE(sameBits(out.data() + id * dim, table.data() + id * dim, dim)) << "row " << id;
    }
  }
  EXPECT_EQ(held.size(), 100u);
  RowTierCounters c = cache.counters();
  EXPECT_EQ(c.lookups, 1000u);
  EXPECT_EQ(c.hits, 100u);
}

TEST(RowCacheTest, UpdateOverwritesOnlyRowsItHolds) {
  RowCache cache(4, 3, EvictionPolicy::Lru, 1);
  std::vector<int64_t> ids = {7, 8};
  std::vector<float> rows = randomTable(2, 3, 2);
  ASSERT_TRUE(cache.insert(ids, rows.data()));
  std::vector<int64_t> update_ids = {8, 9};
  std::vector<float> update_rows = randomTable(2, 3, 3);
  EXPECT_EQ(cache.update(update_ids, update_rows.data()), 1u);
  EXPECT_FALSE(cache.contains(9));
  std::vector<float> out(3);
  ASSERT_TRUE(cache.get(8, out.data()));
  EXPECT_TRUE(sameBits(out.data(), update_rows.data(), 3));
  ASSERT_TRUE(cache.get(7, out.data()));
  EXPECT_TRUE(sameBits(out.data(), rows.data(), 3));
}

TEST(RowCacheTest, ZeroCapacityIsOff) {
  RowCache cache(0, 4, EvictionPolicy::Lfu);
  EXPECT_FALSE(cache.enabled());
  std::vector<float> row(4, 1.0f);
  cache.put(1, row.data());
  EXPECT_FALSE(cache.get(1, row.data()));
  EXPECT_EQ(cache.size(), 0);
  RowTierCounters c = cache.counters();
  EXPECT_EQ(c.lookups + c.hits + c.evictions, 0u);
}

// ---------------------------------------------------------------------------------------------
// HostRowStore

TEST(HostRowStoreTest, ConcurrentInsertsAndLookupsOfAWholeTableAreExact) {
  const int64_t rows = 20000, dim = 8;
  const int threads = 8;
  std::vector<float> table = randomTable(rows, dim, 4);
  std::unique_ptr<HostRowStore> host = HostRowStore::wholeTable(rows, dim, /*shards=*/8);
  std::atomic<size_t> bad{0}, lookups{0}, hits{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      // Thread t inserts ids t, t+8, ... in batches of 50; between batches it looks up random
      // ids of the whole table, of which the others' may or may not be there yet.
      std::vector<int64_t> mine;
      for (int64_t id = t; id < rows; id += threads) mine.push_back(id);
      for (size_t start = 0; start < mine.size(); start += 50) {
        std::span<const int64_t> batch(mine.data() + start, std::min<size_t>(50, mine.size() - start));
        std::vector<float> values = gather(table, dim, batch);
        if (!host->insert(batch, values.data())) ++bad;
        std::vector<int64_t> ids = uniqueIds(rng, rows, 40);
        std::vector<float> out(ids.size() * dim);
        std::vector<uint8_t> found(ids.size());
        size_t n = host->lookup(ids, out.data(), found);
        lookups += ids.size();
        hits += n;
        for (size_t i = 0; i < ids.size(); ++i)
          if (found[i] && !sameBits(out.data() + i * dim, table.data() + ids[i] * dim, dim)) ++bad;
      }
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_EQ(host->size(), rows);
  EXPECT_EQ(host->counters().lookups, lookups.load());
  EXPECT_EQ(host->counters().hits, hits.load());
  EXPECT_EQ(host->counters().evictions, 0u);
  std::vector<int64_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  std::vector<float> out(rows * dim);
  std::vector<uint8_t> found(rows);
  EXPECT_EQ(host->lookup(all, out.data(), found), static_cast<size_t>(rows));
  EXPECT_EQ(mismatches(table, dim, all, out.data()), 0u);
  // It holds the table and nothing more.
  std::vector<float> extra(dim, 0.0f);
  EXPECT_FALSE(host->put(rows, extra.data()));
  EXPECT_EQ(host->size(), rows);
}

TEST(HostRowStoreTest, ConcurrentEvictingTierReturnsExactRows) {
  const int64_t rows = 5000, dim = 8;
  std::vector<float> table = randomTable(rows, dim, 5);
  HostRowStore host(500, dim, EvictionPolicy::Lfu, /*shards=*/8);
  std::atomic<size_t> bad{0}, lookups{0}, hits{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 6; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(200 + t);
      for (int b = 0; b < 300; ++b) {
        std::vector<int64_t> ids = uniqueIds(rng, rows, 32);
        // A skewed mix: half the ids from the first 200 rows, which should come to stay.
        for (size_t i = 0; i < ids.size() / 2; ++i) ids[i] = ids[i] % 200;
        std::sort(ids.begin(), ids.end());
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        std::vector<float> out(ids.size() * dim);
        std::vector<uint8_t> found(ids.size());
        hits += host.lookup(ids, out.data(), found);
        lookups += ids.size();
        std::vector<int64_t> missed;
        for (size_t i = 0; i < ids.size(); ++i) {
          if (found[i] && !sameBits(out.data() + i * dim, table.data() + ids[i] * dim, dim)) ++bad;
          if (!found[i]) missed.push_back(ids[i]);
        }
        std::vector<float> values = gather(table, dim, missed);
        host.insert(missed, values.data());
      }
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_LE(host.size(), 500);
  RowTierCounters c = host.counters();
  EXPECT_EQ(c.lookups, lookups.load());
  EXPECT_EQ(c.hits, hits.load());
  EXPECT_GT(c.hits, 0u);
  EXPECT_GT(c.evictions, 0u);
}

// ---------------------------------------------------------------------------------------------
// RocksDbStore

// A directory under the system's temporary one, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / fmt::format("kiln_store_test_{}_{}", getpid(), counter++);
    fs::remove_all(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  fs::path path() const { return path_; }

 private:
  fs::path path_;
};

#define SKIP_WITHOUT_ROCKSDB()                                                \
  do {                                                                        \
    if (Status available = RocksDbStore::available(); !available)             \
      GTEST_SKIP() << "librocksdb cannot be loaded: " << available.message(); \
  } while (0)

// A RocksDB database written directly, for what a Kiln store never writes: no metadata, garbled
// records, rows of the wrong size.
class RawRocksDb {
 public:
  explicit RawRocksDb(const std::string& dir) {
    lib_ = dlopen("librocksdb.so.7.8", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) lib_ = dlopen("librocksdb.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) return;
    options_create_ = reinterpret_cast<decltype(options_create_)>(dlsym(lib_, "rocksdb_options_create"));
    options_destroy_ = reinterpret_cast<decltype(options_destroy_)>(dlsym(lib_, "rocksdb_options_destroy"));
    create_if_missing_ =
        reinterpret_cast<decltype(create_if_missing_)>(dlsym(lib_, "rocksdb_options_set_create_if_missing"));
    open_ = reinterpret_cast<decltype(open_)>(dlsym(lib_, "rocksdb_open"));
    close_ = reinterpret_cast<decltype(close_)>(dlsym(lib_, "rocksdb_close"));
    put_ = reinterpret_cast<decltype(put_)>(dlsym(lib_, "rocksdb_put"));
    write_options_create_ =
        reinterpret_cast<decltype(write_options_create_)>(dlsym(lib_, "rocksdb_writeoptions_create"));
    write_options_destroy_ =
        reinterpret_cast<decltype(write_options_destroy_)>(dlsym(lib_, "rocksdb_writeoptions_destroy"));
    rocksdb_options_t* options = options_create_();
    create_if_missing_(options, 1);
    char* err = nullptr;
    db_ = open_(options, dir.c_str(), &err);
    options_destroy_(options);
    if (err) {
      error_ = err;
      std::free(err);
      db_ = nullptr;
    }
    write_options_ = write_options_create_();
  }
  ~RawRocksDb() {
    if (write_options_) write_options_destroy_(write_options_);
    if (db_) close_(db_);
    if (lib_) dlclose(lib_);
  }
  bool ok() const { return db_ != nullptr; }
  const std::string& error() const { return error_; }
  void put(std::string_view key, std::string_view value) {
    char* err = nullptr;
    put_(db_, write_options_, key.data(), key.size(), value.data(), value.size(), &err);
    ASSERT_EQ(err, nullptr) << err;
  }

 private:
  void* lib_ = nullptr;
  rocksdb_t* db_ = nullptr;
  rocksdb_writeoptions_t* write_options_ = nullptr;
  std::string error_ = "librocksdb not loaded";
  decltype(&rocksdb_options_create) options_create_ = nullptr;
  decltype(&rocksdb_options_destroy) options_destroy_ = nullptr;
  decltype(&rocksdb_options_set_create_if_missing) create_if_missing_ = nullptr;
  decltype(&rocksdb_open) open_ = nullptr;
  decltype(&rocksdb_close) close_ = nullptr;
  decltype(&rocksdb_put) put_ = nullptr;
  decltype(&rocksdb_writeoptions_create) write_options_create_ = nullptr;
  decltype(&rocksdb_writeoptions_destroy) write_options_destroy_ = nullptr;
};

// The key of a row, spelled out byte by byte as the layout documents it.
std::string rowKeyOf(uint32_t table, uint64_t id) {
  std::string key = "r";
  for (int b = 3; b >= 0; --b) key += static_cast<char>(table >> (8 * b));
  for (int b = 7; b >= 0; --b) key += static_cast<char>(id >> (8 * b));
  return key;
}

// Issue 35: an import stopped halfway left a store at version 0 that served a checkpoint of step
// 0 with its rows missing (500 on every request). A store is incomplete from create() until
// finishImport(), across reopening, and finishImport sets the version in the same write.
TEST(RocksDbStoreTest, AStoreIsCompleteOnlyOnceItsImportFinishes) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(dir.str(), {{"t", 10, 2}});
    ASSERT_TRUE(store) << store.status().message();
    EXPECT_FALSE((*store)->complete());
    const std::vector<int64_t> ids = {0, 1};
    const float rows[4] = {1, 2, 3, 4};
    ASSERT_TRUE((*store)->putRows(0, ids, rows));
    // Stopped here: the rest of the rows never written.
  }
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::open(dir.str());
    ASSERT_TRUE(store) << store.status().message();
    EXPECT_FALSE((*store)->complete());
    EXPECT_EQ((*store)->version(), 0);
    // An update's version move is not the import's end.
    ASSERT_TRUE((*store)->setVersion(3));
    EXPECT_FALSE((*store)->complete());
    Status s = (*store)->finishImport(7);
    ASSERT_TRUE(s) << s.message();
    EXPECT_TRUE((*store)->complete());
    EXPECT_EQ((*store)->version(), 7);
  }
  Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::open(dir.str());
  ASSERT_TRUE(store) << store.status().message();
  EXPECT_TRUE((*store)->complete());
  EXPECT_EQ((*store)->version(), 7);
}

TEST(RocksDbStoreTest, RowsRoundTripBitExactAcrossReopen) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  const std::vector<TableInfo> infos = {{"user", 1000, 8}, {"item", 300, 4}};
  std::vector<std::vector<float>> tables = {randomTable(1000, 8, 6), randomTable(300, 4, 7)};
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(dir.str(), infos);
    ASSERT_TRUE(store) << store.status().message();
    EXPECT_EQ((*store)->version(), 0);
    for (int t = 0; t < 2; ++t) {
      // Every row but the last ten, in batches.
      for (int64_t start = 0; start < infos[t].rows - 10; start += 128) {
        std::vector<int64_t> ids(std::min<int64_t>(128, infos[t].rows - 10 - start));
        std::iota(ids.begin(), ids.end(), start);
        std::vector<float> rows = gather(tables[t], infos[t].dim, ids);
        ASSERT_TRUE((*store)->putRows(t, ids, rows.data()));
      }
    }
    Status s = (*store)->setVersion(42);
    ASSERT_TRUE(s) << s.message();
    EXPECT_EQ((*store)->version(), 42);
  }
  Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::open(dir.str());
  ASSERT_TRUE(store) << store.status().message();
  RocksDbStore& db = **store;
  ASSERT_EQ(db.tables().size(), 2u);
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(db.tables()[t].name, infos[t].name);
    EXPECT_EQ(db.tables()[t].rows, infos[t].rows);
    EXPECT_EQ(db.tables()[t].dim, infos[t].dim);
  }
  EXPECT_EQ(db.tableIndex("item"), 1);
  EXPECT_EQ(db.tableIndex("nope"), -1);
  EXPECT_EQ(db.version(), 42);
  for (int t = 0; t < 2; ++t) {
    std::vector<int64_t> ids(infos[t].rows);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(8));
    std::vector<float> out(ids.size() * infos[t].dim);
    std::vector<uint8_t> found;
    ASSERT_TRUE(db.getRows(t, ids, out.data(), found));
    ASSERT_EQ(found.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      bool written = ids[i] < infos[t].rows - 10;
      EXPECT_EQ(found[i] != 0, written) << "table " << t << " row " << ids[i];
      if (written) {
        EXPECT_TRUE(
            sameBits(out.data() + i * infos[t].dim, tables[t].data() + ids[i] * infos[t].dim, infos[t].dim))
            << "table " << t << " row " << ids[i];
      }
    }
  }
  // The awkward values at the start of table 0 (-0.0, NaN payloads) came back as written.
  std::vector<float> row0(8);
  std::vector<uint8_t> found;
  int64_t zero = 0;
  ASSERT_TRUE(db.getRows(0, std::span<const int64_t>(&zero, 1), row0.data(), found));
  EXPECT_EQ(std::bit_cast<uint32_t>(row0[0]), 0x80000000u);
  EXPECT_EQ(std::bit_cast<uint32_t>(row0[1]), 0x7fc12345u);
  EXPECT_EQ(std::bit_cast<uint32_t>(row0[2]), 0x7f800001u);
  // Ids out of range are errors naming the table.
  int64_t bad = 1000;
  Status s = db.getRows(0, std::span<const int64_t>(&bad, 1), row0.data(), found);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'user'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("1000"), std::string::npos) << s.message();
  s = db.putRows(1, std::span<const int64_t>(&bad, 1), row0.data());
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'item'"), std::string::npos) << s.message();
}

TEST(RocksDbStoreTest, MultiTableWriteIsOneAtomicUpdate) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  Expected<std::unique_ptr<RocksDbStore>> created =
      RocksDbStore::create(dir.str(), {{"a", 100, 4}, {"b", 50, 2}});
  ASSERT_TRUE(created) << created.status().message();
  RocksDbStore& db = **created;
  std::vector<int64_t> a_ids = {3, 1, 99}, b_ids = {0, 49};
  std::vector<float> a_rows = randomTable(3, 4, 9), b_rows = randomTable(2, 2, 10);
  Status s = db.write({{0, a_ids, a_rows.data()}, {1, b_ids, b_rows.data()}}, 7);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(db.version(), 7);
  std::vector<float> out(3 * 4);
  std::vector<uint8_t> found;
  ASSERT_TRUE(db.getRows(0, a_ids, out.data(), found));
  EXPECT_EQ(found, std::vector<uint8_t>({1, 1, 1}));
  EXPECT_TRUE(sameBits(out.data(), a_rows.data(), 12));
  ASSERT_TRUE(db.getRows(1, b_ids, out.data(), found));
  EXPECT_EQ(found, std::vector<uint8_t>({1, 1}));
  EXPECT_TRUE(sameBits(out.data(), b_rows.data(), 4));

  // A write with one bad id writes nothing: not table a's rows, not the version.
  std::vector<int64_t> a2_ids = {5}, b2_ids = {50};
  std::vector<float> a2_rows = randomTable(1, 4, 11);
  s = db.write({{0, a2_ids, a2_rows.data()}, {1, b2_ids, b_rows.data()}}, 8);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'b'"), std::string::npos) << s.message();
  EXPECT_EQ(db.version(), 7);
  ASSERT_TRUE(db.getRows(0, a2_ids, out.data(), found));
  EXPECT_EQ(found, std::vector<uint8_t>({0}));
  created->reset();  // closes it
  Expected<std::unique_ptr<RocksDbStore>> reopened = RocksDbStore::open(dir.str());
  ASSERT_TRUE(reopened) << reopened.status().message();
  EXPECT_EQ((*reopened)->version(), 7);
}

TEST(RocksDbStoreTest, OpenErrorsNameTheDirectory) {
  SKIP_WITHOUT_ROCKSDB();
  auto expectError = [](const std::string& dir, const std::string& what) {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::open(dir);
    ASSERT_FALSE(store) << dir;
    EXPECT_NE(store.status().message().find(dir), std::string::npos) << store.status().message();
    EXPECT_NE(store.status().message().find(what), std::string::npos) << store.status().message();
  };
  TempDir missing;
  expectError(missing.str(), "does not exist");

  TempDir plain;
  fs::create_directories(plain.path());
  std::ofstream(plain.path() / "notes.txt") << "not a database\n";
  expectError(plain.str(), "not a RocksDB database");
  EXPECT_FALSE(fs::exists(plain.path() / "LOCK"));  // opening it left nothing behind

  TempDir foreign;
  {
    RawRocksDb raw(foreign.str());
    ASSERT_TRUE(raw.ok()) << raw.error();
    raw.put("some", "thing");
  }
  expectError(foreign.str(), "not a Kiln store");

  for (std::string garbage :
       {"hello", "kiln.store 1\ntable x 4 t\n", "kiln.store 1\ntable 10 4 t\ntable 10 4 t\n",
        "kiln.store 2\ntable 10 4 t\n", "kiln.store 1\ntable 10 4 t"}) {
    TempDir garbled;
    {
      Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(garbled.str(), {{"t", 10, 4}});
      ASSERT_TRUE(store) << store.status().message();
    }
    {
      RawRocksDb raw(garbled.str());
      ASSERT_TRUE(raw.ok()) << raw.error();
      raw.put("kiln.store", garbage);
    }
    expectError(garbled.str(), "garbled kiln.store");
  }

  TempDir bad_version;
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(bad_version.str(), {{"t", 10, 4}});
    ASSERT_TRUE(store) << store.status().message();
  }
  {
    RawRocksDb raw(bad_version.str());
    ASSERT_TRUE(raw.ok()) << raw.error();
    raw.put("kiln.version", "12x");
  }
  expectError(bad_version.str(), "kiln.version");
}

TEST(RocksDbStoreTest, CreateOverAnExistingStoreFails) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(dir.str(), {{"t", 10, 4}});
    ASSERT_TRUE(store) << store.status().message();
  }
  Expected<std::unique_ptr<RocksDbStore>> again = RocksDbStore::create(dir.str(), {{"t", 10, 4}});
  ASSERT_FALSE(again);
  EXPECT_NE(again.status().message().find(dir.str()), std::string::npos) << again.status().message();
  // Bad tables are refused before anything is written.
  TempDir other;
  Expected<std::unique_ptr<RocksDbStore>> bad = RocksDbStore::create(other.str(), {{"t", 10, 0}});
  ASSERT_FALSE(bad);
  EXPECT_FALSE(fs::exists(other.path()));
}

TEST(RocksDbStoreTest, RowOfTheWrongSizeIsCorruption) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  {
    Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::create(dir.str(), {{"emb", 10, 4}});
    ASSERT_TRUE(store) << store.status().message();
  }
  {
    RawRocksDb raw(dir.str());
    ASSERT_TRUE(raw.ok()) << raw.error();
    raw.put(rowKeyOf(0, 6), "abc");
    // A row written by hand, with the documented key and value layout, reads back.
    std::vector<float> row = randomTable(1, 4, 12);
    raw.put(rowKeyOf(0, 9), std::string_view(reinterpret_cast<const char*>(row.data()), 16));
  }
  Expected<std::unique_ptr<RocksDbStore>> store = RocksDbStore::open(dir.str());
  ASSERT_TRUE(store) << store.status().message();
  std::vector<int64_t> ids = {9};
  std::vector<float> out(4);
  std::vector<uint8_t> found;
  ASSERT_TRUE((*store)->getRows(0, ids, out.data(), found));
  EXPECT_TRUE(sameBits(out.data(), randomTable(1, 4, 12).data(), 4));
  ids = {6};
  Status s = (*store)->getRows(0, ids, out.data(), found);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("corrupt"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'emb' row 6"), std::string::npos) << s.message();
}

// ---------------------------------------------------------------------------------------------
// EmbeddingStore over RocksDB

// A store larger than the cache and host tiers: "ads" has 5000 rows of 16; the cache holds 1% and
// the host 5% of them.
class TieredStoreTest : public ::testing::TestWithParam<EvictionPolicy> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_ROCKSDB();
    infos_ = {{"ads", 5000, 16}, {"users", 2000, 8}};
    tables_ = {randomTable(5000, 16, 20), randomTable(2000, 8, 21)};
    Expected<std::unique_ptr<RocksDbStore>> db = RocksDbStore::create(dir_.str(), infos_);
    ASSERT_TRUE(db) << db.status().message();
    for (int t = 0; t < 2; ++t) {
      std::vector<int64_t> ids(infos_[t].rows);
      std::iota(ids.begin(), ids.end(), 0);
      ASSERT_TRUE((*db)->write({{t, ids, tables_[t].data()}}, 3));
    }
    StoreOptions options;
    options.cache_fraction = 0.01;
    options.host_fraction = 0.05;
    options.policy = GetParam();
    Expected<std::unique_ptr<EmbeddingStore>> store = EmbeddingStore::overStore(db.take(), options);
    ASSERT_TRUE(store) << store.status().message();
    store_ = store.take();
  }

  // Looks up `batches` batches of `batch` unique random ids per table from `threads` threads;
  // returns the rows that differ from the test's copy.
  size_t lookUpFromThreads(int threads, int batches, size_t batch, uint32_t seed) {
    std::atomic<size_t> bad{0};
    std::vector<std::thread> workers;
    for (int w = 0; w < threads; ++w) {
      workers.emplace_back([&, w] {
        std::mt19937 rng(seed + w);
        for (int b = 0; b < batches; ++b) {
          int t = b % 2;
          std::vector<int64_t> ids = uniqueIds(rng, infos_[t].rows, batch);
          std::vector<float> out(ids.size() * infos_[t].dim);
          Status s = store_->lookup(t, ids, out.data());
          if (!s) {
            ADD_FAILURE() << s.message();
            ++bad;
            continue;
          }
          bad += mismatches(tables_[t], infos_[t].dim, ids, out.data());
        }
      });
    }
    for (std::thread& w : workers) w.join();
    return bad.load();
  }

  TempDir dir_;
  std::vector<TableInfo> infos_;
  std::vector<std::vector<float>> tables_;
  std::unique_ptr<EmbeddingStore> store_;
};

TEST_P(TieredStoreTest, ConcurrentLookupsReturnExactRows) {
  ASSERT_EQ(store_->tables().size(), 2u);
  EXPECT_EQ(store_->tableIndex("users"), 1);
  EXPECT_EQ(store_->version(), 3);
  std::vector<EmbeddingStore::TableResidency> residency = store_->residency();
  EXPECT_EQ(residency[0].cache_capacity, 50);
  EXPECT_EQ(residency[0].host_capacity, 250);
  EXPECT_EQ(residency[1].cache_capacity, 20);
  EXPECT_EQ(residency[1].host_capacity, 100);
  EXPECT_GT(infos_[0].rows, residency[0].cache_capacity + residency[0].host_capacity);

  EXPECT_EQ(lookUpFromThreads(/*threads=*/4, /*batches=*/200, /*batch=*/64, 30), 0u);

  const uint64_t asked_per_table = 4 * 100 * 64;
  std::vector<EmbeddingStore::TableCounters> counters = store_->counters();
  for (int t = 0; t < 2; ++t) {
    const EmbeddingStore::TableCounters& c = counters[t];
    // Each tier is asked exactly what the tier above it missed, and RocksDB holds everything.
    EXPECT_EQ(c.cache.lookups, asked_per_table);
    EXPECT_EQ(c.host.lookups, c.cache.lookups - c.cache.hits);
    EXPECT_EQ(c.persistent.lookups, c.host.lookups - c.host.hits);
    EXPECT_EQ(c.persistent.hits, c.persistent.lookups);
    EXPECT_GT(c.cache.hits, 0u);
    EXPECT_GT(c.host.hits, 0u);
    EXPECT_GT(c.cache.evictions, 0u);
    EXPECT_GT(c.host.evictions, 0u);
  }
  residency = store_->residency();
  for (int t = 0; t < 2; ++t) {
    EXPECT_GT(residency[t].cache_rows, 0);
    EXPECT_LE(residency[t].cache_rows, residency[t].cache_capacity);
    EXPECT_GT(residency[t].host_rows, 0);
    EXPECT_LE(residency[t].host_rows, residency[t].host_capacity);
  }
  // Out of range ids are errors naming the table and the id.
  std::vector<int64_t> bad = {4, 5000};
  std::vector<float> out(2 * 16);
  Status s = store_->lookup(0, bad, out.data());
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'ads'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("5000"), std::string::npos) << s.message();
}

TEST_P(TieredStoreTest, UpdatesReachEveryTier) {
  // Warm the tiers, then update half of each table's rows, wherever they are.
  EXPECT_EQ(lookUpFromThreads(2, 100, 64, 40), 0u);
  std::mt19937 rng(41);
  std::vector<EmbeddingStore::RowUpdate> updates;
  for (int t = 0; t < 2; ++t) {
    const int64_t dim = infos_[t].dim;
    std::vector<int64_t> ids = uniqueIds(rng, infos_[t].rows, infos_[t].rows / 2);
    std::vector<float> rows = randomTable(ids.size(), dim, 50 + t);
    for (size_t i = 0; i < ids.size(); ++i)
      std::copy_n(rows.data() + i * dim, dim, tables_[t].data() + ids[i] * dim);
    updates.push_back({t, std::move(ids), std::move(rows)});
  }
  Status s = store_->apply(updates, 4);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(store_->version(), 4);
  EXPECT_EQ(store_->persistent()->version(), 4);

  EXPECT_EQ(lookUpFromThreads(4, 150, 64, 60), 0u);
  // Every row, in large batches, and straight from RocksDB.
  for (int t = 0; t < 2; ++t) {
    std::vector<int64_t> all(infos_[t].rows);
    std::iota(all.begin(), all.end(), 0);
    std::vector<float> out(all.size() * infos_[t].dim);
    for (size_t start = 0; start < all.size(); start += 700) {
      std::span<const int64_t> ids(all.data() + start, std::min<size_t>(700, all.size() - start));
      ASSERT_TRUE(store_->lookup(t, ids, out.data() + start * infos_[t].dim));
    }
    EXPECT_EQ(mismatches(tables_[t], infos_[t].dim, all, out.data()), 0u) << "table " << t;
    std::vector<uint8_t> found;
    ASSERT_TRUE(store_->persistent()->getRows(t, all, out.data(), found));
    EXPECT_EQ(mismatches(tables_[t], infos_[t].dim, all, out.data()), 0u) << "table " << t;
  }

  // A bad update changes nothing.
  std::vector<EmbeddingStore::RowUpdate> bad = {{0, {1}, std::vector<float>(16, 1.0f)}, {1, {2}, {1.0f}}};
  ASSERT_FALSE(store_->apply(bad, 5));
  EXPECT_EQ(store_->version(), 4);
  std::vector<int64_t> one = {1};
  std::vector<float> out(16);
  ASSERT_TRUE(store_->lookup(0, one, out.data()));
  EXPECT_EQ(mismatches(tables_[0], 16, one, out.data()), 0u);
}

INSTANTIATE_TEST_SUITE_P(Policies, TieredStoreTest,
                         ::testing::Values(EvictionPolicy::Lru, EvictionPolicy::Lfu),
                         [](const ::testing::TestParamInfo<EvictionPolicy>& info) {
                           return std::string(evictionPolicyName(info.param));
                         });

// Which tier serves a row, before and after an update: the row is overwritten where it is.
TEST(EmbeddingStoreTest, UpdateOverwritesRowsInPlaceInTheirTier) {
  SKIP_WITHOUT_ROCKSDB();
  TempDir dir;
  const int64_t rows = 1000, dim = 4;
  std::vector<float> table = randomTable(rows, dim, 70);
  Expected<std::unique_ptr<RocksDbStore>> db = RocksDbStore::create(dir.str(), {{"t", rows, dim}});
  ASSERT_TRUE(db) << db.status().message();
  std::vector<int64_t> all(rows);
  std::iota(all.begin(), all.end(), 0);
  ASSERT_TRUE((*db)->putRows(0, all, table.data()));
  StoreOptions options;
  options.cache_fraction = 0.01;  // 10 rows
  options.host_fraction = 0.05;   // 50 rows
  Expected<std::unique_ptr<EmbeddingStore>> opened = EmbeddingStore::overStore(db.take(), options);
  ASSERT_TRUE(opened) << opened.status().message();
  EmbeddingStore& store = **opened;

  // Rows 0..49 come from RocksDB; all 50 stay in the host tier, the last 10 in the cache.
  std::vector<int64_t> first(all.begin(), all.begin() + 50);
  std::vector<float> out(50 * dim);
  ASSERT_TRUE(store.lookup(0, first, out.data()));
  EXPECT_EQ(mismatches(table, dim, first, out.data()), 0u);
  EXPECT_EQ(store.counters()[0].persistent.lookups, 50u);

  EmbeddingStore::RowUpdate update{0, {45, 5, 500}, randomTable(3, dim, 71)};
  for (size_t i = 0; i < update.ids.size(); ++i)
    std::copy_n(update.rows.data() + i * dim, dim, table.data() + update.ids[i] * dim);
  ASSERT_TRUE(store.apply({update}, 9));

  auto lookUpOne = [&](int64_t id) {
    EmbeddingStore::TableCounters before = store.counters()[0];
    std::vector<int64_t> ids = {id};
    std::vector<float> row(dim);
    EXPECT_TRUE(store.lookup(0, ids, row.data()));
    EXPECT_EQ(mismatches(table, dim, ids, row.data()), 0u) << "row " << id;
    EmbeddingStore::TableCounters after = store.counters()[0];
    if (after.cache.hits > before.cache.hits) return std::string("cache");
    if (after.host.hits > before.host.hits) return std::string("host");
    return std::string("persistent");
  };
  EXPECT_EQ(lookUpOne(45), "cache");
  EXPECT_EQ(lookUpOne(5), "host");
  EXPECT_EQ(lookUpOne(500), "persistent");
  EXPECT_EQ(lookUpOne(500), "cache");
}

// ---------------------------------------------------------------------------------------------
// EmbeddingStore in memory

TEST(EmbeddingStoreTest, InMemoryStoreServesLoadedRowsExactly) {
  std::vector<TableInfo> infos = {{"a", 3000, 8}, {"b", 100, 3}};
  std::vector<std::vector<float>> tables = {randomTable(3000, 8, 80), randomTable(100, 3, 81)};
  StoreOptions options;
  options.cache_fraction = 0.1;
  options.policy = EvictionPolicy::Lfu;
  Expected<std::unique_ptr<EmbeddingStore>> opened = EmbeddingStore::inMemory(infos, options);
  ASSERT_TRUE(opened) << opened.status().message();
  EmbeddingStore& store = **opened;
  EXPECT_EQ(store.persistent(), nullptr);
  for (int t = 0; t < 2; ++t)
    for (int64_t first = 0; first < infos[t].rows; first += 700) {
      int64_t count = std::min<int64_t>(700, infos[t].rows - first);
      ASSERT_TRUE(store.loadRows(t, first, count, tables[t].data() + first * infos[t].dim));
    }
  EXPECT_EQ(store.residency()[0].host_rows, 3000);
  EXPECT_EQ(store.residency()[0].cache_capacity, 300);

  std::atomic<size_t> bad{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < 3; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937 rng(90 + w);
      for (int b = 0; b < 200; ++b) {
        int t = b % 2;
        std::vector<int64_t> ids = uniqueIds(rng, infos[t].rows, 48);
        std::vector<float> out(ids.size() * infos[t].dim);
        if (!store.lookup(t, ids, out.data())) {
          ++bad;
          continue;
        }
        bad += mismatches(tables[t], infos[t].dim, ids, out.data());
      }
    });
  }
  for (std::thread& w : workers) w.join();
  EXPECT_EQ(bad.load(), 0u);
  EmbeddingStore::TableCounters c = store.counters()[0];
  EXPECT_EQ(c.cache.lookups, 3u * 100 * 48);
  EXPECT_GT(c.cache.hits, 0u);
  EXPECT_EQ(c.host.lookups, c.cache.lookups - c.cache.hits);
  EXPECT_EQ(c.host.hits, c.host.lookups);
  EXPECT_EQ(c.persistent.lookups, 0u);

  // Updates reach the host tier and the cache.
  std::mt19937 rng(95);
  std::vector<int64_t> ids = uniqueIds(rng, 3000, 1500);
  std::vector<float> rows = randomTable(ids.size(), 8, 96);
  for (size_t i = 0; i < ids.size(); ++i) std::copy_n(rows.data() + i * 8, 8, tables[0].data() + ids[i] * 8);
  ASSERT_TRUE(store.apply({{0, ids, rows}}, 12));
  EXPECT_EQ(store.version(), 12);
  std::vector<int64_t> all(3000);
  std::iota(all.begin(), all.end(), 0);
  std::vector<float> out(3000 * 8);
  ASSERT_TRUE(store.lookup(0, all, out.data()));
  EXPECT_EQ(mismatches(tables[0], 8, all, out.data()), 0u);

  // Out of range ids name the table and the id.
  for (int64_t id : {int64_t{100}, int64_t{-1}}) {
    std::vector<int64_t> bad_ids = {0, id};
    Status s = store.lookup(1, bad_ids, out.data());
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("'b'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(std::to_string(id)), std::string::npos) << s.message();
  }
  EXPECT_FALSE(store.loadRows(1, 90, 11, tables[1].data()));
  EXPECT_EQ(store.tableIndex("b"), 1);
  EXPECT_EQ(store.tableIndex("c"), -1);
}

TEST(EmbeddingStoreTest, InMemoryStoreRefusesWhatItCannotServe) {
  StoreOptions options;
  options.host_fraction = 0.5;
  Expected<std::unique_ptr<EmbeddingStore>> partial = EmbeddingStore::inMemory({{"a", 10, 2}}, options);
  ASSERT_FALSE(partial);
  EXPECT_NE(partial.status().message().find("host_fraction"), std::string::npos);
  options = StoreOptions();
  options.cache_fraction = 1.5;
  EXPECT_FALSE(EmbeddingStore::inMemory({{"a", 10, 2}}, options));
  EXPECT_FALSE(EmbeddingStore::inMemory({{"a", 10, 2}, {"a", 5, 2}}, StoreOptions()));

  Expected<std::unique_ptr<EmbeddingStore>> opened = EmbeddingStore::inMemory({{"a", 10, 2}}, StoreOptions());
  ASSERT_TRUE(opened);
  std::vector<float> rows = randomTable(5, 2, 97);
  ASSERT_TRUE((*opened)->loadRows(0, 0, 5, rows.data()));
  std::vector<int64_t> ids = {4, 7};
  std::vector<float> out(4);
  Status s = (*opened)->lookup(0, ids, out.data());
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("row 7 was never loaded"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace kiln::serving
