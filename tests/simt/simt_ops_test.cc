// The generated CUDA source of each op kind, run on the host (simt): the op case's group is
// lowered, printed as CUDA, compiled by the host compiler with simt_prelude.h and launched over
// guarded host buffers (outputs and temporaries poisoned first); every value the group writes
// is compared with the op's CPU reference. This is gpu_ops_test without the GPU: it executes
// the emitted text (indexing, barriers, shuffles, atomics, launch shapes) where the kernel
// semantics test executes only the kernel IR.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "tests/nvrtc/op_cases.h"
#include "tests/simt/host_module.h"

namespace kiln::testing {
namespace {

// Every op case's kernels in one module, compiled once (cached across the test processes).
const simt::HostModule& allCasesModule() {
  static std::unique_ptr<simt::HostModule> module = [] {
    std::vector<OpCase> cases = allOpCases();
    std::vector<codegen::LoweredGroup> groups;
    for (const OpCase& c : cases) {
      auto g = codegen::lowerGroup(c.group, c.symbols);
      if (g) groups.push_back(g.take());
    }
    std::vector<const codegen::Kernel*> kernels;
    for (const codegen::LoweredGroup& g : groups)
      for (const codegen::Kernel& k : g.kernels) kernels.push_back(&k);
    auto m = simt::HostModule::compile(codegen::emitModule(kernels));
    if (!m) ADD_FAILURE() << m.status().message();
    return m ? m.take() : nullptr;
  }();
  return *module;
}

class SimtOps : public ::testing::TestWithParam<int> {};

TEST_P(SimtOps, EmittedCudaMatchesCpuReference) {
  auto prepared = prepareCase(GetParam(), 4321);
  ASSERT_TRUE(prepared) << prepared.status().message();
  const OpCase& c = prepared->c;
  const CaseRun* run = &prepared->run;
  const codegen::LoweredGroup& g = prepared->group;
  SCOPED_TRACE(c.name);
  if (g.gemm) GTEST_SKIP() << "a GEMM: cuBLASLt's, not generated";
  const simt::HostModule& module = allCasesModule();

  std::vector<ir::HostTensor> host = groupStorage(g, *run);
  clearErrorFlags(g, host);
  std::vector<simt::GuardedBuffer> bufs;
  std::vector<uint64_t> address;
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    auto b = simt::GuardedBuffer::allocate(host[i].storage.size(), ir::dtypeBytes(g.buffers[i].dtype));
    ASSERT_TRUE(b) << b.status().message();
    if (!host[i].storage.empty()) std::memcpy(b->data(), host[i].storage.data(), host[i].storage.size());
    address.push_back(reinterpret_cast<uint64_t>(b->data()));
    bufs.push_back(b.take());
  }
  fillAddressTables(g, address);
  for (size_t k = 0; k < g.kernels.size(); ++k) {
    std::string name;
    codegen::emitKernel(g.kernels[k], &name);
    std::vector<void*> args;
    for (int gb : g.args[k]) args.push_back(bufs[static_cast<size_t>(gb)].data());
    Status s = module.launch(name, codegen::launchConfig(g.kernels[k]), args);
    ASSERT_TRUE(s.isOk()) << s.message();
  }
  for (size_t i = 0; i < g.buffers.size(); ++i)
    if (!host[i].storage.empty()) std::memcpy(host[i].storage.data(), bufs[i].data(), host[i].storage.size());
  expectNoErrorFlagged(g, host);
  EXPECT_GT(expectGroupMatchesReference(g, host, *run, c.tol, "simt"), 0);
}

INSTANTIATE_TEST_SUITE_P(AllOps, SimtOps, ::testing::Range(0, static_cast<int>(allOpCases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return allOpCases()[static_cast<size_t>(i.param)].name; });

// The emulator itself: what it must run, and the mistakes it must catch.
codegen::CudaModule handWritten(const std::string& kernel, const std::string& body) {
  codegen::CudaModule m;
  m.source = codegen::cudaPrelude() + "\nextern \"C\" __global__ void " + kernel + body + "\n";
  m.kernels.push_back({kernel, {}, 0, 0});
  return m;
}

TEST(Simt, BlockReduceAndScanAcrossWarps) {
  // The prelude's block reduction (shuffles + shared scratch) and the jagged-offsets scan, with
  // a block of 96 threads over 200 values: sums known in closed form.
  auto m = simt::HostModule::compile(handWritten(
      "simt_reduce_scan", R"((const float* x, float* sum, const int* len, long long* off, int* err) {
  __shared__ float scratch[32];
  float acc = 0.0f;
  for (int i = threadIdx.x; i < 200; i += blockDim.x) acc += x[i];
  const float s = kiln_block_reduce<float, kiln_fn::SumCombiner>(acc, scratch);
  if (threadIdx.x == 0) sum[blockIdx.x] = s;
  kiln_bag_offsets(len, off + blockIdx.x * 201, 200LL, 1000000LL, err, 0);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(200);
  std::vector<int> len(200);
  for (int i = 0; i < 200; ++i) x[static_cast<size_t>(i)] = static_cast<float>(i), len[static_cast<size_t>(i)] = i % 7;
  std::vector<float> sum(2, -1);
  std::vector<long long> off(2 * 201, -1);
  int err[2] = {0, 0};
  ASSERT_TRUE((*m)->launch("simt_reduce_scan", {2, 96}, {x.data(), sum.data(), len.data(), off.data(), err}).isOk());
  EXPECT_EQ(sum[0], 199 * 200 / 2);
  EXPECT_EQ(sum[1], 199 * 200 / 2);
  long long want = 0;
  for (int b = 0; b < 200; ++b) {
    ASSERT_EQ(off[static_cast<size_t>(b)], want) << b;
    ASSERT_EQ(off[201 + static_cast<size_t>(b)], want) << b;
    want += b % 7;
  }
  EXPECT_EQ(off[200], want);
  EXPECT_EQ(err[0], 0);
}

TEST(Simt, BarrierNotEveryThreadReachesIsADeadlock) {
  // Lane 0 waits at __syncthreads for lanes that wait at a shuffle for lane 0: a GPU hangs.
  auto m = simt::HostModule::compile(handWritten("simt_divergent", R"((float* x) {
  if (threadIdx.x == 0) __syncthreads();
  else x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(32);
  Status s = (*m)->launch("simt_divergent", {1, 32}, {x.data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("simt_divergent"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("deadlock"), std::string::npos) << s.message();
}

TEST(Simt, AMissingBarrierShowsInTheResults) {
  // Thread 0 publishes a value in shared memory; the others read it, once without a barrier in
  // between and once with one. Threads run in a shuffled order, so without the barrier some
  // read before thread 0 wrote, as they may on a GPU.
  auto m = simt::HostModule::compile(handWritten("simt_publish", R"((float* racy, float* synced) {
  __shared__ float value;
  if (threadIdx.x == 0) value = 1.0f + blockIdx.x;
  racy[blockIdx.x * blockDim.x + threadIdx.x] = value;
  __syncthreads();
  synced[blockIdx.x * blockDim.x + threadIdx.x] = value;
  __syncthreads();
  if (threadIdx.x == 0) value = 0.0f;
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> racy(4 * 64), synced(4 * 64);
  ASSERT_TRUE((*m)->launch("simt_publish", {4, 64}, {racy.data(), synced.data()}).isOk());
  int stale = 0;
  for (size_t i = 0; i < racy.size(); ++i) {
    const float want = 1.0f + static_cast<float>(i / 64);
    EXPECT_EQ(synced[i], want) << i;
    stale += racy[i] != want;
  }
  EXPECT_GT(stale, 0) << "every thread read after thread 0 wrote: threads ran in index order";
}

TEST(Simt, ShuffleWithAnExitedLaneIsAnError) {
  auto m = simt::HostModule::compile(handWritten("simt_exited_lane", R"((float* x) {
  if (threadIdx.x == 5) return;
  x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
})"));
  ASSERT_TRUE(m) << m.status().message();
  std::vector<float> x(32);
  Status s = (*m)->launch("simt_exited_lane", {1, 32}, {x.data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("exited"), std::string::npos) << s.message();
}

TEST(Simt, WriteOnePastTheEndIsAFaultNamingTheKernel) {
  auto m = simt::HostModule::compile(handWritten("simt_overrun", R"((float* x) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i <= 1000; i += (long long)gridDim.x * blockDim.x)
    x[i] = 2.0f;
})"));
  ASSERT_TRUE(m) << m.status().message();
  auto buf = simt::GuardedBuffer::allocate(1000 * sizeof(float), sizeof(float));
  ASSERT_TRUE(buf);
  Status s = (*m)->launch("simt_overrun", {4, 256}, {buf->data()});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("simt_overrun"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("memory access fault"), std::string::npos) << s.message();
  // The process is unharmed: a correct launch afterwards succeeds.
  auto ok = simt::GuardedBuffer::allocate(1001 * sizeof(float), sizeof(float));
  ASSERT_TRUE(ok);
  EXPECT_TRUE((*m)->launch("simt_overrun", {4, 256}, {ok->data()}).isOk());
}

TEST(Simt, CompileErrorCarriesTheCompilerOutput) {
  auto m = simt::HostModule::compile(handWritten("simt_bad", "(float* x) { x[0] = undeclared_name; }"));
  ASSERT_FALSE(m);
  EXPECT_NE(m.status().message().find("undeclared_name"), std::string::npos) << m.status().message();
}

}  // namespace
}  // namespace kiln::testing
