#include "runtime/data/line_reader.h"

#include <fmt/format.h>

#include <cerrno>
#include <climits>
#include <cstring>

namespace kiln::data {

namespace {
constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";
}  // namespace

Status locatedError(std::string message, const std::string& file, int64_t line, int64_t col) {
  if (line <= INT_MAX && col <= INT_MAX)
    return Status::error(std::move(message), Location{file, static_cast<int>(line), static_cast<int>(col)});
  return Status::error(fmt::format("line {}, column {}: {}", line, col, message), Location{file});
}

std::string printableField(std::string_view f) {
  std::string s(f.substr(0, 24));
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 32 || static_cast<unsigned char>(c) > 126) c = '?';
  return f.size() > 24 ? s + "..." : s;
}

LineReader::LineReader(std::vector<std::string> files, int64_t max_line_bytes, std::string what)
    : files_(std::move(files)), max_line_bytes_(max_line_bytes), what_(std::move(what)) {
  buf_.resize(1 << 20);
}

void LineReader::close() {
  if (fp_) std::fclose(fp_);
  fp_ = nullptr;
}

Status LineReader::open(size_t file, int64_t offset, int64_t line) {
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

Expected<bool> LineReader::next(std::string_view* line) {
  if (!fp_) return false;
  for (;;) {
    const char* base = buf_.data();
    const void* nl = std::memchr(base + buf_begin_, '\n', buf_end_ - buf_begin_);
    if (nl || (eof_ && buf_begin_ < buf_end_)) {
      size_t end = nl ? static_cast<size_t>(static_cast<const char*>(nl) - base) : buf_end_;
      if (static_cast<int64_t>(end - buf_begin_) > max_line_bytes_) return tooLong();
      *line = std::string_view(base + buf_begin_, end - buf_begin_);
      // A byte-order mark (as some editors and exporters write) is no part of the first field.
      if (buf_offset_ + static_cast<int64_t>(buf_begin_) == 0 && line->substr(0, kUtf8Bom.size()) == kUtf8Bom)
        line->remove_prefix(kUtf8Bom.size());
      buf_begin_ = nl ? end + 1 : end;
      ++line_;
      return true;
    }
    if (eof_) return false;
    // Move the partial line to the front, grow for long lines (up to the limit), and read more.
    size_t rest = buf_end_ - buf_begin_;
    if (static_cast<int64_t>(rest) > max_line_bytes_) return tooLong();
    std::memmove(buf_.data(), base + buf_begin_, rest);
    buf_offset_ += static_cast<int64_t>(buf_begin_);
    buf_begin_ = 0;
    buf_end_ = rest;
    if (buf_end_ == buf_.size()) buf_.resize(buf_.size() * 2);
    size_t n = std::fread(buf_.data() + buf_end_, 1, buf_.size() - buf_end_, fp_);
    if (n == 0) {
      if (std::ferror(fp_))
        return Status::errorf("cannot read '{}': {}", files_[file_], std::strerror(errno));
      eof_ = true;
    }
    buf_end_ += n;
  }
}

Status LineReader::tooLong() const {
  return locatedError(fmt::format("line {} is longer than {} bytes: {}", line_ + 1, max_line_bytes_, what_),
                      files_[file_], line_ + 1, max_line_bytes_ + 1);
}

}  // namespace kiln::data
