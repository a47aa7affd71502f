// Every kernel of the training step of every model in models/ lowers and compiles with NVRTC
// for sm_90. Models are compiled by the frontend and differentiated by the autodiff pass.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "frontend/frontend.h"
#include "passes/autodiff.h"
#include "runtime/cuda/nvrtc_compiler.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> modelFiles() {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(fs::path(KILN_SOURCE_DIR) / "models"))
    if (e.path().extension() == ".kiln") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

// The training step's kernels at a small batch (the batch only changes constants).
Expected<std::vector<codegen::LoweredGroup>> lowerTrainStep(const std::string& path, std::unique_ptr<ir::Module>& keep) {
  std::ostringstream diag_text;
  frontend::DiagnosticEngine diags(&diag_text);
  auto m = frontend::compileModelFile(path, {}, diags);
  if (!m) return Status::errorf("{}: {}", path, diag_text.str());
  keep = m.take();
  if (Status s = passes::buildTrainStep(*keep); !s.isOk()) return Status::errorf("autodiff: {}", s.message());
  ir::Function* step = keep->lookup("train_step");
  if (!step) return Status::errorf("{}: no @train_step", path);
  return codegen::lowerFunction(*step, {{"B", 64}});
}

class ModelKernels : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelKernels, TrainStepKernelsCompileForSm90) {
  std::unique_ptr<ir::Module> module;
  auto groups = lowerTrainStep(GetParam(), module);
  // The model or its training step not building is the frontend's and autodiff's tests' to
  // report; this test is about the kernels.
  if (!groups && groups.status().message().find(".kiln: ") != std::string::npos) GTEST_SKIP() << groups.status().message();
  if (!groups && groups.status().message().rfind("autodiff: ", 0) == 0) GTEST_SKIP() << groups.status().message();
  // Known gap, open on issue 5: gather's adjoint (DLRM's dot interaction backward) has no CUDA
  // lowering yet. Only this op is excused; any other missing lowering fails.
  if (!groups && groups.status().message().find("'kiln.scatter_add'") != std::string::npos &&
      groups.status().message().find("has no CUDA lowering") != std::string::npos)
    GTEST_SKIP() << groups.status().message();
  ASSERT_TRUE(groups) << groups.status().message();
  std::vector<const codegen::Kernel*> kernels;
  int gemms = 0, bags = 0, updates = 0;
  for (const auto& g : *groups) {
    gemms += g.gemm != nullptr;
    for (const auto& k : g.kernels) {
      kernels.push_back(&k);
      bags += k.kind == codegen::KernelKind::EmbeddingForward;
      updates += k.kind == codegen::KernelKind::EmbeddingAccumulate;
    }
  }
  EXPECT_GT(gemms, 0);
  EXPECT_EQ(bags, 1) << "all tables of the collection pool in one launch";
  EXPECT_GT(updates, 0) << "embedding rows are updated sparsely";
  codegen::CudaModule m = codegen::emitModule(kernels);
  std::cerr << m.kernels.size() << " kernels, " << m.source.size() << " bytes of CUDA\n";
  // The build tree's cache: a rebuild's rerun compiles only what changed.
  auto nvrtc = cuda::NvrtcCompiler::create(std::string(KILN_BINARY_DIR) + "/nvrtc-cache");
  if (!nvrtc) GTEST_SKIP() << nvrtc.status().message();
  auto r = (*nvrtc)->compile(m, "sm_90");
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_GT(r->cubin.size(), 1000u);
}

INSTANTIATE_TEST_SUITE_P(Models, ModelKernels, ::testing::ValuesIn(modelFiles()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return fs::path(info.param).stem().string();
                         });

}  // namespace
}  // namespace kiln::testing
