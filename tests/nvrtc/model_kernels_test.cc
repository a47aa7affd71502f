// Every kernel of the training step of every model in models/ lowers and compiles with NVRTC
// for sm_90, with and without the fusion pass. Models are compiled by the frontend and
// differentiated by the autodiff pass.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "frontend/frontend.h"
#include "passes/pass_manager.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

// The training step's kernels at a small batch (the batch only changes constants), after the
// passes of `pipeline` (autodiff first).
Expected<std::vector<codegen::LoweredGroup>> lowerTrainStep(const std::string& path, const std::string& pipeline,
                                                            std::unique_ptr<ir::Module>& keep) {
  std::ostringstream diag_text;
  frontend::DiagnosticEngine diags(&diag_text);
  auto m = frontend::compileModelFile(path, {}, diags);
  if (!m) return Status::errorf("{}: {}", path, diag_text.str());
  keep = m.take();
  passes::PassManager pm;
  KILN_RETURN_IF_ERROR(pm.addPipeline(pipeline));
  if (auto r = pm.run(*keep); !r) return Status::errorf("autodiff: {}", r.status().message());
  ir::Function* step = keep->lookup("train_step");
  if (!step) return Status::errorf("{}: no @train_step", path);
  return codegen::lowerFunction(*step, {{"B", 64}});
}

constexpr const char* kUnfused = "autodiff,canonicalize,cse,dce";
constexpr const char* kFused = "autodiff,canonicalize,cse,dce,fusion";

// Kernel launches plus cuBLASLt calls: the units of GPU work of one step.
int launches(const std::vector<codegen::LoweredGroup>& groups) {
  int n = 0;
  for (const auto& g : groups) n += static_cast<int>(g.kernels.size()) + (g.gemm != nullptr);
  return n;
}

void compileForSm90(const std::vector<codegen::LoweredGroup>& groups) {
  std::vector<const codegen::Kernel*> kernels;
  for (const auto& g : groups)
    for (const auto& k : g.kernels) kernels.push_back(&k);
  codegen::CudaModule m = codegen::emitModule(kernels);
  std::cerr << m.kernels.size() << " kernels, " << m.source.size() << " bytes of CUDA\n";
  // The build tree's cache: a rebuild's rerun compiles only what changed.
  auto nvrtc = cuda::NvrtcCompiler::create(std::string(KILN_BINARY_DIR) + "/nvrtc-cache");
  if (!nvrtc) GTEST_SKIP() << nvrtc.status().message();
  auto r = (*nvrtc)->compile(m, "sm_90");
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_GT(r->cubin.size(), 1000u);
}

// Whether the model's training step looks up embedding tables (the recommendation models do;
// the MoE layer and the language model do not).
bool looksUpTables(ir::Module& m) {
  bool found = false;
  m.lookup("train_step")->walk([&](ir::Op& op) { found |= op.is(ir::OpCode::EmbeddingBag); });
  return found;
}

class ModelKernels : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelKernels, TrainStepKernelsCompileForSm90) {
  std::unique_ptr<ir::Module> module;
  auto groups = lowerTrainStep(GetParam(), kUnfused, module);
  // The model or its training step not building is the frontend's and autodiff's tests' to
  // report; this test is about the kernels.
  if (!groups && groups.status().message().find(".kiln: ") != std::string::npos) GTEST_SKIP() << groups.status().message();
  if (!groups && groups.status().message().rfind("autodiff: ", 0) == 0) GTEST_SKIP() << groups.status().message();
  ASSERT_TRUE(groups) << groups.status().message();
  int gemms = 0, bags = 0, updates = 0;
  for (const auto& g : *groups) {
    gemms += g.gemm != nullptr;
    for (const auto& k : g.kernels) {
      bags += k.kind == codegen::KernelKind::EmbeddingForward;
      updates += k.name.rfind("embedding_update_", 0) == 0;
    }
  }
  EXPECT_GT(gemms, 0);
  if (looksUpTables(*module)) {
    EXPECT_EQ(bags, 1) << "all tables of the collection pool in one launch";
    EXPECT_GT(updates, 0) << "embedding rows are updated sparsely";
  }
  compileForSm90(*groups);
}

// The fusion pass's groups are what the CUDA backend runs: every fused op becomes one unit of
// work (none of the models' groups needs splitting), and the step needs fewer launches.
TEST_P(ModelKernels, FusedTrainStepCompilesWithFewerLaunches) {
  std::unique_ptr<ir::Module> plain_module, fused_module;
  auto plain = lowerTrainStep(GetParam(), kUnfused, plain_module);
  if (!plain && plain.status().message().find(".kiln: ") != std::string::npos) GTEST_SKIP() << plain.status().message();
  if (!plain && plain.status().message().rfind("autodiff: ", 0) == 0) GTEST_SKIP() << plain.status().message();
  ASSERT_TRUE(plain) << plain.status().message();
  auto fused = lowerTrainStep(GetParam(), kFused, fused_module);
  ASSERT_TRUE(fused) << fused.status().message();
  int fused_groups = 0, epilogues = 0, loose_bag_launches = 0, bag_launches = 0;
  for (const auto& g : *fused) {
    EXPECT_TRUE(g.split_reason.empty()) << g.fused_kind << " group #" << g.fused_index << " split: " << g.split_reason;
    fused_groups += !g.fused_kind.empty();
    epilogues += g.gemm && (g.gemm_call.bias >= 0 || !g.gemm_call.activation.empty());
    int bags = 0;
    for (const auto& k : g.kernels) bags += k.kind == codegen::KernelKind::EmbeddingForward;
    bag_launches += bags;
    if (g.fused_kind == "embedding") {
      // Every bag of the collection (all ops but the concat) in the one lookup kernel.
      EXPECT_EQ(bags, 1);
      ASSERT_FALSE(g.kernels.empty());
      EXPECT_EQ(g.kernels[0].tables.size() + 1, g.ops.size());
    } else {
      loose_bag_launches += bags;
    }
  }
  EXPECT_GT(fused_groups, 0);
  if (looksUpTables(*fused_module)) {
    EXPECT_GT(bag_launches, 0);
  }
  EXPECT_LE(loose_bag_launches, 1) << "bags the fusion pass left alone pool in one launch";
  std::cerr << launches(*plain) << " launches unfused, " << launches(*fused) << " fused (" << epilogues
            << " GEMM epilogues)\n";
  EXPECT_LT(launches(*fused), launches(*plain));
  compileForSm90(*fused);
}

INSTANTIATE_TEST_SUITE_P(Models, ModelKernels, ::testing::ValuesIn(modelFiles()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return fs::path(info.param).stem().string();
                         });

}  // namespace
}  // namespace kiln::testing
