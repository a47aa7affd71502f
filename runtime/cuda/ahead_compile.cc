#include "runtime/cuda/ahead_compile.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "codegen/kernel_lowering.h"

namespace kiln::cuda {

int nvrtcThreads(int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("KILN_NVRTC_THREADS"); env && *env) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (*end == '\0' && n > 0 && n <= 1024) return static_cast<int>(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

std::vector<std::vector<const codegen::Kernel*>> splitIntoPrograms(
    const std::vector<const codegen::Kernel*>& kernels, int threads) {
  std::vector<const codegen::Kernel*> unique;
  std::set<std::string> seen;
  for (const codegen::Kernel* k : kernels) {
    std::string name;
    codegen::emitKernel(*k, &name);
    if (seen.insert(name).second) unique.push_back(k);
  }
  std::vector<std::vector<const codegen::Kernel*>> programs;
  if (unique.empty()) return programs;
  const size_t n = unique.size();
  const size_t per_thread = 4 * static_cast<size_t>(std::max(threads, 1));
  const size_t per = std::max<size_t>(kMinKernelsPerProgram, (n + per_thread - 1) / per_thread);
  // No more programs than keep every one at kMinKernelsPerProgram: ceil(n / per) alone would give
  // 39 kernels 10 programs, one of them of 3.
  const size_t count = std::min((n + per - 1) / per, std::max<size_t>(1, n / kMinKernelsPerProgram));
  // Sizes n / count or one more, the larger ones first.
  size_t at = 0;
  for (size_t p = 0; p < count; ++p) {
    const size_t size = n / count + (p < n % count ? 1 : 0);
    programs.emplace_back(unique.begin() + static_cast<std::ptrdiff_t>(at),
                          unique.begin() + static_cast<std::ptrdiff_t>(at + size));
    at += size;
  }
  return programs;
}

Expected<std::vector<CompiledModule>> compileInParallel(NvrtcCompiler& nvrtc,
                                                        const std::vector<CompileJob>& jobs, int threads) {
  std::vector<size_t> order(jobs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return jobs[a].module->source.size() > jobs[b].module->source.size();
  });
  std::vector<std::optional<Expected<CompiledModule>>> results(jobs.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    for (size_t i = next++; i < order.size() && !failed; i = next++) {
      const CompileJob& job = jobs[order[i]];
      Expected<CompiledModule> r = nvrtc.compile(*job.module, job.arch);
      if (!r) failed = true;
      results[order[i]] = std::move(r);
    }
  };
  const size_t workers = std::min<size_t>(static_cast<size_t>(std::max(threads, 1)), jobs.size());
  if (workers <= 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    pool.reserve(workers);
    for (size_t t = 0; t < workers; ++t) pool.emplace_back(work);
    for (std::thread& t : pool) t.join();
  }
  std::vector<CompiledModule> out;
  out.reserve(jobs.size());
  for (std::optional<Expected<CompiledModule>>& r : results)
    if (r && !*r) return r->status();
  for (std::optional<Expected<CompiledModule>>& r : results) out.push_back(r->take());
  return out;
}

Expected<KernelSet> compileKernelsAhead(const ir::Function& f, const ir::SymbolBindings& symbols,
                                        const AheadOptions& options) {
  if (options.archs.empty())
    return Status::error("compiling kernels ahead of time: no GPU architectures given");
  std::vector<std::string> archs;
  for (const std::string& arch : options.archs) {
    KILN_RETURN_IF_ERROR(checkGpuArch(arch));
    if (std::find(archs.begin(), archs.end(), arch) == archs.end()) archs.push_back(arch);
  }
  if (options.ptx) {
    const std::string newest =
        *std::max_element(archs.begin(), archs.end(),
                          [](const auto& a, const auto& b) { return archNumber(a) < archNumber(b); });
    archs.push_back(fmt::format("compute_{}", archNumber(newest)));
  }
  auto nvrtc = NvrtcCompiler::create(options.cache_dir);
  if (!nvrtc)
    return Status::errorf("compiling the kernels of @{} ahead of time needs NVRTC: {}", f.name(),
                          nvrtc.status().message());

  // The executor's lowering (CudaExecutor::create), so the names are the ones it looks up.
  KILN_ASSIGN_OR_RETURN(auto groups, codegen::lowerFunction(f, symbols));
  std::vector<const codegen::Kernel*> kernels;
  for (const codegen::LoweredGroup& g : groups)
    for (const codegen::Kernel& k : g.kernels) kernels.push_back(&k);
  const int threads = nvrtcThreads(options.threads);
  std::vector<codegen::CudaModule> modules;
  for (const auto& program : splitIntoPrograms(kernels, threads))
    modules.push_back(codegen::emitModule(program));

  std::vector<CompileJob> jobs;
  for (const std::string& arch : archs)
    for (const codegen::CudaModule& m : modules) jobs.push_back({&m, arch});
  auto compiled = compileInParallel(**nvrtc, jobs, threads);
  if (!compiled)
    return Status::errorf("compiling the kernels of @{} ahead of time: {}", f.name(),
                          compiled.status().message());

  KernelSet set;
  for (size_t j = 0; j < jobs.size(); ++j) {
    KernelImage im;
    im.arch = jobs[j].arch;
    for (const codegen::EmittedKernel& k : jobs[j].module->kernels) im.kernels.push_back(k.name);
    std::vector<char>& bytes = (*compiled)[j].cubin;
    im.bytes.assign(bytes.begin(), bytes.end());
    set.images.push_back(std::move(im));
  }
  return set;
}

}  // namespace kiln::cuda
