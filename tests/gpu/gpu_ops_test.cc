// Each op kind on the GPU: the op case's group is lowered, compiled by NVRTC for this GPU and
// launched on device buffers (outputs and temporaries poisoned with NaN / 0xA5 first); every
// value the group writes is compared with the op's CPU reference on the same random inputs.
// GEMMs run through the CudaExecutor (cuBLASLt) against a naive triple loop. Everything here
// skips without a GPU (ctest label `gpu`).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "ir/precision.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/cuda_executor.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tests/nvrtc/op_cases.h"
#include "tests/gpu/gpu_test_util.h"

namespace kiln::testing {
namespace {

#ifdef KILN_HAVE_CUDA_HEADERS

class GpuOps : public ::testing::TestWithParam<int> {};

TEST_P(GpuOps, CudaResultMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  auto prepared = prepareCase(GetParam(), 4321);
  ASSERT_TRUE(prepared) << prepared.status().message();
  const OpCase& c = prepared->c;
  const CaseRun* run = &prepared->run;
  const codegen::LoweredGroup& g = prepared->group;
  SCOPED_TRACE(c.name);
  if (g.gemm) GTEST_SKIP() << "a GEMM: covered by GpuGemm";

  auto ctxr = cuda::CudaContext::create(0);
  ASSERT_TRUE(ctxr) << ctxr.status().message();
  cuda::CudaDriver* drv = (*ctxr)->driver();
  auto nvrtc = cuda::NvrtcCompiler::create();
  ASSERT_TRUE(nvrtc) << nvrtc.status().message();
  std::vector<const codegen::Kernel*> ks;
  for (const codegen::Kernel& k : g.kernels) ks.push_back(&k);
  codegen::CudaModule mod = codegen::emitModule(ks);
  auto cubin = (*nvrtc)->compile(mod, (*ctxr)->arch());
  ASSERT_TRUE(cubin) << cubin.status().message();
  auto module = cuda::LoadedModule::load(drv, cubin->cubin);
  ASSERT_TRUE(module) << module.status().message();

  std::vector<ir::HostTensor> host = groupStorage(g, *run);
  clearErrorFlags(g, host);
  std::vector<cuda::DeviceBuffer> bufs;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const codegen::GroupBuffer& b = g.buffers[i];
    auto d = cuda::DeviceBuffer::allocate(drv, std::max<size_t>(host[i].storage.size(), 4), b.name);
    ASSERT_TRUE(d) << d.status().message();
    if (!host[i].storage.empty()) {
      ASSERT_TRUE(d->upload(host[i].storage.data(), host[i].storage.size()).isOk());
    }
    bufs.push_back(d.take());
  }
  // Address tables, once every buffer has its device address.
  std::vector<uint64_t> address;
  for (const cuda::DeviceBuffer& d : bufs) address.push_back(static_cast<uint64_t>(d.ptr()));
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    if (g.buffers[i].words.empty()) continue;
    std::vector<int64_t> words = codegen::addressTableWords(g.buffers[i], address);
    ASSERT_TRUE(bufs[i].upload(words.data(), words.size() * sizeof(int64_t)).isOk());
  }
  auto stream = cuda::Stream::create(drv);
  ASSERT_TRUE(stream);
  for (size_t k = 0; k < g.kernels.size(); ++k) {
    std::vector<CUdeviceptr> args;
    for (int gb : g.args[k]) args.push_back(bufs[static_cast<size_t>(gb)].ptr());
    auto fn = (*module)->function(mod.kernels[k].name);
    ASSERT_TRUE(fn) << fn.status().message();
    codegen::LaunchConfig lc = codegen::launchConfig(g.kernels[k]);
    Status s = cuda::launchKernel(drv, *fn, mod.kernels[k].name, lc.grid, lc.block, args, (*stream)->get());
    ASSERT_TRUE(s.isOk()) << s.message();
  }
  Status done = (*stream)->synchronize();
  ASSERT_TRUE(done.isOk()) << done.message();

  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const bool flag = g.buffers[i].name == "embedding_errors";
    if ((flag || (g.buffers[i].value && g.buffers[i].written)) && !host[i].storage.empty()) {
      ASSERT_TRUE(bufs[i].download(host[i].storage.data(), host[i].storage.size()).isOk());
    }
  }
  expectNoErrorFlagged(g, host);
  EXPECT_GT(expectGroupMatchesReference(g, host, *run, c.tol, "GPU"), 0);
}

