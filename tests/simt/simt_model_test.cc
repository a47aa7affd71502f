// Whole training steps of the CUDA backend on the host: each model's @train_step lowered and
// built exactly as CudaExecutor builds it (groups, arena plan, streams and events, generated
// kernels, cuBLASLt problems), run by simt::HostProgram, against the CPU executor from the same
// initial parameters on the same batches: loss, logits, and every parameter and optimizer state
// after two steps. gpu_model_test runs the same comparison on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "codegen/kernel_lowering.h"
#include "ir/ops/kernel_util.h"
#include "runtime/data/batch_reader.h"
#include "tests/model_compare.h"
#include "tests/simt/host_program.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

using testing::compareTensors;
using testing::ModelCase;
using testing::valueAt;

constexpr int64_t kBatch = 64;

std::unique_ptr<driver::Session> makeSession(const ModelCase& c) { return testing::makeSession(c, kBatch, "500"); }

std::vector<data::Batch> batches(const driver::Session& s, int n) { return testing::syntheticBatches(s, kBatch, n); }

// The training step's inputs: the batch, the lr factor 1 and the 1-based step.
driver::StepInputs trainInputs(const data::Batch& b, int64_t step) { return driver::StepInputs(b, {{"lr", 1.0f}, {"step", static_cast<float>(step)}}); }

class SimtModel : public ::testing::TestWithParam<ModelCase> {};

TEST_P(SimtModel, TrainingStepMatchesCpu) {
  auto cpu = makeSession(GetParam());
  auto host = makeSession(GetParam());
  const double loss_tol = testing::lossTolerance(GetParam()), logit_tol = testing::logitTolerance(GetParam());
  ASSERT_TRUE(cpu && host);
  const ir::Function* f = host->module().lookup("train_step");
  ASSERT_NE(f, nullptr);
  auto program = simt::HostProgram::create(*f, {{"B", kBatch}});
  ASSERT_TRUE(program) << program.status().message();
  EXPECT_GT((*program)->numKernels(), 0);
  // The bias gradients below come from cuBLASLt's bias-gradient epilogue (gemmAsCublasLt's
  // emulation of it): every model here has a layer with a bias. Its ReLU layers' backward is
  // the DRELU epilogue of the GEMM before, reading the mask the forward GEMM wrote.
  auto groups = codegen::lowerFunction(*f, {{"B", kBatch}});
  ASSERT_TRUE(groups) << groups.status().message();
  int bias_gradient_gemms = 0, drelu_gemms = 0, mask_gemms = 0;
  for (const codegen::LoweredGroup& g : *groups) {
    bias_gradient_gemms += g.gemm && g.gemm_call.bias_gradient_of != 0;
    drelu_gemms += g.gemm && g.gemm_call.activation_grad == "relu";
    mask_gemms += g.gemm && g.gemm_call.writes_relu_mask;
    if (g.fused_kind == "gemm_epilogue") {
      EXPECT_TRUE(g.split_reason.empty()) << g.split_reason;
    }
  }
  EXPECT_GT(bias_gradient_gemms, 0);
  EXPECT_GT(drelu_gemms, 0);
  EXPECT_EQ(mask_gemms, drelu_gemms) << "each DRELU reads the mask of its own forward GEMM";
  std::vector<data::Batch> bs = batches(*cpu, 2);
  ASSERT_EQ(bs.size(), 2u);
  for (int step = 1; step <= 2; ++step) {
    auto c = cpu->trainStep(bs[static_cast<size_t>(step - 1)], 1.0, step);
    ASSERT_TRUE(c) << c.status().message();
    const driver::StepInputs in = trainInputs(bs[static_cast<size_t>(step - 1)], step);
    auto r = (*program)->run(in.views(), host->params(), static_cast<uint64_t>(step));
    ASSERT_TRUE(r) << r.status().message();
    ASSERT_GE(r->size(), 2u);
    EXPECT_NEAR(valueAt((*r)[0], 0), c->loss, loss_tol * (1 + std::fabs(c->loss))) << "step " << step;
    ASSERT_EQ((*r)[1].numel(), static_cast<int64_t>(c->logits.size()));
    for (size_t i = 0; i < c->logits.size(); ++i)
      ASSERT_NEAR(valueAt((*r)[1], static_cast<int64_t>(i)), c->logits[i], logit_tol * (1 + std::fabs(c->logits[i])))
          << "logit " << i << " step " << step;
  }
  for (const std::string& name : cpu->checkpointNames()) {
    const ir::HostTensor* want = cpu->params().find(name);
    const ir::HostTensor* got = host->params().find(name);
    ASSERT_TRUE(want && got) << name;
    ASSERT_EQ(want->storage.size(), got->storage.size()) << name;
    testing::TensorDiff d = compareTensors(*got, *want, testing::stateTolerance(GetParam(), want->view.dtype));
    EXPECT_LE(d.off, d.allowed()) << name << ": " << d.str();
  }
}

