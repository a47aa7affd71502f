// The Program: its printed form, its serialization round trip, damaged bytes, and streams.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "codegen/lower_cpu.h"
#include "ir/interpreter.h"
#include "runtime/cpu/executor.h"
#include "runtime_test_util.h"

namespace kiln::codegen {
namespace {

using ::testing::HasSubstr;

const char* kModel = R"(
func.func @forward() -> (!kiln.tensor<Bx4xf32>) {
  %x = "kiln.input"() {name = "dense"} : () -> !kiln.tensor<Bx6xf32>
  %w = "kiln.parameter"() {init = "xavier_uniform", name = "top.weight"} : () -> !kiln.tensor<4x6xf32>
  %s = "kiln.parameter"() {init = "constant", value = 2.0, name = "top.scale"} : () -> !kiln.tensor<4xf32>
  %0 = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx6xf32>, !kiln.tensor<4x6xf32>) -> !kiln.tensor<Bx4xf32>
  %1 = "kiln.exp"(%x) {kiln.stream = 1} : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx6xf32>
  %2 = "kiln.reduce"(%1) {axes = [1], keepdims = true, kind = "mean", kiln.stream = 1} : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx1xf32>
  %3 = "kiln.mul"(%0, %2) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx4xf32>
  %4 = "kiln.mul"(%3, %s) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  "func.return"(%4) : (!kiln.tensor<Bx4xf32>) -> ()
}
)";

Program lower(const ir::Module& m, int64_t batch) {
  auto p = lowerForCpu(*m.lookup("forward"), {{"B", batch}});
  EXPECT_TRUE(p.isOk()) << (p.isOk() ? "" : p.status().str());
  return p.isOk() ? p.take() : Program{};
}

TEST(Program, PrintsOneInstructionPerLine) {
  auto m = runtime::testing::parseOrDie(kModel);
  Program p = lower(*m, 8);
  std::string s = p.str();
  EXPECT_THAT(s, HasSubstr("program @forward symbols {B = 8} arena_bytes "));
  EXPECT_THAT(s, HasSubstr("%b0 input \"dense\" !kiln.tensor<Bx6xf32> bytes=192\n"));
  EXPECT_THAT(s, HasSubstr("%b1 param \"top.weight\" !kiln.tensor<4x6xf32> bytes=96\n"));
  EXPECT_THAT(s, HasSubstr("%b3 = launch \"kiln.matmul\"(%b0, %b1) {transpose_b = true} : "
                           "(!kiln.tensor<Bx6xf32>, !kiln.tensor<4x6xf32>) -> (!kiln.tensor<Bx4xf32>)\n"));
  EXPECT_THAT(s, HasSubstr("stream 1:\n"));
  EXPECT_THAT(s, HasSubstr("record event 0\n"));
  EXPECT_THAT(s, HasSubstr("wait event 0\n"));
  EXPECT_THAT(s, HasSubstr("results: %b7\n"));
  EXPECT_EQ(s.find("kiln.stream"), std::string::npos) << "the stream attribute becomes the stream itself";
}

TEST(Program, CrossStreamValuesAreGuardedByEvents) {
  auto m = runtime::testing::parseOrDie(kModel);
  Program p = lower(*m, 8);
  ASSERT_EQ(p.streams.size(), 2u);
  ASSERT_EQ(p.num_events, 1);
  // Stream 1 computes %2 then records; stream 0 waits before the mul that reads %2.
  const auto& s1 = p.streams[1].instrs;
  ASSERT_EQ(s1.size(), 3u);
  EXPECT_EQ(s1[2].kind, InstrKind::RecordEvent);
  int wait_seq = -1, mul_seq = -1;
  for (const auto& in : p.streams[0].instrs) {
    if (in.kind == InstrKind::WaitEvent) wait_seq = in.seq;
    if (in.kind == InstrKind::Launch && in.op == "kiln.mul" && mul_seq < 0) mul_seq = in.seq;
  }
  EXPECT_LT(s1[2].seq, wait_seq);
  EXPECT_LT(wait_seq, mul_seq);
  EXPECT_TRUE(validate(p).isOk());

  // Runs like the interpreter.
  runtime::ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*m, 1).isOk());
  auto x = runtime::testing::randomTensor(ir::DType::f32, {8, 6}, 3);
  std::map<std::string, ir::HostTensor> all = {{"dense", x}};
  for (const auto& n : params.names()) all[n] = *params.find(n);
  auto ref = ir::interpret(*m->lookup("forward"), all, {{"B", 8}});
  ASSERT_TRUE(ref.isOk()) << ref.status().str();
  auto ex = runtime::cpu::CpuExecutor::create(p);
  ASSERT_TRUE(ex.isOk()) << ex.status().str();
  auto got = (*ex)->run({{"dense", x.view}}, params);
  ASSERT_TRUE(got.isOk()) << got.status().str();
  runtime::testing::expectClose((*got)[0], (*ref)[0], 1e-5, 1e-6);
}

