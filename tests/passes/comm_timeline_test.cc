// The communication timeline (passes/comm_timeline.h) on hand-built steps, against times worked
// out by hand on a target whose rates make every op's time a round number: arithmetic is free,
// memory moves 1 GB/s, a launch costs 1 us, the link moves 1 MB/s after 10 us per ring step.
#include "passes/comm_timeline.h"

#include <gtest/gtest.h>

#include "ir/parser.h"

namespace kiln::passes {
namespace {

Target roundTarget() {
  Target t;
  t.name = "round";
  t.gemm_flops_per_s = {1e30, 1e30};
  t.vector_flops_per_s = {1e30, 1e30};
  t.bytes_per_s = 1e9;
  t.launch_s = 1e-6;
  t.intra_node = {1e6, 1e-5};
  t.inter_node = {1e5, 1e-4};
  return t;
}

std::unique_ptr<ir::Module> parse(const std::string& text) {
  auto m = ir::parseModule(text, "<test>");
  EXPECT_TRUE(m.isOk()) << (m.isOk() ? "" : m.status().str());
  return m.isOk() ? m.take() : nullptr;
}

// Each unary op on 1000 f32 reads and writes 4000 bytes: 8 us + 1 us launch = 9 us. The add
// reads two and writes one: 12 us + 1 us = 13 us. The all_reduce over 2 ranks puts
// 2 * 1/2 * 4000 = 4000 bytes on the wire in 2 ring steps: 2 * 10 us + 4000 us = 4020 us.
constexpr double kUnary = 9e-6, kAdd = 13e-6, kAllReduce = 4020e-6;

// %a (0-9 us) feeds the all_reduce (9-4029 us); %b and %c (9-27 us) do not depend on it and
// run meanwhile; %d waits for the sum from 27 to 4029 us and ends at 4042 us.
const char* kOverlapped = R"(
func.func @step() -> (!kiln.tensor<1000xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<1000xf32>
  %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<1000xf32>
  %a = "kiln.tanh"(%x) : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %r = "kiln.all_reduce"(%a) {ranks = 2} : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %b = "kiln.sigmoid"(%w) : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %c = "kiln.tanh"(%b) : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %d = "kiln.add"(%r, %c) : (!kiln.tensor<1000xf32>, !kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  "func.return"(%d) : (!kiln.tensor<1000xf32>) -> ()
}
)";

TEST(CommTimeline, IndependentComputeHidesPartOfTheTransfer) {
  auto m = parse(kOverlapped);
  ASSERT_NE(m, nullptr);
  CostModel cost(roundTarget(), {});
  CommTimeline t = simulateCommTimeline(*m->lookup("step"), cost);
  EXPECT_EQ(t.collectives, 1);
  EXPECT_NEAR(t.comm_seconds, kAllReduce, 1e-12);
  EXPECT_NEAR(t.exposed_comm_seconds_no_overlap, kAllReduce, 1e-12);
  EXPECT_NEAR(t.compute_seconds, 3 * kUnary + kAdd, 1e-12);
  // Waiting from the end of %c (27 us) to the sum's arrival (4029 us).
  EXPECT_NEAR(t.exposed_comm_seconds, (kUnary + kAllReduce) - 3 * kUnary, 1e-12);
  EXPECT_NEAR(t.step_seconds, kUnary + kAllReduce + kAdd, 1e-12);
}

// The same ops with the consumer right after the collective: nothing to overlap, the whole
// transfer is exposed. Then a second all_reduce nobody reads: it queues behind the first on
// the comm stream and the step waits for it at the end.
const char* kSerial = R"(
func.func @step() -> (!kiln.tensor<1000xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<1000xf32>
  %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<1000xf32>
  %a = "kiln.tanh"(%x) : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %r = "kiln.all_reduce"(%a) {ranks = 2} : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %s = "kiln.all_reduce"(%x) {ranks = 2} : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  %d = "kiln.add"(%r, %w) : (!kiln.tensor<1000xf32>, !kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  "func.return"(%d) : (!kiln.tensor<1000xf32>) -> ()
}
)";

TEST(CommTimeline, AConsumerRightAfterItsCollectiveAndAnUnreadTransferAreExposed) {
  auto m = parse(kSerial);
  ASSERT_NE(m, nullptr);
  CostModel cost(roundTarget(), {});
  CommTimeline t = simulateCommTimeline(*m->lookup("step"), cost);
  EXPECT_EQ(t.collectives, 2);
  EXPECT_NEAR(t.exposed_comm_seconds_no_overlap, 2 * kAllReduce, 1e-12);
  // %a 0-9; %r 9-4029; %s (its operand ready at 0) queues behind %r: 4029-8049. %d waits
  // 9-4029 and runs to 4042; the end waits 4042-8049.
  const double d_end = kUnary + kAllReduce + kAdd, s_end = kUnary + 2 * kAllReduce;
  EXPECT_NEAR(t.exposed_comm_seconds, kAllReduce + (s_end - d_end), 1e-12);
  EXPECT_NEAR(t.exposed_comm_seconds, 2 * kAllReduce - kAdd, 1e-12);
  EXPECT_NEAR(t.step_seconds, s_end, 1e-12);
}

// Across nodes the link's rates apply: 2 * 100 us + 4000 B / 100 kB/s = 40.2 ms.
TEST(CommTimeline, InterNodeLinksUseTheirRates) {
  auto m = parse(kOverlapped);
  ASSERT_NE(m, nullptr);
  CostModel cost(roundTarget(), {});
  CommTimeline t = simulateCommTimeline(*m->lookup("step"), cost, ir::LinkScope::inter_node);
  EXPECT_NEAR(t.comm_seconds, 2e-4 + 4000 / 1e5, 1e-12);
  EXPECT_NEAR(t.exposed_comm_seconds, kUnary + (2e-4 + 4000 / 1e5) - 3 * kUnary, 1e-12);
}

TEST(CommTimeline, AStepWithoutCollectivesExposesNothing) {
  auto m = parse(R"(
func.func @step() -> (!kiln.tensor<1000xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<1000xf32>
  %a = "kiln.tanh"(%x) : (!kiln.tensor<1000xf32>) -> !kiln.tensor<1000xf32>
  "func.return"(%a) : (!kiln.tensor<1000xf32>) -> ()
}
)");
  ASSERT_NE(m, nullptr);
  CostModel cost(roundTarget(), {});
  CommTimeline t = simulateCommTimeline(*m->lookup("step"), cost);
  EXPECT_EQ(t.collectives, 0);
  EXPECT_EQ(t.exposed_comm_seconds, 0);
  EXPECT_EQ(t.exposed_comm_seconds_no_overlap, 0);
  EXPECT_NEAR(t.step_seconds, kUnary, 1e-12);
}

}  // namespace
}  // namespace kiln::passes
