// The shared arena layout: best-fit reuse in one stream, no reuse across streams that have not
// joined, and waits that keep a multi-stream schedule equal to its serial order. The random
// test checks every plan against happens-before computed independently (graph reachability).
#include "ir/arena_plan.h"

#include <gtest/gtest.h>

#include <random>

namespace kiln::ir {
namespace {

ArenaBuffer temp(int64_t bytes) {
  return {bytes, TensorType(DType::f32, std::vector<Dim>{Dim::fixed(bytes / 4)}), true, false};
}

bool overlaps(const ArenaPlan& p, const std::vector<ArenaBuffer>& b, int x, int y) {
  int64_t ax = p.offset[static_cast<size_t>(x)], ay = p.offset[static_cast<size_t>(y)];
  return ax < ay + b[static_cast<size_t>(y)].bytes && ay < ax + b[static_cast<size_t>(x)].bytes;
}

TEST(ArenaPlan, OneStreamReusesADeadBlock) {
  // %0 = step0; step1 reads %0 -> %1; step2 -> %2 (same size as %0) may take %0's block.
  std::vector<ArenaBuffer> bufs = {temp(1024), temp(256), temp(1024)};
  std::vector<ArenaStep> steps(3);
  steps[0].results = {0};
  steps[1].operands = {0};
  steps[1].results = {1};
  steps[2].results = {2};
  steps[2].operands = {1};
  ArenaPlan p = planArena(steps, bufs);
  EXPECT_EQ(p.offset[2], p.offset[0]);
  EXPECT_EQ(p.peak, 1024 + 256);
  EXPECT_EQ(p.first[0], 0);
  EXPECT_EQ(p.last[0], 1);
}

TEST(ArenaPlan, NoReuseAcrossStreamsBeforeAJoin) {
  // Step 1 on stream 1 reads %0; step 2 on stream 0 has not waited for it, so %2 may not take
  // %0's block even though %0 is dead in the serial order.
  std::vector<ArenaBuffer> bufs = {temp(1024), temp(64), temp(1024)};
  std::vector<ArenaStep> steps(3);
  steps[0].results = {0};
  steps[1] = {1, {0}, {1}, {0}, InPlace::kNever};
  steps[2].results = {2};
  ArenaPlan unjoined = planArena(steps, bufs);
  EXPECT_FALSE(overlaps(unjoined, bufs, 0, 2));
  steps[2].waits = {1};
  ArenaPlan joined = planArena(steps, bufs);
  EXPECT_EQ(joined.offset[2], joined.offset[0]);
}

TEST(ArenaPlan, InPlaceOnlyWhenEveryReaderHasJoined) {
  // %0 is read on stream 1 (step 1) and dies at step 2 (stream 0), an elementwise op of its type.
  std::vector<ArenaBuffer> bufs = {temp(512), temp(64), temp(512)};
  std::vector<ArenaStep> steps(3);
  steps[0].results = {0};
  steps[1] = {1, {0}, {1}, {0}, InPlace::kNever};
  steps[2] = {0, {0}, {2}, {}, InPlace::kSameType};
  EXPECT_EQ(planArena(steps, bufs).in_place_of[2], -1);
  steps[2].waits = {1};
  ArenaPlan p = planArena(steps, bufs);
  EXPECT_EQ(p.in_place_of[2], 0);
  EXPECT_EQ(p.offset[2], p.offset[0]);
  EXPECT_EQ(planArena(steps, bufs, {64, false}).in_place_of[2], -1);
}

TEST(ArenaPlan, ReturnedBuffersLiveToTheEnd) {
  std::vector<ArenaBuffer> bufs = {temp(256), temp(256)};
  bufs[0].live_to_end = true;
  std::vector<ArenaStep> steps(2);
  steps[0].results = {0};
  steps[1].results = {1};
  ArenaPlan p = planArena(steps, bufs);
  EXPECT_EQ(p.last[0], 2);
  EXPECT_FALSE(overlaps(p, bufs, 0, 1));
}

TEST(StreamHazards, ReadAfterWriteWriteAfterReadAcrossStreams) {
  StreamHazards h;
  // Buffer 0: produced on stream 0 (step 0), read on stream 1 (step 1) and stream 0 (step 2),
  // then updated in place on stream 1 (step 3), then read on stream 0 (step 4).
  EXPECT_TRUE(h.add(0, 0, {}, {}, {0}).empty());
  EXPECT_EQ(h.add(1, 1, {0}, {}, {1}), std::vector<int>({0}));
  EXPECT_TRUE(h.add(2, 0, {0}, {}, {2}).empty());  // same stream as the producer
  EXPECT_EQ(h.add(3, 1, {0}, {0}, {}), std::vector<int>({0, 2}));  // producer and stream-0 reader
  EXPECT_EQ(h.add(4, 0, {0}, {}, {}), std::vector<int>({3}));      // sees the updated value
  EXPECT_TRUE(h.add(5, 0, {2}, {}, {}).empty());
}

// Happens-before by reachability over stream order and waits: an independent check of the plan.
TEST(ArenaPlan, RandomMultiStreamPlansNeverShareMemoryBetweenConcurrentUses) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 6 + static_cast<int>(rng() % 20), streams = 1 + static_cast<int>(rng() % 3);
    std::vector<ArenaBuffer> bufs;
    std::vector<ArenaStep> steps(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) {
      ArenaStep& s = steps[static_cast<size_t>(t)];
      s.stream = static_cast<int>(rng() % static_cast<unsigned>(streams));
      for (int k = 0, reads = static_cast<int>(rng() % 3); k < reads && !bufs.empty(); ++k)
        s.operands.push_back(static_cast<int>(rng() % bufs.size()));
      if (t > 0 && rng() % 3 == 0) s.waits.push_back(static_cast<int>(rng() % static_cast<unsigned>(t)));
      if (rng() % 4 == 0) s.in_place = InPlace::kSameType;
      bufs.push_back(temp(64 * (1 + static_cast<int64_t>(rng() % 4))));
      s.results.push_back(static_cast<int>(bufs.size()) - 1);
    }
    ArenaPlan p = planArena(steps, bufs);
    // before[a][b]: step a happens before step b.
    std::vector<std::vector<bool>> before(static_cast<size_t>(n), std::vector<bool>(static_cast<size_t>(n), false));
    for (int b = 0; b < n; ++b)
      for (int a = b - 1; a >= 0; --a) {
        const ArenaStep& sb = steps[static_cast<size_t>(b)];
        bool direct = steps[static_cast<size_t>(a)].stream == sb.stream ||
                      std::find(sb.waits.begin(), sb.waits.end(), a) != sb.waits.end();
        if (!direct) continue;
        before[static_cast<size_t>(a)][static_cast<size_t>(b)] = true;
        for (int c = 0; c < a; ++c)
          if (before[static_cast<size_t>(c)][static_cast<size_t>(a)]) before[static_cast<size_t>(c)][static_cast<size_t>(b)] = true;
      }
    std::vector<std::vector<int>> uses(bufs.size());
    for (int t = 0; t < n; ++t) {
      for (int id : steps[static_cast<size_t>(t)].operands) uses[static_cast<size_t>(id)].push_back(t);
      for (int id : steps[static_cast<size_t>(t)].results) uses[static_cast<size_t>(id)].push_back(t);
    }
    auto allBefore = [&](int x, int y) {  // every use of x happens before y is written
      int w = p.first[static_cast<size_t>(y)];
      for (int u : uses[static_cast<size_t>(x)])
        if (u != w && !before[static_cast<size_t>(u)][static_cast<size_t>(w)]) return false;
      return true;
    };
    for (int x = 0; x < static_cast<int>(bufs.size()); ++x)
      for (int y = x + 1; y < static_cast<int>(bufs.size()); ++y) {
        if (!overlaps(p, bufs, x, y)) continue;
        // y may write over x's block only after every use of x (in place: at x's last use).
        ASSERT_TRUE(allBefore(x, y)) << "trial " << trial << ": buffers " << x << " and " << y << " share memory";
        if (p.in_place_of[static_cast<size_t>(y)] != x) {
          ASSERT_LT(p.last[static_cast<size_t>(x)], p.first[static_cast<size_t>(y)]) << "trial " << trial;
        }
      }
  }
}

}  // namespace
}  // namespace kiln::ir
