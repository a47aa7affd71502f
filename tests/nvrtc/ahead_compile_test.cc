// compileKernelsAhead (runtime/cuda/ahead_compile.h) on a model's training step: CUBINs for
// sm_80 and sm_90 whose ELF headers say so (checked against nvcc's own CUBINs when nvcc is
// installed), PTX for compute_90, exactly the kernels the CUDA Program launches, the same on one
// thread as on four; the split into programs; errors. Skips without NVRTC (label nvrtc).
#include "runtime/cuda/ahead_compile.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "codegen/cuda_program.h"
#include "codegen/kernel_lowering.h"
#include "frontend/frontend.h"
#include "passes/pass_manager.h"

namespace kiln::cuda {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kBatch = 64;

// A model's training step after the fused pipeline the CUDA backend runs.
struct TrainStep {
  std::unique_ptr<ir::Module> module;
  const ir::Function* step = nullptr;
  ir::SymbolBindings symbols{{"B", kBatch}};
};

TrainStep trainStep(const std::string& model) {
  TrainStep t;
  const std::string path = std::string(KILN_SOURCE_DIR) + "/models/" + model + ".kiln";
  std::ostringstream diag_text;
  frontend::DiagnosticEngine diags(&diag_text);
  auto m = frontend::compileModelFile(path, {}, diags);
  EXPECT_TRUE(m) << diag_text.str();
  if (!m) return t;
  t.module = m.take();
  passes::PassManager pm;
  EXPECT_TRUE(pm.addPipeline("autodiff,canonicalize,cse,dce,fusion"));
  auto r = pm.run(*t.module);
  EXPECT_TRUE(r) << r.status().message();
  t.step = t.module->lookup("train_step");
  EXPECT_NE(t.step, nullptr);
  return t;
}

bool haveNvrtc(std::string* why) {
  auto c = NvrtcCompiler::create("");
  if (!c) *why = c.status().message();
  return static_cast<bool>(c);
}

#define NVRTC_OR_SKIP()                        \
  do {                                         \
    std::string why;                           \
    if (!haveNvrtc(&why)) GTEST_SKIP() << why; \
  } while (0)

// The SM a CUDA ELF is for. Its e_flags hold it in bits 0-7 up to ELF ABI version 7 (CUDA 11 and
// early 12) and in bits 8-15 from version 8 on (CUDA 12.8+, 13); EI_ABIVERSION is byte 8.
struct CudaElf {
  bool ok = false;
  int abi = 0;
  uint32_t flags = 0;
  int sm() const { return abi >= 8 ? static_cast<int>((flags >> 8) & 0xff) : static_cast<int>(flags & 0xff); }
};

CudaElf readCudaElf(const std::string& bytes) {
  CudaElf e;
  // 64-bit ELF: e_machine (u16) at 18, e_flags (u32) at 48.
  if (bytes.size() < 64 ||
      bytes.compare(0, 4,
                    "\x7f"
                    "ELF") != 0 ||
      bytes[4] != 2)
    return e;
  uint16_t machine = 0;
  std::memcpy(&machine, bytes.data() + 18, 2);
  if (machine != 190) return e;  // EM_CUDA
  std::memcpy(&e.flags, bytes.data() + 48, 4);
  e.abi = static_cast<unsigned char>(bytes[8]);
  e.ok = true;
  return e;
}

// nvcc's CUBIN of a one-line kernel for `arch`, or "" without nvcc.
std::string nvccCubin(const std::string& arch) {
#ifdef KILN_NVCC
  if (!fs::exists(KILN_NVCC)) return "";
  const fs::path dir = fs::temp_directory_path() / ("kiln-nvcc-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "k.cu") << "extern \"C\" __global__ void k(float* p) { p[threadIdx.x] = 1.f; }\n";
  const std::string cubin = (dir / (arch + ".cubin")).string();
  const std::string cmd = std::string(KILN_NVCC) + " -cubin -arch=" + arch + " -o " + cubin + " " +
                          (dir / "k.cu").string() + " > /dev/null 2>&1";
  std::string bytes;
  if (std::system(cmd.c_str()) == 0) {
    std::ifstream in(cubin, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  fs::remove_all(dir);
  return bytes;
#else
  (void)arch;
  return "";
#endif
}

// The kernels the CUDA Program's steps launch: what the executor looks up.
std::set<std::string> programKernels(const TrainStep& t) {
  std::set<std::string> names;
  auto groups = codegen::lowerFunction(*t.step, t.symbols);
  EXPECT_TRUE(groups) << groups.status().message();
  if (!groups) return names;
  auto program = codegen::buildCudaProgram(*t.step, *groups, t.symbols);
  EXPECT_TRUE(program) << program.status().message();
  if (!program) return names;
  for (const codegen::CudaStep& s : program->steps)
    if (!s.isGemm()) names.insert(s.name);
  return names;
}

std::map<std::string, std::set<std::string>> namesByArch(const KernelSet& set) {
  std::map<std::string, std::set<std::string>> out;
  for (const KernelImage& im : set.images) {
    for (const std::string& k : im.kernels)
      EXPECT_TRUE(out[im.arch].insert(k).second) << k << " twice for " << im.arch;
  }
  return out;
}

TEST(AheadCompile, TrainStepForTwoArchsAndPtx) {
  NVRTC_OR_SKIP();
  TrainStep t = trainStep("dlrm");
  ASSERT_NE(t.step, nullptr);
  AheadOptions o;
  o.threads = 4;
  auto set = compileKernelsAhead(*t.step, t.symbols, o);
  ASSERT_TRUE(set) << set.status().message();
  EXPECT_EQ(set->archs(), (std::vector<std::string>{"sm_80", "sm_90", "compute_90"}));

  const std::set<std::string> want = programKernels(t);
  ASSERT_FALSE(want.empty());
  const auto by_arch = namesByArch(*set);
  for (const auto& [arch, names] : by_arch) EXPECT_EQ(names, want) << arch;
  const std::vector<std::string> all = set->kernelNames();
  EXPECT_EQ(std::set<std::string>(all.begin(), all.end()), want);

  std::map<std::string, CudaElf> reference;  // nvcc's, when installed
  for (const char* arch : {"sm_80", "sm_90"}) {
    CudaElf e = readCudaElf(nvccCubin(arch));
    if (e.ok) reference[arch] = e;
  }
  if (reference.empty()) std::cerr << "no nvcc: the CUBINs' arch is checked against the ELF layout only\n";
  int cubins = 0, ptxs = 0;
  for (const KernelImage& im : set->images) {
    ASSERT_FALSE(im.bytes.empty()) << im.arch;
    if (im.isPtx()) {
      ++ptxs;
      EXPECT_EQ(im.arch, "compute_90");
      EXPECT_NE(im.bytes.find(".target sm_90"), std::string::npos);
      for (const std::string& k : im.kernels) EXPECT_NE(im.bytes.find(".entry " + k), std::string::npos) << k;
      continue;
    }
    ++cubins;
    const CudaElf e = readCudaElf(im.bytes);
    ASSERT_TRUE(e.ok) << im.arch << ": not a 64-bit CUDA ELF";
    EXPECT_EQ(e.sm(), archNumber(im.arch))
        << im.arch << " e_flags " << std::hex << e.flags << " abi " << e.abi;
    if (auto it = reference.find(im.arch); it != reference.end()) {
      EXPECT_EQ(e.abi, it->second.abi) << im.arch;
      EXPECT_EQ(e.flags & 0xffff, it->second.flags & 0xffff)
          << im.arch << ": NVRTC's e_flags " << std::hex << e.flags << ", nvcc's " << it->second.flags;
      EXPECT_EQ(it->second.sm(), archNumber(im.arch));
    }
    for (const std::string& k : im.kernels) EXPECT_NE(im.bytes.find(k), std::string::npos) << k;
  }
  EXPECT_GT(cubins, 0);
  EXPECT_EQ(cubins, 2 * ptxs);  // the same programs for every arch

  // The serialized set round-trips and still selects.
  auto back = KernelSet::deserialize(set->serialize(), "test");
  ASSERT_TRUE(back) << back.status().message();
  auto chosen = back->select("sm_90", std::vector<std::string>(want.begin(), want.end()));
  ASSERT_TRUE(chosen) << chosen.status().message();
  for (const KernelImage* im : *chosen) EXPECT_EQ(im->arch, "sm_90");
  chosen = back->select("sm_100", std::vector<std::string>(want.begin(), want.end()));
  ASSERT_TRUE(chosen) << chosen.status().message();
  for (const KernelImage* im : *chosen) EXPECT_EQ(im->arch, "compute_90");
}

TEST(AheadCompile, OneThreadGivesTheSameKernelsAsFour) {
  NVRTC_OR_SKIP();
  TrainStep t = trainStep("dlrm");
  ASSERT_NE(t.step, nullptr);
  AheadOptions o;
  o.archs = {"sm_90"};
  o.threads = 1;
  auto serial = compileKernelsAhead(*t.step, t.symbols, o);
  ASSERT_TRUE(serial) << serial.status().message();
  o.threads = 4;
  auto parallel = compileKernelsAhead(*t.step, t.symbols, o);
  ASSERT_TRUE(parallel) << parallel.status().message();
  EXPECT_EQ(namesByArch(*serial), namesByArch(*parallel));
  EXPECT_LT(serial->images.size(), parallel->images.size()) << "four threads split into more programs";
}

TEST(AheadCompile, ProgramsSplitDeduplicatedKernels) {
  TrainStep t = trainStep("dlrm");
  ASSERT_NE(t.step, nullptr);
  auto groups = codegen::lowerFunction(*t.step, t.symbols);
  ASSERT_TRUE(groups) << groups.status().message();
  std::vector<const codegen::Kernel*> kernels;
  for (const auto& g : *groups)
    for (const auto& k : g.kernels) kernels.push_back(&k);
  std::vector<const codegen::Kernel*> twice = kernels;
  twice.insert(twice.end(), kernels.begin(), kernels.end());
  std::set<std::string> unique;
  for (const codegen::Kernel* k : kernels) {
    std::string name;
    codegen::emitKernel(*k, &name);
    unique.insert(name);
  }
  for (int threads : {1, 2, 4, 16, 64}) {
    auto programs = splitIntoPrograms(twice, threads);
    std::set<std::string> seen;
    size_t smallest = SIZE_MAX, largest = 0;
    for (const auto& p : programs) {
      smallest = std::min(smallest, p.size());
      largest = std::max(largest, p.size());
      for (const codegen::Kernel* k : p) {
        std::string name;
        codegen::emitKernel(*k, &name);
        EXPECT_TRUE(seen.insert(name).second) << name << " in two programs";
      }
    }
    EXPECT_EQ(seen, unique) << threads;
    EXPECT_LE(largest - smallest, 1u) << threads;
    if (programs.size() > 1) {
      EXPECT_GE(smallest, static_cast<size_t>(kMinKernelsPerProgram)) << threads;
    }
    const size_t per = (unique.size() + 4 * threads - 1) / (4 * threads);
    EXPECT_LE(largest, std::max<size_t>(per, kMinKernelsPerProgram) + 1) << threads;
  }
  EXPECT_TRUE(splitIntoPrograms({}, 4).empty());
  // Counts that do not divide evenly: every program keeps kMinKernelsPerProgram (39 kernels on
  // 16 threads once gave a program of 3), and every kernel is in one.
  for (int n : {4, 5, 11, 39, 100, 257}) {
    std::vector<codegen::Kernel> many(static_cast<size_t>(n));
    std::vector<const codegen::Kernel*> ptrs;
    for (int i = 0; i < n; ++i) {
      codegen::Kernel& k = many[static_cast<size_t>(i)];
      k.name = "k" + std::to_string(i);
      k.space = {static_cast<int64_t>(i) + 1};
      ptrs.push_back(&k);
    }
    for (int threads : {1, 2, 16, 64}) {
      auto programs = splitIntoPrograms(ptrs, threads);
      size_t total = 0;
      for (const auto& p : programs) {
        total += p.size();
        if (programs.size() > 1)
          EXPECT_GE(p.size(), static_cast<size_t>(kMinKernelsPerProgram)) << n << " on " << threads;
      }
      EXPECT_EQ(total, static_cast<size_t>(n)) << n << " on " << threads;
    }
  }
}

TEST(AheadCompile, BadArchsAreErrors) {
  TrainStep t = trainStep("dlrm");
  ASSERT_NE(t.step, nullptr);
  AheadOptions o;
  o.archs = {"sm_90", "compute_90"};
  auto r = compileKernelsAhead(*t.step, t.symbols, o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("bad GPU architecture 'compute_90'"), std::string::npos)
      << r.status().message();
  o.archs = {};
  r = compileKernelsAhead(*t.step, t.symbols, o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("no GPU architectures"), std::string::npos) << r.status().message();
}

TEST(AheadCompile, ParallelCompileReportsTheFailingProgram) {
  NVRTC_OR_SKIP();
  auto nvrtc = NvrtcCompiler::create("");
  ASSERT_TRUE(nvrtc);
  std::vector<codegen::CudaModule> modules(6);
  for (size_t i = 0; i < modules.size(); ++i)
    modules[i].source = "extern \"C\" __global__ void k" + std::to_string(i) +
                        "(float* p) { p[0] = " + (i == 3 ? "undeclared" : "1.f") + "; }\n";
  std::vector<CompileJob> jobs;
  for (const auto& m : modules) jobs.push_back({&m, "sm_90"});
  auto bad = compileInParallel(**nvrtc, jobs, 3);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("undeclared"), std::string::npos) << bad.status().message();
  jobs.erase(jobs.begin() + 3);
  jobs.push_back({&modules[0], "compute_90"});
  const int before = (*nvrtc)->compilations();
  auto good = compileInParallel(**nvrtc, jobs, 3);
  ASSERT_TRUE(good) << good.status().message();
  ASSERT_EQ(good->size(), jobs.size());
  for (size_t i = 0; i + 1 < jobs.size(); ++i)
    EXPECT_EQ(readCudaElf(std::string((*good)[i].cubin.begin(), (*good)[i].cubin.end())).sm(), 90);
  const std::string ptx((*good).back().cubin.begin(), (*good).back().cubin.end());
  EXPECT_NE(ptx.find(".entry k0"), std::string::npos);
  EXPECT_EQ((*nvrtc)->compilations() - before, 6);  // counted from three threads
}

}  // namespace
}  // namespace kiln::cuda
