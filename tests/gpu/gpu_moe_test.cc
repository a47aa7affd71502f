// The MoE kernels on a GPU (label gpu; every test skips without one): the checks of
// tests/simt/moe_checks.h compiled by NVRTC for the device's arch and run on device buffers,
// and the routed expert layer captured as ONE CUDA graph and replayed after the routing
// changed: the offsets never leave the device, so nothing in the step needs the host.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "codegen/cuda_emitter.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/simt/moe_checks.h"

namespace kiln::testing::moe {
namespace {

#ifdef KILN_HAVE_CUDA_HEADERS

class GpuRun : public MoeRun {
 public:
  GpuRun() {
    auto ctx = cuda::CudaContext::create(0);
    EXPECT_TRUE(ctx) << ctx.status().message();
    if (ctx) ctx_ = ctx.take();
  }
  void run() override { launchAll(false); }
  // The kernels captured into one CUDA graph, replayed `times` times.
  void runCaptured(int times) { launchAll(true, times); }

 protected:
  int addBytes(const void* data, size_t bytes, size_t) override {
    auto b = cuda::DeviceBuffer::allocate(ctx_->driver(), std::max<size_t>(4, bytes), "moe test buffer");
    EXPECT_TRUE(b) << b.status().message();
    if (bytes) EXPECT_TRUE(b->upload(data, bytes).isOk());
    bufs_.push_back(b.take());
    return static_cast<int>(bufs_.size() - 1);
  }
  void getBytes(int buffer, void* out, size_t bytes) override {
    ASSERT_TRUE(bufs_[static_cast<size_t>(buffer)].download(out, bytes).isOk());
  }
  void setBytes(int buffer, const void* data, size_t bytes) override {
    ASSERT_TRUE(bufs_[static_cast<size_t>(buffer)].upload(data, bytes).isOk());
  }

 private:
  void launchAll(bool capture, int times = 1) {
    ASSERT_TRUE(ctx_);
    cuda::CudaDriver* drv = ctx_->driver();
    if (!module_) {
      std::vector<const Kernel*> ks;
      for (const Kernel& k : kernels_) ks.push_back(&k);
      mod_ = codegen::emitModule(ks);
      auto nvrtc = cuda::NvrtcCompiler::create();
      ASSERT_TRUE(nvrtc) << nvrtc.status().message();
      auto cubin = (*nvrtc)->compile(mod_, ctx_->arch());
      ASSERT_TRUE(cubin) << cubin.status().message();
      auto module = cuda::LoadedModule::load(drv, cubin->cubin);
      ASSERT_TRUE(module) << module.status().message();
      module_ = module.take();
      auto stream = cuda::Stream::create(drv);
      ASSERT_TRUE(stream) << stream.status().message();
      stream_ = stream.take();
    }
    auto enqueue = [&]() {
      for (size_t i = 0; i < kernels_.size(); ++i) {
        std::vector<CUdeviceptr> args;
        for (int b : args_[i]) args.push_back(bufs_[static_cast<size_t>(b)].ptr());
        auto fn = module_->function(mod_.kernels[i].name);
        ASSERT_TRUE(fn) << fn.status().message();
        const codegen::LaunchConfig lc = codegen::launchConfig(kernels_[i]);
        Status s =
            cuda::launchKernel(drv, *fn, mod_.kernels[i].name, lc.grid, lc.block, args, stream_->get());
        ASSERT_TRUE(s.isOk()) << s.message();
      }
    };
    if (!capture) {
      enqueue();
    } else {
      if (!graph_) {
        ASSERT_TRUE(cuda::CudaGraph::beginCapture(drv, stream_->get()).isOk());
        enqueue();
        auto g = cuda::CudaGraph::endCapture(drv, stream_->get());
        ASSERT_TRUE(g) << g.status().message();
        graph_ = g.take();
      }
      for (int t = 0; t < times; ++t) ASSERT_TRUE(graph_->launch(stream_->get()).isOk());
    }
    Status done = stream_->synchronize();
    ASSERT_TRUE(done.isOk()) << done.message();
  }

  std::unique_ptr<cuda::CudaContext> ctx_;
  std::vector<cuda::DeviceBuffer> bufs_;
  codegen::CudaModule mod_;
  std::unique_ptr<cuda::LoadedModule> module_;
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<cuda::CudaGraph> graph_;
};

TEST(GpuMoe, TopkAlongAMiddleAxisWithTies) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkTopkAlongAMiddleAxisWithTies(run);
}
TEST(GpuMoe, ZLossAndGradient) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkZLossAndGradient(run);
}
TEST(GpuMoe, ExpertBiasUpdateMovesTowardTheMeanLoad) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkExpertBiasUpdate(run);
}

class GpuRouter : public ::testing::TestWithParam<RouterCase> {};
TEST_P(GpuRouter, ForwardMatchesTheContractAndGradientMatchesFiniteDifferences) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkRouter(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Routing, GpuRouter, ::testing::ValuesIn(routerCases()),
                         [](const ::testing::TestParamInfo<RouterCase>& i) {
                           return std::string(i.param.name);
                         });

class GpuAuxLoss : public ::testing::TestWithParam<std::tuple<bool, int64_t>> {};
TEST_P(GpuAuxLoss, LossAndGradientMatchTheContract) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkAuxLoss(run, std::get<0>(GetParam()), std::get<1>(GetParam()));
}
INSTANTIATE_TEST_SUITE_P(Scores, GpuAuxLoss,
                         ::testing::Combine(::testing::Bool(), ::testing::Values<int64_t>(0, 8)));

class GpuDispatch : public ::testing::TestWithParam<DispatchCase> {};
TEST_P(GpuDispatch, RowsOffsetsAndCountsMatchTheContract) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkDispatch(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Policies, GpuDispatch, ::testing::ValuesIn(dispatchCases()),
                         [](const ::testing::TestParamInfo<DispatchCase>& i) {
                           return std::string(i.param.name);
                         });

class GpuPermute : public ::testing::TestWithParam<bool> {};
TEST_P(GpuPermute, PermuteUnpermuteAndRowDotOverDroppedAndPaddedSlots) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkPermutation(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(DTypes, GpuPermute, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "bf16" : "f32"; });

class GpuGroupedGemm : public ::testing::TestWithParam<GemmCase> {};
TEST_P(GpuGroupedGemm, ForwardAndWeightGradientMatchF64Loops) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkGroupedGemm(run, GetParam());
}
INSTANTIATE_TEST_SUITE_P(Tiles, GpuGroupedGemm, ::testing::ValuesIn(gemmCases()),
                         [](const ::testing::TestParamInfo<GemmCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(GpuMoe, ARoutedExpertLayerReplaysAsOneGraph) {
  SKIP_WITHOUT_GPU();
  GpuRun run;
  checkRoutedLayer(run, [&](int replays) { run.runCaptured(replays); });
}

#else
TEST(GpuMoe, NeedsTheCudaHeaders) { GTEST_SKIP() << "built without the CUDA toolkit's headers"; }
#endif

}  // namespace
}  // namespace kiln::testing::moe
