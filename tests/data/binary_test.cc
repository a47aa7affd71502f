#include <cstring>

#include "runtime/data/batch_reader.h"
#include "runtime/data/binary_format.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::readFile;
using testing::TempDir;

std::string tsv(int n, int seed) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    int v = i + seed * 1000;
    out += std::to_string(v % 4 == 0);
    for (int j = 0; j < kNumDense; ++j) out += (v + j) % 9 == 0 ? "\t" : "\t" + std::to_string((v * 31 + j) % 1000 - 5);
    for (int c = 0; c < kNumSparse; ++c)
      out += (v + c) % 11 == 0 ? "\t" : "\t" + fmt::format("{:x}", static_cast<uint32_t>(v * 2246822519u + c * 3266489917u));
    out += "\n";
  }
  return out;
}

TEST(Binary, ConvertedFileReadsLikeTheTsv) {
  TempDir dir;
  std::vector<std::string> tsvs = {dir.write("a.tsv", tsv(300, 1) + "garbage line\n"), dir.write("b.tsv", tsv(77, 2))};
  std::string bin = dir.file("all.bin");
  int skipped = 0;
  auto stats = convertToBinary(tsvs, bin, {.on_skip = [&](const Status&) { ++skipped; }});
  ASSERT_TRUE(stats.isOk()) << stats.status().str();
  EXPECT_EQ(stats->records, 377);
  EXPECT_EQ(stats->malformed, 1);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(readFile(bin).size(), static_cast<size_t>(kBinaryHeaderBytes + 377 * kBinaryRecordBytes));
  EXPECT_FALSE(std::filesystem::exists(bin + ".tmp"));
  auto n = checkBinaryFile(bin);
  ASSERT_TRUE(n.isOk());
  EXPECT_EQ(*n, 377);

  // Batches from the TSV and from the binary file are byte-identical, for a model with
  // multi-hot features and both id maps.
  std::vector<int> hot(kNumSparse, 1);
  hot[0] = 3;
  hot[7] = 2;
  std::vector<int64_t> rows(kNumSparse, 1000);
  rows[4] = 3;
  auto spec = fromInputs(testing::criteoInputs(hot, rows));
  ASSERT_TRUE(spec.isOk());
  auto from_tsv = openBatchReader(*spec, {.paths = tsvs, .batch_size = 64, .on_skip = [](const Status&) {}});
  auto from_bin = openBatchReader(*spec, {.paths = {bin}, .batch_size = 64});
  ASSERT_TRUE(from_tsv.isOk());
  ASSERT_TRUE(from_bin.isOk()) << from_bin.status().str();
  int batches = 0;
  for (;;) {
    Batch a, b;
    auto ga = (*from_tsv)->next(a);
    auto gb = (*from_bin)->next(b);
    ASSERT_TRUE(ga.isOk() && gb.isOk());
    ASSERT_EQ(*ga, *gb);
    if (!*ga) break;
    ++batches;
    ASSERT_EQ(a.size, b.size);
    for (size_t k = 0; k < a.tensors.size(); ++k) {
      EXPECT_EQ(a.tensors[k].view.shape, b.tensors[k].view.shape);
      EXPECT_EQ(a.tensors[k].storage, b.tensors[k].storage) << a.names[k];
    }
  }
  EXPECT_EQ(batches, 6);  // 377 = 5 * 64 + 57
  // A converted file is not converted again.
  EXPECT_FALSE(convertToBinary({bin}, dir.file("again.bin")).isOk());
}

TEST(Binary, SeekResumes) {
  TempDir dir;
  std::string bin = dir.file("x.bin");
  ASSERT_TRUE(convertToBinary({dir.write("x.tsv", tsv(9000, 3))}, bin).isOk());
  auto all = openBinary({bin});
  ASSERT_TRUE(all.isOk());
  std::vector<RawSample> want;
  RawSample s;
  while (*(*all)->next(s)) want.push_back(s);
  ASSERT_EQ(want.size(), 9000u);
  for (int stop : {0, 1, 4096, 5000, 9000}) {
    auto src = openBinary({bin});
    for (int i = 0; i < stop; ++i) ASSERT_TRUE(*(*src)->next(s));
    auto resumed = openBinary({bin});
    ASSERT_TRUE((*resumed)->seek((*src)->position()).isOk());
    int i = stop;
    while (*(*resumed)->next(s)) {
      ASSERT_EQ(std::memcmp(s.cats, want[static_cast<size_t>(i)].cats, sizeof s.cats), 0);
      ++i;
    }
    EXPECT_EQ(i, 9000);
  }
}

