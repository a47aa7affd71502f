// A system that refuses threads (ulimit -u; issue 35 item 10): the in-process ranks and the kernel
// pool fail with an error that names the limit and join every thread they started, instead of
// std::terminate (exit 134). The refusal is injected (runtime/thread_start.h), since CI runs as
// root, where RLIMIT_NPROC is not enforced.
#include "runtime/thread_start.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <vector>

#include "runtime/comm/local_group.h"
#include "runtime/cpu/thread_pool.h"
#include "runtime/data/prefetcher.h"
#include "tests/data/test_util.h"

namespace kiln::runtime {
namespace {

using namespace std::chrono_literals;

struct RefuseThreads {
  explicit RefuseThreads(int64_t after) { failThreadStartsAfter(after); }
  ~RefuseThreads() { failThreadStartsAfter(-1); }
};

TEST(ThreadStart, TheRefusalNamesTheLimit) {
  RefuseThreads refuse(1);
  auto a = startThread("first", [] {});
  ASSERT_TRUE(a) << a.status().message();
  a->join();
  auto b = startThread("cannot start the second", [] {});
  ASSERT_FALSE(b);
  EXPECT_EQ(b.status().message().rfind("cannot start the second: Resource temporarily unavailable (", 0), 0u)
      << b.status().message();
  // Every later start fails too, until the refusal is lifted.
  EXPECT_FALSE(startThread("third", [] {}));
  failThreadStartsAfter(-1);
  auto c = startThread("fourth", [] {});
  ASSERT_TRUE(c);
  c->join();
}

TEST(ThreadStart, LocalGroupJoinsTheRanksItStartedAndFails) {
  // 4 ranks, only 2 threads: ranks 0 and 1 wait in an all_reduce for ranks 2 and 3, which never
  // start; the group aborts them at once (not after the 60 s timeout) and returns the refusal.
  comm::LocalGroup group(4);
  group.setTimeout(60s);
  std::vector<std::string> errors(4);
  std::atomic<int> ran{0};
  const auto started = std::chrono::steady_clock::now();
  Status s;
  {
    RefuseThreads refuse(2);
    s = group.run([&](comm::Communicator& c) {
      ++ran;
      float x = 1, sum = 0;
      Status st = c.allReduceSync(&x, &sum, 1, comm::DataType::f32);
      if (!st) errors[static_cast<size_t>(c.rank())] = st.message();
      return st;
    });
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("cannot start the thread of rank 2 of 4: Resource temporarily unavailable"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(ran.load(), 2);
  for (int r : {0, 1})
    EXPECT_NE(
        errors[static_cast<size_t>(r)].find("the group was aborted: rank 2 aborted: cannot start the thread"),
        std::string::npos)
        << errors[static_cast<size_t>(r)];
}

TEST(ThreadStart, AnExceptionInARankFailsTheGroup) {
  // A rank whose own thread cannot start (a prefetcher's std::thread throws) fails its rank and
  // aborts the others instead of leaving its thread (std::terminate).
  comm::LocalGroup group(2);
  group.setTimeout(60s);
  std::string other;
  Status s = group.run([&](comm::Communicator& c) -> Status {
    if (c.rank() == 1)
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    float x = 1, sum = 0;
    Status st = c.allReduceSync(&x, &sum, 1, comm::DataType::f32);
    if (!st) other = st.message();
    return st;
  });
  ASSERT_FALSE(s);
  EXPECT_NE(other.find("rank 1 cannot start a thread: Resource temporarily unavailable"), std::string::npos)
      << other;
}

TEST(ThreadStart, ThreadPoolJoinsTheWorkersItStartedAndFails) {
  {
    RefuseThreads refuse(1);
    auto pool = ThreadPool::create(4);
    ASSERT_FALSE(pool);
    EXPECT_EQ(pool.status().message().rfind(
                  "cannot start thread 3 of 4 (--threads 4): Resource temporarily unavailable (", 0),
              0u)
        << pool.status().message();
    EXPECT_THROW(ThreadPool{4}, std::runtime_error);
  }
  auto pool = ThreadPool::create(4);
  ASSERT_TRUE(pool) << pool.status().message();
  EXPECT_EQ((*pool)->numThreads(), 4);
  std::vector<int> hit(100);
  (*pool)->parallelFor(100, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++hit[static_cast<size_t>(i)];
  });
  EXPECT_EQ(hit, std::vector<int>(100, 1));
}

TEST(ThreadStart, APrefetcherWithoutItsThreadFailsAtTheFirstBatch) {
  // Its constructor threw std::system_error; in a rank's thread that was std::terminate.
  data::BatchSpec spec = data::testing::criteoSpec(1);
  data::DataOptions opts{.paths = {"synthetic"}, .batch_size = 8, .epochs = 1, .synthetic_samples = 64};
  auto reader = data::openBatchReader(spec, opts);
  ASSERT_TRUE(reader) << reader.status().message();
  RefuseThreads refuse(0);
  data::Prefetcher pf(reader.take(), 2);
  data::Batch b;
  auto got = pf.next(b);
  ASSERT_FALSE(got);
  EXPECT_EQ(got.status().message().rfind(
                "cannot start the data prefetcher's thread: Resource temporarily unavailable (", 0),
            0u)
      << got.status().message();
}

}  // namespace
}  // namespace kiln::runtime
