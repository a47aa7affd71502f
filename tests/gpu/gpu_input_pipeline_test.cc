// The input pipeline on the GPU (runtime/cuda/input_pipeline.h): steps whose batch was staged
// during the previous step (pinned copy, upload on the copy stream, copy-in on stream 0, the
// graph replayed over batches from both landing slots) train exactly as steps that stage their
// own batch; a staged batch the caller does not train on is dropped; the executor's own
// stage/launch/collect two batches ahead gives run()'s results; batches placed in the
// executor's page-locked staging pool (as the data thread does) are uploaded from there, give
// each step its own batch and train as unstaged steps; an evaluation's forward steps staged
// ahead give the unstaged logits. Skips without a GPU (label gpu).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "ir/builder.h"
#include "runtime/cuda/cuda_executor.h"
#include "runtime/data/staging_pool.h"
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

// The trainer's path with the data thread's copies: after step 1 (which makes the executor)
// batches 3 on are placed in @train_step's staging pool, and each is let go right after the step
// that trained on it (its buffer then goes back while a later upload may run). Training must
// match a session that stages nothing; the pool must have waited for uploads before reusing
// buffers; forward steps staged ahead (the evaluator's order) give the unstaged logits.
TEST(GpuInputPipelinePool, PlacedBatchesTrainAsUnstagedOnesAndForwardStagesAhead) {
  SKIP_WITHOUT_GPU();
  const ModelCase c{"dlrm", ""};
  const int steps = 9;
  auto plain = gpuSession(c);
  auto staged = gpuSession(c);
  ASSERT_TRUE(plain && staged);
  std::vector<data::Batch> bs = testing::syntheticBatches(*plain, kBatch, steps);
  ASSERT_EQ(bs.size(), static_cast<size_t>(steps));
  std::vector<data::Batch> placed = bs;  // copies own their bytes; placed into the pool below
  std::shared_ptr<data::StagingPool> pool;
  for (int step = 1; step <= steps; ++step) {
    const size_t i = static_cast<size_t>(step - 1);
    auto ps = plain->trainStep(bs[i], 1.0, step);
    ASSERT_TRUE(ps) << ps.status().message();
    driver::Session::NextStep next;
    if (step == 1) {
      // The pool exists once the executor does; the data thread places batch 3 on.
      auto s1 = staged->trainStep(placed[0], 1.0, 1, {&placed[1], 1.0, 2});
      ASSERT_TRUE(s1) << s1.status().message();
      auto got = staged->trainStagingPool(kBatch, 3);
      ASSERT_TRUE(got) << got.status().message();
      pool = *got;
      ASSERT_TRUE(pool);
      for (size_t k = 2; k < 5; ++k) ASSERT_TRUE(pool->place(placed[k])) << k;  // three buffers
      EXPECT_EQ(s1->loss, ps->loss);
      continue;
    }
    if (step < steps) next = {&placed[i + 1], 1.0, step + 1};
    auto ss = staged->trainStep(placed[i], 1.0, step, next);
    ASSERT_TRUE(ss) << ss.status().message();
    EXPECT_NEAR(ss->loss, ps->loss, testing::lossTolerance(c) * (1 + std::fabs(ps->loss))) << "step " << step;
    ASSERT_EQ(ss->logits.size(), ps->logits.size());
    for (size_t j = 0; j < ps->logits.size(); ++j)
      ASSERT_NEAR(ss->logits[j], ps->logits[j], testing::logitTolerance(c) * (1 + std::fabs(ps->logits[j])))
          << "step " << step << " logit " << j;
    placed[i] = data::Batch();  // let go: from batch 2 on, its buffer goes back to the pool
    if (i >= 2 && i + 3 < placed.size()) ASSERT_TRUE(pool->place(placed[i + 3])) << "batch " << i + 3;
  }
  const data::StagingPool::Stats st = pool->stats();
  EXPECT_EQ(st.placed, steps - 2);
  EXPECT_GT(st.fence_waits, 0) << "the executor left no fence: its uploads did not read the buffers";
  EXPECT_EQ(st.none_free, 0);

  // Forward steps numbered 1..4, each staging the next.
  std::vector<driver::StepOutputs> ahead;
  for (int k = 1; k <= 4; ++k) {
    driver::Session::NextStep next;
    if (k < 4) next = {&bs[static_cast<size_t>(k)], 1.0, k + 1};
    auto out = staged->forward(bs[static_cast<size_t>(k - 1)], k, next);
    ASSERT_TRUE(out) << out.status().message();
    ahead.push_back(*out);
  }
  for (int k = 1; k <= 4; ++k) {
    auto want = staged->forward(bs[static_cast<size_t>(k - 1)]);
    ASSERT_TRUE(want) << want.status().message();
    ASSERT_EQ(ahead[static_cast<size_t>(k - 1)].logits.size(), want->logits.size());
    for (size_t j = 0; j < want->logits.size(); ++j)
      ASSERT_NEAR(ahead[static_cast<size_t>(k - 1)].logits[j], want->logits[j],
                  testing::logitTolerance(c) * (1 + std::fabs(want->logits[j])))
          << "forward batch " << k << " logit " << j;
  }
}

