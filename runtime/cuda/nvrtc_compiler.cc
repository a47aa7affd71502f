#include "runtime/cuda/nvrtc_compiler.h"

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <set>
#include <sstream>

#include <fmt/format.h>

#ifdef KILN_HAVE_CUDA_HEADERS
#include <nvrtc.h>
#endif

namespace kiln::cuda {

Status checkGpuArch(const std::string& arch) {
  static const std::regex re("sm_[0-9]{2,3}[af]?");
  if (!std::regex_match(arch, re))
    return Status::errorf("bad GPU architecture '{}': expected sm_NN, e.g. sm_90 for the H100/H200", arch);
  return Status::ok();
}

Status checkPtxArch(const std::string& arch) {
  static const std::regex re("compute_[0-9]{2,3}[af]?");
  if (!std::regex_match(arch, re))
    return Status::errorf("bad virtual architecture '{}': expected compute_NN, e.g. compute_90", arch);
  return Status::ok();
}

#ifdef KILN_HAVE_CUDA_HEADERS

struct NvrtcCompiler::Api {
  decltype(&::nvrtcVersion) version = nullptr;
  decltype(&::nvrtcGetErrorString) errorString = nullptr;
  decltype(&::nvrtcCreateProgram) createProgram = nullptr;
  decltype(&::nvrtcDestroyProgram) destroyProgram = nullptr;
  decltype(&::nvrtcCompileProgram) compileProgram = nullptr;
  decltype(&::nvrtcGetProgramLogSize) getProgramLogSize = nullptr;
  decltype(&::nvrtcGetProgramLog) getProgramLog = nullptr;
  decltype(&::nvrtcGetCUBINSize) getCUBINSize = nullptr;
  decltype(&::nvrtcGetCUBIN) getCUBIN = nullptr;
  decltype(&::nvrtcGetPTXSize) getPTXSize = nullptr;
  decltype(&::nvrtcGetPTX) getPTX = nullptr;
};

NvrtcCompiler::~NvrtcCompiler() = default;

Expected<std::unique_ptr<NvrtcCompiler>> NvrtcCompiler::create(std::string cache_dir) {
  auto lib = DynamicLibrary::open({"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}, cudaLibraryDirs());
  if (!lib) return Status::errorf("cannot compile CUDA kernels: NVRTC {}", lib.status().message());
  std::unique_ptr<NvrtcCompiler> c(new NvrtcCompiler());
  c->lib_ = lib.take();
  // NVRTC opens its builtins library by bare name. When NVRTC itself was found by a full path
  // the loader does not search, that fails at the first compile; load it from NVRTC's folder
  // first (a loaded library answers later opens of its soname).
  if (const std::string& path = c->lib_.path(); path.find('/') != std::string::npos) {
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("libnvrtc-builtins.so", 0) != 0) continue;
      if (auto b = DynamicLibrary::open({e.path().string()})) {
        c->builtins_ = b.take();
        break;
      }
    }
  }
  c->api_ = std::make_unique<Api>();
  Api& a = *c->api_;
  bool ok = true;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(c->lib_.symbol(name));
    ok &= fn != nullptr;
  };
  bind(a.version, "nvrtcVersion");
  bind(a.errorString, "nvrtcGetErrorString");
  bind(a.createProgram, "nvrtcCreateProgram");
  bind(a.destroyProgram, "nvrtcDestroyProgram");
  bind(a.compileProgram, "nvrtcCompileProgram");
  bind(a.getProgramLogSize, "nvrtcGetProgramLogSize");
  bind(a.getProgramLog, "nvrtcGetProgramLog");
  bind(a.getCUBINSize, "nvrtcGetCUBINSize");
  bind(a.getCUBIN, "nvrtcGetCUBIN");
  bind(a.getPTXSize, "nvrtcGetPTXSize");
  bind(a.getPTX, "nvrtcGetPTX");
  if (!ok) return Status::errorf("{} lacks NVRTC entry points (nvrtcGetCUBIN needs NVRTC 11.1 or newer)", c->lib_.path());
  if (a.version(&c->major_, &c->minor_) != NVRTC_SUCCESS)
    return Status::errorf("nvrtcVersion failed in {}", c->lib_.path());
  c->cache_dir_ = std::move(cache_dir);
  return c;
}