TEST(Program, SerializationRoundTrips) {
  auto m = runtime::testing::parseOrDie(kModel);
  Program p = lower(*m, 1000);
  std::vector<uint8_t> bytes = p.serialize();
  auto back = Program::deserialize(bytes.data(), bytes.size());
  ASSERT_TRUE(back.isOk()) << back.status().str();
  EXPECT_EQ(back->str(), p.str());
  EXPECT_EQ(back->serialize(), bytes);
  EXPECT_EQ(memoryPlanStr(*back), memoryPlanStr(p));
  EXPECT_EQ(back->peak_bytes, p.peak_bytes);
  ASSERT_EQ(back->streams[0].instrs[0].attrs.size(), p.streams[0].instrs[0].attrs.size());
}

TEST(Program, DamagedBytesAreErrorsNotCrashes) {
  auto m = runtime::testing::parseOrDie(kModel);
  std::vector<uint8_t> bytes = lower(*m, 4).serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = Program::deserialize(bytes.data(), n);
    ASSERT_FALSE(r.isOk()) << "truncated to " << n << " bytes";
  }
  std::vector<uint8_t> extra = bytes;
  extra.push_back(0);
  EXPECT_FALSE(Program::deserialize(extra.data(), extra.size()).isOk());
  // Flipping any single byte must never crash (it may still decode: a changed name).
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::vector<uint8_t> bad = bytes;
    bad[i] ^= 0xff;
    (void)Program::deserialize(bad.data(), bad.size()).isOk();
  }
  std::vector<uint8_t> garbage = {'n', 'o', 'p', 'e'};
  auto r = Program::deserialize(garbage.data(), garbage.size());
  ASSERT_FALSE(r.isOk());
  EXPECT_THAT(r.status().message(), HasSubstr("bad magic"));
}

// An ahead-of-time Program is planned at the largest batch and run at smaller ones: rebound, it
// computes bit for bit what a Program lowered at that batch computes, in the same arena.
TEST(Program, ReboundToASmallerBatchEqualsOneLoweredForIt) {
  auto m = runtime::testing::parseOrDie(kModel);
  runtime::ParameterStore params;
  ASSERT_TRUE(params.initializeFrom(*m, 7).isOk());
  Program planned = lower(*m, 64);
  for (int64_t batch : {1, 5, 63, 64}) {
    Program rebound = planned;
    ASSERT_TRUE(rebindProgram(rebound, {{"B", batch}}).isOk());
    EXPECT_EQ(rebound.arena_bytes, planned.arena_bytes);
    ir::HostTensor x =
        runtime::testing::randomTensor(ir::DType::f32, {batch, 6}, static_cast<uint32_t>(batch));
    runtime::cpu::Batch inputs{{"dense", x.view}};
    auto a = runtime::cpu::CpuExecutor::create(std::move(rebound));
    auto b = runtime::cpu::CpuExecutor::create(lower(*m, batch));
    ASSERT_TRUE(a.isOk() && b.isOk());
    auto ra = (*a)->run(inputs, params), rb = (*b)->run(inputs, params);
    ASSERT_TRUE(ra.isOk()) << ra.status().str();
    ASSERT_TRUE(rb.isOk()) << rb.status().str();
    ASSERT_EQ((*ra)[0].view.shape, (std::vector<int64_t>{batch, 4}));
    ASSERT_EQ((*ra)[0].view.shape, (*rb)[0].view.shape);
    EXPECT_EQ(std::memcmp((*ra)[0].view.data, (*rb)[0].view.data, static_cast<size_t>(batch * 4 * 4)), 0)
        << "batch " << batch;
  }
  // A larger batch does not fit the plan: named, not run past the arena.
  Program over = planned;
  Status s = rebindProgram(over, {{"B", 65}});
  ASSERT_FALSE(s.isOk());
  EXPECT_THAT(s.message(), HasSubstr("was planned for"));
}

}  // namespace
}  // namespace kiln::codegen
