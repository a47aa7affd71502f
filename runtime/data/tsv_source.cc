// Criteo TSV, streamed: a 1 MiB buffer per open file, lines parsed in place, files of any size.
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "runtime/data/record_source.h"

namespace kiln::data {

namespace {

inline bool parseDense(std::string_view f, float* out) {
  if (f.empty()) {
    *out = 0;
    return true;
  }
  size_t i = 0;
  bool neg = false;
  if (f[0] == '-') {
    neg = true;
    i = 1;
    if (f.size() == 1) return false;
  }
  uint64_t v = 0;
  for (; i < f.size(); ++i) {
    unsigned d = static_cast<unsigned char>(f[i]) - '0';
    if (d > 9) return false;
    if (v > (UINT64_MAX - d) / 10) return false;  // overflow
    v = v * 10 + d;
  }
  *out = neg ? 0.0f : static_cast<float>(std::log1p(static_cast<double>(v)));
  return true;
}

inline bool parseHex(std::string_view f, uint64_t* out) {
  if (f.empty() || f.size() > 16) return false;
  uint64_t v = 0;
  for (char c : f) {
    unsigned d;
    if (c >= '0' && c <= '9') d = static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f') d = static_cast<unsigned>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') d = static_cast<unsigned>(c - 'A' + 10);
    else return false;
    v = (v << 4) | d;
  }
  *out = v;
  return true;
}

std::string printable(std::string_view f) {
  std::string s(f.substr(0, 24));
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 32 || static_cast<unsigned char>(c) > 126) c = '?';
  return f.size() > 24 ? s + "..." : s;
}

// file:line:col as a Location, whose numbers are ints: a line past them (a file of over two
// billion lines) is named in the message instead of wrapping to a negative number.
Status locatedError(std::string message, const std::string& file, int64_t line, int64_t col) {
  if (line <= INT_MAX && col <= INT_MAX)
    return Status::error(std::move(message), Location{file, static_cast<int>(line), static_cast<int>(col)});
  return Status::error(fmt::format("line {}, column {}: {}", line, col, message), Location{file});
}

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

}  // namespace

Status parseTsvLine(std::string_view line, RawSample& s, int64_t* col) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  constexpr int kFields = 1 + kNumDense + kNumSparse;
  s.missing = 0;
  size_t start = 0;
  for (int field = 0; field < kFields; ++field) {
    size_t tab = line.find('\t', start);
    if ((tab == std::string_view::npos) != (field == kFields - 1)) {
      *col = static_cast<int64_t>(tab == std::string_view::npos ? line.size() + 1 : tab + 1);
      int64_t got = 1;
      for (char c : line) got += c == '\t';
      return Status::errorf("expected {} tab-separated fields (label, {} integer, {} categorical), got {}", kFields,
                            kNumDense, kNumSparse, got);
    }
    std::string_view f = line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start);
    *col = static_cast<int64_t>(start + 1);
    if (field == 0) {
      if (f != "0" && f != "1") return Status::errorf("label must be 0 or 1, got '{}'", printable(f));
      s.label = f[0] == '1' ? 1.0f : 0.0f;
    } else if (field <= kNumDense) {
      if (!parseDense(f, &s.dense[field - 1]))
        return Status::errorf("integer feature {} is not an integer: '{}'", field, printable(f));
    } else {
      int c = field - 1 - kNumDense;
      if (f.empty()) {
        s.missing |= 1u << c;
        s.cats[c] = 0;
      } else if (!parseHex(f, &s.cats[c])) {
        return Status::errorf("categorical feature {} is not a hex value of at most 16 digits: '{}'", c + 1, printable(f));
      }
    }
    start = tab + 1;
  }
  return Status::ok();
}

namespace {

class TsvSource final : public RecordSource {
 public:
  TsvSource(std::vector<std::string> files, TsvOptions opts) : files_(std::move(files)), opts_(std::move(opts)) {
    buf_.resize(1 << 20);
  }
  ~TsvSource() override { close(); }

  Status open(size_t file, int64_t offset, int64_t line) {
    close();
    file_ = file;
    buf_begin_ = buf_end_ = 0;
    buf_offset_ = offset;
    line_ = line;
    eof_ = false;
    if (file_ >= files_.size()) return Status::ok();
    fp_ = std::fopen(files_[file_].c_str(), "rb");
    if (!fp_) return Status::errorf("cannot open '{}': {}", files_[file_], std::strerror(errno));
    if (offset < 0) return Status::errorf("cannot seek to byte {} of '{}'", offset, files_[file_]);
    if (offset > 0) {
      if (fseeko(fp_, 0, SEEK_END) != 0 || ftello(fp_) < offset)
        return Status::errorf("cannot seek to byte {} of '{}': the file is shorter", offset, files_[file_]);
      if (fseeko(fp_, offset, SEEK_SET) != 0)
        return Status::errorf("cannot seek to byte {} of '{}': {}", offset, files_[file_],
                              std::strerror(errno));
    }
    return Status::ok();
  }