// Issue 12, found by binary_fuzzer (tests/fuzz/regressions/binary_fuzzer/second_epoch.bin): each
// epoch restarts at offset 0 of the first file, which the binary reader rejected as "not at a
// record", so no second epoch over binary data ever started. Every epoch reads every record.
TEST(Binary, EveryEpochRereadsTheFile) {
  TempDir dir;
  std::string bin = dir.file("x.bin");
  ASSERT_TRUE(convertToBinary({dir.write("x.tsv", tsv(10, 5))}, bin).isOk());
  auto reader = openBatchReader(testing::criteoSpec(), {.paths = {bin}, .batch_size = 4, .epochs = 3});
  ASSERT_TRUE(reader.isOk()) << reader.status().str();
  std::vector<float> dense;  // every sample's 13 dense features, in reading order
  int64_t batches = 0;
  for (;;) {
    Batch b;
    auto more = (*reader)->next(b);
    ASSERT_TRUE(more.isOk()) << more.status().str();
    if (!*more) break;
    ++batches;
    const float* d = b.find("dense")->as<float>();
    dense.insert(dense.end(), d, d + b.size * kNumDense);
  }
  EXPECT_EQ(batches, 8);  // 30 samples in batches of 4
  ASSERT_EQ(dense.size(), static_cast<size_t>(30 * kNumDense));
  for (size_t i = 0; i < static_cast<size_t>(10 * kNumDense); ++i) {
    EXPECT_EQ(dense[i + 10 * kNumDense], dense[i]) << i;
    EXPECT_EQ(dense[i + 20 * kNumDense], dense[i]) << i;
  }
}

class CorruptBinary : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = dir_.file("good.bin");
    ASSERT_TRUE(convertToBinary({dir_.write("g.tsv", tsv(10, 4))}, bin_).isOk());
    bytes_ = readFile(bin_);
  }
  // Writes a damaged copy and returns the error of opening and reading it all.
  std::string errorOf(const std::string& damaged) {
    std::string path = dir_.write("bad.bin", damaged);
    auto src = openBinary({path});
    if (!src) return src.status().message();
    RawSample s;
    for (;;) {
      auto got = (*src)->next(s);
      if (!got) return got.status().message();
      if (!*got) return "";
    }
  }
  TempDir dir_;
  std::string bin_, bytes_;
};

TEST_F(CorruptBinary, TruncatedFiles) {
  EXPECT_NE(errorOf(bytes_.substr(0, 20)).find("truncated binary data file: 20 bytes, the header alone needs 64"),
            std::string::npos);
  std::string e = errorOf(bytes_.substr(0, bytes_.size() - 100));
  EXPECT_NE(e.find("truncated file: the header says 10 records (2784 bytes) but the file has 2684 bytes"), std::string::npos) << e;
  EXPECT_NE(errorOf(bytes_ + "extra").find("corrupt file"), std::string::npos);
}

TEST_F(CorruptBinary, DamagedHeaderAndRecords) {
  std::string b = bytes_;
  b[0] = 'X';
  EXPECT_NE(errorOf(b).find("bad magic"), std::string::npos);
  b = bytes_;
  b[33] ^= 1;  // the record count, without fixing the checksum
  EXPECT_NE(errorOf(b).find("corrupt header (checksum mismatch)"), std::string::npos);
  b = bytes_;
  float half = 0.5f;
  std::memcpy(&b[kBinaryHeaderBytes + 3 * kBinaryRecordBytes], &half, 4);
  EXPECT_NE(errorOf(b).find("corrupt record 3: label is 0.5, not 0 or 1"), std::string::npos) << errorOf(b);
  b = bytes_;
  float nan = std::nanf("");
  std::memcpy(&b[kBinaryHeaderBytes + 9 * kBinaryRecordBytes + 8 + 4 * 2], &nan, 4);
  EXPECT_NE(errorOf(b).find("corrupt record 9: dense feature 3 is nan"), std::string::npos) << errorOf(b);
  EXPECT_EQ(errorOf(bytes_), "");
}

// Issue 12, found by binary_fuzzer (tests/fuzz/regressions/binary_fuzzer/record_count_overflow.bin):
// a header whose record count times the record size overflows 64 bits made the size check's
// message overflow a signed multiply (undefined behaviour; a negative byte count in practice) and
// could call a truncated file corrupt. The count is a named error with the right word.
TEST_F(CorruptBinary, RecordCountBeyondAnyFileSize) {
  auto withCount = [&](uint64_t records) {
    std::string b = bytes_;
    std::memcpy(&b[32], &records, 8);
    uint64_t h = 0xcbf29ce484222325ull;  // the header's FNV-1a checksum, made right again
    for (int i = 0; i < 40; ++i)
      h = (h ^ static_cast<unsigned char>(b[static_cast<size_t>(i)])) * 0x100000001b3ull;
    std::memcpy(&b[40], &h, 8);
    return errorOf(b);
  };
  std::string e = withCount(0xE400000000000003ull);
  EXPECT_NE(e.find("corrupt header: it says 16429131440647569411 records, more than any file holds (the file has "
                   "2784 bytes)"),
            std::string::npos)
      << e;
  // 2^62 records: 2^62 * 272 wraps to 0 in 64 bits; the count is named, not compared as a wrapped size.
  e = withCount(uint64_t{1} << 62);
  EXPECT_NE(e.find("corrupt header: it says 4611686018427387904 records, more than any file holds"), std::string::npos)
      << e;
  e = withCount(11);
  EXPECT_NE(e.find("truncated file: the header says 11 records (3056 bytes) but the file has 2784 bytes"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace kiln::data
