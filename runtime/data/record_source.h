// A stream of raw Criteo samples from files (TSV or Kiln's binary format), read in sequence.
// Sources remember where they are so that training can resume at the exact next sample.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/data/sample.h"

namespace kiln::data {

// Receives each malformed line that was skipped (a located error).
using DiagnosticSink = std::function<void(const Status&)>;

class RecordSource {
 public:
  virtual ~RecordSource() = default;
  // Reads the next sample into `s`; false after the last sample of the last file.
  virtual Expected<bool> next(RawSample& s) = 0;
  // Continues from `pos` (its file, offset and line; epoch and sample are the caller's).
  virtual Status seek(const StreamPosition& pos) = 0;
  // The position of the next sample (epoch and sample left 0).
  virtual StreamPosition position() const = 0;
  // Lines skipped as malformed so far.
  virtual int64_t malformed() const { return 0; }
};

// The longest TSV line read (newline excluded). A Criteo line is under 1 KiB; a longer one is
// not a Criteo line (say, a file without newlines), and buffering it whole could exhaust memory.
inline constexpr int64_t kMaxTsvLineBytes = int64_t{1} << 20;

struct TsvOptions {
  bool strict = false;     // a malformed line is an error instead of skipped and counted
  DiagnosticSink on_skip;  // told about each skipped line (default: printed to stderr)
  // A longer line is an error (not skipped: it is no Criteo line). Tests lower it.
  int64_t max_line_bytes = kMaxTsvLineBytes;
};

// Criteo TSV: label, 13 integer features, 26 hex categorical features per line, tab-separated.
// A UTF-8 byte-order mark at the start of a file is skipped.
Expected<std::unique_ptr<RecordSource>> openTsv(std::vector<std::string> files, TsvOptions opts = {});

// Parses one TSV line (without its newline). On error, `col` is the 1-based column at fault.
Status parseTsvLine(std::string_view line, RawSample& s, int64_t* col);

// Checks that `path` can be opened as a data file: it opens, is no directory, and is not
// compressed. Compressed files are named by their magic bytes (gzip, zstd, bzip2, xz) rather
// than read: a checkpoint resumes a stream at a byte offset of its file, which a decompressing
// reader could only reach by decompressing everything before it.
Status checkDataFile(const std::string& path);

// Opens each file by its content: Kiln binary files by their magic, anything else as TSV. All
// files of one stream must be of one kind.
Expected<std::unique_ptr<RecordSource>> openRecords(std::vector<std::string> files, TsvOptions opts = {});

}  // namespace kiln::data
