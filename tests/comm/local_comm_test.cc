// The in-process backend: every collective for N = 1..4 threads, timeouts, aborts, mismatches.
#include <gtest/gtest.h>

#include <thread>

#include "runtime/comm/local_group.h"
#include "tests/comm/collective_checks.h"

namespace kiln::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Runs `check` on every rank of an N-rank group; a failed gtest assertion on one rank aborts the
// group so the others do not wait for it.
void runOnRanks(int n, void (*check)(Communicator&)) {
  LocalGroup group(n);
  group.setTimeout(60s);
  Status s = group.run([&](Communicator& c) {
    check(c);
    if (::testing::Test::HasFatalFailure()) return Status::errorf("rank {} failed a check", c.rank());
    return Status::ok();
  });
  EXPECT_TRUE(s.isOk()) << s.message();
}

class LocalCollectives : public ::testing::TestWithParam<int> {};

TEST_P(LocalCollectives, AllReduce) { runOnRanks(GetParam(), testing::checkAllReduce); }
TEST_P(LocalCollectives, ReduceScatter) { runOnRanks(GetParam(), testing::checkReduceScatter); }
TEST_P(LocalCollectives, AllGather) { runOnRanks(GetParam(), testing::checkAllGather); }
TEST_P(LocalCollectives, AllToAll) { runOnRanks(GetParam(), testing::checkAllToAll); }
TEST_P(LocalCollectives, BroadcastAndBarrier) { runOnRanks(GetParam(), testing::checkBroadcast); }
TEST_P(LocalCollectives, OverlappingRequests) { runOnRanks(GetParam(), testing::checkOverlap); }

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "N" + std::to_string(i.param);
                         });

// Non-integer f32 sums: the local backend adds in rank order, so the result is bit-exact with
// a plain loop in rank order, on every rank.
TEST(LocalComm, AllReduceSumsInRankOrder) {
  const int n = 4;
  const size_t count = 1001;
  auto value = [](int r, size_t i) {
    return 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i);
  };
  LocalGroup group(n);
  std::vector<std::vector<float>> out(n, std::vector<float>(count));
  ASSERT_TRUE(group
                  .run([&](Communicator& c) {
                    std::vector<float> in(count);
                    for (size_t i = 0; i < count; ++i) in[i] = value(c.rank(), i);
                    return c.allReduceSync(in.data(), out[static_cast<size_t>(c.rank())].data(), count,
                                           DataType::f32);
                  })
                  .isOk());
  for (size_t i = 0; i < count; ++i) {
    float want = value(0, i);
    for (int r = 1; r < n; ++r) want += value(r, i);
    for (int r = 0; r < n; ++r) ASSERT_EQ(out[static_cast<size_t>(r)][i], want);
  }
}

// A rank that never arrives: the others fail within the timeout, naming it and the collective;
// the late rank, arriving afterwards, fails at once instead of waiting.
TEST(LocalComm, TimeoutNamesTheMissingRank) {
  LocalGroup group(3);
  group.setTimeout(200ms);
  std::vector<Status> results(3);
  std::vector<double> seconds(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      Communicator& c = group.comm(r);
      float x = 1, y = 0;
      auto start = Clock::now();
      Status s = c.allReduceSync(&x, &y, 1, DataType::f32);  // #1: everyone
      if (s && r == 2) std::this_thread::sleep_for(600ms);   // rank 2 is late for #2
      if (s) s = c.allReduceSync(&x, &y, 1, DataType::f32);
      results[static_cast<size_t>(r)] = s;
      seconds[static_cast<size_t>(r)] = std::chrono::duration<double>(Clock::now() - start).count();
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(results[static_cast<size_t>(r)].isOk());
    const std::string& m = results[static_cast<size_t>(r)].message();
    EXPECT_NE(m.find("all_reduce #2 on rank"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 2 did not arrive within 200 ms"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 2 is at collective #1"), std::string::npos) << m;
    EXPECT_LT(seconds[static_cast<size_t>(r)], 0.55) << "rank " << r << " waited for the late rank";
  }
  ASSERT_FALSE(results[2].isOk());
  EXPECT_NE(results[2].message().find("all_reduce #2 on rank 2: the group was aborted"), std::string::npos)
      << results[2].message();
}

TEST(LocalComm, TimeoutNamesARankThatIssuedNothing) {
  LocalGroup group(2);
  group.setTimeout(100ms);
  Status s = group.comm(0).barrier();
  ASSERT_FALSE(s.isOk());
  EXPECT_EQ(s.message(),
            "barrier #1 on rank 0: rank 1 did not arrive within 100 ms; rank 1 has issued no collective");
}

