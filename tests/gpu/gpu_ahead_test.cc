// Executors run from kernels compiled ahead of time (compileKernelsAhead, then
// CudaExecutorOptions::kernels): a training step equals the JIT executor's, from the GPU's CUBIN
// and from PTX alone (the driver compiles it), and a process that runs only from a serialized set
// never loads NVRTC. A set without the executor's kernels is a clear error. Skips without a GPU
// (ctest label `gpu`).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "runtime/cuda/ahead_compile.h"
#include "runtime/cuda/cuda_driver.h"
#include "runtime/cuda/cuda_executor.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/model_compare.h"
#include "tools/session_flags.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kBatch = 128;
const ModelCase kModel{"dlrm", ""};

// What one training step from given parameters gives: its results and the parameters after.
struct StepResult {
  std::vector<ir::HostTensor> results;
  runtime::ParameterStore params;
  int compiled = 0, modules = 0;  // the executor's NVRTC programs compiled, modules loaded
};

Expected<StepResult> runStep(const std::shared_ptr<cuda::CudaSession>& session, const ir::Function& f,
                             const runtime::ParameterStore& initial, const data::Batch& batch,
                             const cuda::CudaExecutorOptions& options) {
  KILN_RETURN_IF_ERROR(session->uploadParameters(initial));
  KILN_ASSIGN_OR_RETURN(auto exec, cuda::CudaExecutor::create(f, {{"B", kBatch}}, session, options));
  const driver::StepInputs inputs(batch, {{"lr", 1.0f}, {"step", 1.0f}});
  StepResult out;
  KILN_ASSIGN_OR_RETURN(out.results, exec->run(inputs.views()));
  out.compiled = exec->kernelsCompiled();
  out.modules = exec->modulesLoaded();
  out.params = initial;
  KILN_RETURN_IF_ERROR(session->downloadParameters(out.params));
  return out;
}

