// Criteo TSV, streamed: a 1 MiB buffer per open file, lines parsed in place, files of any size.
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "runtime/data/line_reader.h"
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
      if (f != "0" && f != "1") return Status::errorf("label must be 0 or 1, got '{}'", printableField(f));
      s.label = f[0] == '1' ? 1.0f : 0.0f;
    } else if (field <= kNumDense) {
      if (!parseDense(f, &s.dense[field - 1]))
        return Status::errorf("integer feature {} is not an integer: '{}'", field, printableField(f));
    } else {
      int c = field - 1 - kNumDense;
      if (f.empty()) {
        s.missing |= 1u << c;
        s.cats[c] = 0;
      } else if (!parseHex(f, &s.cats[c])) {
        return Status::errorf("categorical feature {} is not a hex value of at most 16 digits: '{}'", c + 1,
                              printableField(f));
      }
    }
    start = tab + 1;
  }
  return Status::ok();
}

namespace {

class TsvSource final : public RecordSource {
 public:
  TsvSource(std::vector<std::string> files, TsvOptions opts)
      : lines_(std::move(files), opts.max_line_bytes, "not a Criteo TSV line (is this a TSV file?)"),
        opts_(std::move(opts)) {}

  Status open() { return lines_.open(0, 0, 0); }

  Expected<bool> next(RawSample& s) override {
    return nextParsedLine(
        lines_, opts_, malformed_,
        [&](std::string_view line, int64_t* col) { return parseTsvLine(line, s, col); },
        [&](size_t file) { return lines_.open(file, 0, 0); });
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || static_cast<size_t>(pos.file) > lines_.files())
      return Status::errorf("data position names file {} but the stream has {} files", pos.file,
                            lines_.files());
    return lines_.open(static_cast<size_t>(pos.file), pos.offset, pos.line);
  }

  StreamPosition position() const override {
    StreamPosition p;
    p.file = static_cast<int64_t>(lines_.file());
    p.offset = lines_.offset();
    p.line = lines_.line();
    return p;
  }

  int64_t malformed() const override { return malformed_; }

 private:
  LineReader lines_;
  TsvOptions opts_;
  int64_t malformed_ = 0;
};

}  // namespace

Expected<std::unique_ptr<RecordSource>> openTsv(std::vector<std::string> files, TsvOptions opts) {
  if (files.empty()) return Status::error("no data files given");
  // Every file, so that a bad one fails before the first is read.
  for (const std::string& f : files) KILN_RETURN_IF_ERROR(checkDataFile(f));
  auto src = std::make_unique<TsvSource>(std::move(files), std::move(opts));
  KILN_RETURN_IF_ERROR(src->open());
  return std::unique_ptr<RecordSource>(std::move(src));
}

}  // namespace kiln::data
