#include <chrono>

#include "runtime/data/prefetcher.h"
#include "test_util.h"

namespace kiln::data {
namespace {

TEST(Prefetcher, DeliversTheReadersBatchesInOrder) {
  BatchSpec spec = testing::criteoSpec(2);
  DataOptions opts{.paths = {"synthetic"}, .batch_size = 50, .epochs = 1, .synthetic = {.seed = 9}, .synthetic_samples = 1030};
  auto direct = openBatchReader(spec, opts);
  auto r = openBatchReader(spec, opts);
  ASSERT_TRUE(direct.isOk() && r.isOk());
  Prefetcher pf(r.take(), 3);
  int n = 0;
  for (;;) {
    Batch want, got;
    auto w = (*direct)->next(want);
    auto g = pf.next(got);
    ASSERT_TRUE(w.isOk() && g.isOk());
    ASSERT_EQ(*w, *g);
    if (!*w) break;
    ++n;
    EXPECT_EQ(got.size, want.size);
    for (size_t k = 0; k < got.tensors.size(); ++k) ASSERT_EQ(got.tensors[k].storage, want.tensors[k].storage);
    EXPECT_EQ(pf.position(), want.end);
  }
  EXPECT_EQ(n, 21);
  Batch b;
  EXPECT_FALSE(*pf.next(b));  // stays at the end
}

TEST(Prefetcher, PropagatesTheReadersErrorAfterTheGoodBatches) {
  testing::TempDir dir;
  std::string good = "0";
  for (int j = 0; j < kNumDense; ++j) good += "\t1";
  for (int c = 0; c < kNumSparse; ++c) good += "\tab";
  std::string content;
  for (int i = 0; i < 25; ++i) content += good + "\n";
  content += "1\t2\n";
  for (int i = 0; i < 5; ++i) content += good + "\n";
  std::string path = dir.write("d.tsv", content);
  auto r = openBatchReader(testing::criteoSpec(), {.paths = {path}, .batch_size = 10, .strict = true});
  ASSERT_TRUE(r.isOk());
  Prefetcher pf(r.take(), 2);
  Batch b;
  ASSERT_TRUE(*pf.next(b));
  ASSERT_TRUE(*pf.next(b));
  auto err = pf.next(b);
  ASSERT_FALSE(err.isOk());
  EXPECT_EQ(err.status().location().str(), path + ":26:4");
  EXPECT_NE(err.status().message().find("expected 40 tab-separated fields"), std::string::npos);
}

TEST(Prefetcher, StopsPromptlyWhenDestroyedWithAFullQueue) {
  BatchSpec spec = testing::criteoSpec();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    auto r = openBatchReader(spec, {.paths = {"synthetic"}, .batch_size = 256, .epochs = 0});
    Prefetcher pf(r.take(), 2);
    Batch b;
    ASSERT_TRUE(*pf.next(b));
    if (i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let the queue fill
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
}  // namespace kiln::data
