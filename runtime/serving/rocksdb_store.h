// The persistent tier of the serving embedding store: every row of every table in a RocksDB
// database, read and written through RocksDB's C API. librocksdb is opened at run time (dlopen),
// never linked: the ahead-of-time runner must start on machines without RocksDB, as it does
// without CUDA, and only `kiln serve --store` needs it.
//
// Layout of the database:
//   'r' + table index (u32, big-endian) + row id (u64, big-endian)  ->  dim float32s, as in memory
//                                                                       (little-endian)
//   "kiln.store"    ->  "kiln.store <format version>\n" then "table <rows> <dim> <name>\n" per
//                       table, in order
//   "kiln.version"  ->  the model version (the training step the rows come from), in decimal
//   "kiln.importing" -> present while an import fills the store (from create to finishImport)
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::serving {

struct TableInfo {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
};

// Ok when every table has a name (distinct, without line breaks) and positive rows and dim.
Status checkTables(const std::vector<TableInfo>& tables);

// New values of some rows of one table: rows + i*dim holds the row of ids[i].
struct RowWrite {
  int table = 0;
  std::span<const int64_t> ids;
  const float* rows = nullptr;
};

class RocksDbStore {
 public:
  // Ok when librocksdb loads and has every function the store uses; else the error a user sees.
  static Status available();

  // A new store in `dir` (made if missing) for `tables`, at version 0 and marked incomplete
  // (complete() is false) until finishImport. Error if `dir` already holds a database.
  static Expected<std::unique_ptr<RocksDbStore>> create(const std::string& dir,
                                                        const std::vector<TableInfo>& tables);
  // The store in `dir`, read-write. Errors name `dir`: missing, not a RocksDB database, no or a
  // garbled Kiln metadata record.
  static Expected<std::unique_ptr<RocksDbStore>> open(const std::string& dir);

  ~RocksDbStore();
  RocksDbStore(const RocksDbStore&) = delete;
  RocksDbStore& operator=(const RocksDbStore&) = delete;

  const std::string& dir() const { return dir_; }
  const std::vector<TableInfo>& tables() const { return tables_; }
  // The index of the table called `name`, or -1.
  int tableIndex(std::string_view name) const;

  // Writes rows + i*dim as the row of ids[i] of `table`, all or none (one WriteBatch).
  Status putRows(int table, std::span<const int64_t> ids, const float* rows);
  // Reads the row of each ids[i] of `table` into out + i*dim; found[i] says whether the store holds
  // it (found is resized to ids.size()). A stored value of the wrong size is a corruption error.
  Status getRows(int table, std::span<const int64_t> ids, float* out, std::vector<uint8_t>& found);
  // Writes the rows of every write, and the version if given, all or none (one WriteBatch).
  Status write(const std::vector<RowWrite>& writes, std::optional<int64_t> version);

  Status setVersion(int64_t version);
  int64_t version() const { return version_.load(std::memory_order_acquire); }
  // Sets the version and clears the mark create() set, in one write: the import's last step.
  Status finishImport(int64_t version);
  // False for a store whose import did not finish (stopped halfway): kiln serve refuses it.
  bool complete() const { return complete_; }

 private:
  struct Handles;
  RocksDbStore(std::string dir, std::vector<TableInfo> tables, std::unique_ptr<Handles> handles,
               int64_t version);
  Status checkRows(int table, std::span<const int64_t> ids) const;

  std::string dir_;
  std::vector<TableInfo> tables_;
  std::unique_ptr<Handles> handles_;
  std::atomic<int64_t> version_;
  bool complete_ = true;
};

}  // namespace kiln::serving
