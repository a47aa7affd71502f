// Issue 12, defects 2, 8 and 11 on the data readers' side: a line too long to buffer is a
// located error (not std::bad_alloc), line numbers past 32 bits do not wrap, a binary header's
// record count is checked against the file's size before it sizes anything, compressed files
// and directories are named, a UTF-8 byte-order mark is skipped, and the prefetcher counts and
// reports only the malformed lines of batches it hands out.
#include <chrono>
#include <cstring>
#include <thread>

#include "runtime/data/binary_format.h"
#include "runtime/data/prefetcher.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::TempDir;

std::string goodLine(int i) {
  std::string s = std::to_string(i % 2);
  for (int j = 0; j < kNumDense; ++j) s += "\t" + std::to_string((i + j) % 17);
  for (int c = 0; c < kNumSparse; ++c) s += "\t" + fmt::format("{:x}", static_cast<uint32_t>(i * 40503u + c));
  return s + "\n";
}

std::string goodLines(int first, int n) {
  std::string s;
  for (int i = first; i < first + n; ++i) s += goodLine(i);
  return s;
}

// Reads the whole source; returns the samples read and the first error ("" when none).
std::pair<std::vector<RawSample>, std::string> drain(RecordSource& src) {
  std::vector<RawSample> out;
  RawSample s;
  for (;;) {
    auto got = src.next(s);
    if (!got) return {out, got.status().str()};
    if (!*got) return {out, ""};
    out.push_back(s);
  }
}

TEST(TsvLimits, ALineLongerThanOneMebibyteIsALocatedError) {
  TempDir dir;
  // One byte over the limit; lines of the limit's length and below are read as usual.
  std::string path =
      dir.write("long.tsv", goodLine(0) + std::string((1 << 20) + 1, '1') + "\n" + goodLine(1));
  std::vector<std::string> skipped;
  auto src = openTsv({path}, {.on_skip = [&](const Status& s) { skipped.push_back(s.str()); }});
  ASSERT_TRUE(src.isOk()) << src.status().str();
  auto [samples, error] = drain(**src);
  EXPECT_EQ(samples.size(), 1u);
  EXPECT_EQ(error,
            path +
                ":2:1048577: error: line 2 is longer than 1048576 bytes: not a Criteo TSV line (is this a "
                "TSV file?)");
  EXPECT_TRUE(skipped.empty());
}

TEST(TsvLimits, ALongLastLineWithoutNewlineIsALocatedError) {
  TempDir dir;
  std::string path = dir.write("tail.tsv", goodLine(0) + goodLine(1) + std::string(3 << 20, '0'));
  auto src = openTsv({path});
  ASSERT_TRUE(src.isOk());
  auto [samples, error] = drain(**src);
  EXPECT_EQ(samples.size(), 2u);
  EXPECT_EQ(error.rfind(path + ":3:1048577: error: line 3 is longer than 1048576 bytes", 0), 0u) << error;
}

TEST(TsvLimits, LineNumbersPastThirtyTwoBitsDoNotWrap) {
  TempDir dir;
  std::string path = dir.write("d.tsv", "2\tx\n" + goodLine(0));
  std::vector<std::string> skipped;
  auto src = openTsv({path}, {.on_skip = [&](const Status& s) { skipped.push_back(s.str()); }});
  ASSERT_TRUE(src.isOk());
  // As if 3e9 lines came before (a resumed position says so without a file that long).
  ASSERT_TRUE((*src)->seek(StreamPosition{.file = 0, .offset = 0, .line = 3'000'000'000}).isOk());
  auto [samples, error] = drain(**src);
  EXPECT_EQ(error, "");
  EXPECT_EQ(samples.size(), 1u);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0], path + ": error: line 3000000001, column 1: label must be 0 or 1, got '2'");
}

TEST(TsvMessages, AUtf8ByteOrderMarkIsSkipped) {
  TempDir dir;
  std::string plain = dir.write("plain.tsv", goodLines(0, 5));
  std::string bom = dir.write("bom.tsv", "\xEF\xBB\xBF" + goodLines(0, 5));
  auto a = openTsv({plain});
  auto b = openTsv({bom});
  ASSERT_TRUE(a.isOk() && b.isOk());
  auto [want, e1] = drain(**a);
  auto [got, e2] = drain(**b);
  ASSERT_EQ(e1 + e2, "");
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ((*b)->malformed(), 0);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), sizeof(RawSample) * 5), 0);
  // Only at the start of a file: elsewhere the bytes are part of a (bad) label.
  std::string mid = dir.write("mid.tsv", goodLine(0) + "\xEF\xBB\xBF" + goodLine(1));
  auto c = openTsv({mid}, {.on_skip = [](const Status&) {}});
  ASSERT_TRUE(c.isOk());
  EXPECT_EQ(drain(**c).first.size(), 1u);
  EXPECT_EQ((*c)->malformed(), 1);
}

