#include "runtime/data/binary_format.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>

#include "runtime/random.h"

namespace kiln::data {

static_assert(std::endian::native == std::endian::little, "the binary format is little-endian; add byte swaps");

namespace {

template <typename T>
void put(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T take(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void encodeHeader(int64_t records, unsigned char* h) {
  std::memset(h, 0, kBinaryHeaderBytes);
  std::memcpy(h, kBinaryMagic, 8);
  put<uint32_t>(h + 8, kBinaryVersion);
  put<uint32_t>(h + 12, kBinaryHeaderBytes);
  put<uint32_t>(h + 16, kBinaryRecordBytes);
  put<uint32_t>(h + 20, kNumDense);
  put<uint32_t>(h + 24, kNumSparse);
  put<uint32_t>(h + 28, 0);
  put<uint64_t>(h + 32, static_cast<uint64_t>(records));
  put<uint64_t>(h + 40, runtime::fnv1a64(h, 40));
}

Expected<int64_t> fileSize(std::FILE* fp, const std::string& path) {
  if (fseeko(fp, 0, SEEK_END) != 0) return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
  int64_t size = ftello(fp);
  if (fseeko(fp, 0, SEEK_SET) != 0) return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
  return size;
}

// Validates the header of an open file; returns the record count.
Expected<int64_t> checkHeader(std::FILE* fp, const std::string& path) {
  KILN_ASSIGN_OR_RETURN(auto size, fileSize(fp, path));
  unsigned char h[kBinaryHeaderBytes];
  if (size < kBinaryHeaderBytes)
    return Status::errorf("'{}': truncated binary data file: {} bytes, the header alone needs {}", path, size,
                          kBinaryHeaderBytes);
  if (std::fread(h, 1, kBinaryHeaderBytes, fp) != static_cast<size_t>(kBinaryHeaderBytes))
    return Status::errorf("cannot read '{}': {}", path, std::strerror(errno));
  if (std::memcmp(h, kBinaryMagic, 8) != 0) return Status::errorf("'{}': not a Kiln binary data file (bad magic)", path);
  // Version 2 checksums its whole (longer) header: named before this version's checksum is read.
  if (take<uint32_t>(h + 8) == 2)
    return Status::errorf(
        "'{}' holds a model's own schema (binary version 2), but the model reads the Criteo layout: "
        "a model whose inputs bind its columns (columns(...)) reads it",
        path);
  if (take<uint64_t>(h + 40) != runtime::fnv1a64(h, 40))
    return Status::errorf("'{}': corrupt header (checksum mismatch)", path);
  if (uint32_t v = take<uint32_t>(h + 8); v != kBinaryVersion)
    return Status::errorf("'{}': binary data version {} is not supported (this build reads version {})", path, v, kBinaryVersion);
  if (take<uint32_t>(h + 12) != kBinaryHeaderBytes || take<uint32_t>(h + 16) != kBinaryRecordBytes ||
      take<uint32_t>(h + 20) != kNumDense || take<uint32_t>(h + 24) != kNumSparse || take<uint32_t>(h + 28) != 0)
    return Status::errorf("'{}': unexpected layout (header {} B, record {} B, {} dense, {} categorical, flags {})", path,
                          take<uint32_t>(h + 12), take<uint32_t>(h + 16), take<uint32_t>(h + 20), take<uint32_t>(h + 24),
                          take<uint32_t>(h + 28));
  // The count is checked against the file's size before anything is sized by it; a count whose
  // byte size overflows 64 bits is named as the count alone.
  uint64_t records = take<uint64_t>(h + 32);
  uint64_t payload = static_cast<uint64_t>(size - kBinaryHeaderBytes);
  if (records > payload / kBinaryRecordBytes) {
    if (records > (static_cast<uint64_t>(INT64_MAX) - kBinaryHeaderBytes) / kBinaryRecordBytes)
      return Status::errorf(
          "'{}': corrupt header: it says {} records, more than any file holds (the file has {} bytes)", path,
          records, size);
    return Status::errorf(
        "'{}': truncated file: the header says {} records ({} bytes) but the file has {} bytes", path,
        records, kBinaryHeaderBytes + static_cast<int64_t>(records) * kBinaryRecordBytes, size);
  }
  if (payload != records * kBinaryRecordBytes)
    return Status::errorf(
        "'{}': corrupt file: the header says {} records ({} bytes) but the file has {} bytes", path, records,
        kBinaryHeaderBytes + static_cast<int64_t>(records) * kBinaryRecordBytes, size);
  return static_cast<int64_t>(records);
}

}  // namespace

void encodeRecord(const RawSample& s, unsigned char* r) {
  put<float>(r, s.label);
  put<uint32_t>(r + 4, s.missing);
  std::memcpy(r + 8, s.dense, sizeof(s.dense));
  put<uint32_t>(r + 60, 0);
  std::memcpy(r + 64, s.cats, sizeof(s.cats));
}

Status decodeRecord(const unsigned char* r, RawSample& s) {
  s.label = take<float>(r);
  s.missing = take<uint32_t>(r + 4);
  std::memcpy(s.dense, r + 8, sizeof(s.dense));
  std::memcpy(s.cats, r + 64, sizeof(s.cats));
  if (s.label != 0.0f && s.label != 1.0f) return Status::errorf("label is {}, not 0 or 1", s.label);
  if (s.missing >> kNumSparse) return Status::errorf("missing mask {:#x} has bits beyond {} features", s.missing, kNumSparse);
  if (take<uint32_t>(r + 60) != 0) return Status::error("padding is not zero");
  for (int j = 0; j < kNumDense; ++j)
    if (!std::isfinite(s.dense[j]) || s.dense[j] < 0)
      return Status::errorf("dense feature {} is {}, not a finite log(1+x) >= 0", j + 1, s.dense[j]);
  return Status::ok();
}

BinaryWriter::~BinaryWriter() {
  if (fp_) {  // never finished: leave no partial file behind
    std::fclose(fp_);
    std::remove(tmp_path_.c_str());
  }
}

Expected<std::unique_ptr<BinaryWriter>> BinaryWriter::create(const std::string& path) {
  std::unique_ptr<BinaryWriter> w(new BinaryWriter());
  w->path_ = path;
  w->tmp_path_ = path + ".tmp";
  w->fp_ = std::fopen(w->tmp_path_.c_str(), "wb");
  if (!w->fp_) return Status::errorf("cannot create '{}': {}", w->tmp_path_, std::strerror(errno));
  std::setvbuf(w->fp_, nullptr, _IOFBF, 1 << 20);
  unsigned char h[kBinaryHeaderBytes];
  encodeHeader(0, h);
  if (std::fwrite(h, 1, sizeof h, w->fp_) != sizeof h) return Status::errorf("cannot write '{}': {}", w->tmp_path_, std::strerror(errno));
  return w;
}

Status BinaryWriter::append(const RawSample& s) {
  unsigned char r[kBinaryRecordBytes];
  encodeRecord(s, r);
  if (std::fwrite(r, 1, sizeof r, fp_) != sizeof r) return Status::errorf("cannot write '{}': {}", tmp_path_, std::strerror(errno));
  ++count_;
  return Status::ok();
}

Status BinaryWriter::finish() {
  unsigned char h[kBinaryHeaderBytes];
  encodeHeader(count_, h);
  bool ok = std::fseek(fp_, 0, SEEK_SET) == 0 && std::fwrite(h, 1, sizeof h, fp_) == sizeof h && std::fflush(fp_) == 0 &&
            ::fsync(fileno(fp_)) == 0;
  int err = errno;
  ok = (std::fclose(fp_) == 0) && ok;
  fp_ = nullptr;
  if (!ok || std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_path_.c_str());
    return Status::errorf("cannot write '{}': {}", path_, std::strerror(ok ? errno : err));
  }
  return Status::ok();
}

bool isBinaryFile(const std::string& path) {
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) return false;
  char m[8];
  bool yes = std::fread(m, 1, 8, fp) == 8 && std::memcmp(m, kBinaryMagic, 8) == 0;
  std::fclose(fp);
  return yes;
}

Expected<int64_t> checkBinaryFile(const std::string& path) {
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
  auto n = checkHeader(fp, path);
  std::fclose(fp);
  return n;
}

namespace {

class BinarySource final : public RecordSource {
 public:
  explicit BinarySource(std::vector<std::string> files) : files_(std::move(files)) {}
  ~BinarySource() override { close(); }

