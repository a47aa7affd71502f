#include <cmath>
#include <fstream>
#include <sstream>

#include "runtime/data/batch_reader.h"
#include "test_util.h"

namespace kiln::data {
namespace {

using testing::TempDir;

// A well-formed line: label, 13 integers, 26 hex values; `i` varies the content.
std::string line(int i, bool crlf = false) {
  std::string s = std::to_string(i % 3 == 0);
  for (int j = 0; j < kNumDense; ++j) s += "\t" + std::to_string((i * 7 + j) % 50);
  for (int c = 0; c < kNumSparse; ++c) s += "\t" + fmt::format("{:08x}", static_cast<uint32_t>(i * 2654435761u + c));
  return s + (crlf ? "\r\n" : "\n");
}

std::vector<RawSample> readAll(RecordSource& src) {
  std::vector<RawSample> out;
  RawSample s;
  for (;;) {
    auto got = src.next(s);
    EXPECT_TRUE(got.isOk()) << got.status().str();
    if (!got.isOk() || !*got) break;
    out.push_back(s);
  }
  return out;
}

bool same(const RawSample& a, const RawSample& b) {
  return a.label == b.label && a.missing == b.missing && !std::memcmp(a.dense, b.dense, sizeof a.dense) &&
         !std::memcmp(a.cats, b.cats, sizeof a.cats);
}

TEST(Tsv, ParsesFieldsMissingValuesAndNegatives) {
  std::string l = "1\t5\t\t-3";
  for (int j = 3; j < kNumDense; ++j) l += "\t0";
  l += "\t68fd1e64\t";  // feature 1 empty
  for (int c = 2; c < kNumSparse; ++c) l += "\tFFFFFFFFFFFFFFFF";
  RawSample s;
  int64_t col = 0;
  Status st = parseTsvLine(l, s, &col);
  ASSERT_TRUE(st.isOk()) << st.str();
  EXPECT_EQ(s.label, 1.0f);
  EXPECT_FLOAT_EQ(s.dense[0], std::log(6.0f));
  EXPECT_EQ(s.dense[1], 0.0f);  // empty
  EXPECT_EQ(s.dense[2], 0.0f);  // log(1 + max(-3, 0))
  EXPECT_EQ(s.cats[0], 0x68fd1e64u);
  EXPECT_EQ(s.missing, 1u << 1);
  EXPECT_EQ(s.cats[25], 0xFFFFFFFFFFFFFFFFull);
}

TEST(Tsv, MalformedLinesAreLocatedSkippedAndCounted) {
  TempDir dir;
  std::string bad_label = line(1);
  bad_label[0] = '2';
  std::string bad_hex = line(2);
  bad_hex.replace(bad_hex.rfind('\t') + 1, 2, "zz");
  std::string bad_int = line(3);
  size_t t1 = bad_int.find('\t');
  bad_int.insert(t1 + 1, "x");
  std::string content = line(0) + bad_label + "0\t1\t2\n" + bad_hex + bad_int + line(5) + "\n";
  std::string path = dir.write("a.tsv", content);
  std::vector<std::string> seen;
  auto src = openTsv({path}, {.strict = false, .on_skip = [&](const Status& s) { seen.push_back(s.str()); }});
  ASSERT_TRUE(src.isOk());
  auto samples = readAll(**src);
  EXPECT_EQ(samples.size(), 2u);
  EXPECT_EQ((*src)->malformed(), 5);
  ASSERT_EQ(seen.size(), 5u);
  EXPECT_EQ(seen[0], path + ":2:1: error: label must be 0 or 1, got '2'");
  EXPECT_EQ(seen[1].rfind(path + ":3:", 0), 0u) << seen[1];
  EXPECT_NE(seen[1].find("expected 40 tab-separated fields"), std::string::npos);
  EXPECT_NE(seen[1].find("got 3"), std::string::npos);
  EXPECT_EQ(seen[2].rfind(path + ":4:" + std::to_string(bad_hex.rfind('\t') + 2) + ": error: categorical feature 26", 0), 0u) << seen[2];
  EXPECT_EQ(seen[3], path + ":5:" + std::to_string(t1 + 2) + ": error: integer feature 1 is not an integer: 'x21'");
  EXPECT_EQ(seen[4].rfind(path + ":7:", 0), 0u) << seen[4];  // the empty line

  auto strict = openTsv({path}, {.strict = true});
  ASSERT_TRUE(strict.isOk());
  RawSample s;
  ASSERT_TRUE((*strict)->next(s).isOk());
  auto err = (*strict)->next(s);
  ASSERT_FALSE(err.isOk());
  EXPECT_EQ(err.status().str(), path + ":2:1: error: label must be 0 or 1, got '2'");
}

TEST(Tsv, StreamsManyFilesAcrossBufferBoundaries) {
  TempDir dir;
  // ~3 MB in the first file so lines straddle the 1 MiB read buffer; CRLF and no final newline
  // in the second.
  std::string a, b;
  for (int i = 0; i < 12000; ++i) a += line(i);
  for (int i = 0; i < 50; ++i) b += line(20000 + i, true);
  b.pop_back();
  b.pop_back();
  std::vector<std::string> files = {dir.write("a.tsv", a), dir.write("b.tsv", b)};
  auto src = openTsv(files);
  ASSERT_TRUE(src.isOk());
  auto got = readAll(**src);
  ASSERT_EQ(got.size(), 12050u);
  // Independently: split with getline and parse each line alone.
  size_t k = 0;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string l;
    while (std::getline(in, l)) {
      RawSample s;
      int64_t col;
      ASSERT_TRUE(parseTsvLine(l, s, &col).isOk());
      ASSERT_TRUE(same(s, got[k])) << "sample " << k;
      ++k;
    }
  }
  EXPECT_EQ(k, got.size());
  EXPECT_EQ((*src)->malformed(), 0);
}

TEST(Tsv, SeekResumesAtTheNextSample) {
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 10; ++i) a += line(i);
  for (int i = 10; i < 15; ++i) b += line(i);
  std::vector<std::string> files = {dir.write("a.tsv", a), dir.write("b.tsv", b)};
  auto all_src = openTsv(files);
  ASSERT_TRUE(all_src.isOk());
  auto all = readAll(**all_src);
  for (int stop : {0, 4, 10, 12}) {
    auto src = openTsv(files);
    RawSample s;
    for (int i = 0; i < stop; ++i) ASSERT_TRUE(*(*src)->next(s));
    StreamPosition at = (*src)->position();
    auto resumed = openTsv(files);
    ASSERT_TRUE((*resumed)->seek(at).isOk());
    auto rest = readAll(**resumed);
    ASSERT_EQ(rest.size(), all.size() - static_cast<size_t>(stop));
    for (size_t i = 0; i < rest.size(); ++i) EXPECT_TRUE(same(rest[i], all[static_cast<size_t>(stop) + i]));
  }
}

