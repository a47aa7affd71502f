// Whole models on the GPU against the CPU: one training step of each model in models/ from the
// same initial parameters on the same batch (loss, logits and every parameter and optimizer
// state afterwards), and 50-step loss trajectories. Skips without a GPU (ctest label `gpu`).
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "runtime/cuda/cuda_driver.h"
#include "runtime/data/batch_reader.h"
#include "tools/session_flags.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/model_compare.h"

namespace kiln::cli {
namespace {

using testing::ModelCase;
constexpr int64_t kBatch = 256;

std::unique_ptr<driver::Session> makeSession(const ModelCase& c, const std::string& device) {
  return testing::makeSession(c, kBatch, "2000", device, 2);
}

std::vector<data::Batch> batches(const driver::Session& s, int n) { return testing::syntheticBatches(s, kBatch, n); }

class GpuModel : public ::testing::TestWithParam<ModelCase> {};

TEST_P(GpuModel, TrainingStepMatchesCpu) {
  SKIP_WITHOUT_GPU();
  auto cpu = makeSession(GetParam(), "cpu");
  auto gpu = makeSession(GetParam(), "cuda");
  ASSERT_TRUE(cpu && gpu);
  std::vector<data::Batch> bs = batches(*cpu, 2);
  ASSERT_EQ(bs.size(), 2u);
  for (int step = 1; step <= 2; ++step) {  // the second step replays the captured graph's inputs anew
    auto c = cpu->trainStep(bs[step - 1], 1.0, step);
    auto g = gpu->trainStep(bs[step - 1], 1.0, step);
    ASSERT_TRUE(c) << c.status().message();
    ASSERT_TRUE(g) << g.status().message();
    EXPECT_NEAR(g->loss, c->loss, testing::lossTolerance(GetParam()) * (1 + std::fabs(c->loss))) << "step " << step;
    ASSERT_EQ(g->logits.size(), c->logits.size());
    for (size_t i = 0; i < c->logits.size(); ++i)
      ASSERT_NEAR(g->logits[i], c->logits[i], testing::logitTolerance(GetParam()) * (1 + std::fabs(c->logits[i])))
          << "logit " << i << " step " << step;
  }
  for (const std::string& name : cpu->checkpointNames()) {
    const ir::HostTensor* want = cpu->params().find(name);
    const ir::HostTensor* got = gpu->params().find(name);
    ASSERT_TRUE(want && got) << name;
    ASSERT_EQ(want->storage.size(), got->storage.size()) << name;
    testing::TensorDiff d = testing::compareTensors(*got, *want, testing::stateTolerance(GetParam(), want->view.dtype));
    EXPECT_LE(d.off, d.allowed()) << name << ": " << d.str();
  }
}

TEST_P(GpuModel, FiftyStepLossTrajectoriesAgree) {
  SKIP_WITHOUT_GPU();
  auto cpu = makeSession(GetParam(), "cpu");
  auto gpu = makeSession(GetParam(), "cuda");
  ASSERT_TRUE(cpu && gpu);
  std::vector<data::Batch> bs = batches(*cpu, 50);
  ASSERT_EQ(bs.size(), 50u);
  double first = 0, last_cpu = 0, last_gpu = 0;
  for (int step = 1; step <= 50; ++step) {
    auto c = cpu->trainStep(bs[step - 1], 1.0, step);
    auto g = gpu->trainStep(bs[step - 1], 1.0, step);
    ASSERT_TRUE(c) << c.status().message();
    ASSERT_TRUE(g) << g.status().message();
    ASSERT_TRUE(std::isfinite(g->loss)) << "step " << step;
    // Summation order differs, so trajectories drift slowly apart; they must stay close.
    ASSERT_NEAR(g->loss, c->loss, 20 * testing::lossTolerance(GetParam()) * step * (1 + std::fabs(c->loss)))
        << "step " << step;
    if (step == 1) first = c->loss;
    last_cpu = c->loss;
    last_gpu = g->loss;
  }
  EXPECT_LT(last_cpu, first);  // both trained
  EXPECT_LT(last_gpu, first);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuModel, ::testing::ValuesIn(testing::modelCases()),
                         [](const ::testing::TestParamInfo<ModelCase>& i) { return i.param.name(); });

TEST(GpuDevice, CudaWithoutAGpuIsAClearError) {
  std::string why;
  if (cuda::cudaAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  driver::SessionOptions o;
  o.model_path = std::string(KILN_SOURCE_DIR) + "/models/dlrm.kiln";
  o.overrides["rows_cap"] = "100";
  o.batch = 8;
  o.device = "cuda";
  std::ostringstream diag;
  auto s = driver::Session::create(o, diag);
  ASSERT_FALSE(s);
  EXPECT_NE(s.status().message().find("--device cuda"), std::string::npos) << s.status().message();
}

}  // namespace
}  // namespace kiln::cli