  Expected<bool> next(RawSample& s) override {
    for (;;) {
      std::string_view line;
      auto got = nextLine(&line);
      if (!got) return got.status();
      if (!*got) {
        if (file_ >= files_.size()) return false;
        KILN_RETURN_IF_ERROR(open(file_ + 1, 0, 0));
        continue;
      }
      int64_t col = 1;
      Status st = parseTsvLine(line, s, &col);
      if (st) return true;
      Status located = locatedError(st.message(), files_[file_], line_, col);
      if (opts_.strict) return located;
      ++malformed_;
      if (opts_.on_skip)
        opts_.on_skip(located);
      else
        std::fprintf(stderr, "%s (line skipped)\n", located.str().c_str());
    }
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || static_cast<size_t>(pos.file) > files_.size())
      return Status::errorf("data position names file {} but the stream has {} files", pos.file, files_.size());
    return open(static_cast<size_t>(pos.file), pos.offset, pos.line);
  }

  StreamPosition position() const override {
    StreamPosition p;
    p.file = static_cast<int64_t>(file_);
    p.offset = buf_offset_ + static_cast<int64_t>(buf_begin_);
    p.line = line_;
    return p;
  }

  int64_t malformed() const override { return malformed_; }

 private:
  void close() {
    if (fp_) std::fclose(fp_);
    fp_ = nullptr;
  }

  // The next line of the current file (without '\n'); false at its end.
  Expected<bool> nextLine(std::string_view* line) {
    if (!fp_) return false;
    for (;;) {
      const char* base = buf_.data();
      const void* nl = std::memchr(base + buf_begin_, '\n', buf_end_ - buf_begin_);
      if (nl || (eof_ && buf_begin_ < buf_end_)) {
        size_t end = nl ? static_cast<size_t>(static_cast<const char*>(nl) - base) : buf_end_;
        if (static_cast<int64_t>(end - buf_begin_) > opts_.max_line_bytes) return tooLong();
        *line = std::string_view(base + buf_begin_, end - buf_begin_);
        // A byte-order mark (as some editors and exporters write) is no part of the label.
        if (buf_offset_ + static_cast<int64_t>(buf_begin_) == 0 &&
            line->substr(0, kUtf8Bom.size()) == kUtf8Bom)
          line->remove_prefix(kUtf8Bom.size());
        buf_begin_ = nl ? end + 1 : end;
        ++line_;
        return true;
      }
      if (eof_) return false;
      // Move the partial line to the front, grow for long lines (up to the limit), and read more.
      size_t rest = buf_end_ - buf_begin_;
      if (static_cast<int64_t>(rest) > opts_.max_line_bytes) return tooLong();
      std::memmove(buf_.data(), base + buf_begin_, rest);
      buf_offset_ += static_cast<int64_t>(buf_begin_);
      buf_begin_ = 0;
      buf_end_ = rest;
      if (buf_end_ == buf_.size()) buf_.resize(buf_.size() * 2);
      size_t n = std::fread(buf_.data() + buf_end_, 1, buf_.size() - buf_end_, fp_);
      if (n == 0) {
        if (std::ferror(fp_)) return Status::errorf("cannot read '{}': {}", files_[file_], std::strerror(errno));
        eof_ = true;
      }
      buf_end_ += n;
    }
  }

  // The next line has more than max_line_bytes before its newline.
  Status tooLong() const {
    return locatedError(
        fmt::format("line {} is longer than {} bytes: not a Criteo TSV line (is this a TSV file?)", line_ + 1,
                    opts_.max_line_bytes),
        files_[file_], line_ + 1, opts_.max_line_bytes + 1);
  }

  std::vector<std::string> files_;
  TsvOptions opts_;
  std::FILE* fp_ = nullptr;
  size_t file_ = 0;
  std::vector<char> buf_;
  size_t buf_begin_ = 0, buf_end_ = 0;
  int64_t buf_offset_ = 0;  // file offset of buf_[0]
  int64_t line_ = 0;        // lines consumed in the current file
  bool eof_ = false;
  int64_t malformed_ = 0;
};

}  // namespace

Expected<std::unique_ptr<RecordSource>> openTsv(std::vector<std::string> files, TsvOptions opts) {
  if (files.empty()) return Status::error("no data files given");
  // Every file, so that a bad one fails before the first is read.
  for (const std::string& f : files) KILN_RETURN_IF_ERROR(checkDataFile(f));
  auto src = std::make_unique<TsvSource>(std::move(files), std::move(opts));
  KILN_RETURN_IF_ERROR(src->open(0, 0, 0));
  return std::unique_ptr<RecordSource>(std::move(src));
}

}  // namespace kiln::data
