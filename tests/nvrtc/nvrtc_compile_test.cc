// Every kernel the CUDA backend generates compiles with NVRTC for sm_90 (the H200), the
// on-disk cache makes a second compile free, and generated source is deterministic. NVRTC
// needs no GPU: this runs in CI on CPU-only machines.
#include <gtest/gtest.h>

#include <fstream>

#include <unistd.h>

#include <filesystem>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "runtime/cuda/nvrtc_compiler.h"
#include "tests/nvrtc/embedding_update_groups.h"
#include "tests/nvrtc/op_cases.h"

namespace kiln::testing {
namespace {

namespace fs = std::filesystem;

// A fresh cache directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("kiln-nvrtc-test-" + std::to_string(getpid()) + "-" + std::to_string(counter_++));
    fs::remove_all(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::unique_ptr<cuda::NvrtcCompiler> compilerOrSkip(const std::string& cache_dir, std::string* why) {
  auto c = cuda::NvrtcCompiler::create(cache_dir);
  if (!c) {
    *why = c.status().message();
    return nullptr;
  }
  return c.take();
}

#define NVRTC_OR_SKIP(var, dir)                          \
  std::string why_##var;                                 \
  auto var = compilerOrSkip(dir, &why_##var);            \
  if (!var) GTEST_SKIP() << why_##var;

// All kernels of every op case, in one module.
codegen::CudaModule allKernelsModule(std::vector<OpCase>& cases, std::vector<codegen::LoweredGroup>& keep) {
  for (OpCase& c : cases) {
    auto g = codegen::lowerGroup(c.group, c.symbols);
    EXPECT_TRUE(g) << c.name << ": " << g.status().message();
    if (g) keep.push_back(g.take());
  }
  std::vector<const codegen::Kernel*> ks;
  for (const auto& g : keep)
    for (const auto& k : g.kernels) ks.push_back(&k);
  return codegen::emitModule(ks);
}

TEST(Nvrtc, EveryOpKernelCompilesForSm90) {
  TempDir dir;
  NVRTC_OR_SKIP(nvrtc, dir.str());
  std::vector<OpCase> cases = allOpCases();
  std::vector<codegen::LoweredGroup> groups;
  codegen::CudaModule m = allKernelsModule(cases, groups);
  ASSERT_GT(m.kernels.size(), cases.size());
  auto r = nvrtc->compile(m, "sm_90");
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_FALSE(r->from_cache);
  EXPECT_GT(r->cubin.size(), 1000u);
  // A CUBIN is an ELF image.
  EXPECT_EQ(std::string(r->cubin.data() + 1, 3), "ELF");
  EXPECT_EQ(nvrtc->compilations(), 1);
}

// 1,100 tables in one embedding update group: the sorted backward's kernels, the row updates
// included, take a handful of parameters, far under CUDA's 4 KB, and compile for the A100 and
// the H100/H200. (The hash-table backward passed 4 KB near 170 tables.) All tables step with
// one sgd: ONE fused update launch for the 1,100.
TEST(Nvrtc, EmbeddingBackwardOfElevenHundredTablesCompiles) {
  std::vector<UpdateTable> tables;
  for (int i = 0; i < 1100; ++i) tables.push_back({3 + i % 7, 4 + i % 3, i % 2 ? DType::i32 : DType::i64, 2, 0, 3, false, false, "sgd"});
  OpCase c = updateGroup("many_tables", 4, tables);
  auto g = codegen::lowerFusedGroup("embedding_update", c.group, c.symbols);
  ASSERT_TRUE(g) << g.status().message();
  std::vector<const codegen::Kernel*> backward;
  int updates = 0;
  for (const codegen::Kernel& k : g->kernels) {
    EXPECT_EQ(k.kind, codegen::KernelKind::Source) << k.name;
    EXPECT_LE(k.buffers.size(), 8u) << k.name;
    updates += k.name == "embedding_update_sgd";
    backward.push_back(&k);
  }
  EXPECT_EQ(updates, 1);
  TempDir dir;
  NVRTC_OR_SKIP(nvrtc, dir.str());
  codegen::CudaModule m = codegen::emitModule(backward);
  for (const char* arch : {"sm_80", "sm_90"}) {
    auto r = nvrtc->compile(m, arch);
    ASSERT_TRUE(r) << arch << ": " << r.status().message();
    EXPECT_GT(r->cubin.size(), 1000u);
  }
}

TEST(Nvrtc, SecondCompileIsACacheHit) {
  TempDir dir;
  std::vector<OpCase> cases = allOpCases();
  cases.resize(6);
  std::vector<codegen::LoweredGroup> groups;
  codegen::CudaModule m = allKernelsModule(cases, groups);
  std::vector<char> first;
  {
    NVRTC_OR_SKIP(nvrtc, dir.str());
    auto r = nvrtc->compile(m, "sm_90");
    ASSERT_TRUE(r) << r.status().message();
    first = r->cubin;
    EXPECT_TRUE(fs::exists(r->cache_file));
  }
  // A new compiler (as in a second run of kiln) finds it and compiles nothing.
  NVRTC_OR_SKIP(again, dir.str());
  auto r = again->compile(m, "sm_90");
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_TRUE(r->from_cache);
  EXPECT_EQ(again->compilations(), 0);
  EXPECT_EQ(again->cacheHits(), 1);
  EXPECT_EQ(r->cubin, first);
  // Another architecture is another entry; no temporary files are left behind.
  auto other = again->compile(m, "sm_80");
  ASSERT_TRUE(other) << other.status().message();
  EXPECT_FALSE(other->from_cache);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.str())) {
    EXPECT_EQ(e.path().extension(), ".cubin") << e.path();
    ++files;
  }
  EXPECT_EQ(files, 2);
}

TEST(Nvrtc, UnwritableCacheStillCompiles) {
  // The cache folder cannot be created (its parent is a file): the kernels still compile, and
  // the next run compiles again.
  TempDir dir;
  const std::string file = dir.str() + "/not-a-folder";
  fs::create_directories(dir.str());
  { std::ofstream(file) << "x"; }
  ASSERT_TRUE(fs::is_regular_file(file));
  std::vector<OpCase> cases = allOpCases();
  cases.resize(2);
  std::vector<codegen::LoweredGroup> groups;
  codegen::CudaModule m = allKernelsModule(cases, groups);
  NVRTC_OR_SKIP(nvrtc, file + "/cache");
  auto r = nvrtc->compile(m, "sm_90");
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_FALSE(r->cubin.empty());
  EXPECT_FALSE(r->from_cache);
  EXPECT_FALSE(fs::exists(file + "/cache"));
}

TEST(Nvrtc, CompileErrorNamesTheKernel) {
  TempDir dir;
  NVRTC_OR_SKIP(nvrtc, dir.str());
  std::vector<OpCase> cases = allOpCases();
  cases.resize(2);
  std::vector<codegen::LoweredGroup> groups;
  codegen::CudaModule m = allKernelsModule(cases, groups);
  // Break the second kernel's body.
  const codegen::EmittedKernel& victim = m.kernels.back();
  size_t at = m.source.find(victim.name + "(");
  ASSERT_NE(at, std::string::npos);
  size_t body = m.source.find("{\n", at);
  m.source.insert(body + 2, "  this_is_not_cuda;\n");
  auto r = nvrtc->compile(m, "sm_90");
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find(victim.name), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("this_is_not_cuda"), std::string::npos) << r.status().message();
}

TEST(Nvrtc, BadArchitectureIsRejected) {
  EXPECT_FALSE(cuda::checkGpuArch("sm90").isOk());
  EXPECT_FALSE(cuda::checkGpuArch("compute_90").isOk());
  EXPECT_TRUE(cuda::checkGpuArch("sm_90").isOk());
  EXPECT_TRUE(cuda::checkGpuArch("sm_90a").isOk());
}

TEST(CudaEmitter, SourceIsDeterministicAndNamesCarryAContentHash) {
  std::vector<OpCase> a = allOpCases(), b = allOpCases();
  std::vector<codegen::LoweredGroup> ga, gb;
  codegen::CudaModule ma = allKernelsModule(a, ga), mb = allKernelsModule(b, gb);
  EXPECT_EQ(ma.source, mb.source);
  for (const auto& k : ma.kernels) {
    EXPECT_EQ(k.name.rfind("kiln_", 0), 0u) << k.name;
    EXPECT_EQ(k.name.size() - k.name.rfind('_') - 1, 16u) << k.name;
  }
  // No host code and no includes: NVRTC compiles it without the toolkit's include directory.
  EXPECT_EQ(ma.source.find("#include"), std::string::npos);
  EXPECT_EQ(ma.source.find("__host__"), std::string::npos);
  // Different kernels get different names.
  std::set<std::string> names;
  for (const auto& k : ma.kernels) names.insert(k.name);
  EXPECT_GT(names.size(), a.size() / 2);
}

TEST(CudaEmitter, LaunchConfigurations) {
  codegen::Kernel k;
  k.kind = codegen::KernelKind::Pointwise;
  k.space = {1000};
  EXPECT_EQ(codegen::launchConfig(k), (codegen::LaunchConfig{4, 256}));
  k.kind = codegen::KernelKind::Row;
  k.space = {16};
  k.row_space = {100};
  EXPECT_EQ(codegen::launchConfig(k), (codegen::LaunchConfig{16, 128}));
  k.space = {1};
  k.row_space = {100000};
  EXPECT_EQ(codegen::launchConfig(k), (codegen::LaunchConfig{1, 1024}));
  k.kind = codegen::KernelKind::EmbeddingForward;
  k.batch = 100;
  k.tables.resize(3);
  EXPECT_EQ(codegen::launchConfig(k), (codegen::LaunchConfig{38, 256}));  // 300 warps, 8 a block
}

// Grid-stride kernels launch at most four full waves of the GPU they were lowered for: its SMs x
// the blocks an SM holds by threads (2048 a SM). An H200 (132 SMs) and an A100 (108) differ; a
// kernel whose work needs fewer blocks gets only those.
TEST(CudaEmitter, GridsAreWholeWavesOfTheTargetsSms) {
  const int h200 = 132, a100 = 108;
  EXPECT_EQ(codegen::gridSms(h200Target()), h200);
  EXPECT_EQ(codegen::gridSms(a100Target()), a100);
  EXPECT_EQ(codegen::gridSms(cpuTarget()), h200);  // no GPU given: the H200's
  EXPECT_EQ(codegen::Kernel{}.sms, h200);
  auto grid = [](codegen::Kernel k, int sms) {
    k.sms = sms;
    return codegen::launchConfig(k);
  };
  codegen::Kernel pointwise;
  pointwise.kind = codegen::KernelKind::Pointwise;
  // 65536 blocks of work: 4224 blocks on an H200, 3456 on an A100.
  pointwise.space = {int64_t{1} << 24};
  EXPECT_EQ(grid(pointwise, h200), (codegen::LaunchConfig{4 * 132 * 8, 256}));
  EXPECT_EQ(grid(pointwise, a100), (codegen::LaunchConfig{4 * 108 * 8, 256}));
  // Less than a wave: the blocks it needs.
  pointwise.space = {300 * 256};
  EXPECT_EQ(grid(pointwise, h200), (codegen::LaunchConfig{300, 256}));
  EXPECT_EQ(grid(pointwise, a100), (codegen::LaunchConfig{300, 256}));
  pointwise.space = {1};
  EXPECT_EQ(grid(pointwise, a100), (codegen::LaunchConfig{1, 256}));

  codegen::Kernel row;
  row.kind = codegen::KernelKind::Row;
  row.space = {100000};  // many rows: 256-thread blocks, each taking rows in turn
  row.row_space = {1000};
  EXPECT_EQ(grid(row, h200), (codegen::LaunchConfig{4 * 132 * 8, 256}));
  EXPECT_EQ(grid(row, a100), (codegen::LaunchConfig{4 * 108 * 8, 256}));
  row.space = {500};  // fewer rows than a wave of 256-thread blocks: 1024 threads, one block each
  row.row_space = {100000};
  EXPECT_EQ(grid(row, h200), (codegen::LaunchConfig{500, 1024}));
  EXPECT_EQ(grid(row, a100), (codegen::LaunchConfig{500, 1024}));
  row.space = {1000};  // a wave of 256-thread blocks on an A100 (864), not on an H200 (1056)
  EXPECT_EQ(grid(row, h200), (codegen::LaunchConfig{1000, 1024}));
  EXPECT_EQ(grid(row, a100), (codegen::LaunchConfig{1000, 256}));

  codegen::Kernel columns;
  columns.kind = codegen::KernelKind::ColumnReduce;
  columns.space = {1, 1 << 20};  // one slab of 32768 strips of 32 columns
  columns.row_space = {64};
  EXPECT_EQ(grid(columns, h200), (codegen::LaunchConfig{4 * 132 * 8, 256}));
  EXPECT_EQ(grid(columns, a100), (codegen::LaunchConfig{4 * 108 * 8, 256}));
  columns.space = {3, 100};  // 3 slabs x 4 strips
  EXPECT_EQ(grid(columns, a100), (codegen::LaunchConfig{12, 256}));
}

// Index math is 32-bit where the iteration space allows (issue 36, item 4): the loop index and
// the divisions that split it into coordinates; a space of 2^32 elements or more keeps 64 bits.
TEST(CudaEmitter, IndexMathIs32BitWhereTheSpaceAllows) {
  auto pointwise = [](std::vector<int64_t> shape) {
    codegen::Kernel k;
    k.name = "fill";
    k.kind = codegen::KernelKind::Pointwise;
    k.space = shape;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int out = k.addBuffer("y", codegen::DType::f32, n, true);
    std::vector<int> coords;
    for (size_t i = 0; i < shape.size(); ++i) coords.push_back(k.exprs.coord(static_cast<int>(i)));
    const int one = k.exprs.constant(1.0, codegen::DType::f32);
    k.stores.push_back({out, codegen::rowMajorOffset(k.exprs, coords, shape), one, -1});
    EXPECT_TRUE(codegen::validate(k).isOk()) << codegen::validate(k).message();
    return codegen::emitKernel(k);
  };
  const std::string narrow = pointwise({4, 5, 6});
  EXPECT_NE(narrow.find("for (unsigned i = "), std::string::npos) << narrow;
  EXPECT_NE(narrow.find("unsigned rest0 = (unsigned)i;"), std::string::npos) << narrow;
  EXPECT_NE(narrow.find("rest0 % 6u;"), std::string::npos) << narrow;
  EXPECT_EQ(narrow.find("long long i"), std::string::npos) << narrow;
  // An odd count: one element a thread (VectorizesTheFlatIndexAccesses has the other form).
  const std::string wide = pointwise({3, (int64_t{1} << 31) + 1});
  EXPECT_NE(wide.find("for (long long i = "), std::string::npos) << wide;
  EXPECT_NE(wide.find("long long rest0 = (long long)i;"), std::string::npos) << wide;
  EXPECT_NE(wide.find("rest0 % 2147483649LL;"), std::string::npos) << wide;
}

// Issue 36, item 4: a Pointwise kernel whose space is a multiple of 4 (and not tiny) takes four
// consecutive elements a thread; its loads and stores at the flat index are one vector access
// each, the others (a broadcast bias, a transposed read) stay per element, and the grid counts
// vectors. Odd spaces and small ones keep one element a thread. simt_ops_test runs the
// vectorized form's math (op cases elementwise_chain_vectorized, vectorized_bf16_i32).
TEST(CudaEmitter, VectorizesTheFlatIndexAccesses) {
  auto kernel = [](int64_t rows, int64_t cols, codegen::DType out_type) {
    codegen::Kernel k;
    k.name = "bias_add";
    k.kind = codegen::KernelKind::Pointwise;
    k.space = {rows, cols};
    codegen::ExprGraph& g = k.exprs;
    const int x = k.addBuffer("x", codegen::DType::f32, rows * cols);
    const int bias = k.addBuffer("bias", codegen::DType::f32, cols);
    const int xt = k.addBuffer("xt", codegen::DType::f32, rows * cols);
    const int y = k.addBuffer("y", out_type, rows * cols, true);
    const int r = g.coord(0), c = g.coord(1);
    const int flat = codegen::rowMajorOffset(g, {r, c}, k.space);
    const int sum = g.binary(codegen::ExprOp::Add, g.load(x, codegen::DType::f32, flat),
                             g.load(bias, codegen::DType::f32, c));
    const int v = g.binary(codegen::ExprOp::Add, sum,
                           g.load(xt, codegen::DType::f32, codegen::rowMajorOffset(g, {c, r}, {cols, rows})));
    k.stores.push_back({y, flat, g.cast(v, codegen::computeType(out_type)), -1});
    EXPECT_TRUE(codegen::validate(k).isOk()) << codegen::validate(k).message();
    return k;
  };
  const codegen::Kernel k = kernel(64, 96, codegen::DType::f32);
  const std::string text = codegen::emitKernel(k);
  EXPECT_NE(text.find("kiln_ld4(b0, v, l"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln_st4(b3, v, s0);"), std::string::npos) << text;
  EXPECT_NE(text.find("kiln_ld(b1, c1)"), std::string::npos) << text;  // the bias
  EXPECT_EQ(text.find("kiln_ld4(b1"), std::string::npos) << text;
  EXPECT_EQ(text.find("kiln_ld4(b2"), std::string::npos) << text;  // the transposed read
  EXPECT_EQ(codegen::launchConfig(k).grid, 64 * 96 / 4 / 256);
  EXPECT_NE(codegen::emitKernel(kernel(64, 96, codegen::DType::bf16)).find("kiln_st4(b3, v, s0);"), std::string::npos);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{63, 97}, {8, 16}}) {
    const codegen::Kernel scalar = kernel(rows, cols, codegen::DType::f32);
    const std::string t = codegen::emitKernel(scalar);
    EXPECT_EQ(t.find("kiln_ld4"), std::string::npos) << t;
    EXPECT_EQ(codegen::launchConfig(scalar).grid, (rows * cols + 255) / 256);
  }
}

}  // namespace
}  // namespace kiln::testing
