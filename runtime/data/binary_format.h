// Kiln's binary data format: the Criteo samples after parsing, as fixed-size little-endian
// records behind a checked header, so reading is a bulk copy with no text parsing.
//
//   header (64 bytes)
//     0  char[8]  magic "KILNDATA"
//     8  u32      version (1)
//    12  u32      header bytes (64)
//    16  u32      record bytes (272)
//    20  u32      dense features (13)
//    24  u32      categorical features (26)
//    28  u32      flags (0)
//    32  u64      record count
//    40  u64      FNV-1a 64 checksum of bytes 0..39
//    48  u8[16]   zero
//   record (272 bytes)
//     0  f32      label (0 or 1)
//     4  u32      missing mask (bit f: categorical feature f was empty)
//     8  f32[13]  dense features, already log(1 + max(x, 0))
//    60  u32      zero
//    64  u64[26]  categorical values as read (0 where missing)
#pragma once

#include <cstdio>
#include <string>

#include "runtime/data/record_source.h"

namespace kiln::data {

inline constexpr char kBinaryMagic[8] = {'K', 'I', 'L', 'N', 'D', 'A', 'T', 'A'};
inline constexpr uint32_t kBinaryVersion = 1;
inline constexpr int64_t kBinaryHeaderBytes = 64;
inline constexpr int64_t kBinaryRecordBytes = 272;

// Writes a binary file: to PATH.tmp, renamed onto PATH by finish().
class BinaryWriter {
 public:
  ~BinaryWriter();
  static Expected<std::unique_ptr<BinaryWriter>> create(const std::string& path);
  Status append(const RawSample& s);
  // Writes the final header, flushes, fsyncs and renames the file into place.
  Status finish();
  int64_t records() const { return count_; }

 private:
  BinaryWriter() = default;
  std::string path_, tmp_path_;
  std::FILE* fp_ = nullptr;
  int64_t count_ = 0;
};

// Checks a binary file's header against its size; returns its record count.
Expected<int64_t> checkBinaryFile(const std::string& path);
// True when the file starts with the binary magic.
bool isBinaryFile(const std::string& path);

Expected<std::unique_ptr<RecordSource>> openBinary(std::vector<std::string> files);

// Converts TSV files into one binary file (malformed lines skipped and counted, or fatal when
// opts.strict). On an error no output file is left behind.
struct ConvertStats {
  int64_t records = 0;
  int64_t malformed = 0;
};
Expected<ConvertStats> convertToBinary(const std::vector<std::string>& inputs, const std::string& output, TsvOptions opts = {});

// Encodes/decodes one record (exposed for tests of corruption handling).
void encodeRecord(const RawSample& s, unsigned char* out);
// Checks the record's invariants; the message says which field is bad.
Status decodeRecord(const unsigned char* in, RawSample& s);

}  // namespace kiln::data
