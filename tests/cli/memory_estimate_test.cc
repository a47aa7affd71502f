// Issue 17, item 6 ("Memory up front"): the count the memory check, `kiln dump --stats` and the
// trainer share, against a hand count of a small model with one optimizer of each kind; the
// limit --memory-limit N% sets; and the command boundary that turns an allocation failure into
// exit 1.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

// Two f32 tables of 16 (rowwise_adagrad: one f32 per row), a bf16 table of 4 (adam: two bf16
// copies of it) and an MLP 8+16+16+4 = 44 -> 10 -> 1 under adagrad (one f32 per element).
const char* kModel = R"(model mem {
  dim B
  input dense: f32[B, 8]
  input cats:  ids[B, 2]
  input tok:   ids[B, 1]
  input label: f32[B]

  t = embeddings(rows = [1000, 500], dim = 16, optimizer = rowwise_adagrad)
  u = embeddings(rows = [300], dim = 4, dtype = bf16, optimizer = adam)
  logit = mlp(concat(dense, t(cats), cast(concat(u(tok)), f32)), [10, 1], last = identity)

  output logit
  train {
    loss = bce_with_logits(logit, label)
    optimizer = adagrad(lr = 0.01)
    metrics = [auc]
  }
}
)";

driver::SessionOptions memModel(int64_t batch) {
  static const std::string path = [] {
    std::string p = (std::filesystem::temp_directory_path() /
                     ("kiln_memory_estimate_test_" + std::to_string(::getpid()) + ".kiln"))
                        .string();
    std::ofstream(p) << kModel;
    return p;
  }();
  driver::SessionOptions o;
  o.model_path = path;
  o.batch = batch;
  return o;
}

constexpr uint64_t kF32 = 4, kBf16 = 2;
constexpr uint64_t kTableWeights = (1000 + 500) * 16 * kF32 + 300 * 4 * kBf16;
constexpr uint64_t kDenseWeights = (44 * 10 + 10 + 10 * 1 + 1) * kF32;
constexpr uint64_t kRowwiseState = (1000 + 500) * kF32;
constexpr uint64_t kAdamState = 2 * 300 * 4 * kBf16;
// A sample: 8 dense f32, 2 + 1 i64 ids, an f32 label.
constexpr uint64_t kSampleBytes = 8 * 4 + 3 * 8 + 4;

TEST(MemoryEstimate, CountsEachOptimizersStateByHand) {
  std::ostringstream diag;
  const driver::SessionOptions o = memModel(32);
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  auto need = driver::estimateSessionMemory((*s)->module(), o, (*s)->trainSpec());
  ASSERT_TRUE(need) << need.status().str();
  const driver::MemoryTotals t = driver::memoryTotals(*need);
  EXPECT_EQ(t.param_bytes, kTableWeights + kDenseWeights);
  EXPECT_EQ(t.optimizer_bytes, kRowwiseState + kAdamState + kDenseWeights);
  EXPECT_EQ(t.workspace_bytes, 4u + 32 * 4);  // the loss and one logit per sample
  EXPECT_EQ(t.data_bytes, uint64_t{driver::kTrainPrefetchDepth + 2} * 32 * kSampleBytes);
  EXPECT_EQ(t.checkpoint_bytes, 0u);
  auto arena = driver::plannedPeakBytes(*(*s)->module().lookup("train_step"), 32);
  ASSERT_TRUE(arena) << arena.status().str();
  EXPECT_GT(*arena, 0);
  EXPECT_EQ(t.activation_peak_bytes, static_cast<uint64_t>(*arena));
  ASSERT_TRUE(t.peak_bytes);
  EXPECT_EQ(*t.peak_bytes,
            t.param_bytes + t.optimizer_bytes + t.activation_peak_bytes + t.workspace_bytes + t.data_bytes);
  // What the count says the store holds is what it allocated.
  EXPECT_EQ(static_cast<uint64_t>((*s)->params().totalBytes()), t.param_bytes + t.optimizer_bytes);
}

// Issue 34: under --device cuda the GPU's memory is counted from the CUDA program, not the CPU's:
// every parameter and its state on the device, the CUDA program's arena, the inputs beside it and
// cuBLASLt's workspace.
TEST(MemoryEstimate, TheGpuCountsTheCudaProgramsArenaAndEveryParameter) {
  std::ostringstream diag;
  driver::SessionOptions o = memModel(32);
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  o.device = "cuda";
  auto need = driver::estimateDeviceMemory((*s)->module(), o);
  ASSERT_TRUE(need) << need.status().str();
  const driver::MemoryTotals t = driver::memoryTotals(*need);
  EXPECT_EQ(t.param_bytes, kTableWeights + kDenseWeights);
  EXPECT_EQ(t.optimizer_bytes, kRowwiseState + kAdamState + kDenseWeights);
  EXPECT_EQ(t.data_bytes, 0u);  // the data stays on the host
  // The arena holds at least the MLP's input, [32, 44] f32, in 256-byte units.
  EXPECT_GE(t.activation_peak_bytes, 32u * 44 * kF32);
  EXPECT_EQ(t.activation_peak_bytes % 256, 0u);
  // Beside it: cuBLASLt's workspace and the batch's inputs on the device.
  EXPECT_GE(t.workspace_bytes, (uint64_t{32} << 20) + 32 * kSampleBytes);
  EXPECT_LT(t.workspace_bytes, (uint64_t{32} << 20) + 64 * kSampleBytes);
  // What the check compares with the GPU's free memory: one byte short fails, naming the GPU's limit.
  ASSERT_TRUE(t.peak_bytes);
  runtime::MemoryLimit gpu;
  gpu.source = "the free memory of a test GPU";
  gpu.bytes = *t.peak_bytes;
  EXPECT_TRUE(runtime::checkMemoryFits(*need, gpu));
  gpu.bytes = *t.peak_bytes - 1;
  Status short_by_one = runtime::checkMemoryFits(*need, gpu);
  ASSERT_FALSE(short_by_one);
  EXPECT_NE(short_by_one.message().find("the free memory of a test GPU"), std::string::npos) << short_by_one.message();
  EXPECT_NE(short_by_one.message().find("cuBLASLt's workspace"), std::string::npos) << short_by_one.message();
}

