// The CPU executor's asynchronous collectives: a collective on the comm stream stays in flight
// while independent compute runs, is waited on where its result is first needed, and keeps its
// buffers out of the arena's reuse until then. A lazy group (the transfer happens in wait())
// makes a wait placed too late, or storage reused too early, change the numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codegen/lower_cpu.h"
#include "runtime/comm/local_group.h"
#include "runtime/comm/rank_group.h"
#include "runtime/cpu/executor.h"
#include "runtime_test_util.h"

namespace kiln::runtime::cpu {
namespace {

using ir::DType;
using ir::HostTensor;

// %a feeds the all_reduce on stream 2; %z is independent of it and as large as %a, so a plan
// that let %a's block go at the collective's launch would give it to %z.
const char* kOverlap = R"(
func.func @forward() -> (!kiln.tensor<64xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<64xf32>
  %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<64xf32>
  %a = "kiln.sigmoid"(%x) : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %r = "kiln.all_reduce"(%a) {ranks = 1, kiln.stream = 2} : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %z = "kiln.tanh"(%w) : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %out = "kiln.add"(%r, %z) : (!kiln.tensor<64xf32>, !kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  "func.return"(%out) : (!kiln.tensor<64xf32>) -> ()
}
)";

// One rank whose issued all_reduce moves its data only when waited on (a transfer still on the
// wire): reading the result before the wait sees stale bytes, writing the send buffer before it
// changes what is sent.
class LazyGroup final : public ir::RankGroup {
 public:
  int waits = 0;
  bool fail_wait = false;

  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status allReduceSum(const void* send, void* recv, int64_t count, DType t) override {
    std::memmove(recv, send, static_cast<size_t>(count * ir::dtypeBytes(t)));
    return Status::ok();
  }
  ir::PendingCollective issueAllReduceSum(const void* send, void* recv, int64_t count, DType t) override {
    return ir::PendingCollective([this, send, recv, count, t] {
      ++waits;
      if (fail_wait) return Status::error("all_reduce #1 on rank 0: the link went down");
      std::memmove(recv, send, static_cast<size_t>(count * ir::dtypeBytes(t)));
      return Status::ok();
    });
  }
  Status reduceScatterSum(const void*, void*, int64_t, DType) override { return unused(); }
  Status allGather(const void*, void*, int64_t, DType) override { return unused(); }
  Status allToAll(const void*, void*, int64_t, DType) override { return unused(); }
  Status allToAllV(const void*, const std::vector<int64_t>&, void*, const std::vector<int64_t>&, int64_t,
                   DType) override {
    return unused();
  }
  Expected<std::vector<int64_t>> exchangeCounts(const std::vector<int64_t>&) override { return unused(); }

