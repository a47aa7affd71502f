// Lines of a sequence of text files, streamed through one buffer (1 MiB, grown for long lines up
// to a bound), with the position of the next line for exact resume. The TSV readers share it.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "runtime/data/record_source.h"

namespace kiln::data {

class LineReader {
 public:
  // `what` ends the error for a line over `max_line_bytes` ("not a Criteo TSV line ...").
  LineReader(std::vector<std::string> files, int64_t max_line_bytes, std::string what);
  ~LineReader() { close(); }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // Opens file `file` at byte `offset`, with `line` lines consumed before it (file == files():
  // past the last file, so next() returns false).
  Status open(size_t file, int64_t offset, int64_t line);
  // The next line of the current file (without '\n'; a UTF-8 byte-order mark at the start of a
  // file is dropped); false at its end.
  Expected<bool> next(std::string_view* line);

  size_t file() const { return file_; }
  size_t files() const { return files_.size(); }
  const std::string& path() const { return files_[file_]; }
  // The byte offset of the next line in the current file, and the lines consumed there.
  int64_t offset() const { return buf_offset_ + static_cast<int64_t>(buf_begin_); }
  int64_t line() const { return line_; }

 private:
  void close();
  Status tooLong() const;

  std::vector<std::string> files_;
  int64_t max_line_bytes_;
  std::string what_;
  std::FILE* fp_ = nullptr;
  size_t file_ = 0;
  std::vector<char> buf_;
  size_t buf_begin_ = 0, buf_end_ = 0;
  int64_t buf_offset_ = 0;  // file offset of buf_[0]
  int64_t line_ = 0;        // lines consumed in the current file
  bool eof_ = false;
};

// At most 24 printable characters of a field, for messages ('?' for the others, "..." when cut).
std::string printableField(std::string_view f);

// file:line:col as a located error (numbers past INT_MAX are named in the message instead).
Status locatedError(std::string message, const std::string& file, int64_t line, int64_t col);

// The next line of `lines` that `parse(line, &col)` accepts, crossing into the next file with
// `open_next(file)` at a file's end; false after the last file. A line `parse` rejects is a
// located error with opts.strict, or else reported (opts.on_skip, or stderr), counted in
// `malformed` and skipped.
template <class Parse, class OpenNext>
Expected<bool> nextParsedLine(LineReader& lines, const TsvOptions& opts, int64_t& malformed, Parse parse,
                              OpenNext open_next) {
  for (;;) {
    std::string_view line;
    KILN_ASSIGN_OR_RETURN(bool got, lines.next(&line));
    if (!got) {
      if (lines.file() >= lines.files()) return false;
      KILN_RETURN_IF_ERROR(open_next(lines.file() + 1));
      continue;
    }
    int64_t col = 1;
    Status st = parse(line, &col);
    if (st) return true;
    Status located = locatedError(st.message(), lines.path(), lines.line(), col);
    if (opts.strict) return located;
    ++malformed;
    if (opts.on_skip)
      opts.on_skip(located);
    else
      std::fprintf(stderr, "%s (line skipped)\n", located.str().c_str());
  }
}

}  // namespace kiln::data