TEST(TsvMessages, CompressedFilesAreNamedByTheirMagicBytes) {
  TempDir dir;
  const std::pair<std::string, std::string> kinds[] = {
      {std::string("\x1f\x8b\x08\x00", 4), "is a gzip file: decompress it first (gunzip -k '"},
      {std::string("\x28\xb5\x2f\xfd\x00", 5), "is a zstd file: decompress it first (zstd -d '"},
      {"BZh91AY&SY", "is a bzip2 file: decompress it first (bunzip2 -k '"},
      {std::string("\xfd"
                   "7zXZ\x00\x00",
                   7),
       "is an xz file: decompress it first (unxz -k '"},
  };
  for (const auto& [magic, message] : kinds) {
    std::string path = dir.write("data.tsv.z", magic + "rest of the stream");
    auto tsv = openTsv({path});
    ASSERT_FALSE(tsv.isOk());
    EXPECT_EQ(tsv.status().message(),
              "'" + path + "' " + message + path + "'); Kiln reads Criteo TSV and Kiln binary files");
    // The same for any later file of a stream, before the first one is read.
    auto records = openRecords({dir.write("ok.tsv", goodLine(0)), path});
    ASSERT_FALSE(records.isOk());
    EXPECT_NE(records.status().message().find(message), std::string::npos) << records.status().str();
  }
}

TEST(TsvMessages, ADirectoryIsNamedWhenOpened) {
  TempDir dir;
  std::filesystem::create_directories(dir.file("sub"));
  auto r = openRecords({dir.file("sub")});
  ASSERT_FALSE(r.isOk());
  EXPECT_EQ(r.status().message(), "'" + dir.file("sub") + "' is a directory, not a data file");
}

// A valid header (its checksum fixed) that claims `records` records.
std::string headerClaiming(uint64_t records) {
  unsigned char h[kBinaryHeaderBytes] = {};
  std::memcpy(h, kBinaryMagic, 8);
  const uint32_t fields[] = {kBinaryVersion, kBinaryHeaderBytes, kBinaryRecordBytes,
                             kNumDense,      kNumSparse,         0};
  std::memcpy(h + 8, fields, sizeof fields);
  std::memcpy(h + 32, &records, 8);
  uint64_t fnv = 0xcbf29ce484222325ull;
  for (int i = 0; i < 40; ++i) fnv = (fnv ^ h[i]) * 0x100000001b3ull;
  std::memcpy(h + 40, &fnv, 8);
  return std::string(reinterpret_cast<char*>(h), sizeof h);
}

TEST(BinaryHeader, ACountBeyondTheFileIsAnErrorWithTrueNumbers) {
  TempDir dir;
  std::string path =
      dir.write("huge.bin", headerClaiming(uint64_t{1} << 60) + std::string(2 * kBinaryRecordBytes, '\0'));
  auto n = checkBinaryFile(path);
  ASSERT_FALSE(n.isOk());
  EXPECT_EQ(n.status().message(),
            "'" + path +
                "': corrupt header: it says 1152921504606846976 records, more than any file "
                "holds (the file has 608 bytes)");
  EXPECT_FALSE(openBinary({path}).isOk());
  // A count that fits in 64-bit bytes still gets its true byte size in the message.
  std::string short_path =
      dir.write("short.bin", headerClaiming(1000) + std::string(kBinaryRecordBytes, '\0'));
  auto m = checkBinaryFile(short_path);
  ASSERT_FALSE(m.isOk());
  EXPECT_EQ(m.status().message(),
            "'" + short_path +
                "': truncated file: the header says 1000 records (272064 bytes) but the file "
                "has 336 bytes");
}

TEST(PrefetchCount, LinesReadAheadButNeverHandedOutAreNeitherCountedNorReported) {
  TempDir dir;
  // Two batches of 8, then three malformed lines, then plenty for the prefetcher to read ahead.
  std::string path = dir.write("d.tsv", goodLines(0, 16) + "2\tbad\nnot a line\n\n" + goodLines(16, 200));
  std::vector<std::string> reported;
  auto r = openBatchReader(
      testing::criteoSpec(),
      {.paths = {path}, .batch_size = 8, .on_skip = [&](const Status& s) { reported.push_back(s.str()); }});
  ASSERT_TRUE(r.isOk()) << r.status().str();
  Prefetcher pf(r.take(), 4);
  Batch b;
  ASSERT_TRUE(*pf.next(b));
  ASSERT_TRUE(*pf.next(b));
  // Give the reader time to read ahead past the malformed lines (the counts must not depend on it).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(pf.malformed(), 0);
  EXPECT_TRUE(reported.empty());
  ASSERT_TRUE(*pf.next(b));
  EXPECT_EQ(pf.malformed(), 3);
  ASSERT_EQ(reported.size(), 3u);
  EXPECT_EQ(reported[0], path + ":17:1: error: label must be 0 or 1, got '2'");
  EXPECT_EQ(reported[2].rfind(path + ":19:", 0), 0u) << reported[2];
}

TEST(PrefetchCount, MalformedLinesAfterTheLastSampleCountAtTheEnd) {
  TempDir dir;
  std::string path = dir.write("d.tsv", goodLines(0, 16) + "2\n3\n");
  auto r = openBatchReader(testing::criteoSpec(),
                           {.paths = {path}, .batch_size = 8, .on_skip = [](const Status&) {}});
  ASSERT_TRUE(r.isOk());
  Prefetcher pf(r.take(), 4);
  Batch b;
  ASSERT_TRUE(*pf.next(b));
  ASSERT_TRUE(*pf.next(b));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(pf.malformed(), 0);
  EXPECT_FALSE(*pf.next(b));
  EXPECT_EQ(pf.malformed(), 2);
}

}  // namespace
}  // namespace kiln::data