TEST(MemoryEstimate, SgdKeepsNoStateAndTablesKeepTheirOwnOptimizer) {
  std::ostringstream diag;
  driver::SessionOptions o = memModel(16);
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  o.train_overrides = {{"optimizer", ir::Attribute(sgd)}};
  auto s = driver::Session::create(o, diag);
  ASSERT_TRUE(s) << s.status().str() << diag.str();
  auto need = driver::estimateSessionMemory((*s)->module(), o, (*s)->trainSpec());
  ASSERT_TRUE(need) << need.status().str();
  const driver::MemoryTotals t = driver::memoryTotals(*need);
  EXPECT_EQ(t.param_bytes, kTableWeights + kDenseWeights);
  EXPECT_EQ(t.optimizer_bytes, kRowwiseState + kAdamState);  // no accumulator for the MLP
  EXPECT_EQ(t.data_bytes, uint64_t{driver::kTrainPrefetchDepth + 2} * 16 * kSampleBytes);
}

TEST(MemoryEstimate, ALimitBelowTheCountStopsBeforeAllocatingNamingTheLargestTable) {
  std::ostringstream diag;
  driver::SessionOptions o = memModel(32);
  auto fits = driver::Session::create(o, diag);
  ASSERT_TRUE(fits) << fits.status().str() << diag.str();
  auto need = driver::estimateSessionMemory((*fits)->module(), o, (*fits)->trainSpec());
  ASSERT_TRUE(need) << need.status().str();
  const uint64_t total = *driver::memoryTotals(*need).peak_bytes;

  o.memory_limit = total;
  auto exact = driver::Session::create(o, diag);
  EXPECT_TRUE(exact) << exact.status().str();
  o.memory_limit = total - 5000;
  auto short_by = driver::Session::create(o, diag);
  ASSERT_FALSE(short_by);
  const std::string& m = short_by.status().message();
  EXPECT_NE(m.find(fmt::format("the run needs {} ({} bytes)", runtime::formatBytes(total), total)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("4.88 KiB (5000 bytes) short"), std::string::npos) << m;
  // t.0 (1000 x 16 f32, 64000 bytes) is the largest consumer.
  EXPECT_NE(m.find("largest:\n    parameter \"t.0\" f32[1000, 16] (weights): 62.5 KiB (64000 bytes)"),
            std::string::npos)
      << m;
}

TEST(MemoryEstimate, APercentLimitIsAShareOfTheMachine) {
  driver::SessionOptions o;
  o.memory_limit_percent = 50;
  const runtime::MemoryLimit machine = runtime::availableMemory(std::nullopt);
  const runtime::MemoryLimit half = driver::sessionMemoryLimit(o);
  if (!machine.bytes) GTEST_SKIP() << "nothing limits this machine's memory";
  ASSERT_TRUE(half.bytes);
  EXPECT_EQ(half.source.rfind("--memory-limit 50% of ", 0), 0u) << half.source;
  // MemAvailable moves between the two readings: within 5% of half of it.
  const double want = static_cast<double>(*machine.bytes) / 2;
  EXPECT_NEAR(static_cast<double>(*half.bytes), want, want * 0.05);
  o.memory_shares = 4;
  const runtime::MemoryLimit quarter = driver::sessionMemoryLimit(o);
  ASSERT_TRUE(quarter.bytes);
  EXPECT_NEAR(static_cast<double>(*quarter.bytes), want / 4, want / 4 * 0.05);
  EXPECT_NE(quarter.source.find("shared by 4 in-process ranks"), std::string::npos) << quarter.source;
}

int throwsBadAlloc(const std::vector<std::string>&) { throw std::bad_alloc(); }
int throwsLengthError(const std::vector<std::string>&) {
  std::vector<double> v;
  v.resize(v.max_size() + size_t{1});  // std::length_error
  return 0;
}
int returnsThree(const std::vector<std::string>&) { return 3; }

TEST(CommandBoundary, AnAllocationFailureIsOutOfMemoryAndExitOne) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(runCommandGuarded("kiln", "train", throwsBadAlloc, {}), kExitError);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind("kiln train: error: out of memory: an allocation failed (std::bad_alloc)", 0), 0u)
      << err;

  ::testing::internal::CaptureStderr();
  EXPECT_EQ(runCommandGuarded("./dcn", "predict", throwsLengthError, {}), kExitError);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind("./dcn predict: error: out of memory: a size too large to allocate", 0), 0u) << err;

  ::testing::internal::CaptureStderr();
  EXPECT_EQ(runCommandGuarded("kiln", "dump", returnsThree, {}), 3);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace kiln::cli