 private:
  static Status unused() { return Status::error("LazyGroup runs all_reduce only"); }
};

codegen::Program lower(const char* text) {
  auto m = testing::parseOrDie(text);
  auto p = codegen::lowerForCpu(*m->lookup("forward"), {});
  EXPECT_TRUE(p.isOk()) << (p.isOk() ? "" : p.status().str());
  return p.isOk() ? p.take() : codegen::Program{};
}

const codegen::Instruction& launchOf(const codegen::Program& p, const std::string& op) {
  for (const codegen::Instruction* in : p.ordered())
    if (in->kind == codegen::InstrKind::Launch && in->op == op) return *in;
  ADD_FAILURE() << "no launch of " << op;
  static codegen::Instruction none;
  return none;
}

struct Inputs {
  HostTensor x = testing::randomTensor(DType::f32, {64}, 1);
  HostTensor w = testing::randomTensor(DType::f32, {64}, 2);
  Batch batch() const { return {{"x", x.view}, {"w", w.view}}; }
  // sigmoid(x) summed over one rank, plus tanh(w): the plain loop.
  double expected(int64_t i) const {
    return 1 / (1 + std::exp(-static_cast<double>(x.as<float>()[i]))) +
           std::tanh(static_cast<double>(w.as<float>()[i]));
  }
};

// An executor of `p` whose collectives run over `g`, with `o`'s other options.
std::unique_ptr<CpuExecutor> executorOver(const codegen::Program& p, LazyGroup& g, ExecutorOptions o = {}) {
  o.ranks = &g;
  auto ex = CpuExecutor::create(p, o);
  EXPECT_TRUE(ex.isOk()) << ex.status().str();
  return ex.isOk() ? ex.take() : nullptr;
}

void expectResult(const HostTensor& got, const Inputs& in) {
  ASSERT_EQ(got.view.shape, std::vector<int64_t>{64});
  for (int64_t i = 0; i < 64; ++i) EXPECT_NEAR(got.as<float>()[i], in.expected(i), 1e-5) << "element " << i;
}

TEST(CpuExecutorOverlap, IndependentComputeRunsWhileTheCollectiveIsInFlight) {
  codegen::Program p = lower(kOverlap);
  const int issue = launchOf(p, "kiln.all_reduce").seq, tanh = launchOf(p, "kiln.tanh").seq,
            add = launchOf(p, "kiln.add").seq;
  ASSERT_LT(issue, tanh);
  ASSERT_LT(tanh, add);
  LazyGroup g;
  ExecutorOptions o;
  o.poison_arena = true;
  auto ex = executorOver(p, g, o);
  ASSERT_NE(ex, nullptr);
  Inputs in;
  ParameterStore params;
  auto out = ex->run(in.batch(), params);
  ASSERT_TRUE(out.isOk()) << out.status().str();
  expectResult((*out)[0], in);
  // Issued at its launch, waited on after tanh ran and before add read the result.
  ASSERT_EQ(ex->collectiveWaits().size(), 1u);
  EXPECT_EQ(ex->collectiveWaits()[0].issued_at, issue);
  EXPECT_GT(ex->collectiveWaits()[0].waited_at, tanh);
  EXPECT_LE(ex->collectiveWaits()[0].waited_at, add);
  EXPECT_EQ(g.waits, 1);
}

TEST(CpuExecutorOverlap, NoOverlapWaitsRightAfterIssuing) {
  codegen::Program p = lower(kOverlap);
  LazyGroup g;
  ExecutorOptions o;
  o.overlap_collectives = false;
  auto ex = executorOver(p, g, o);
  ASSERT_NE(ex, nullptr);
  Inputs in;
  ParameterStore params;
  auto out = ex->run(in.batch(), params);
  ASSERT_TRUE(out.isOk()) << out.status().str();
  expectResult((*out)[0], in);
  ASSERT_EQ(ex->collectiveWaits().size(), 1u);
  EXPECT_EQ(ex->collectiveWaits()[0].waited_at, launchOf(p, "kiln.all_reduce").seq);
}

// The plan keeps the collective's send and receive buffers apart from what compute writes
// before the join; the executor refuses a plan that does not (a lifetime shortened to the
// launch), instead of letting the transfer read overwritten bytes.
TEST(CpuExecutorOverlap, BuffersInFlightAreNotReusedBeforeTheWait) {
  codegen::Program p = lower(kOverlap);
  const codegen::Instruction& ar = launchOf(p, "kiln.all_reduce");
  const codegen::Buffer& send = p.buffers[static_cast<size_t>(ar.operands[0])];
  const codegen::Buffer& recv = p.buffers[static_cast<size_t>(ar.results[0])];
  const codegen::Buffer& z = p.buffers[static_cast<size_t>(launchOf(p, "kiln.tanh").results[0])];
  auto apart = [](const codegen::Buffer& a, const codegen::Buffer& b) {
    return a.offset + a.bytes <= b.offset || b.offset + b.bytes <= a.offset;
  };
  EXPECT_TRUE(apart(send, z)) << p.str();
  EXPECT_TRUE(apart(recv, z)) << p.str();

  // The same program with tanh's result moved onto the send buffer, as a plan that ended %a's
  // life at the launch could have placed it.
  codegen::Program reused = p;
  reused.buffers[z.id].offset = send.offset;
  LazyGroup g;
  auto ex = executorOver(reused, g);
  ASSERT_NE(ex, nullptr);
  Inputs in;
  ParameterStore params;
  auto out = ex->run(in.batch(), params);
  ASSERT_FALSE(out.isOk());
  EXPECT_NE(out.status().message().find("still uses"), std::string::npos) << out.status().str();
  EXPECT_EQ(g.waits, 1);  // waited on before returning, though the run failed
}

TEST(CpuExecutorOverlap, AFailedWaitNamesTheCollective) {
  codegen::Program p = lower(kOverlap);
  LazyGroup g;
  g.fail_wait = true;
  auto ex = executorOver(p, g);
  ASSERT_NE(ex, nullptr);
  Inputs in;
  ParameterStore params;
  auto out = ex->run(in.batch(), params);
  ASSERT_FALSE(out.isOk());
  EXPECT_NE(out.status().message().find("kiln.all_reduce"), std::string::npos) << out.status().str();
  EXPECT_NE(out.status().message().find("the link went down"), std::string::npos) << out.status().str();
}

// Two in-process ranks over a LocalGroup: the overlapped all_reduce sums both ranks' values,
// and the group counts what it sent whether or not the wait found the transfer done.
const char* kTwoRanks = R"(
func.func @forward() -> (!kiln.tensor<64xf32>) {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<64xf32>
  %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<64xf32>
  %a = "kiln.sigmoid"(%x) : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %r = "kiln.all_reduce"(%a) {ranks = 2, kiln.stream = 2} : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %z = "kiln.tanh"(%w) : (!kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  %out = "kiln.add"(%r, %z) : (!kiln.tensor<64xf32>, !kiln.tensor<64xf32>) -> !kiln.tensor<64xf32>
  "func.return"(%out) : (!kiln.tensor<64xf32>) -> ()
}
)";

TEST(CpuExecutorOverlap, TwoRanksSumAndCountBytes) {
  const codegen::Program p = lower(kTwoRanks);
  for (bool overlap : {true, false}) {
    std::vector<HostTensor> x = {testing::randomTensor(DType::f32, {64}, 11),
                                 testing::randomTensor(DType::f32, {64}, 12)};
    std::vector<HostTensor> w = {testing::randomTensor(DType::f32, {64}, 13),
                                 testing::randomTensor(DType::f32, {64}, 14)};
    std::vector<HostTensor> got(2);
    std::vector<comm::CommStats> stats(2);
    comm::LocalGroup group(2);
    Status s = group.run([&](comm::Communicator& c) -> Status {
      comm::CommunicatorRankGroup ranks(c);
      ExecutorOptions o;
      o.ranks = &ranks;
      o.overlap_collectives = overlap;
      KILN_ASSIGN_OR_RETURN(auto ex, CpuExecutor::create(p, o));
      ParameterStore params;
      const int r = c.rank();
      for (int step = 0; step < 3; ++step) {
        KILN_ASSIGN_OR_RETURN(auto out, ex->run({{"x", x[r].view}, {"w", w[r].view}}, params));
        got[static_cast<size_t>(r)] = std::move(out[0]);
      }
      stats[static_cast<size_t>(r)] = ranks.stats();
      return Status::ok();
    });
    ASSERT_TRUE(s.isOk()) << s.str();
    for (int r = 0; r < 2; ++r) {
      for (int64_t i = 0; i < 64; ++i) {
        double sum = 0;
        for (int q = 0; q < 2; ++q) sum += 1 / (1 + std::exp(-static_cast<double>(x[q].as<float>()[i])));
        EXPECT_NEAR(got[r].as<float>()[i], sum + std::tanh(static_cast<double>(w[r].as<float>()[i])), 1e-5)
            << "rank " << r << " element " << i << (overlap ? "" : " (no overlap)");
      }
      // Three steps of a ring all_reduce: 2 (N-1)/N of 64 floats each.
      EXPECT_EQ(stats[r].bytes_sent, 3 * 256);
      EXPECT_EQ(stats[r].collectives, 3);
      EXPECT_GE(stats[r].seconds, 0);
    }
  }
}

}  // namespace
}  // namespace kiln::runtime::cpu