// An abort from one rank wakes the others at once, in a wait or at their next collective.
TEST(LocalComm, AbortWakesEveryRank) {
  LocalGroup group(4);
  group.setTimeout(60s);
  auto start = Clock::now();
  Status s = group.run([](Communicator& c) -> Status {
    KILN_RETURN_IF_ERROR(c.barrier());
    if (c.rank() == 1) {
      std::this_thread::sleep_for(50ms);  // let the others block in the barrier
      c.abort("out of host memory");
      return Status::ok();
    }
    return c.barrier();
  });
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("barrier #2 on rank"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("rank 1 aborted: out of host memory"), std::string::npos) << s.message();
  EXPECT_LT(seconds, 5.0);
  // The group stays broken.
  float x = 0;
  Status later = group.comm(0).allReduceSync(&x, &x, 1, DataType::f32);
  ASSERT_FALSE(later.isOk());
  EXPECT_NE(later.message().find("rank 1 aborted"), std::string::npos);
}

// A rank whose work fails aborts the group through LocalGroup::run.
TEST(LocalComm, AFailingRankFailsTheOthers) {
  LocalGroup group(3);
  group.setTimeout(60s);
  Status s = group.run([](Communicator& c) -> Status {
    if (c.rank() == 2) return Status::error("cannot read the batch");
    return c.barrier();
  });
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("cannot read the batch"), std::string::npos) << s.message();
}

TEST(LocalComm, MismatchedCollectivesFail) {
  LocalGroup group(2);
  group.setTimeout(10s);
  std::vector<Status> results(2);
  ASSERT_FALSE(group
                   .run([&](Communicator& c) {
                     float in[2] = {1, 2}, out[4] = {};
                     Status s = c.rank() == 0 ? c.allReduceSync(in, out, 2, DataType::f32)
                                              : c.allGatherSync(in, out, 2, DataType::f32);
                     results[static_cast<size_t>(c.rank())] = s;
                     return s;
                   })
                   .isOk());
  // The rank that finds the mismatch fails; the other fails too unless its side completed first.
  auto text = [](const Status& st) { return st.isOk() ? std::string("(ok)") : st.message(); };
  std::string both = text(results[0]) + "\n" + text(results[1]);
  EXPECT_NE(both.find(" as this collective"), std::string::npos) << both;
}

TEST(LocalComm, VariableAllToAllChecksSplitsAndCapacity) {
  LocalGroup group(2);
  group.setTimeout(10s);
  // Rank 0 claims to send 2 to rank 1, which expects 1.
  std::vector<Status> results(2);
  (void)group.run([&](Communicator& c) {
    float in[4] = {}, out[4] = {};
    std::vector<size_t> send = {1, c.rank() == 0 ? size_t{2} : size_t{1}}, recv = {1, 1};
    results[static_cast<size_t>(c.rank())] = c.allToAllVSync(in, send, out, recv, 4, DataType::f32);
    return results[static_cast<size_t>(c.rank())];
  });
  // The rank that finds the mismatch fails; the other fails too unless its side completed first.
  auto text = [](const Status& st) { return st.isOk() ? std::string("(ok)") : st.message(); };
  std::string both = text(results[0]) + "\n" + text(results[1]);
  EXPECT_NE(both.find("rank 0 sends 2 elements to rank 1, which expects 1"), std::string::npos) << both;

  LocalGroup one(1);
  float in[4] = {}, out[2] = {};
  Status s = one.comm(0).allToAllVSync(in, {3}, out, {3}, 2, DataType::f32);
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("receives 3 elements into a buffer of 2"), std::string::npos) << s.message();
}

TEST(LocalComm, TestPollsToCompletion) {
  LocalGroup group(2);
  Status s = group.run([](Communicator& c) -> Status {
    int64_t x = c.rank() + 1, y = 0;
    Request r = c.allReduce(&x, &y, 1, DataType::i64);
    while (true) {
      KILN_ASSIGN_OR_RETURN(bool done, r.test());
      if (done) break;
      std::this_thread::yield();
    }
    return y == 3 ? Status::ok() : Status::errorf("sum {}", y);
  });
  EXPECT_TRUE(s.isOk()) << s.message();
}

TEST(LocalComm, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(floatToF16(1.0f), 0x3c00);
  EXPECT_EQ(floatToF16(-2.0f), 0xc000);
  EXPECT_EQ(floatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(floatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(floatToF16(5.9604645e-8f), 0x0001);       // the smallest subnormal
  EXPECT_EQ(floatToF16(1.0f + 1.0f / 2048), 0x3c00);  // halfway: to even
  EXPECT_EQ(floatToF16(1.0f + 3.0f / 2048), 0x3c02);
  for (uint32_t h = 0; h < 0x7c00; ++h) ASSERT_EQ(floatToF16(f16ToFloat(static_cast<uint16_t>(h))), h);
}

TEST(LocalComm, Names) {
  EXPECT_EQ(operationName(CollectiveKind::AllToAll, 17, 2), "all_to_all #17 on rank 2");
  EXPECT_EQ(formatDuration(kDefaultTimeout), "300 s");
  EXPECT_EQ(formatDuration(std::chrono::milliseconds(1500)), "1.5 s");
  auto u8 = fromIrDType(ir::DType::i1);
  ASSERT_TRUE(u8);
  EXPECT_EQ(*u8, DataType::u8);
  EXPECT_FALSE(fromIrDType(ir::DType::f8e4m3));
}

}  // namespace
}  // namespace kiln::comm