// A scratch folder removed afterwards.
struct TempDir {
  fs::path path = fs::temp_directory_path() / ("kiln-gpu-ahead-" + std::to_string(getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

void expectSameStep(const StepResult& got, const StepResult& want, const std::string& what,
                    bool exact_results) {
  ASSERT_EQ(got.results.size(), want.results.size()) << what;
  for (size_t i = 0; i < want.results.size(); ++i) {
    if (exact_results) {
      EXPECT_EQ(got.results[i].storage, want.results[i].storage) << what << ": result " << i << " differs";
    } else {
      TensorDiff d = compareTensors(got.results[i], want.results[i], 1e-5);
      EXPECT_LE(d.off, d.allowed()) << what << ": result " << i << ": " << d.str();
    }
  }
  // Embedding gradients are summed with float atomics, whose order varies from run to run: the
  // parameters agree to rounding, not bit for bit.
  for (const std::string& name : want.params.names()) {
    const ir::HostTensor* w = want.params.find(name);
    const ir::HostTensor* g = got.params.find(name);
    ASSERT_TRUE(w && g) << name;
    TensorDiff d = compareTensors(*g, *w, 1e-5);
    EXPECT_LE(d.off, d.allowed()) << what << ": " << name << ": " << d.str();
  }
}

class GpuAhead : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    model_ = makeSession(kModel, kBatch, "2000", "cuda");
    ASSERT_TRUE(model_);
    step_ = model_->module().lookup("train_step");
    ASSERT_NE(step_, nullptr);
    initial_ = model_->params();
    std::vector<data::Batch> bs = syntheticBatches(*model_, kBatch, 1);
    ASSERT_EQ(bs.size(), 1u);
    batch_ = std::move(bs[0]);
    cuda::CudaSessionOptions so;
    so.cache_dir = (dir_.path / "cache").string();
    auto s = cuda::CudaSession::create(so);
    ASSERT_TRUE(s) << s.status().message();
    session_ = s.take();
  }

  Expected<cuda::KernelSet> compileAhead(bool cubin, bool ptx) {
    cuda::AheadOptions o;
    const std::string arch = session_->arch();
    o.archs = {arch};
    o.ptx = ptx;
    KILN_ASSIGN_OR_RETURN(cuda::KernelSet set, cuda::compileKernelsAhead(*step_, {{"B", kBatch}}, o));
    if (!cubin) std::erase_if(set.images, [](const cuda::KernelImage& im) { return !im.isPtx(); });
    return set;
  }

  TempDir dir_;
  std::unique_ptr<driver::Session> model_;
  const ir::Function* step_ = nullptr;
  runtime::ParameterStore initial_;
  data::Batch batch_;
  std::shared_ptr<cuda::CudaSession> session_;
};

TEST_F(GpuAhead, CubinSetRunsLikeJit) {
  auto set = compileAhead(/*cubin=*/true, /*ptx=*/false);
  ASSERT_TRUE(set) << set.status().message();
  auto jit = runStep(session_, *step_, initial_, batch_, {});
  ASSERT_TRUE(jit) << jit.status().message();
  cuda::CudaExecutorOptions o;
  o.kernels = &*set;
  auto ahead = runStep(session_, *step_, initial_, batch_, o);
  ASSERT_TRUE(ahead) << ahead.status().message();
  expectSameStep(*ahead, *jit, "from the CUBIN set", /*exact_results=*/true);
  EXPECT_GT(jit->compiled, 0);  // a fresh cache folder: NVRTC ran, on several programs
  EXPECT_GT(jit->modules, 1);
  EXPECT_EQ(ahead->compiled, 0);
  EXPECT_GT(ahead->modules, 0);
}

TEST_F(GpuAhead, PtxOnlySetRunsLikeJit) {
  auto set = compileAhead(/*cubin=*/false, /*ptx=*/true);
  ASSERT_TRUE(set) << set.status().message();
  ASSERT_FALSE(set->images.empty());
  auto jit = runStep(session_, *step_, initial_, batch_, {});
  ASSERT_TRUE(jit) << jit.status().message();
  cuda::CudaExecutorOptions o;
  o.kernels = &*set;
  auto ahead = runStep(session_, *step_, initial_, batch_, o);
  ASSERT_TRUE(ahead) << ahead.status().message();
  // The driver's PTX compile may schedule differently from NVRTC's: agree to rounding.
  expectSameStep(*ahead, *jit, "from PTX", /*exact_results=*/false);
}

TEST_F(GpuAhead, SetWithoutTheKernelsIsAClearError) {
  cuda::KernelSet empty;
  empty.images.push_back({session_->arch(), {"kiln_other_0000000000000000"}, "not loaded"});
  cuda::CudaExecutorOptions o;
  o.kernels = &empty;
  auto r = runStep(session_, *step_, initial_, batch_, o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("the compiled kernels have no 'kiln_"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("B=128"), std::string::npos) << r.status().message();
}

// The child half of the next test: runs a step from the serialized set in $KILN_AHEAD_SET and
// writes its loss bytes and what /proc/self/maps says about NVRTC to $KILN_AHEAD_OUT.
TEST_F(GpuAhead, ChildRunsFromSerializedSet) {
  const char* set_path = std::getenv("KILN_AHEAD_SET");
  const char* out_path = std::getenv("KILN_AHEAD_OUT");
  if (!set_path || !out_path) GTEST_SKIP() << "run by RunFromSetNeverLoadsNvrtc in a process of its own";
  std::ifstream in(set_path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto set = cuda::KernelSet::deserialize(bytes, set_path);
  ASSERT_TRUE(set) << set.status().message();
  cuda::CudaExecutorOptions o;
  o.kernels = &*set;
  auto ahead = runStep(session_, *step_, initial_, batch_, o);
  ASSERT_TRUE(ahead) << ahead.status().message();
  std::ifstream maps("/proc/self/maps");
  std::string line, nvrtc;
  while (std::getline(maps, line))
    if (line.find("libnvrtc") != std::string::npos) nvrtc = line;
  std::ofstream out(out_path, std::ios::binary);
  const std::vector<unsigned char>& loss = ahead->results.at(0).storage;
  out << (nvrtc.empty() ? "no nvrtc" : "nvrtc: " + nvrtc) << '\n';
  out.write(reinterpret_cast<const char*>(loss.data()), static_cast<std::streamsize>(loss.size()));
}

TEST_F(GpuAhead, RunFromSetNeverLoadsNvrtc) {
  if (std::getenv("KILN_AHEAD_SET")) GTEST_SKIP() << "the child";
  auto set = compileAhead(/*cubin=*/true, /*ptx=*/true);
  ASSERT_TRUE(set) << set.status().message();
  const fs::path set_file = dir_.path / "kernels.kset", out_file = dir_.path / "child.out";
  std::ofstream(set_file, std::ios::binary) << set->serialize();
  auto jit = runStep(session_, *step_, initial_, batch_, {});
  ASSERT_TRUE(jit) << jit.status().message();

  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string cmd = "KILN_AHEAD_SET='" + set_file.string() + "' KILN_AHEAD_OUT='" + out_file.string() +
                          "' '" + self + "' --gtest_filter=GpuAhead.ChildRunsFromSerializedSet > '" +
                          (dir_.path / "child.log").string() + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir_.path / "child.log");
  const std::string log_text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << log_text;
  std::ifstream out(out_file, std::ios::binary);
  ASSERT_TRUE(out) << "the child wrote nothing:\n" << log_text;
  std::string first;
  std::getline(out, first);
  EXPECT_EQ(first, "no nvrtc");
  const std::string loss((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  const std::vector<unsigned char>& want = jit->results.at(0).storage;
  EXPECT_EQ(loss, std::string(want.begin(), want.end()))
      << "the child's loss differs from the JIT executor's";
}

}  // namespace
}  // namespace kiln::testing
