// The MoE kernels run on the host (simt): the checks of moe_checks.h over simt::HostModule, with
// guarded buffers (an overrun faults) and the emulator's shuffled thread order.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_interpreter.h"
#include "tests/simt/host_module.h"
#include "tests/simt/moe_checks.h"

namespace kiln::testing::moe {
namespace {

// Guarded host buffers (an overrun faults) and the emulator's shuffled thread order.
class SimtRun : public MoeRun {
 public:
  void run() override {
    std::vector<const Kernel*> ks;
    for (const Kernel& k : kernels_) ks.push_back(&k);
    auto m = simt::HostModule::compile(codegen::emitModule(ks));
    ASSERT_TRUE(m) << m.status().message();
    for (size_t i = 0; i < kernels_.size(); ++i) {
      std::string name;
      codegen::emitKernel(kernels_[i], &name);
      std::vector<void*> args;
      for (int b : args_[i]) args.push_back(bufs_[static_cast<size_t>(b)].data());
      Status s = (*m)->launch(name, codegen::launchConfig(kernels_[i]), args);
      ASSERT_TRUE(s.isOk()) << s.message();
    }
  }

 protected:
  int addBytes(const void* data, size_t bytes, size_t align) override {
    auto b = simt::GuardedBuffer::allocate(std::max<size_t>(1, bytes), align);
    EXPECT_TRUE(b) << b.status().message();
    if (bytes) std::memcpy(b->data(), data, bytes);
    bufs_.push_back(b.take());
    return static_cast<int>(bufs_.size() - 1);
  }
  void getBytes(int buffer, void* out, size_t bytes) override {
    std::memcpy(out, bufs_[static_cast<size_t>(buffer)].data(), bytes);
  }
  void setBytes(int buffer, const void* data, size_t bytes) override {
    std::memcpy(bufs_[static_cast<size_t>(buffer)].data(), data, bytes);
  }

 private:
  std::vector<simt::GuardedBuffer> bufs_;
};

TEST(SimtMoe, TopkAlongAMiddleAxisWithTies) {
  SimtRun run;
  checkTopkAlongAMiddleAxisWithTies(run);
}
TEST(SimtMoe, ZLossAndGradient) {
  SimtRun run;
  checkZLossAndGradient(run);
}
TEST(SimtMoe, ExpertBiasUpdateMovesTowardTheMeanLoad) {
  SimtRun run;
  checkExpertBiasUpdate(run);
}

class SimtRouter : public ::testing::TestWithParam<RouterCase> {};
TEST_P(SimtRouter, ForwardMatchesTheContractAndGradientMatchesFiniteDifferences) {
  SimtRun run;
  checkRouter(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Routing, SimtRouter, ::testing::ValuesIn(routerCases()),
                         [](const ::testing::TestParamInfo<RouterCase>& i) {
                           return std::string(i.param.name);
                         });

class SimtAuxLoss : public ::testing::TestWithParam<std::tuple<bool, int64_t>> {};
TEST_P(SimtAuxLoss, LossAndGradientMatchTheContract) {
  SimtRun run;
  checkAuxLoss(run, std::get<0>(GetParam()), std::get<1>(GetParam()));
}
INSTANTIATE_TEST_SUITE_P(Scores, SimtAuxLoss,
                         ::testing::Combine(::testing::Bool(), ::testing::Values<int64_t>(0, 8)));

class SimtDispatch : public ::testing::TestWithParam<DispatchCase> {};
TEST_P(SimtDispatch, RowsOffsetsAndCountsMatchTheContract) {
  SimtRun run;
  checkDispatch(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Policies, SimtDispatch, ::testing::ValuesIn(dispatchCases()),
                         [](const ::testing::TestParamInfo<DispatchCase>& i) {
                           return std::string(i.param.name);
                         });

class SimtPermute : public ::testing::TestWithParam<bool> {};
TEST_P(SimtPermute, PermuteUnpermuteAndRowDotOverDroppedAndPaddedSlots) {
  SimtRun run;
  checkPermutation(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(DTypes, SimtPermute, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "bf16" : "f32"; });

class SimtGroupedGemm : public ::testing::TestWithParam<GemmCase> {};
TEST_P(SimtGroupedGemm, ForwardAndWeightGradientMatchF64Loops) {
  SimtRun run;
  checkGroupedGemm(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Tiles, SimtGroupedGemm, ::testing::ValuesIn(gemmCases()),
                         [](const ::testing::TestParamInfo<GemmCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(SimtMoe, ARoutedExpertLayerFollowsNewRouting) {
  SimtRun run;
  checkRoutedLayer(run, [&](int) { run.run(); });
}

TEST(SimtMoe, TheInterpreterRefusesSourceKernels) {
  Kernel k = emit::expertBiasUpdateKernel(4, 0.1);
  std::vector<float> bias(4);
  std::vector<int> counts(4);
  Status s = codegen::interpret(k, {bias.data(), counts.data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("moe_expert_bias_update"), std::string::npos) << s.message();
  k.block = 48;  // not whole warps
  EXPECT_FALSE(codegen::validate(k).isOk());
}

}  // namespace
}  // namespace kiln::testing::moe