// The MoE decoder (models/moe_lm.kiln at a small size): attention, routing, dispatch on the
// device, grouped GEMMs and their backward, as generated CUDA on the host, against the CPU.
TEST(SimtMoeModel, MoeLmTrainingStepMatchesCpu) {
  constexpr int64_t kSeqs = 4;
  auto make = [] {
    driver::SessionOptions o;
    o.model_path = std::string(KILN_SOURCE_DIR) + "/models/moe_lm.kiln";
    o.overrides = {{"T", "8"},     {"vocab", "32"},   {"d", "32"},      {"layers", "1"},
                   {"heads", "2"}, {"kv_heads", "1"}, {"experts", "4"}, {"ffn", "16"}};
    // Exact f32 GEMMs: the generated code's numbers within f32 rounding of the CPU's, as the
    // model cases without a precision run (TF32's margins are the tf32 cases').
    o.train_overrides = {{"precision", ir::Attribute(std::string("f32_strict"))}};
    o.batch = kSeqs;
    o.seed = 3;
    std::ostringstream diag;
    auto s = driver::Session::create(o, diag);
    EXPECT_TRUE(s) << s.status().message() << diag.str();
    return s ? s.take() : nullptr;
  };
  auto cpu = make();
  auto host = make();
  ASSERT_TRUE(cpu && host);
  auto program = simt::HostProgram::create(*host->module().lookup("train_step"), {{"B", kSeqs}});
  ASSERT_TRUE(program) << program.status().message();
  std::vector<data::Batch> bs = testing::syntheticBatches(*cpu, kSeqs, 2);
  ASSERT_EQ(bs.size(), 2u);
  for (int step = 1; step <= 2; ++step) {
    auto c = cpu->trainStep(bs[static_cast<size_t>(step - 1)], 1.0, step);
    ASSERT_TRUE(c) << c.status().message();
    const driver::StepInputs in = trainInputs(bs[static_cast<size_t>(step - 1)], step);
    auto r = (*program)->run(in.views(), host->params(), static_cast<uint64_t>(step));
    ASSERT_TRUE(r) << r.status().message();
    ASSERT_GE(r->size(), 3u);
    EXPECT_NEAR(valueAt((*r)[0], 0), c->loss, 1e-4 * (1 + std::fabs(c->loss))) << "step " << step;
    // (A token model's session does not copy out its logits; the loss and, after two steps,
    // every weight check the forward and the backward.) The per-expert counts and balancing
    // losses follow the loss and the prediction.
    ASSERT_EQ(r->size(), 2 + c->stats.size());
    for (size_t k = 0; k < c->stats.size(); ++k)
      for (size_t i = 0; i < c->stats[k].second.size(); ++i)
        EXPECT_NEAR(ir::kernels::loadAsDouble((*r)[2 + k].view, static_cast<int64_t>(i)),
                    c->stats[k].second[i], 1e-4 * (1 + std::fabs(c->stats[k].second[i])))
            << c->stats[k].first << "[" << i << "] step " << step;
  }
  for (const std::string& name : cpu->checkpointNames()) {
    const ir::HostTensor* want = cpu->params().find(name);
    const ir::HostTensor* got = host->params().find(name);
    ASSERT_TRUE(want && got) << name;
    testing::TensorDiff d = compareTensors(*got, *want, testing::stateTolerance(want->view.dtype));
    EXPECT_LE(d.off, d.allowed()) << name << ": " << d.str();
  }
}

