// Compiles generated CUDA C++ to CUBIN (or PTX) with NVRTC, loaded at run time (libnvrtc.so.13,
// .so.12 or .so; never linked), through the on-disk kernel cache. NVRTC needs no GPU, so this
// runs, and is tested, on CPU-only machines. One compiler may compile on several threads at once
// (NVRTC is thread-safe per program; the counters are atomic).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cuda_emitter.h"
#include "ir/status.h"
#include "runtime/cuda/dynamic_library.h"
#include "runtime/cuda/kernel_cache.h"

namespace kiln::cuda {

struct CompiledModule {
  std::vector<char> cubin;  // CUBIN; for a compute_XX arch the PTX text (no terminating NUL)
  bool from_cache = false;
  std::string cache_file;  // where it is (or would be) cached
};

// What ptxas reports of one kernel (NvrtcCompiler::resourceUsage).
struct KernelResources {
  std::string name;
  int registers = 0;          // per thread
  int64_t shared_bytes = 0;   // static shared memory per block
  int64_t spill_bytes = 0;    // spill stores + spill loads
  int64_t stack_bytes = 0;    // stack frame per thread
};

class NvrtcCompiler {
 public:
  // Loads NVRTC; the error says which libraries were tried. The cache directory defaults to
  // defaultCacheDir(); an empty string disables caching.
  static Expected<std::unique_ptr<NvrtcCompiler>> create(std::string cache_dir = defaultCacheDir());
  ~NvrtcCompiler();

  // "13.0"
  std::string version() const { return std::to_string(major_) + "." + std::to_string(minor_); }
  const std::string& libraryPath() const { return lib_.path(); }

  // Compiles a module for `arch`: CUBIN for a real GPU (sm_90 for the H200; any sm_XX NVRTC
  // knows), PTX for a virtual one (compute_90), which the driver JIT-compiles for that arch and
  // newer. A failure carries NVRTC's log and names the kernels its errors point into.
  Expected<CompiledModule> compile(const codegen::CudaModule& module, const std::string& arch = "sm_90");
  // Same for plain source; `kernel_at_line` maps a 1-based source line to a kernel name.
  Expected<CompiledModule> compileSource(const std::string& source, const std::string& arch,
                                         const std::function<std::string(int)>& kernel_at_line = {});

  // What ptxas reports for each kernel of a module compiled for a real `arch` (registers,
  // shared memory, spills), in the module's order: how a kernel's occupancy is checked without
  // a GPU. Compiled afresh, with ptxas's -v; the cache is not used.
  Expected<std::vector<KernelResources>> resourceUsage(const codegen::CudaModule& module,
                                                       const std::string& arch = "sm_90");

  // Counters since creation: NVRTC invocations and cache hits.
  int compilations() const { return compilations_.load(); }
  int cacheHits() const { return cache_hits_.load(); }

 private:
  NvrtcCompiler() = default;
  // compileSource with `extra` options after the standard ones; the log goes to `log` when given.
  Expected<CompiledModule> compileWith(const std::string& source, const std::string& arch,
                                       const std::vector<std::string>& extra, bool use_cache,
                                       const std::function<std::string(int)>& kernel_at_line, std::string* log);
  struct Api;
  DynamicLibrary lib_;
  DynamicLibrary builtins_;  // libnvrtc-builtins, preloaded when NVRTC came from a full path
  std::unique_ptr<Api> api_;
  int major_ = 0, minor_ = 0;
  std::string cache_dir_;
  std::atomic<int> compilations_{0}, cache_hits_{0};
};

// Checks an architecture name: sm_NN or sm_NNa (a real GPU, so NVRTC emits CUBIN).
Status checkGpuArch(const std::string& arch);
// Checks a virtual architecture name: compute_NN or compute_NNa (NVRTC emits PTX).
Status checkPtxArch(const std::string& arch);

}  // namespace kiln::cuda