#ifdef KILN_HAVE_CUDA_HEADERS

// y = x + x over n f32 elements: the step the executor tests below stage batches for.
ir::Function& doubling(ir::Module& module, int64_t n) {
  ir::Function& f = module.addFunction("f");
  f.body().addBlock();
  ir::Builder b(f.entry());
  auto x = b.createWithTypes("kiln.input", {}, {ir::TensorType(ir::DType::f32, testing::S({n}))},
                             {{"name", ir::Attribute("x")}});
  EXPECT_TRUE(x) << x.status().message();
  if (!x) return f;
  auto y = b.create("kiln.add", {(*x)->result(), (*x)->result()});
  EXPECT_TRUE(y) << y.status().message();
  if (!y) return f;
  EXPECT_TRUE(b.createWithTypes("func.return", {(*y)->result()}, {}));
  f.setResultTypes({(*y)->result()->type()});
  return f;
}

// The executor's own API two batches ahead: y = x + x over batches staged before the step
// before them ran, through the eager first launch and the captured graph's replays.
TEST(GpuInputPipelineExecutor, TwoBatchesAheadGiveEachBatchItsOwnResult) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1 << 20;
  ir::Module module;
  ir::Function& f = doubling(module, n);
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

// The executor's staging pool: each batch copied into a page-locked buffer (as the data thread
// does) and let go as soon as it is staged, its buffer placed again at once with the batch two
// steps on while the upload may still read it. Each step must give its own batch's result, the
// host copy nothing, and the pool wait for the uploads before reusing a buffer.
TEST(GpuInputPipelineExecutor, BatchesInTheStagingPoolAreUploadedFromThere) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1 << 20;
  ir::Module module;
  ir::Function& f = doubling(module, n);
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  auto ex = cuda::CudaExecutor::create(f, {}, *session);
  ASSERT_TRUE(ex) << ex.status().message();
  cuda::CudaExecutor& e = **ex;
  auto pool = e.stagingPool(2);
  ASSERT_TRUE(pool) << pool.status().message();
  EXPECT_EQ((*pool)->memoryKind(), "page-locked");

  const int steps = 7;
  auto value = [](int i, int64_t j) { return static_cast<float>(i * 1000 + j % 991); };
  auto stage = [&](int i) {
    data::Batch batch;
    batch.size = n;
    batch.names = {"x"};
    batch.tensors.emplace_back(ir::DType::f32, std::vector<int64_t>{n});
    float* v = batch.tensors[0].as<float>();
    for (int64_t j = 0; j < n; ++j) v[j] = value(i, j);
    EXPECT_TRUE((*pool)->place(batch)) << "batch " << i;
    runtime::cpu::Batch views{{"x", batch.tensors[0].view}};
    return e.stage(views);  // `batch` dies here: its buffer goes back while the upload runs
  };
  std::vector<cuda::CudaExecutor::Ticket> tickets;
  auto collect = [&](int d) {
    auto out = e.collect(tickets[static_cast<size_t>(d)]);
    ASSERT_TRUE(out) << out.status().message();
    const float* got = (*out)[0].as<float>();
    for (int64_t j = 0; j < n; j += 4099) ASSERT_EQ(got[j], 2 * value(d, j)) << "batch " << d << " at " << j;
  };
  for (int i = 0; i < 2; ++i) {
    auto t = stage(i);
    ASSERT_TRUE(t) << t.status().message();
    tickets.push_back(*t);
  }
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
  const cuda::CudaExecutor::StagingStats st = e.stagingStats();
  EXPECT_EQ(st.in_place, steps);
  EXPECT_EQ(st.filled, 0);
  EXPECT_EQ(st.host_bytes, 0u);
  EXPECT_EQ((*pool)->stats().fence_waits, steps - 2);
}

#endif

}  // namespace
}  // namespace kiln::cli
