#include "runtime/data/token_source.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "runtime/data/record_source.h"
#include "runtime/data/sample.h"

namespace kiln::data {

std::string_view tokenDTypeName(TokenDType t) { return t == TokenDType::U16 ? "u16" : "u32"; }

namespace {

bool endsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

Expected<TokenDType> tokenDTypeFor(const std::string& path, const std::string& flag) {
  if (flag == "u16") return TokenDType::U16;
  if (flag == "u32") return TokenDType::U32;
  if (!flag.empty()) return Status::errorf("token dtype must be u16 or u32, got '{}'", flag);
  if (endsWith(path, ".u32") || endsWith(path, ".u32.bin")) return TokenDType::U32;
  if (endsWith(path, ".u16") || endsWith(path, ".bin")) return TokenDType::U16;
  return Status::errorf(
      "'{}': cannot tell the token dtype from the name (.bin, .u16 or .u32): give --token-dtype u16|u32",
      path);
}

namespace {

constexpr size_t kTokenBufferBytes = size_t{1} << 20;

class TokenFileSource final : public TokenSource {
 public:
  TokenFileSource(std::vector<std::string> files, std::vector<int64_t> sizes, TokenDType dtype,
                  int64_t seq_len, int64_t vocab)
      : files_(std::move(files)),
        sizes_(std::move(sizes)),
        bytes_(tokenBytes(dtype)),
        seq_len_(seq_len),
        vocab_(vocab),
        buffer_(kTokenBufferBytes) {}
  ~TokenFileSource() override { close(); }

  int64_t windowLength() const override { return seq_len_ + 1; }

  Expected<bool> next(int32_t* window) override {
    // The window starts at start_ (file, offset); it ends at the token the next one starts at.
    KILN_RETURN_IF_ERROR(openAt(start_file_, start_offset_));
    int64_t last_file = 0, last_offset = 0;
    for (int64_t k = 0; k <= seq_len_; ++k) {
      KILN_ASSIGN_OR_RETURN(bool got, readToken(window[k], &last_file, &last_offset));
      if (!got) return false;
    }
    start_file_ = last_file;
    start_offset_ = last_offset;
    return true;
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || pos.file > static_cast<int64_t>(files_.size()) ||
        (pos.file < static_cast<int64_t>(files_.size()) &&
         (pos.offset > sizes_[static_cast<size_t>(pos.file)] || pos.offset % bytes_ != 0)))
      return Status::errorf("bad token data position {}: not a token of these {} file(s)", pos.str(),
                            files_.size());
    start_file_ = pos.file;
    start_offset_ = pos.offset;
    close();
    return Status::ok();
  }

  StreamPosition position() const override {
    return StreamPosition{.file = start_file_, .offset = start_offset_};
  }

 private:
  void close() {
    if (fp_) std::fclose(fp_);
    fp_ = nullptr;
    begin_ = end_ = 0;
  }

  // Makes the reader's next token the one at (file, offset), reopening only when it is not.
  Status openAt(int64_t file, int64_t offset) {
    if (fp_ && file == file_ && offset == offset_) return Status::ok();
    close();
    file_ = file;
    offset_ = offset;
    if (file_ >= static_cast<int64_t>(files_.size())) return Status::ok();
    const std::string& path = files_[static_cast<size_t>(file_)];
    fp_ = std::fopen(path.c_str(), "rb");
    if (!fp_) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
    if (offset_ > 0 && std::fseek(fp_, static_cast<long>(offset_), SEEK_SET) != 0)
      return Status::errorf("'{}': cannot seek to byte {}: {}", path, offset_, std::strerror(errno));
    return Status::ok();
  }