Expected<CompiledModule> NvrtcCompiler::compile(const codegen::CudaModule& module, const std::string& arch) {
  return compileSource(module.source, arch, [&](int line) { return module.kernelAtLine(line); });
}

Expected<CompiledModule> NvrtcCompiler::compileSource(const std::string& source, const std::string& arch,
                                                      const std::function<std::string(int)>& kernel_at_line) {
  return compileWith(source, arch, {}, true, kernel_at_line, nullptr);
}

Expected<std::vector<KernelResources>> NvrtcCompiler::resourceUsage(const codegen::CudaModule& module,
                                                                    const std::string& arch) {
  KILN_RETURN_IF_ERROR(checkGpuArch(arch));
  std::string log;
  auto compiled = compileWith(module.source, arch, {"--ptxas-options=-v"}, false,
                              [&](int line) { return module.kernelAtLine(line); }, &log);
  if (!compiled) return compiled.status();
  // ptxas -v prints, per kernel:
  //   ptxas info    : Compiling entry function 'NAME' for 'sm_90'
  //   ptxas info    : Function properties for NAME
  //       S bytes stack frame, T bytes spill stores, L bytes spill loads
  //   ptxas info    : Used R registers, ... M bytes smem, ...
  static const std::regex entry("Compiling entry function '([^']+)'");
  static const std::regex frame("([0-9]+) bytes stack frame, ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads");
  static const std::regex used("Used ([0-9]+) registers");
  static const std::regex smem("([0-9]+) bytes smem");
  std::vector<KernelResources> out;
  std::istringstream lines(log);
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, entry)) {
      out.push_back({m[1].str()});
    } else if (out.empty()) {
      continue;
    } else if (std::regex_search(line, m, frame)) {
      out.back().stack_bytes = std::stoll(m[1].str());
      out.back().spill_bytes = std::stoll(m[2].str()) + std::stoll(m[3].str());
    } else if (std::regex_search(line, m, used)) {
      out.back().registers = std::stoi(m[1].str());
      if (std::regex_search(line, m, smem)) out.back().shared_bytes = std::stoll(m[1].str());
    }
  }
  if (out.empty()) return Status::errorf("NVRTC {} printed no ptxas report for {}:\n{}", version(), arch, log);
  return out;
}

