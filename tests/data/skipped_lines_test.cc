// Issue 12, defect 7 on the reader's side: each batch says where among its samples the malformed
// lines sat, and the lines after the last sample are kept for the end, so that kiln predict can
// write one output line per input line.
#include <cmath>
#include <set>

#include "runtime/data/prefetcher.h"
#include "test_util.h"

namespace kiln::data {
namespace {

std::string goodLine(int i) {
  std::string s = std::to_string(i % 2);
  for (int j = 0; j < kNumDense; ++j) s += "\t" + std::to_string(i + j);
  for (int c = 0; c < kNumSparse; ++c) s += "\tab";
  return s + "\n";
}

// Lines 0..n-1 with those in `bad` malformed (a label of 2).
std::string linesWithBad(int n, const std::set<int>& bad) {
  std::string s;
  for (int i = 0; i < n; ++i) s += bad.count(i) ? "2\tbad line " + std::to_string(i) + "\n" : goodLine(i);
  return s;
}

// The input line of each sample and each skipped line, from the batches: -1 stands for a skipped
// line. Dense feature 0 of the sample of line i is log(1 + i).
std::vector<int> layout(const std::vector<Batch>& batches, const std::vector<SkippedLine>& at_end,
                        const BatchSpec& spec) {
  std::vector<int> out;
  const int dense = spec.indexOf("dense");
  for (const Batch& b : batches) {
    size_t k = 0;
    for (int64_t i = 0; i <= b.size; ++i) {
      for (; k < b.skipped.size() && b.skipped[k].before == i; ++k) out.push_back(-1);
      if (i < b.size) {
        float d = b.tensors[static_cast<size_t>(dense)].as<float>()[i * kNumDense];
        out.push_back(static_cast<int>(std::lround(std::expm1(static_cast<double>(d)))));
      }
    }
    EXPECT_EQ(k, b.skipped.size());
  }
  for (size_t k = 0; k < at_end.size(); ++k) out.push_back(-1);
  return out;
}

TEST(SkippedLines, BatchesPlaceEachMalformedLineAmongTheirSamples) {
  testing::TempDir dir;
  const BatchSpec spec = testing::criteoSpec();
  // Bad lines first, mid-batch, at a batch boundary, twice in a row and last; batch sizes that
  // divide the samples and some that do not.
  const std::set<int> bad = {0, 5, 9, 10, 22, 23};
  std::string path = dir.write("d.tsv", linesWithBad(24, bad));
  std::vector<int> want;
  for (int i = 0; i < 24; ++i) want.push_back(bad.count(i) ? -1 : i);
  for (int64_t batch : {1, 3, 4, 6, 18, 100}) {
    std::vector<std::string> reported;
    auto r = openBatchReader(spec, {.paths = {path}, .batch_size = batch, .on_skip = [&](const Status& s) {
                                      reported.push_back(s.location().str());
                                    }});
    ASSERT_TRUE(r.isOk());
    Prefetcher pf(r.take(), 2);
    std::vector<Batch> batches;
    Batch b;
    while (*pf.next(b)) batches.push_back(b);
    EXPECT_EQ(layout(batches, pf.skippedAtEnd(), spec), want) << "batch " << batch;
    EXPECT_EQ(pf.malformed(), 6);
    std::vector<std::string> lines;
    for (int i : bad) lines.push_back(path + ":" + std::to_string(i + 1) + ":1");
    EXPECT_EQ(reported, lines) << "batch " << batch;
  }
}

TEST(SkippedLines, WithoutAPrefetcherTheReaderReportsAsItReads) {
  testing::TempDir dir;
  std::string path = dir.write("d.tsv", linesWithBad(6, {1, 5}));
  int reported = 0;
  auto r = openBatchReader(testing::criteoSpec(),
                           {.paths = {path}, .batch_size = 4, .on_skip = [&](const Status&) { ++reported; }});
  ASSERT_TRUE(r.isOk());
  Batch b;
  ASSERT_TRUE(*(*r)->next(b));
  EXPECT_EQ(b.size, 4);
  ASSERT_EQ(b.skipped.size(), 1u);
  EXPECT_EQ(b.skipped[0].before, 1);
  EXPECT_EQ(reported, 1);
  // Line 6 is read looking for the next sample, which does not come: it belongs to the end.
  EXPECT_FALSE(*(*r)->next(b));
  EXPECT_TRUE(b.skipped.empty());
  ASSERT_EQ((*r)->skippedAtEnd().size(), 1u);
  EXPECT_EQ((*r)->skippedAtEnd()[0].reason.location().line, 6);
  EXPECT_EQ(reported, 2);
}

}  // namespace
}  // namespace kiln::data
