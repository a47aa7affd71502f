// The staging pool the data thread copies batches into (page-locked on a GPU, ordinary memory
// here): a placed batch holds the reader's bytes at the layout's places, a buffer returns when
// its batch dies and is handed out again only after its reader's fence, and the prefetcher
// places the batches it reads once given a pool.
#include "runtime/data/staging_pool.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <future>
#include <thread>

#include "runtime/data/prefetcher.h"
#include "test_util.h"

namespace kiln::data {
namespace {

// A layout holding `b`'s tensors at their sizes, each at a 256-byte aligned offset.
StagingBufferLayout layoutOf(const Batch& b) {
  StagingBufferLayout l;
  for (size_t i = 0; i < b.tensors.size(); ++i) {
    l.names.push_back(b.names[i]);
    l.offset.push_back(l.total);
    const size_t bytes = static_cast<size_t>(b.tensors[i].view.bytes());
    l.bytes.push_back(bytes);
    l.total += (bytes + 255) / 256 * 256;
  }
  l.names.push_back("step");  // an input the data does not fill: left to the executor
  l.offset.push_back(l.total);
  l.bytes.push_back(4);
  l.total += 256;
  return l;
}

std::vector<unsigned char> bytesOf(const ir::HostTensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.view.data);
  return {p, p + t.view.bytes()};
}

Batch syntheticBatch(int64_t size, uint64_t seed) {
  auto r =
      openBatchReader(testing::criteoSpec(2),
                      {.paths = {"synthetic"}, .batch_size = size, .epochs = 1, .synthetic = {.seed = seed}});
  EXPECT_TRUE(r.isOk());
  Batch b;
  EXPECT_TRUE(*(*r)->next(b));
  return b;
}

TEST(StagingPool, APlacedBatchHoldsItsBytesAtTheLayoutsPlaces) {
  Batch b = syntheticBatch(50, 3);
  const Batch copy = b;  // owns its bytes
  auto pool = StagingPool::create(layoutOf(b), 2);
  ASSERT_TRUE(pool) << pool.status().message();
  ASSERT_TRUE((*pool)->place(b));
  const int buffer = (*pool)->find(b.tensors[0].view.data);
  ASSERT_GE(buffer, 0);
  for (size_t i = 0; i < b.tensors.size(); ++i) {
    EXPECT_EQ(b.tensors[i].view.data, (*pool)->base(buffer) + (*pool)->layout().offset[i]) << b.names[i];
    EXPECT_EQ(b.tensors[i].view.shape, copy.tensors[i].view.shape);
    EXPECT_EQ(bytesOf(b.tensors[i]), copy.tensors[i].storage) << b.names[i];
  }
  // A copy of a placed batch owns its bytes, off the pool.
  Batch again = b;
  EXPECT_LT((*pool)->find(again.tensors[0].view.data), 0);
  EXPECT_EQ(bytesOf(again.tensors[0]), copy.tensors[0].storage);
}

TEST(StagingPool, LeavesABatchItCannotHoldAsItWas) {
  Batch small = syntheticBatch(20, 1);
  auto pool = StagingPool::create(layoutOf(small), 1);
  ASSERT_TRUE(pool);
  Batch bigger = syntheticBatch(21, 1);
  const void* before = bigger.tensors[0].view.data;
  EXPECT_FALSE((*pool)->place(bigger));
  EXPECT_EQ(bigger.tensors[0].view.data, before);
  Batch renamed = syntheticBatch(20, 1);
  renamed.names[0] = "not_in_the_layout";
  EXPECT_FALSE((*pool)->place(renamed));
  EXPECT_EQ((*pool)->stats().did_not_fit, 2);
  // A smaller batch (the data's short last one) fits.
  Batch shorter = syntheticBatch(7, 1);
  EXPECT_TRUE((*pool)->place(shorter));
  EXPECT_EQ((*pool)->stats().placed, 1);
}

// An upload on another thread reads the buffer 50 ms after it is enqueued; the batch is let go
// at once. The next batch placed in the only buffer must wait for the upload's fence: the upload
// then reads the first batch's bytes, not the second's.
TEST(StagingPool, NeverHandsOutABufferStillBeingUploaded) {
  Batch first = syntheticBatch(50, 1);
  const std::vector<unsigned char> first_ids = first.tensors.back().storage;
  auto pool = StagingPool::create(layoutOf(first), 1);
  ASSERT_TRUE(pool);
  ASSERT_TRUE((*pool)->place(first));
  const unsigned char* ids = static_cast<const unsigned char*>(first.tensors.back().view.data);
  std::promise<std::vector<unsigned char>> read;
  std::shared_future<std::vector<unsigned char>> uploaded = read.get_future().share();
  std::thread upload([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    read.set_value(std::vector<unsigned char>(ids, ids + first_ids.size()));
  });
  (*pool)->setFence(0, [uploaded] {
    uploaded.wait();
    return Status::ok();
  });
  first = Batch();  // the trainer lets go (a dropped stage): the buffer goes back, still read
  Batch second = syntheticBatch(50, 2);
  ASSERT_NE(second.tensors.back().storage, first_ids);
  ASSERT_TRUE((*pool)->place(second));
  EXPECT_EQ(uploaded.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_EQ(uploaded.get(), first_ids);
  EXPECT_EQ((*pool)->stats().fence_waits, 1);
  upload.join();
}

TEST(StagingPool, AFailedFenceKeepsTheBufferOut) {
  Batch b = syntheticBatch(10, 1);
  auto pool = StagingPool::create(layoutOf(b), 1);
  ASSERT_TRUE(pool);
  ASSERT_TRUE((*pool)->place(b));
  (*pool)->setFence(0, [] { return Status::error("the device is gone"); });
  b = Batch();
  Batch next = syntheticBatch(10, 2);
  EXPECT_FALSE((*pool)->place(next));  // the reader of buffer 0 is unknown: never reused
  EXPECT_FALSE((*pool)->place(next));
}

// The prefetcher given a pool places the batches it reads from then on: each equals the
// reader's, those placed lie in the pool, and with the two batches a trainer holds, the queue's
// and the one being read (depth + 3) the pool never runs dry.
TEST(Prefetcher, CopiesTheBatchesItReadsIntoTheStagingPool) {
  BatchSpec spec = testing::criteoSpec(2);
  DataOptions opts{.paths = {"synthetic"},
                   .batch_size = 50,
                   .epochs = 1,
                   .synthetic = {.seed = 9},
                   .synthetic_samples = 1030};
  auto direct = openBatchReader(spec, opts);
  auto r = openBatchReader(spec, opts);
  ASSERT_TRUE(direct.isOk() && r.isOk());
  std::atomic<int> fences{0};  // outlives the pool, whose destructor runs the fences left
  auto pool = StagingPool::create(layoutOf(syntheticBatch(50, 9)), 3 + 3);
  ASSERT_TRUE(pool);
  Prefetcher pf(r.take(), 3);
  pf.stageInto(*pool);
  std::deque<Batch> held;
  int n = 0, in_pool = 0;
  for (;;) {
    // As the trainer: two batches held (this step's and the next) once the next is read.
    if (held.size() == 2) held.pop_front();
    Batch want, got;
    auto w = (*direct)->next(want);
    auto g = pf.next(got);
    ASSERT_TRUE(w.isOk() && g.isOk());
    ASSERT_EQ(*w, *g);
    if (!*w) break;
    ++n;
    EXPECT_EQ(got.size, want.size);
    ASSERT_EQ(got.names, want.names);
    for (size_t k = 0; k < got.tensors.size(); ++k) {
      EXPECT_EQ(got.tensors[k].view.shape, want.tensors[k].view.shape);
      ASSERT_EQ(bytesOf(got.tensors[k]), want.tensors[k].storage) << "batch " << n << " " << got.names[k];
    }
    const int buffer = (*pool)->find(got.tensors[0].view.data);
    if (buffer >= 0) {
      ++in_pool;
      for (size_t k = 0; k < got.tensors.size(); ++k)
        EXPECT_EQ(got.tensors[k].view.data, (*pool)->base(buffer) + (*pool)->layout().offset[k]);
      (*pool)->setFence(buffer, [&fences] {
        ++fences;
        return Status::ok();
      });
    }
    held.push_back(std::move(got));
  }
  EXPECT_EQ(n, 21);                // the last holds 30 samples
  EXPECT_GE(in_pool, 21 - 3 - 1);  // all but those read before stageInto
  EXPECT_EQ((*pool)->stats().placed, in_pool);
  EXPECT_EQ((*pool)->stats().none_free, 0);
  EXPECT_EQ(fences.load(), (*pool)->stats().fence_waits);
  EXPECT_GT(fences.load(), 0);
}

}  // namespace
}  // namespace kiln::data
