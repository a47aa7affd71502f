// Every MoE kernel (codegen/emit/moe.h) compiles with NVRTC for sm_90, at the simt tests' small
// shapes and at production ones (DeepSeek-V3's 256 experts in 8 groups, Mixtral's 8 of top 2,
// 64-expert capacity dispatch, grouped GEMMs of thousands of rows), within the static shared
// memory an sm_90 block may declare without opting in (48 KiB).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "codegen/cuda_emitter.h"
#include "codegen/emit/moe.h"
#include "runtime/cuda/nvrtc_compiler.h"

namespace kiln::testing {
namespace {

using codegen::DType;
using codegen::Kernel;
namespace emit = codegen::emit;
namespace fs = std::filesystem;

std::vector<Kernel> moeKernels(int64_t tokens, int64_t experts, int64_t topk, int64_t hidden) {
  std::vector<Kernel> ks;
  auto append = [&](std::vector<Kernel> more) {
    for (Kernel& k : more) ks.push_back(std::move(k));
  };
  ks.push_back(emit::topkKernel(DType::f32, tokens, experts, 1, topk));
  ks.push_back(emit::topkKernel(DType::bf16, 4, 300, 7, 3));
  for (bool sigmoid : {false, true})
    for (bool pre : {false, true}) {
      emit::RouterShape r;
      r.tokens = tokens, r.experts = experts, r.topk = topk, r.sigmoid = sigmoid, r.pre_softmax = pre;
      r.bias = sigmoid;
      r.scale = 2.5;
      if (sigmoid && pre) r.groups = 8, r.group_topk = 4;  // DeepSeek-V3's node-limited routing
      ks.push_back(emit::routerKernel(r));
      ks.push_back(emit::routerGradKernel(r));
      emit::AuxLossShape a{tokens, experts, topk, pre ? tokens / 4 : 0, sigmoid, 0.01};
      append(emit::auxLossKernels(a));
      append(emit::auxLossGradKernels(a));
    }
  ks.push_back(emit::zLossKernel(tokens, experts, 1e-3));
  ks.push_back(emit::zLossGradKernel(tokens, experts, 1e-3));
  const int64_t capacity = emit::expertCapacity(tokens, topk, experts, 1.25);
  for (bool by_probs : {false, true})
    for (bool pad : {false, true})
      append(emit::dispatchKernels({tokens, experts, topk, pad || by_probs ? capacity : 0, by_probs, pad,
                                    pad ? experts * capacity : tokens * topk}));
  const int64_t rows = tokens * topk;
  for (DType t : {DType::f32, DType::bf16}) {
    ks.push_back(emit::permuteKernel(t, tokens, topk, hidden, rows, true));
    append(emit::unpermuteKernels(t, tokens, topk, hidden, rows, true));
    append(emit::rowDotKernels(t, t, tokens, topk, hidden, rows));
    for (bool transpose : {false, true}) {
      ks.push_back(emit::groupedMatmulKernel({t, rows, hidden, 4 * hidden, experts, transpose}));
      ks.push_back(emit::groupedWgradKernel({t, rows, hidden, 4 * hidden, experts, transpose}));
    }
  }
  ks.push_back(emit::expertBiasUpdateKernel(experts, 1e-3));
  return ks;
}

void expectCompiles(const std::vector<Kernel>& ks) {
  for (const Kernel& k : ks) ASSERT_TRUE(codegen::validate(k).isOk()) << codegen::validate(k).message();
  std::vector<const Kernel*> ptrs;
  for (const Kernel& k : ks) ptrs.push_back(&k);
  const fs::path dir = fs::temp_directory_path() / ("kiln-moe-nvrtc-" + std::to_string(getpid()));
  auto nvrtc = cuda::NvrtcCompiler::create(dir.string());
  if (!nvrtc) GTEST_SKIP() << nvrtc.status().message();
  auto r = (*nvrtc)->compile(codegen::emitModule(ptrs), "sm_90");
  fs::remove_all(dir);
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_EQ(std::string(r->cubin.data() + 1, 3), "ELF");
}

TEST(MoeNvrtc, SmallShapesCompileForSm90) { expectCompiles(moeKernels(37, 40, 4, 37)); }

TEST(MoeNvrtc, ProductionShapesCompileForSm90) {
  expectCompiles(moeKernels(8192, 256, 8, 2048));
  expectCompiles(moeKernels(4096, 8, 2, 4096));
}

// The tensor-core grouped GEMMs are written for two 256-thread blocks per SM (mmaTile): ptxas
// must fit each thread in 128 registers without spilling, and a block's three stages in the
// 48 KiB of static shared memory, at aligned (cp.async) and unaligned (register copy) shapes,
// for the A100 and the H100/H200. Unrolling the stage's two halves, for one, spills 160-260
// bytes per thread here.
TEST(MoeNvrtc, TensorCoreGemmsFitTwoBlocksPerSm) {
  std::vector<Kernel> ks;
  for (int64_t k : {4096, 2048 + 3})
    for (bool transpose : {false, true}) {
      ks.push_back(emit::groupedMatmulKernel({DType::bf16, 16384, k, 1792, 8, transpose}));
      ks.push_back(emit::groupedWgradKernel({DType::bf16, 16384, k, 1792 + 5, 8, transpose}));
    }
  std::vector<const Kernel*> ptrs;
  for (const Kernel& k : ks) ptrs.push_back(&k);
  auto nvrtc = cuda::NvrtcCompiler::create("");
  if (!nvrtc) GTEST_SKIP() << nvrtc.status().message();
  const codegen::CudaModule module = codegen::emitModule(ptrs);
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto usage = (*nvrtc)->resourceUsage(module, arch);
    ASSERT_TRUE(usage) << usage.status().message();
    int checked = 0;
    for (const cuda::KernelResources& r : *usage) {
      if (r.name.find("bf16_mma") == std::string::npos) continue;
      ++checked;
      const std::string what = r.name + " for " + arch;
      EXPECT_LE(r.registers * 256 * 2, 65536) << what << ": " << r.registers << " registers";
      EXPECT_GT(r.registers, 0) << what;
      EXPECT_EQ(r.spill_bytes, 0) << what;
      EXPECT_LE(r.shared_bytes, 48 * 1024) << what;
      EXPECT_GE(r.shared_bytes, 3 * 2 * 128 * 32 * 2) << what << ": three stages of two 128x32 bf16 tiles";
    }
    EXPECT_EQ(checked, 8) << "kernels reported for " << arch;
  }
}

}  // namespace
}  // namespace kiln::testing