  // Reads the next token of the stream (crossing into later files) and where it lay.
  Expected<bool> readToken(int32_t& out, int64_t* file, int64_t* offset) {
    while (end_ - begin_ < static_cast<size_t>(bytes_)) {
      if (file_ >= static_cast<int64_t>(files_.size())) return false;
      // A short read may end mid-token: keep its bytes and read on.
      const size_t kept = end_ - begin_;
      std::memmove(buffer_.data(), buffer_.data() + begin_, kept);
      begin_ = 0;
      end_ = kept;
      const size_t got = fp_ ? std::fread(buffer_.data() + kept, 1, buffer_.size() - kept, fp_) : 0;
      end_ += got;
      if (got > 0) continue;
      const std::string& path = files_[static_cast<size_t>(file_)];
      if (fp_ && std::ferror(fp_)) return Status::errorf("cannot read '{}': {}", path, std::strerror(errno));
      // Opening checked that each file holds whole tokens.
      if (kept > 0)
        return Status::errorf("'{}': the file changed while read (a token is cut at byte {})", path, offset_);
      KILN_RETURN_IF_ERROR(openAt(file_ + 1, 0));
    }
    const unsigned char* p = buffer_.data() + begin_;
    uint32_t id = bytes_ == 2 ? static_cast<uint32_t>(p[0] | (p[1] << 8))
                              : static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                                    (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
    *file = file_;
    *offset = offset_;
    if (static_cast<int64_t>(id) >= vocab_)
      return Status::errorf("'{}': token {} (byte {}) is {}, not below the model's vocab {}",
                            files_[static_cast<size_t>(file_)], offset_ / bytes_, offset_, id, vocab_);
    out = static_cast<int32_t>(id);
    begin_ += static_cast<size_t>(bytes_);
    offset_ += bytes_;
    return true;
  }

  std::vector<std::string> files_;
  std::vector<int64_t> sizes_;
  int bytes_;
  int64_t seq_len_, vocab_;
  int64_t start_file_ = 0, start_offset_ = 0;  // the next window's first token
  std::FILE* fp_ = nullptr;
  int64_t file_ = 0, offset_ = 0;  // the reader's next token (after the buffered bytes' first)
  std::vector<unsigned char> buffer_;
  size_t begin_ = 0, end_ = 0;
};

}  // namespace

Expected<std::unique_ptr<TokenSource>> openTokenFiles(std::vector<std::string> files, TokenDType dtype,
                                                      int64_t seq_len, int64_t vocab) {
  if (files.empty()) return Status::error("no token files given");
  if (seq_len <= 0) return Status::errorf("the sequence length must be positive, got {}", seq_len);
  std::vector<int64_t> sizes;
  const int bytes = tokenBytes(dtype);
  for (const std::string& f : files) {
    KILN_RETURN_IF_ERROR(checkDataFile(f));
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(f, ec));
    if (ec) return Status::errorf("cannot read the size of '{}': {}", f, ec.message());
    if (size % bytes != 0)
      return Status::errorf(
          "'{}': truncated token file: {} bytes is no whole number of {} tokens ({} bytes each); "
          "the last token, at byte {}, is cut short",
          f, size, tokenDTypeName(dtype), bytes, size - size % bytes);
    sizes.push_back(size);
  }
  return std::unique_ptr<TokenSource>(
      std::make_unique<TokenFileSource>(std::move(files), std::move(sizes), dtype, seq_len, vocab));
}

void assembleTokenBatch(const BatchSpec& spec, const int32_t* windows, int64_t n, Batch& batch) {
  allocateBatch(spec, n, batch);
  const int64_t t = spec.inputs[static_cast<size_t>(spec.tokensIndex())].seq_len;
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const InputSpec& in = spec.inputs[i];
    const int64_t shift = in.role == InputRole::Targets ? 1 : 0;  // targets are the tokens one on
    ir::HostTensor& out = batch.tensors[i];
    for (int64_t r = 0; r < n; ++r) {
      const int32_t* w = windows + r * (t + 1) + shift;
      if (in.type.dtype() == ir::DType::i64)
        std::copy(w, w + t, out.as<int64_t>() + r * t);
      else
        std::copy(w, w + t, out.as<int32_t>() + r * t);
    }
  }
}

}  // namespace kiln::data
