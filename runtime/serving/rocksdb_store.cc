#include "runtime/serving/rocksdb_store.h"

#include <dlfcn.h>
// Only for the C API's types and signatures: librocksdb is dlopen'ed, never linked.
#include <rocksdb/c.h>

#include <bit>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

namespace kiln::serving {

// The RocksDB C API functions the store calls, resolved from librocksdb at run time. The
// ahead-of-time runner must start on machines without RocksDB, as it does without CUDA: only
// `kiln serve --store` needs it, so the library is opened with dlopen when a store is created or
// opened, and its absence is an error there, not a loader failure at start-up.
#define KILN_ROCKSDB_FUNCTIONS(X)  \
  X(options_create)                \
  X(options_destroy)               \
  X(options_set_create_if_missing) \
  X(options_set_error_if_exists)   \
  X(open)                          \
  X(close)                         \
  X(readoptions_create)            \
  X(readoptions_destroy)           \
  X(writeoptions_create)           \
  X(writeoptions_destroy)          \
  X(writebatch_create)             \
  X(writebatch_destroy)            \
  X(writebatch_put)                \
  X(writebatch_delete)             \
  X(write)                         \
  X(get)                           \
  X(multi_get)                     \
  X(free)

struct RocksDbApi {
#define KILN_ROCKSDB_MEMBER(fn) decltype(&rocksdb_##fn) fn = nullptr;
  KILN_ROCKSDB_FUNCTIONS(KILN_ROCKSDB_MEMBER)
#undef KILN_ROCKSDB_MEMBER
};

namespace {

static_assert(std::endian::native == std::endian::little,
              "rows are stored as little-endian float32 copied from memory");

constexpr int kFormatVersion = 1;
constexpr std::string_view kMetadataKey = "kiln.store";
constexpr std::string_view kVersionKey = "kiln.version";
// Present from create() until finishImport(): an import that stopped halfway (killed, a full
// disk, a bad checkpoint) leaves a store that says so, rather than one at version 0 that serves
// a checkpoint of step 0 with rows missing (500 on every request). A store made before this
// record existed has none, and is complete.
constexpr std::string_view kImportingKey = "kiln.importing";
constexpr size_t kRowKeyBytes = 1 + 4 + 8;
constexpr int64_t kMaxDim = int64_t{1} << 24;

Expected<RocksDbApi> loadRocksDb() {
  void* lib = nullptr;
  std::string tried;
  for (const char* name : {"librocksdb.so.7.8", "librocksdb.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* why = dlerror();
    tried += fmt::format("\n  {}: {}", name, why ? why : "not found");
  }
  if (!lib)
    return Status::errorf("kiln serve --store needs librocksdb (Debian: librocksdb7.8); tried:{}", tried);
  RocksDbApi api;
  std::string missing;
#define KILN_ROCKSDB_RESOLVE(fn)                                           \
  api.fn = reinterpret_cast<decltype(api.fn)>(dlsym(lib, "rocksdb_" #fn)); \
  if (!api.fn) missing += " rocksdb_" #fn;
  KILN_ROCKSDB_FUNCTIONS(KILN_ROCKSDB_RESOLVE)
#undef KILN_ROCKSDB_RESOLVE
  if (!missing.empty()) {
    dlclose(lib);
    return Status::errorf(
        "kiln serve --store needs librocksdb 7.8 (Debian: librocksdb7.8); the librocksdb found lacks:{}",
        missing);
  }
  // The library stays loaded for the life of the process.
  return api;
}

Expected<const RocksDbApi*> rocksDb() {
  static const Expected<RocksDbApi> api = loadRocksDb();
  if (!api) return api.status();
  return &*api;
}

// A RocksDB error string (malloc'ed by the library) as a message; frees it.
std::string takeError(const RocksDbApi& api, char* err) {
  std::string message = err;
  api.free(err);
  return message;
}

void rowKey(char* key, int table, int64_t id) {
  auto t = static_cast<uint32_t>(table);
  auto r = static_cast<uint64_t>(id);
  key[0] = 'r';
  for (int b = 0; b < 4; ++b) key[1 + b] = static_cast<char>(t >> (24 - 8 * b));
  for (int b = 0; b < 8; ++b) key[5 + b] = static_cast<char>(r >> (56 - 8 * b));
}

std::string metadataText(const std::vector<TableInfo>& tables) {
  std::string text = fmt::format("kiln.store {}\n", kFormatVersion);
  for (const TableInfo& t : tables) text += fmt::format("table {} {} {}\n", t.rows, t.dim, t.name);
  return text;
}

bool parseInt(std::string_view text, int64_t& value) {
  if (text.empty()) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

// Parses the "kiln.store" record; errors say what is wrong, the caller adds the directory.
Expected<std::vector<TableInfo>> parseMetadata(std::string_view text) {
  if (text.empty() || text.back() != '\n') return Status::error("it does not end with a line break");
  std::vector<TableInfo> tables;
  int line_number = 0;
  while (!text.empty()) {
    size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol + 1);
    ++line_number;
    if (line_number == 1) {
      int64_t format = 0;
      if (!line.starts_with("kiln.store ") || !parseInt(line.substr(11), format))
        return Status::error("line 1 is not 'kiln.store <format version>'");
      if (format != kFormatVersion)
        return Status::errorf("format version {}; this kiln reads version {}", format, kFormatVersion);
      continue;
    }
    // "table <rows> <dim> <name>"
    TableInfo t;
    size_t rows_end = line.find(' ', 6);
    size_t dim_end = rows_end == std::string_view::npos ? rows_end : line.find(' ', rows_end + 1);
    if (!line.starts_with("table ") || dim_end == std::string_view::npos ||
        !parseInt(line.substr(6, rows_end - 6), t.rows) ||
        !parseInt(line.substr(rows_end + 1, dim_end - rows_end - 1), t.dim))
      return Status::errorf("line {} is not 'table <rows> <dim> <name>'", line_number);
    t.name = std::string(line.substr(dim_end + 1));
    tables.push_back(std::move(t));
  }
  KILN_RETURN_IF_ERROR(checkTables(tables));
  return tables;
}

}  // namespace

Status checkTables(const std::vector<TableInfo>& tables) {
  if (tables.size() > std::numeric_limits<uint32_t>::max()) return Status::error("too many tables");
  std::set<std::string_view> names;
  for (const TableInfo& t : tables) {
    if (t.name.empty()) return Status::error("a table has an empty name");
    if (t.name.find_first_of("\r\n") != std::string::npos)
      return Status::errorf("table name '{}' has a line break", t.name);
    if (!names.insert(t.name).second) return Status::errorf("two tables are called '{}'", t.name);
    if (t.rows <= 0) return Status::errorf("table '{}': rows must be positive, not {}", t.name, t.rows);
    if (t.dim <= 0 || t.dim > kMaxDim)
      return Status::errorf("table '{}': dim must be in [1, {}], not {}", t.name, kMaxDim, t.dim);
  }
  return Status::ok();
}

struct RocksDbStore::Handles {
  const RocksDbApi* api = nullptr;
  rocksdb_t* db = nullptr;
  rocksdb_readoptions_t* read = nullptr;
  rocksdb_writeoptions_t* write = nullptr;

  ~Handles() {
    if (read) api->readoptions_destroy(read);
    if (write) api->writeoptions_destroy(write);
    if (db) api->close(db);
  }

  static Expected<std::unique_ptr<Handles>> open(const RocksDbApi* api, const std::string& dir, bool create) {
    rocksdb_options_t* options = api->options_create();
    api->options_set_create_if_missing(options, create);
    api->options_set_error_if_exists(options, create);
    char* err = nullptr;
    rocksdb_t* db = api->open(options, dir.c_str(), &err);
    api->options_destroy(options);
    if (err) {
      if (db) api->close(db);
      return Status::errorf("cannot {} the store in {}: {}", create ? "create" : "open", dir,
                            takeError(*api, err));
    }
    auto handles = std::make_unique<Handles>();
    handles->api = api;
    handles->db = db;
    handles->read = api->readoptions_create();
    handles->write = api->writeoptions_create();
    return handles;
  }

  // The value of `key`, or nullopt if absent.
  Expected<std::optional<std::string>> get(std::string_view key, const std::string& dir) const {
    size_t size = 0;
    char* err = nullptr;
    char* value = api->get(db, read, key.data(), key.size(), &size, &err);
    if (err) return Status::errorf("{}: cannot read {}: {}", dir, key, takeError(*api, err));
    if (!value) return std::optional<std::string>();
    std::string text(value, size);
    api->free(value);
    return std::optional<std::string>(std::move(text));
  }
};

Status RocksDbStore::available() { return statusOf(rocksDb()); }

RocksDbStore::RocksDbStore(std::string dir, std::vector<TableInfo> tables, std::unique_ptr<Handles> handles,
                           int64_t version)
    : dir_(std::move(dir)), tables_(std::move(tables)), handles_(std::move(handles)), version_(version) {}

RocksDbStore::~RocksDbStore() = default;

Expected<std::unique_ptr<RocksDbStore>> RocksDbStore::create(const std::string& dir,
                                                             const std::vector<TableInfo>& tables) {
  KILN_ASSIGN_OR_RETURN(const RocksDbApi* api, rocksDb());
  if (Status s = checkTables(tables); !s)
    return Status::errorf("cannot create a store in {}: {}", dir, s.message());
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "CURRENT", ec))
    return Status::errorf("{} already holds a RocksDB database; open it, or remove it to create a new store",
                          dir);
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    return Status::errorf("cannot create a store in {}: it is not a directory", dir);
  fs::create_directories(dir, ec);
  if (ec) return Status::errorf("cannot create the directory {}: {}", dir, ec.message());
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Handles> handles, Handles::open(api, dir, /*create=*/true));
  std::unique_ptr<RocksDbStore> store(new RocksDbStore(dir, tables, std::move(handles), 0));
  store->complete_ = false;
  // The tables and version 0 go in one batch: a store is never left without its metadata.
  rocksdb_writebatch_t* batch = api->writebatch_create();
  std::string metadata = metadataText(tables);
  api->writebatch_put(batch, kMetadataKey.data(), kMetadataKey.size(), metadata.data(), metadata.size());
  api->writebatch_put(batch, kVersionKey.data(), kVersionKey.size(), "0", 1);
  api->writebatch_put(batch, kImportingKey.data(), kImportingKey.size(), "1", 1);
  char* err = nullptr;
  api->write(store->handles_->db, store->handles_->write, batch, &err);
  api->writebatch_destroy(batch);
  if (err) return Status::errorf("{}: cannot write the store's metadata: {}", dir, takeError(*api, err));
  return store;
}

Expected<std::unique_ptr<RocksDbStore>> RocksDbStore::open(const std::string& dir) {
  KILN_ASSIGN_OR_RETURN(const RocksDbApi* api, rocksDb());
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return Status::errorf("no store in {}: the directory does not exist", dir);
  if (!fs::is_directory(dir, ec)) return Status::errorf("no store in {}: it is not a directory", dir);
  // Checked before RocksDB opens it, which would leave a LOCK and a LOG file in any directory.
  if (!fs::exists(fs::path(dir) / "CURRENT", ec))
    return Status::errorf("no store in {}: it is not a RocksDB database (no CURRENT file)", dir);
  KILN_ASSIGN_OR_RETURN(std::unique_ptr<Handles> handles, Handles::open(api, dir, /*create=*/false));
  KILN_ASSIGN_OR_RETURN(std::optional<std::string> metadata, handles->get(kMetadataKey, dir));
  if (!metadata)
    return Status::errorf("{} is a RocksDB database but not a Kiln store (it has no {} record)", dir,
                          kMetadataKey);
  Expected<std::vector<TableInfo>> tables = parseMetadata(*metadata);
  if (!tables)
    return Status::errorf("{}: garbled {} record: {}", dir, kMetadataKey, tables.status().message());
  KILN_ASSIGN_OR_RETURN(std::optional<std::string> version_text, handles->get(kVersionKey, dir));
  int64_t version = 0;
  if (!version_text || !parseInt(*version_text, version))
    return Status::errorf("{}: missing or garbled {} record", dir, kVersionKey);
  KILN_ASSIGN_OR_RETURN(std::optional<std::string> importing, handles->get(kImportingKey, dir));
  std::unique_ptr<RocksDbStore> store(new RocksDbStore(dir, tables.take(), std::move(handles), version));
  store->complete_ = !importing.has_value();
  return store;
}

int RocksDbStore::tableIndex(std::string_view name) const {
  for (size_t t = 0; t < tables_.size(); ++t)
    if (tables_[t].name == name) return static_cast<int>(t);
  return -1;
}

Status RocksDbStore::checkRows(int table, std::span<const int64_t> ids) const {
  if (table < 0 || table >= static_cast<int>(tables_.size()))
    return Status::errorf("{}: no table {} (the store has {})", dir_, table, tables_.size());
  const TableInfo& t = tables_[table];
  for (int64_t id : ids)
    if (id < 0 || id >= t.rows)
      return Status::errorf("table '{}': row id {} is out of range [0, {})", t.name, id, t.rows);
  return Status::ok();
}

Status RocksDbStore::putRows(int table, std::span<const int64_t> ids, const float* rows) {
  return write({RowWrite{table, ids, rows}}, std::nullopt);
}

Status RocksDbStore::write(const std::vector<RowWrite>& writes, std::optional<int64_t> version) {
  for (const RowWrite& w : writes) KILN_RETURN_IF_ERROR(checkRows(w.table, w.ids));
  const RocksDbApi& api = *handles_->api;
  rocksdb_writebatch_t* batch = api.writebatch_create();
  char key[kRowKeyBytes];
  for (const RowWrite& w : writes) {
    int64_t dim = tables_[w.table].dim;
    for (size_t i = 0; i < w.ids.size(); ++i) {
      rowKey(key, w.table, w.ids[i]);
      api.writebatch_put(batch, key, kRowKeyBytes, reinterpret_cast<const char*>(w.rows + i * dim),
                         static_cast<size_t>(dim) * sizeof(float));
    }
  }
  std::string version_text;
  if (version) {
    version_text = std::to_string(*version);
    api.writebatch_put(batch, kVersionKey.data(), kVersionKey.size(), version_text.data(),
                       version_text.size());
  }
  char* err = nullptr;
  api.write(handles_->db, handles_->write, batch, &err);
  api.writebatch_destroy(batch);
  if (err) return Status::errorf("{}: write failed: {}", dir_, takeError(api, err));
  if (version) version_.store(*version, std::memory_order_release);
  return Status::ok();
}

Status RocksDbStore::setVersion(int64_t version) { return write({}, version); }

Status RocksDbStore::finishImport(int64_t version) {
  const RocksDbApi& api = *handles_->api;
  rocksdb_writebatch_t* batch = api.writebatch_create();
  const std::string version_text = std::to_string(version);
  api.writebatch_put(batch, kVersionKey.data(), kVersionKey.size(), version_text.data(), version_text.size());
  api.writebatch_delete(batch, kImportingKey.data(), kImportingKey.size());
  char* err = nullptr;
  api.write(handles_->db, handles_->write, batch, &err);
  api.writebatch_destroy(batch);
  if (err) return Status::errorf("{}: write failed: {}", dir_, takeError(api, err));
  version_.store(version, std::memory_order_release);
  complete_ = true;
  return Status::ok();
}

Status RocksDbStore::getRows(int table, std::span<const int64_t> ids, float* out,
                             std::vector<uint8_t>& found) {
  KILN_RETURN_IF_ERROR(checkRows(table, ids));
  found.assign(ids.size(), 0);
  if (ids.empty()) return Status::ok();
  const RocksDbApi& api = *handles_->api;
  const TableInfo& t = tables_[table];
  const size_t row_bytes = static_cast<size_t>(t.dim) * sizeof(float);
  size_t n = ids.size();
  std::vector<char> key_bytes(n * kRowKeyBytes);
  std::vector<const char*> keys(n);
  std::vector<size_t> key_sizes(n, kRowKeyBytes);
  for (size_t i = 0; i < n; ++i) {
    keys[i] = key_bytes.data() + i * kRowKeyBytes;
    rowKey(key_bytes.data() + i * kRowKeyBytes, table, ids[i]);
  }
  std::vector<char*> values(n, nullptr);
  std::vector<size_t> value_sizes(n, 0);
  std::vector<char*> errs(n, nullptr);
  api.multi_get(handles_->db, handles_->read, n, keys.data(), key_sizes.data(), values.data(),
                value_sizes.data(), errs.data());
  // Every value and error is the caller's to free, whatever goes wrong.
  Status status;
  for (size_t i = 0; i < n; ++i) {
    if (errs[i]) {
      std::string message = takeError(api, errs[i]);
      if (status) status = Status::errorf("{}: reading table '{}' row {}: {}", dir_, t.name, ids[i], message);
    }
    if (!values[i]) continue;
    if (value_sizes[i] != row_bytes) {
      if (status)
        status = Status::errorf("{}: corrupt store: table '{}' row {} holds {} bytes, expected {}", dir_,
                                t.name, ids[i], value_sizes[i], row_bytes);
    } else {
      std::memcpy(out + i * t.dim, values[i], row_bytes);
      found[i] = 1;
    }
    api.free(values[i]);
  }
  return status;
}

}  // namespace kiln::serving