TEST(BatchReader, EpochsDropLastAndErrors) {
  TempDir dir;
  std::string a;
  for (int i = 0; i < 10; ++i) a += line(i);
  std::string path = dir.write("a.tsv", a);
  BatchSpec spec = testing::criteoSpec();
  auto count = [&](int64_t epochs, bool drop_last) {
    auto r = openBatchReader(spec, {.paths = {path}, .batch_size = 4, .epochs = epochs, .drop_last = drop_last});
    EXPECT_TRUE(r.isOk());
    std::vector<int64_t> sizes;
    Batch b;
    while (*(*r)->next(b)) sizes.push_back(b.size);
    return sizes;
  };
  EXPECT_EQ(count(1, false), (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(count(1, true), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(count(2, false), (std::vector<int64_t>{4, 4, 4, 4, 4}));  // batches run across epochs
  EXPECT_EQ(count(3, false), (std::vector<int64_t>{4, 4, 4, 4, 4, 4, 4, 2}));

  // The second epoch repeats the first sample by sample.
  auto r = openBatchReader(spec, {.paths = {path}, .batch_size = 10, .epochs = 2});
  Batch e1, e2;
  ASSERT_TRUE(*(*r)->next(e1));
  ASSERT_TRUE(*(*r)->next(e2));
  EXPECT_EQ(e1.tensors[2].storage, e2.tensors[2].storage);
  EXPECT_EQ(e2.end.epoch, 1);

  auto missing = openBatchReader(spec, {.paths = {dir.file("nope.tsv")}, .batch_size = 4});
  ASSERT_FALSE(missing.isOk());
  EXPECT_NE(missing.status().message().find("nope.tsv"), std::string::npos);
  auto empty = openBatchReader(spec, {.paths = {dir.write("empty.tsv", "")}, .batch_size = 4, .epochs = 0});
  Batch b;
  auto got = (*empty)->next(b);
  ASSERT_FALSE(got.isOk());
  EXPECT_NE(got.status().message().find("no samples"), std::string::npos);
}

}  // namespace
}  // namespace kiln::data