  Status open(size_t file, int64_t record) {
    close();
    file_ = file;
    next_ = record;
    chunk_.clear();
    chunk_pos_ = 0;
    if (file_ >= files_.size()) return Status::ok();
    const std::string& path = files_[file_];
    fp_ = std::fopen(path.c_str(), "rb");
    if (!fp_) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
    KILN_ASSIGN_OR_RETURN(auto n, checkHeader(fp_, path));
    count_ = n;
    if (record < 0 || record > count_)
      return Status::errorf("'{}': data position record {} is beyond its {} records", path, record, count_);
    if (fseeko(fp_, kBinaryHeaderBytes + record * kBinaryRecordBytes, SEEK_SET) != 0)
      return Status::errorf("cannot seek in '{}': {}", path, std::strerror(errno));
    return Status::ok();
  }

  Expected<bool> next(RawSample& s) override {
    while (chunk_pos_ * kBinaryRecordBytes >= static_cast<int64_t>(chunk_.size())) {
      if (file_ >= files_.size()) return false;
      if (next_ >= count_) {
        KILN_RETURN_IF_ERROR(open(file_ + 1, 0));
        continue;
      }
      // Read records in chunks of about 1 MiB.
      int64_t n = std::min<int64_t>(count_ - next_, 4096);
      chunk_.resize(static_cast<size_t>(n * kBinaryRecordBytes));
      if (std::fread(chunk_.data(), 1, chunk_.size(), fp_) != chunk_.size())
        return Status::errorf("'{}': truncated while reading record {}", files_[file_], next_);
      chunk_first_ = next_;
      chunk_pos_ = 0;
      next_ += n;
    }
    Status st = decodeRecord(chunk_.data() + chunk_pos_ * kBinaryRecordBytes, s);
    if (!st) {
      int64_t record = chunk_first_ + chunk_pos_;
      return Status::errorf("'{}': corrupt record {}: {} (the record at byte {})", files_[file_], record,
                            st.message(), kBinaryHeaderBytes + record * kBinaryRecordBytes);
    }
    ++chunk_pos_;
    return true;
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.file < 0 || static_cast<size_t>(pos.file) > files_.size())
      return Status::errorf("data position names file {} but the stream has {} files", pos.file, files_.size());
    // Offset 0 is the start of a file, where each epoch begins (BatchReader): its first record.
    const int64_t offset = pos.offset == 0 ? kBinaryHeaderBytes : pos.offset;
    if ((offset - kBinaryHeaderBytes) % kBinaryRecordBytes != 0 || offset < kBinaryHeaderBytes)
      return Status::errorf("data position offset {} is not at a record of a binary file", pos.offset);
    return open(static_cast<size_t>(pos.file), (offset - kBinaryHeaderBytes) / kBinaryRecordBytes);
  }