// @forward (evaluation and prediction) after a training step: the logits of the next batch.
TEST_P(SimtModel, ForwardMatchesCpu) {
  auto cpu = makeSession(GetParam());
  auto host = makeSession(GetParam());
  ASSERT_TRUE(cpu && host);
  std::vector<data::Batch> bs = batches(*cpu, 2);
  ASSERT_EQ(bs.size(), 2u);
  // Both sides start the forward pass from the same trained parameters: the CPU's.
  ASSERT_TRUE(cpu->trainStep(bs[0], 1.0, 1));
  for (const std::string& name : cpu->checkpointNames()) *host->params().find(name) = *cpu->params().find(name);
  const ir::Function* f = host->module().lookup("forward");
  ASSERT_NE(f, nullptr);
  auto program = simt::HostProgram::create(*f, {{"B", kBatch}});
  ASSERT_TRUE(program) << program.status().message();
  auto c = cpu->forward(bs[1]);
  ASSERT_TRUE(c) << c.status().message();
  const driver::StepInputs in(bs[1], {});
  auto r = (*program)->run(in.views(), host->params(), 1);
  ASSERT_TRUE(r) << r.status().message();
  // @forward returns the model's outputs; the logits are the one with a value per sample.
  const ir::HostTensor* logits = nullptr;
  for (const ir::HostTensor& t : *r)
    if (t.numel() == kBatch && t.view.dtype == ir::DType::f32) logits = &t;
  ASSERT_NE(logits, nullptr);
  ASSERT_EQ(c->logits.size(), static_cast<size_t>(kBatch));
  const double tol = testing::logitTolerance(GetParam());
  for (size_t i = 0; i < c->logits.size(); ++i)
    ASSERT_NEAR(valueAt(*logits, static_cast<int64_t>(i)), c->logits[i], tol * (1 + std::fabs(c->logits[i]))) << i;
}

// The streams' events order every cross-stream access: however the streams interleave, the
// step computes the same bits.
TEST_P(SimtModel, EveryStreamInterleavingComputesTheSameBits) {
  auto host = makeSession(GetParam());
  ASSERT_TRUE(host);
  const ir::Function* f = host->module().lookup("train_step");
  ASSERT_NE(f, nullptr);
  auto program = simt::HostProgram::create(*f, {{"B", kBatch}});
  ASSERT_TRUE(program) << program.status().message();
  std::vector<data::Batch> bs = batches(*host, 1);
  ASSERT_EQ(bs.size(), 1u);
  const driver::StepInputs in = trainInputs(bs[0], 1);
  const runtime::ParameterStore initial = host->params();
  std::vector<ir::HostTensor> first;
  runtime::ParameterStore first_params;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    runtime::ParameterStore params = initial;
    auto r = (*program)->run(in.views(), params, seed);
    ASSERT_TRUE(r) << r.status().message();
    if (seed == 1) {
      first = r.take();
      first_params = params;
      continue;
    }
    for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ((*r)[i].storage, first[i].storage) << "result " << i;
    for (const std::string& name : params.names())
      EXPECT_EQ(params.find(name)->storage, first_params.find(name)->storage) << name << ", seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SimtModel, ::testing::ValuesIn(testing::modelCases()),
                         [](const ::testing::TestParamInfo<ModelCase>& i) { return i.param.name(); });

}  // namespace
}  // namespace kiln::cli