Expected<CompiledModule> NvrtcCompiler::compileWith(const std::string& source, const std::string& arch,
                                                    const std::vector<std::string>& extra, bool use_cache,
                                                    const std::function<std::string(int)>& kernel_at_line,
                                                    std::string* log_out) {
  const bool ptx = arch.rfind("compute_", 0) == 0;
  KILN_RETURN_IF_ERROR(ptx ? checkPtxArch(arch) : checkGpuArch(arch));
  // No fast math: the GPU computes what the CPU references compute, within rounding.
  std::vector<std::string> options = {"--gpu-architecture=" + arch, "--std=c++17"};
  options.insert(options.end(), extra.begin(), extra.end());
  std::string joined;
  for (const std::string& o : options) joined += o + ' ';
  CompiledModule out;
  std::string entry = KernelCache::entryName(source, joined, arch, version());
  KernelCache cache(cache_dir_);
  if (use_cache && !cache_dir_.empty()) {
    out.cache_file = cache.pathOf(entry);
    if (auto hit = cache.load(entry)) {
      ++cache_hits_;
      out.cubin = std::move(*hit);
      out.from_cache = true;
      return out;
    }
  }
  const Api& a = *api_;
  nvrtcProgram prog = nullptr;
  nvrtcResult r = a.createProgram(&prog, source.c_str(), "kiln_kernels.cu", 0, nullptr, nullptr);
  if (r != NVRTC_SUCCESS) return Status::errorf("nvrtcCreateProgram failed: {}", a.errorString(r));
  std::vector<const char*> argv;
  for (const std::string& o : options) argv.push_back(o.c_str());
  ++compilations_;
  r = a.compileProgram(prog, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  std::string log;
  if (a.getProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
    log.resize(log_size);
    a.getProgramLog(prog, log.data());
    log.resize(log_size - 1);
  }
  if (log_out) *log_out = log;
  if (r != NVRTC_SUCCESS) {
    a.destroyProgram(&prog);
    // Name the kernels the errors point into: "kiln_kernels.cu(123): error: ...".
    std::set<std::string> kernels;
    static const std::regex where("kiln_kernels\\.cu\\(([0-9]+)\\): error");
    for (auto it = std::sregex_iterator(log.begin(), log.end(), where); it != std::sregex_iterator(); ++it) {
      std::string k = kernel_at_line ? kernel_at_line(std::stoi((*it)[1])) : "";
      kernels.insert(k.empty() ? "the prelude" : k);
    }
    std::string names;
    for (const std::string& k : kernels) names += (names.empty() ? "" : ", ") + k;
    return Status::errorf("NVRTC {} failed to compile {} for {} ({}):\n{}", version(),
                          names.empty() ? "the kernels" : "kernel " + names, arch, a.errorString(r), log);
  }
  size_t size = 0;
  r = ptx ? a.getPTXSize(prog, &size) : a.getCUBINSize(prog, &size);
  if (r == NVRTC_SUCCESS && size > 0) {
    out.cubin.resize(size);
    r = ptx ? a.getPTX(prog, out.cubin.data()) : a.getCUBIN(prog, out.cubin.data());
    // The PTX's size counts its terminating NUL.
    if (ptx && r == NVRTC_SUCCESS && out.cubin.back() == '\0') out.cubin.pop_back();
  }
  a.destroyProgram(&prog);
  if (r != NVRTC_SUCCESS || out.cubin.empty())
    return Status::errorf("NVRTC produced no {} for {} ({})", ptx ? "PTX" : "CUBIN", arch,
                          r != NVRTC_SUCCESS ? a.errorString(r) : "empty");
  if (use_cache && !cache_dir_.empty()) {
    // A cache that cannot be written costs the next run a compile, not this one its kernels.
    Status stored = cache.store(entry, out.cubin);
    if (!stored) std::fprintf(stderr, "warning: kernel cache: %s\n", stored.message().c_str());
  }
  return out;
}

#else  // !KILN_HAVE_CUDA_HEADERS

struct NvrtcCompiler::Api {};
NvrtcCompiler::~NvrtcCompiler() = default;
Expected<std::unique_ptr<NvrtcCompiler>> NvrtcCompiler::create(std::string) {
  return Status::error("this kiln was built without the CUDA toolkit's headers: NVRTC is unavailable");
}
Expected<CompiledModule> NvrtcCompiler::compile(const codegen::CudaModule&, const std::string&) {
  return Status::error("NVRTC is unavailable");
}
Expected<CompiledModule> NvrtcCompiler::compileSource(const std::string&, const std::string&,
                                                      const std::function<std::string(int)>&) {
  return Status::error("NVRTC is unavailable");
}
Expected<std::vector<KernelResources>> NvrtcCompiler::resourceUsage(const codegen::CudaModule&,
                                                                    const std::string&) {
  return Status::error("NVRTC is unavailable");
}
Expected<CompiledModule> NvrtcCompiler::compileWith(const std::string&, const std::string&,
                                                    const std::vector<std::string>&, bool,
                                                    const std::function<std::string(int)>&, std::string*) {
  return Status::error("NVRTC is unavailable");
}

#endif

}  // namespace kiln::cuda
