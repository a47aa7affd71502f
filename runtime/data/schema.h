// A model's own data layout (DataLayout::Named or Positional): the file columns its inputs bind
// with `columns(...)`, one Record per sample, the parser of a text line under the schema and the
// assembly of records into the model's Batch (docs/data.md, "Schemas").
//
// The schema lists the bound columns by kind, in the order of the model's inputs: labels (each
// 0 or 1), dense features (numbers, read as they are) and categorical features (one id, a fixed
// number of ids, or a variable-length list of at most max_hotness ids, all in one field).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/data/batch.h"
#include "runtime/data/binary_format.h"
#include "runtime/data/record_source.h"

namespace kiln::data {

enum class ColumnKind : uint8_t { Label, Dense, Categorical };

struct SchemaColumn {
  ColumnRef ref;
  ColumnKind kind = ColumnKind::Dense;
  int input = -1;  // the spec's input that reads it
  // Categorical: exactly `hotness` values (a missing field holds none), or at most `max_values`
  // when `list` (a variable-length feature).
  int hotness = 1;
  int max_values = 1;
  bool list = false;

  std::string describe(const BatchSpec& spec) const;  // "label 'click' of input 'labels'"
};

struct Schema {
  DataLayout layout = DataLayout::Named;
  std::vector<SchemaColumn> labels, dense, cats;

  static Schema of(const BatchSpec& spec);  // spec.layout must not be Criteo
  size_t size() const { return labels.size() + dense.size() + cats.size(); }
  // The columns in one list: labels, dense, categorical.
  std::vector<const SchemaColumn*> all() const;
};

// One sample under a schema. Categorical column c holds values[ends[c-1] .. ends[c]) (raw
// values: a decimal integer as itself, any other text by its 64-bit hash); none when missing.
struct Record {
  std::vector<float> labels, dense;
  std::vector<uint64_t> values;
  std::vector<int32_t> ends;

  int32_t begin(size_t c) const { return c == 0 ? 0 : ends[c - 1]; }
};

// The raw value of a categorical text value: digits are the number they spell (up to 2^64 - 1),
// anything else the FNV-1a 64-bit hash of its bytes.
uint64_t categoricalValue(std::string_view text);

// Parses lines of a text file (TSV, or CSV with quoted fields) under `schema`. A named schema
// first reads the file's header line (bindHeader) to find its columns.
class SchemaParser {
 public:
  SchemaParser(const BatchSpec& spec, Schema schema, char delimiter);

  // The header line of a file: finds each named column. Errors name the missing column.
  Status bindHeader(std::string_view line);
  // Parses one line into `r`; on error `*col` is the 1-based byte column at fault.
  Status parse(std::string_view line, Record& r, int64_t* col);

  const Schema& schema() const { return schema_; }
  bool needsHeader() const { return schema_.layout == DataLayout::Named; }

 private:
  // Splits `line` into fields_ (byte ranges, quotes stripped).
  void split(std::string_view line);

  const BatchSpec& spec_;
  Schema schema_;
  char delimiter_;
  std::vector<const SchemaColumn*> columns_;  // schema_.all()
  std::vector<int64_t> field_of_;             // per column: its field index in a line
  int64_t expected_fields_ = -1;              // a named file's lines have the header's count
  std::vector<std::pair<size_t, size_t>> fields_;
};

// The delimiter of a text file: ',' for a name ending in .csv, else a tab.
char delimiterFor(const std::string& path);

// A stream of Records from files under a schema, as RecordSource is for Criteo samples.
class RowSource {
 public:
  virtual ~RowSource() = default;
  virtual Expected<bool> next(Record& r) = 0;
  virtual Status seek(const StreamPosition& pos) = 0;
  virtual StreamPosition position() const = 0;
  virtual int64_t malformed() const { return 0; }
};

// Text files (TSV, or CSV by a .csv name) under the schema of `spec`: a named schema reads each
// file's first line as its header. Malformed lines are skipped and counted as TSV's are.
Expected<std::unique_ptr<RowSource>> openSchemaText(const BatchSpec& spec, std::vector<std::string> files,
                                                    TsvOptions opts = {});

// Kiln binary data, version 2 (docs/data.md): a schema's records. The header names every column
// (its key: the name, or "#k" for position k), so a model reads by key the columns it needs.
inline constexpr uint32_t kSchemaBinaryVersion = 2;
Expected<std::unique_ptr<RowSource>> openSchemaBinary(const BatchSpec& spec, std::vector<std::string> files);
// A version-2 file's header, checked, in words: its record count and columns.
Expected<std::string> schemaBinaryInfo(const std::string& path);
// Reads every record of a version-2 file under its own header, with the checks any model's reader
// makes (labels 0 or 1, finite values, lists within their bound, nothing after the last record):
// the records read, or the first corrupt one's error. A model's own bounds (hotness) are not
// known here: openSchemaBinary checks those.
Expected<int64_t> checkSchemaBinaryRecords(const std::string& path);
// Reads text files under the schema of `spec` into one version-2 binary file (written to
// OUT.tmp, fsynced and renamed; nothing is left behind on an error).
Expected<ConvertStats> convertSchemaToBinary(const BatchSpec& spec, const std::vector<std::string>& inputs,
                                             const std::string& output, TsvOptions opts = {});

// Fills `batch` with `n` records: labels, dense features, ids (mapped into each table's rows),
// lengths of variable-length features and per-id weights of 1.
void assembleRecords(const BatchSpec& spec, const Record* records, int64_t n, Batch& batch);

}  // namespace kiln::data
