// Kiln binary data, version 2: a schema's records behind a checked header that names every
// column, so that any model whose columns the file holds reads it by name (docs/data.md).
#include <fmt/format.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>

#include "runtime/data/binary_format.h"
#include "runtime/data/schema.h"
#include "runtime/random.h"

namespace kiln::data {

namespace {

template <typename T>
void append(std::vector<unsigned char>& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}
template <typename T>
T take(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The key a column is stored and found under: its name, or "#k" for a position.
std::string columnKey(const ColumnRef& r) { return r.named() ? r.name : fmt::format("#{}", r.position); }

// The header: the fixed 48 bytes (magic, version, header bytes, label, dense and categorical
// counts, flags, records, checksum) then per column: u8 kind, u8 list, u16 name bytes, u32
// max values, the name; zero-padded to a multiple of 8. The checksum covers all but itself.
std::vector<unsigned char> encodeHeader(const std::vector<SchemaColumn>& cols, uint32_t labels,
                                        uint32_t dense, uint32_t cats, int64_t records) {
  std::vector<unsigned char> h(kBinaryMagic, kBinaryMagic + 8);
  append<uint32_t>(h, kSchemaBinaryVersion);
  append<uint32_t>(h, 0);  // header bytes, below
  append<uint32_t>(h, labels);
  append<uint32_t>(h, dense);
  append<uint32_t>(h, cats);
  append<uint32_t>(h, 0);
  append<uint64_t>(h, static_cast<uint64_t>(records));
  append<uint64_t>(h, 0);  // checksum, below
  for (const SchemaColumn& c : cols) {
    const std::string key = columnKey(c.ref);
    append<uint8_t>(h, static_cast<uint8_t>(c.kind));
    append<uint8_t>(h, c.list ? 1 : 0);
    append<uint16_t>(h, static_cast<uint16_t>(key.size()));
    append<uint32_t>(h, static_cast<uint32_t>(c.max_values));
    h.insert(h.end(), key.begin(), key.end());
  }
  h.resize((h.size() + 7) / 8 * 8, 0);
  const auto bytes = static_cast<uint32_t>(h.size());
  std::memcpy(h.data() + 12, &bytes, 4);
  uint64_t sum = runtime::fnv1a64(h.data(), 40) ^ runtime::fnv1a64(h.data() + 48, h.size() - 48);
  std::memcpy(h.data() + 40, &sum, 8);
  return h;
}

struct FileColumn {
  ColumnKind kind;
  bool list;
  uint32_t max_values;
  std::string key;
};

struct FileSchema {
  int64_t header_bytes = 0, records = 0;
  uint32_t labels = 0, dense = 0, cats = 0;
  std::vector<FileColumn> columns;  // labels, dense, categorical
};

Expected<FileSchema> readHeader(std::FILE* fp, const std::string& path, int64_t size) {
  unsigned char fixed[48];
  if (size < 48 || std::fread(fixed, 1, 48, fp) != 48)
    return Status::errorf("'{}': truncated binary data file: {} bytes, less than a header", path, size);
  if (std::memcmp(fixed, kBinaryMagic, 8) != 0)
    return Status::errorf("'{}': not a Kiln binary data file (bad magic)", path);
  if (uint32_t v = take<uint32_t>(fixed + 8); v != kSchemaBinaryVersion) {
    if (v == kBinaryVersion)
      return Status::errorf(
          "'{}' is a Kiln binary file of the Criteo layout (version 1), but the model reads its own "
          "schema (columns(...)): convert its text files with kiln data convert --model",
          path);
    return Status::errorf(
        "'{}': binary data version {} is not supported (this build reads versions {} and {})", path, v,
        kBinaryVersion, kSchemaBinaryVersion);
  }
  FileSchema s;
  s.header_bytes = take<uint32_t>(fixed + 12);
  s.labels = take<uint32_t>(fixed + 16);
  s.dense = take<uint32_t>(fixed + 20);
  s.cats = take<uint32_t>(fixed + 24);
  if (s.header_bytes < 48 || s.header_bytes > size || s.header_bytes > (1 << 26))
    return Status::errorf("'{}': corrupt header: it says {} header bytes in a file of {}", path,
                          s.header_bytes, size);
  std::vector<unsigned char> h(static_cast<size_t>(s.header_bytes));
  std::memcpy(h.data(), fixed, 48);
  if (std::fread(h.data() + 48, 1, h.size() - 48, fp) != h.size() - 48)
    return Status::errorf("cannot read '{}': {}", path, std::strerror(errno));
  if (take<uint64_t>(h.data() + 40) !=
      (runtime::fnv1a64(h.data(), 40) ^ runtime::fnv1a64(h.data() + 48, h.size() - 48)))
    return Status::errorf("'{}': corrupt header (checksum mismatch)", path);
  s.records = static_cast<int64_t>(take<uint64_t>(h.data() + 32));
  size_t at = 48;
  const uint64_t n = uint64_t{s.labels} + s.dense + s.cats;
  for (uint64_t i = 0; i < n; ++i) {
    if (at + 8 > h.size()) return Status::errorf("'{}': corrupt header: its columns run past it", path);
    FileColumn c;
    c.kind = static_cast<ColumnKind>(h[at]);
    c.list = h[at + 1] != 0;
    const uint16_t len = take<uint16_t>(h.data() + at + 2);
    c.max_values = take<uint32_t>(h.data() + at + 4);
    if (at + 8 + len > h.size()) return Status::errorf("'{}': corrupt header: its columns run past it", path);
    c.key.assign(reinterpret_cast<const char*>(h.data() + at + 8), len);
    at += 8 + len;
    s.columns.push_back(std::move(c));
  }
  // Every record has at least its fixed part: the count cannot exceed what the file holds.
  const int64_t min_record = 4 * (int64_t{s.labels} + s.dense + s.cats);
  if (s.records < 0 || (min_record > 0 && s.records > (size - s.header_bytes) / min_record))
    return Status::errorf("'{}': truncated file: the header says {} records, but {} bytes hold at most {}",
                          path, s.records, size - s.header_bytes,
                          min_record ? (size - s.header_bytes) / min_record : 0);
  return s;
}

Expected<int64_t> fileSize(std::FILE* fp, const std::string& path) {
  if (fseeko(fp, 0, SEEK_END) != 0)
    return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
  int64_t size = ftello(fp);
  if (fseeko(fp, 0, SEEK_SET) != 0)
    return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
  return size;
}

class SchemaBinarySource final : public RowSource {
 public:
  SchemaBinarySource(BatchSpec spec, std::vector<std::string> files)
      : spec_(std::move(spec)),
        schema_(Schema::of(spec_)),
        columns_(schema_.all()),
        files_(std::move(files)) {}
  ~SchemaBinarySource() override { close(); }

  // Opens file `file` at byte `offset` (0: its first record), `record` records before it.
  Status open(size_t file, int64_t offset, int64_t record) {
    close();
    file_ = file;
    record_ = record;
    if (file_ >= files_.size()) return Status::ok();
    const std::string& path = files_[file_];
    fp_ = std::fopen(path.c_str(), "rb");
    if (!fp_) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
    std::setvbuf(fp_, nullptr, _IOFBF, 1 << 20);
    KILN_ASSIGN_OR_RETURN(size_, fileSize(fp_, path));
    KILN_ASSIGN_OR_RETURN(file_schema_, readHeader(fp_, path, size_));
    KILN_RETURN_IF_ERROR(bind(path));
    offset_ = offset == 0 ? file_schema_.header_bytes : offset;
    if (offset_ < file_schema_.header_bytes || offset_ > size_ || record_ > file_schema_.records)
      return Status::errorf("'{}': data position byte {} (record {}) is outside the file", path, offset_,
                            record_);
    if (fseeko(fp_, offset_, SEEK_SET) != 0)
      return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
    return Status::ok();
  }

  Expected<bool> next(Record& r) override {
    for (;;) {
      if (!fp_) return false;
      if (record_ < file_schema_.records) break;
      if (offset_ != size_)
        return Status::errorf("'{}': corrupt file: {} bytes follow its {} records", files_[file_],
                              size_ - offset_, file_schema_.records);
      KILN_RETURN_IF_ERROR(open(file_ + 1, 0, 0));
    }
    KILN_RETURN_IF_ERROR(readRecord(r));
    ++record_;
    return true;
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || static_cast<size_t>(pos.file) > files_.size())
      return Status::errorf("data position names file {} but the stream has {} files", pos.file,
                            files_.size());
    return open(static_cast<size_t>(pos.file), pos.offset, pos.line);
  }

  StreamPosition position() const override {
    StreamPosition p;
    p.file = static_cast<int64_t>(file_);
    p.offset = offset_;
    p.line = record_;
    return p;
  }

 private:
  void close() {
    if (fp_) std::fclose(fp_);
    fp_ = nullptr;
  }

  // Finds each of the model's columns among the file's, by key and kind.
  Status bind(const std::string& path) {
    std::map<std::pair<std::string, ColumnKind>, size_t> index;
    for (size_t i = 0; i < file_schema_.columns.size(); ++i)
      index.emplace(std::pair{file_schema_.columns[i].key, file_schema_.columns[i].kind}, i);
    file_of_.assign(file_schema_.columns.size(), -1);
    for (size_t i = 0; i < columns_.size(); ++i) {
      auto it = index.find({columnKey(columns_[i]->ref), columns_[i]->kind});
      if (it == index.end()) {
        std::string keys;
        for (size_t k = 0; k < file_schema_.columns.size() && k < 12; ++k)
          keys += fmt::format("{}'{}'", k ? ", " : "", file_schema_.columns[k].key);
        return Status::errorf("'{}' has no {}; it has {}", path, columns_[i]->describe(spec_), keys);
      }
      if (file_of_[it->second] >= 0)
        return Status::errorf("'{}': the model reads column '{}' twice, which a binary file serves once",
                              path, it->first.first);
      file_of_[it->second] = static_cast<int>(i);
    }
    return Status::ok();
  }

  Status fail(const std::string& why) const {
    return Status::errorf("'{}': corrupt record {} (at byte {}): {}", files_[file_], record_, record_start_,
                          why);
  }

  Status readRecord(Record& r) {
    const FileSchema& fs = file_schema_;
    record_start_ = offset_;  // where a corrupt record's message says it lies
    r.labels.resize(schema_.labels.size());
    r.dense.resize(schema_.dense.size());
    r.ends.resize(schema_.cats.size());
    r.values.clear();
    // The model's categorical columns in the file's order may differ from the model's: gather
    // each column's values, then lay them out in the model's order.
    pending_.assign(schema_.cats.size(), {});
    const size_t first_cat = schema_.labels.size() + schema_.dense.size();
    for (size_t i = 0; i < fs.columns.size(); ++i) {
      const FileColumn& fc = fs.columns[i];
      const int mine = file_of_[i];
      if (fc.kind != ColumnKind::Categorical) {
        float v;
        if (std::fread(&v, 4, 1, fp_) != 1) return fail("the file ends inside it");
        offset_ += 4;
        if (!std::isfinite(v)) return fail(fmt::format("column '{}' is {}", fc.key, v));
        if (fc.kind == ColumnKind::Label && v != 0 && v != 1)
          return fail(fmt::format("label '{}' is {}, not 0 or 1", fc.key, v));
        if (mine >= 0) {
          const SchemaColumn* c = columns_[static_cast<size_t>(mine)];
          (c->kind == ColumnKind::Label ? r.labels[static_cast<size_t>(mine)]
                                        : r.dense[static_cast<size_t>(mine) - schema_.labels.size()]) = v;
        }
        continue;
      }
      uint32_t count;
      if (std::fread(&count, 4, 1, fp_) != 1) return fail("the file ends inside it");
      offset_ += 4;
      if (count > fc.max_values)
        return fail(
            fmt::format("column '{}' holds {} values, more than its bound {}", fc.key, count, fc.max_values));
      std::vector<uint64_t>* into = mine >= 0 ? &pending_[static_cast<size_t>(mine) - first_cat] : &skip_;
      into->resize(count);
      if (count && std::fread(into->data(), 8, count, fp_) != count) return fail("the file ends inside it");
      offset_ += 8 * static_cast<int64_t>(count);
      if (mine >= 0) {
        // The model's own bounds, as the text reader checks them.
        const SchemaColumn& c = *columns_[static_cast<size_t>(mine)];
        if (static_cast<int>(count) > c.max_values ||
            (!c.list && count != 0 && static_cast<int>(count) != c.hotness))
          return Status::errorf("'{}': record {}: {} holds {} value(s), but its input reads {} {}",
                                files_[file_], record_, c.describe(spec_), count,
                                c.list ? "at most" : "exactly", c.list ? c.max_values : c.hotness);
      }
    }
    for (size_t c = 0; c < pending_.size(); ++c) {
      r.values.insert(r.values.end(), pending_[c].begin(), pending_[c].end());
      r.ends[c] = static_cast<int32_t>(r.values.size());
    }
    return Status::ok();
  }

  BatchSpec spec_;
  Schema schema_;
  std::vector<const SchemaColumn*> columns_;
  std::vector<std::string> files_;
  std::FILE* fp_ = nullptr;
  size_t file_ = 0;
  int64_t size_ = 0, offset_ = 0, record_ = 0, record_start_ = 0;
  FileSchema file_schema_;
  std::vector<int> file_of_;  // per file column: the model's column, or -1
  std::vector<std::vector<uint64_t>> pending_;
  std::vector<uint64_t> skip_;
};

}  // namespace

Expected<std::string> schemaBinaryInfo(const std::string& path) {
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
  auto size = fileSize(fp, path);
  auto fs = size ? readHeader(fp, path, *size) : Expected<FileSchema>(size.status());
  std::fclose(fp);
  if (!fs) return fs.status();
  std::string names;
  for (size_t i = 0; i < fs->columns.size() && i < 8; ++i)
    names += fmt::format("{}'{}'", i ? ", " : "", fs->columns[i].key);
  if (fs->columns.size() > 8) names += ", ...";
  return fmt::format("{} records, version {}: {} label, {} dense and {} categorical columns ({})",
                     fs->records, kSchemaBinaryVersion, fs->labels, fs->dense, fs->cats, names);
}

Expected<int64_t> checkSchemaBinaryRecords(const std::string& path) {
  // A spec that binds no column: the reader checks and skips every one of the file's.
  KILN_ASSIGN_OR_RETURN(auto src, openSchemaBinary(BatchSpec{}, {path}));
  Record r;
  int64_t records = 0;
  for (;;) {
    KILN_ASSIGN_OR_RETURN(bool more, src->next(r));
    if (!more) return records;
    ++records;
  }
}

Expected<std::unique_ptr<RowSource>> openSchemaBinary(const BatchSpec& spec, std::vector<std::string> files) {
  if (files.empty()) return Status::error("no data files given");
  for (const std::string& f : files) KILN_RETURN_IF_ERROR(checkDataFile(f));
  auto src = std::make_unique<SchemaBinarySource>(spec, std::move(files));
  KILN_RETURN_IF_ERROR(src->open(0, 0, 0));
  return std::unique_ptr<RowSource>(std::move(src));
}

Expected<ConvertStats> convertSchemaToBinary(const BatchSpec& spec, const std::vector<std::string>& inputs,
                                             const std::string& output, TsvOptions opts) {
  KILN_ASSIGN_OR_RETURN(auto source, openSchemaText(spec, inputs, std::move(opts)));
  const Schema schema = Schema::of(spec);
  const std::string tmp = output + ".tmp";
  std::FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (!fp) return Status::errorf("cannot create '{}': {}", tmp, std::strerror(errno));
  std::setvbuf(fp, nullptr, _IOFBF, 1 << 20);
  std::vector<SchemaColumn> cols;
  for (const SchemaColumn* c : schema.all()) cols.push_back(*c);
  const auto L = static_cast<uint32_t>(schema.labels.size()), D = static_cast<uint32_t>(schema.dense.size()),
             C = static_cast<uint32_t>(schema.cats.size());
  auto failed = [&](Status s) {
    std::fclose(fp);
    std::remove(tmp.c_str());
    return s;
  };
  std::vector<unsigned char> header = encodeHeader(cols, L, D, C, 0);
  if (std::fwrite(header.data(), 1, header.size(), fp) != header.size())
    return failed(Status::errorf("cannot write '{}': {}", tmp, std::strerror(errno)));
  ConvertStats stats;
  Record r;
  std::vector<unsigned char> rec;
  for (;;) {
    auto got = source->next(r);
    if (!got) return failed(got.status());
    if (!*got) break;
    rec.clear();
    for (float v : r.labels) append<float>(rec, v);
    for (float v : r.dense) append<float>(rec, v);
    for (size_t c = 0; c < C; ++c) {
      append<uint32_t>(rec, static_cast<uint32_t>(r.ends[c] - r.begin(c)));
      for (int32_t k = r.begin(c); k < r.ends[c]; ++k)
        append<uint64_t>(rec, r.values[static_cast<size_t>(k)]);
    }
    if (std::fwrite(rec.data(), 1, rec.size(), fp) != rec.size())
      return failed(Status::errorf("cannot write '{}': {}", tmp, std::strerror(errno)));
    ++stats.records;
  }
  stats.malformed = source->malformed();
  header = encodeHeader(cols, L, D, C, stats.records);
  bool ok = std::fseek(fp, 0, SEEK_SET) == 0 &&
            std::fwrite(header.data(), 1, header.size(), fp) == header.size() && std::fflush(fp) == 0 &&
            ::fsync(fileno(fp)) == 0;
  ok = std::fclose(fp) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), output.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status::errorf("cannot write '{}': {}", output, std::strerror(errno));
  }
  return stats;
}

}  // namespace kiln::data
