// The input pipeline on the GPU (runtime/cuda/input_pipeline.h): steps whose batch was staged
// during the previous step (pinned copy, upload on the copy stream, copy-in on stream 0, the
// graph replayed over batches from both landing slots) train exactly as steps that stage their
// own batch; a staged batch the caller does not train on is dropped; the executor's own
// stage/launch/collect two batches ahead gives run()'s results. Skips without a GPU (label gpu).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "ir/builder.h"
#include "runtime/cuda/cuda_executor.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/model_compare.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::cli {
namespace {

using testing::ModelCase;
constexpr int64_t kBatch = 256;
constexpr int kSteps = 6;

std::unique_ptr<driver::Session> gpuSession(const ModelCase& c) {
  return testing::makeSession(c, kBatch, "2000", "cuda", 2);
}

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

class GpuInputPipeline : public ::testing::TestWithParam<ModelCase> {};

// The same program on the same inputs in the same order: the results agree to the bit, so a
// step that read another step's batch or scalars (a slot mixed up, an upload not waited for)
// shows. A second unstaged session is the control: should the device not repeat its own bits
// (a float atomic somewhere), the staged run is held to the CPU comparison's tolerances instead.
TEST_P(GpuInputPipeline, StagedStepsTrainAsUnstagedOnes) {
  SKIP_WITHOUT_GPU();
  auto plain = gpuSession(GetParam());
  auto control = gpuSession(GetParam());
  auto staged = gpuSession(GetParam());
  ASSERT_TRUE(plain && control && staged);
  ASSERT_TRUE(staged->stagesAhead());
  std::vector<data::Batch> bs = testing::syntheticBatches(*plain, kBatch, kSteps);
  ASSERT_EQ(bs.size(), static_cast<size_t>(kSteps));
  std::vector<driver::StepOutputs> p, c, s;
  for (int step = 1; step <= kSteps; ++step) {
    const double lr = 1.0 - 0.05 * step;  // each step's own factor: a staged scalar is its step's
    auto ps = plain->trainStep(bs[step - 1], lr, step);
    auto cs = control->trainStep(bs[step - 1], lr, step);
    driver::Session::NextStep next;
    if (step < kSteps) next = {&bs[static_cast<size_t>(step)], 1.0 - 0.05 * (step + 1), step + 1};
    auto ss = staged->trainStep(bs[step - 1], lr, step, next);
    ASSERT_TRUE(ps) << ps.status().message();
    ASSERT_TRUE(cs) << cs.status().message();
    ASSERT_TRUE(ss) << ss.status().message();
    p.push_back(*ps);
    c.push_back(*cs);
    s.push_back(*ss);
  }
  bool deterministic = true;
  for (int i = 0; i < kSteps; ++i)
    deterministic = deterministic && c[i].loss == p[i].loss && sameBits(c[i].logits, p[i].logits);
  if (!deterministic) {
    std::printf(
        "note: two unstaged GPU sessions of %s differ; the staged run is compared within tolerances\n",
        GetParam().name().c_str());
    RecordProperty("deterministic", "no");
  }
  for (int i = 0; i < kSteps; ++i) {
    if (deterministic) {
      EXPECT_EQ(s[i].loss, p[i].loss) << "step " << i + 1;
      EXPECT_TRUE(sameBits(s[i].logits, p[i].logits)) << "step " << i + 1;
    } else {
      EXPECT_NEAR(s[i].loss, p[i].loss, testing::lossTolerance(GetParam()) * (1 + std::fabs(p[i].loss)))
          << "step " << i + 1;
    }
  }
  for (const std::string& name : plain->checkpointNames()) {
    const ir::HostTensor* want = plain->params().find(name);
    const ir::HostTensor* got = staged->params().find(name);
    ASSERT_TRUE(want && got) << name;
    ASSERT_EQ(want->storage.size(), got->storage.size()) << name;
    if (deterministic) {
      EXPECT_EQ(std::memcmp(want->storage.data(), got->storage.data(), want->storage.size()), 0) << name;
    } else {
      testing::TensorDiff d =
          testing::compareTensors(*got, *want, testing::stateTolerance(GetParam(), want->view.dtype));
      EXPECT_LE(d.off, d.allowed()) << name << ": " << d.str();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GpuInputPipeline,
                         ::testing::Values(ModelCase{"dlrm", ""}, ModelCase{"dlrm_dcnv2", "tf32"},
                                           ModelCase{"deepfm", ""}),
                         [](const ::testing::TestParamInfo<ModelCase>& i) { return i.param.name(); });

// A staged batch for step 2 while the caller trains step 2 on another batch (after a stop and a
// resume, say): the session drops it and trains on the batch it was given.
TEST(GpuInputPipelineDrop, AStagedBatchNotTrainedOnIsDropped) {
  SKIP_WITHOUT_GPU();
  const ModelCase c{"dlrm", ""};
  auto plain = gpuSession(c);
  auto staged = gpuSession(c);
  ASSERT_TRUE(plain && staged);
  std::vector<data::Batch> bs = testing::syntheticBatches(*plain, kBatch, 3);
  ASSERT_EQ(bs.size(), 3u);
  auto p1 = plain->trainStep(bs[0], 1.0, 1);
  auto s1 = staged->trainStep(bs[0], 1.0, 1, {&bs[1], 1.0, 2});
  ASSERT_TRUE(p1 && s1);
  // Step 3 instead of step 2: the batch staged for step 2 must not be read.
  auto p2 = plain->trainStep(bs[2], 1.0, 3);
  auto s2 = staged->trainStep(bs[2], 1.0, 3, {});
  ASSERT_TRUE(p2) << p2.status().message();
  ASSERT_TRUE(s2) << s2.status().message();
  // Another batch's logits differ by far more than the device's rounding could.
  EXPECT_NEAR(s2->loss, p2->loss, testing::lossTolerance(c) * (1 + std::fabs(p2->loss)));
  ASSERT_EQ(s2->logits.size(), p2->logits.size());
  for (size_t i = 0; i < p2->logits.size(); ++i)
    ASSERT_NEAR(s2->logits[i], p2->logits[i], testing::logitTolerance(c) * (1 + std::fabs(p2->logits[i])))
        << "logit " << i;
}

#ifdef KILN_HAVE_CUDA_HEADERS

// The executor's own API two batches ahead: y = x + x over batches staged before the step
// before them ran, through the eager first launch and the captured graph's replays.
TEST(GpuInputPipelineExecutor, TwoBatchesAheadGiveEachBatchItsOwnResult) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1 << 20;
  ir::Module module;
  ir::Function& f = module.addFunction("f");
  f.body().addBlock();
  ir::Builder b(f.entry());
  auto x = b.createWithTypes("kiln.input", {}, {ir::TensorType(ir::DType::f32, testing::S({n}))},
                             {{"name", ir::Attribute("x")}});
  ASSERT_TRUE(x);
  auto y = b.create("kiln.add", {(*x)->result(), (*x)->result()});
  ASSERT_TRUE(y) << y.status().message();
  ASSERT_TRUE(b.createWithTypes("func.return", {(*y)->result()}, {}));
  f.setResultTypes({(*y)->result()->type()});
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  auto ex = cuda::CudaExecutor::create(f, {}, *session);
  ASSERT_TRUE(ex) << ex.status().message();
  cuda::CudaExecutor& e = **ex;

  const int steps = 7;
  std::vector<std::vector<float>> xs(steps, std::vector<float>(static_cast<size_t>(n)));
  for (int i = 0; i < steps; ++i)
    for (int64_t j = 0; j < n; ++j)
      xs[static_cast<size_t>(i)][static_cast<size_t>(j)] = static_cast<float>(i * 1000 + j % 997);
  auto stage = [&](int i) {
    // The batch is gone once staged: its memory is rewritten at once.
    std::vector<float> copy = xs[static_cast<size_t>(i)];
    runtime::cpu::Batch batch{{"x", ir::TensorView{ir::DType::f32, {n}, copy.data()}}};
    auto t = e.stage(batch);
    std::fill(copy.begin(), copy.end(), -1.0f);
    return t;
  };
  std::vector<cuda::CudaExecutor::Ticket> tickets;
  for (int i = 0; i < 2; ++i) {
    auto t = stage(i);
    ASSERT_TRUE(t) << t.status().message();
    tickets.push_back(*t);
  }
  EXPECT_FALSE(stage(2)) << "two slots, both staged and not launched";
  auto collect = [&](int d) {
    auto out = e.collect(tickets[static_cast<size_t>(d)]);
    ASSERT_TRUE(out) << out.status().message();
    const float* got = (*out)[0].as<float>();
    for (int64_t j = 0; j < n; j += 4099)
      ASSERT_EQ(got[j], 2 * xs[static_cast<size_t>(d)][static_cast<size_t>(j)])
          << "batch " << d << " at " << j;
  };
  for (int i = 0; i < steps; ++i) {
    ASSERT_TRUE(e.launch(tickets[static_cast<size_t>(i)]));
    if (i + 2 < steps) {
      auto t = stage(i + 2);
      ASSERT_TRUE(t) << t.status().message();
      tickets.push_back(*t);
    }
    if (i >= 1) collect(i - 1);
  }
  collect(steps - 1);
  EXPECT_TRUE(e.graphCaptured());
}

#endif

}  // namespace
}  // namespace kiln::cli