INSTANTIATE_TEST_SUITE_P(AllOps, GpuOps, ::testing::Range(0, static_cast<int>(allOpCases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return allOpCases()[static_cast<size_t>(i.param)].name; });

// C = op(A) op(B) through the executor (cuBLASLt), against a naive loop in double.
struct GemmCase {
  int64_t batch, m, n, k;
  bool ta, tb;
};

class GpuGemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GpuGemm, ExecutorMatmulMatchesNaiveLoop) {
  SKIP_WITHOUT_GPU();
  const GemmCase gc = GetParam();
  ir::Module m;
  ir::Function& f = m.addFunction("f");
  f.body().addBlock();
  ir::Builder b;
  b.setInsertionPointToEnd(f.entry());
  auto shapeOf = [&](int64_t r, int64_t c) {
    ir::Shape s;
    if (gc.batch > 1) s.push_back(Dim::fixed(gc.batch));
    s.push_back(Dim::fixed(r));
    s.push_back(Dim::fixed(c));
    return s;
  };
  auto a = b.createWithTypes("kiln.input", {}, {TensorType(DType::f32, gc.ta ? shapeOf(gc.k, gc.m) : shapeOf(gc.m, gc.k))},
                             {{"name", Attribute("a")}});
  auto bb = b.createWithTypes("kiln.input", {}, {TensorType(DType::f32, gc.tb ? shapeOf(gc.n, gc.k) : shapeOf(gc.k, gc.n))},
                              {{"name", Attribute("b")}});
  ASSERT_TRUE(a && bb);
  auto mm = b.create("kiln.matmul", {(*a)->result(), (*bb)->result()},
                     {{"transpose_a", Attribute(gc.ta)}, {"transpose_b", Attribute(gc.tb)}});
  ASSERT_TRUE(mm) << mm.status().message();
  auto ret = b.createWithTypes("func.return", {(*mm)->result()}, {});
  ASSERT_TRUE(ret) << ret.status().message();
  f.setResultTypes({(*mm)->result()->type()});

  std::mt19937 rng(7);
  auto shapeVec = [&](const ir::Shape& s) {
    std::vector<int64_t> v;
    for (const Dim& d : s) v.push_back(d.size());
    return v;
  };
  ir::HostTensor ha(DType::f32, shapeVec((*a)->result()->type().shape()));
  ir::HostTensor hb(DType::f32, shapeVec((*bb)->result()->type().shape()));
  fillTensor(ha, Fill::Normal, 0, rng);
  fillTensor(hb, Fill::Normal, 0, rng);

  const bool tf32 = ir::allowsTf32(**mm);
  EXPECT_TRUE(tf32);  // f32 inputs, no f32_strict
  auto session = cuda::CudaSession::create();
  ASSERT_TRUE(session) << session.status().message();
  auto ex = cuda::CudaExecutor::create(f, {}, *session);
  ASSERT_TRUE(ex) << ex.status().message();
  EXPECT_EQ((*ex)->numGemms(), 1);
  runtime::cpu::Batch batch{{"a", ha.view}, {"b", hb.view}};
  for (int run = 0; run < 3; ++run) {  // eager, captured, replayed
    auto out = (*ex)->run(batch);
    ASSERT_TRUE(out) << out.status().message();
    const float* A = ha.as<float>();
    const float* B = hb.as<float>();
    const float* C = (*out)[0].as<float>();
    for (int64_t p = 0; p < gc.batch; ++p)
      for (int64_t i = 0; i < gc.m; ++i)
        for (int64_t j = 0; j < gc.n; ++j) {
          double s = 0;
          for (int64_t l = 0; l < gc.k; ++l) {
            double x = gc.ta ? A[p * gc.m * gc.k + l * gc.m + i] : A[p * gc.m * gc.k + i * gc.k + l];
            double y = gc.tb ? B[p * gc.k * gc.n + j * gc.k + l] : B[p * gc.k * gc.n + l * gc.n + j];
            s += x * y;
          }
          // Precision f32 (no train block says otherwise): cuBLASLt runs it in TF32, each input
          // rounded to a 10-bit mantissa (2^-11 relative), so a product of N(0, 1) values is off
          // by about 1e-3 and the sum of K of them by about 1e-3 sqrt(K); exact f32 (f32_strict)
          // stays within f32 rounding of the sum.
          const double tol = tf32 ? 2e-3 : 1e-4;
          ASSERT_NEAR(C[(p * gc.m + i) * gc.n + j], s, tol * (1 + std::fabs(s)) * std::sqrt(double(gc.k)))
              << "run " << run << " batch " << p << " (" << i << ", " << j << ")";
        }
  }
  EXPECT_TRUE((*ex)->graphCaptured());
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuGemm,
                         ::testing::Values(GemmCase{1, 33, 17, 65, false, false}, GemmCase{1, 64, 48, 13, true, false},
                                           GemmCase{1, 31, 40, 96, false, true}, GemmCase{1, 20, 24, 36, true, true},
                                           GemmCase{3, 16, 8, 12, false, false}, GemmCase{2, 9, 11, 7, true, true}));

#endif  // KILN_HAVE_CUDA_HEADERS

TEST(GpuAvailability, ExecutorFailsCleanlyWithoutAGpu) {
  std::string why;
  if (cuda::cudaAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  auto s = cuda::CudaSession::create();
  ASSERT_FALSE(s);
  EXPECT_FALSE(s.status().message().empty());
}

}  // namespace
}  // namespace kiln::testing
