#include "runtime/cuda/kernel_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "codegen/cuda_emitter.h"

namespace kiln::cuda {

std::string defaultCacheDir() {
  if (const char* d = std::getenv("KILN_CACHE_DIR"); d && *d) return d;
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/kiln";
  return ".kiln-cache";
}

std::string KernelCache::entryName(const std::string& source, const std::string& options, const std::string& arch,
                                   const std::string& compiler_version) {
  std::string key = options + '\0' + source;
  uint64_t h1 = codegen::fnv1a64(key);
  uint64_t h2 = codegen::fnv1a64(key, 0x84222325cbf29ce4ull);  // a second, independent seed
  const char* kind = arch.rfind("compute_", 0) == 0 ? "ptx" : "cubin";
  return fmt::format("{:016x}{:016x}-{}-nvrtc{}.{}", h1, h2, arch, compiler_version, kind);
}

std::optional<std::vector<char>> KernelCache::load(const std::string& entry) const {
  std::ifstream in(pathOf(entry), std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) return std::nullopt;
  return bytes;
}

Status KernelCache::store(const std::string& entry, const std::vector<char>& bytes) const {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return Status::errorf("cannot create the kernel cache directory '{}': {}", dir_, ec.message());
  static std::atomic<int> counter{0};
  std::string tmp = fmt::format("{}.tmp.{}.{}", pathOf(entry), static_cast<long>(getpid()), counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::errorf("cannot write kernel cache file '{}'", tmp);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return Status::errorf("cannot write kernel cache file '{}'", tmp);
    }
  }
  if (std::rename(tmp.c_str(), pathOf(entry).c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status::errorf("cannot move '{}' into the kernel cache", tmp);
  }
  return Status::ok();
}

}  // namespace kiln::cuda