  StreamPosition position() const override {
    StreamPosition p;
    p.file = static_cast<int64_t>(file_);
    int64_t record = chunk_.empty() ? next_ : chunk_first_ + chunk_pos_;
    if (!chunk_.empty() && chunk_pos_ * kBinaryRecordBytes >= static_cast<int64_t>(chunk_.size())) record = next_;
    p.offset = kBinaryHeaderBytes + record * kBinaryRecordBytes;
    p.line = record;
    return p;
  }

 private:
  void close() {
    if (fp_) std::fclose(fp_);
    fp_ = nullptr;
  }

  std::vector<std::string> files_;
  std::FILE* fp_ = nullptr;
  size_t file_ = 0;
  int64_t count_ = 0;  // records in the current file
  int64_t next_ = 0;   // next record to read from the file
  std::vector<unsigned char> chunk_;
  int64_t chunk_first_ = 0, chunk_pos_ = 0;
};

}  // namespace

Expected<std::unique_ptr<RecordSource>> openBinary(std::vector<std::string> files) {
  if (files.empty()) return Status::error("no data files given");
  // Check every file up front so a bad one fails before training starts.
  for (const auto& f : files) {
    KILN_RETURN_IF_ERROR(checkBinaryFile(f));
  }
  auto src = std::make_unique<BinarySource>(std::move(files));
  KILN_RETURN_IF_ERROR(src->open(0, 0));
  return std::unique_ptr<RecordSource>(std::move(src));
}

Expected<ConvertStats> convertToBinary(const std::vector<std::string>& inputs, const std::string& output, TsvOptions opts) {
  for (const auto& f : inputs)
    if (isBinaryFile(f)) return Status::errorf("'{}' is already a Kiln binary data file", f);
  KILN_ASSIGN_OR_RETURN(auto src, openTsv(inputs, std::move(opts)));
  KILN_ASSIGN_OR_RETURN(auto writer, BinaryWriter::create(output));
  RawSample s;
  for (;;) {
    KILN_ASSIGN_OR_RETURN(auto got, src->next(s));
    if (!got) break;
    KILN_RETURN_IF_ERROR(writer->append(s));
  }
  KILN_RETURN_IF_ERROR(writer->finish());
  return ConvertStats{writer->records(), src->malformed()};
}

Expected<std::unique_ptr<RecordSource>> openRecords(std::vector<std::string> files, TsvOptions opts) {
  if (files.empty()) return Status::error("no data files given");
  size_t binary = 0;
  for (const auto& f : files) {
    KILN_RETURN_IF_ERROR(checkDataFile(f));
    binary += isBinaryFile(f);
  }
  if (binary == files.size()) return openBinary(std::move(files));
  if (binary != 0) return Status::error("data files mix Kiln binary and TSV files; convert them all with 'kiln data convert'");
  return openTsv(std::move(files), std::move(opts));
}

}  // namespace kiln::data
