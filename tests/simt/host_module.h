// Runs the CUDA source Kiln generates on the host, so its text (not only the kernel IR it
// prints) is executed and checked on machines without a GPU.
//
// HostModule::compile builds a codegen::CudaModule's source with the host C++ compiler, with
// simt_prelude.h force-included (CUDA's kernel words given host meanings: blocks one after
// another, threads as fibers), into a shared object cached by content hash, and loads it.
// launch() runs one kernel <<<grid, block>>> over host pointers. A deadlocked barrier, a shuffle
// with an exited lane or a memory fault (see GuardedBuffer) is an error naming the kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codegen/cuda_emitter.h"
#include "ir/status.h"

namespace kiln::simt {

// Host memory whose last byte is followed by an inaccessible page, so a kernel that reads or
// writes past the end faults (and the launch reports it) instead of passing silently. The start
// is aligned to `align` bytes (the element size); overruns smaller than that go unseen.
class GuardedBuffer {
 public:
  GuardedBuffer() = default;
  static Expected<GuardedBuffer> allocate(size_t bytes, size_t align = 8);
  GuardedBuffer(GuardedBuffer&& o) noexcept { *this = std::move(o); }
  GuardedBuffer& operator=(GuardedBuffer&& o) noexcept;
  ~GuardedBuffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class HostModule {
 public:
  // Compiles (or finds in the cache) and loads the module. Errors carry the compiler's output.
  static Expected<std::unique_ptr<HostModule>> compile(const codegen::CudaModule& module);
  ~HostModule();

  // Runs kernel `name` (a symbol of the module) over `args`, one pointer per kernel parameter.
  Status launch(const std::string& name, const codegen::LaunchConfig& launch, const std::vector<void*>& args) const;

  // The directory compiled modules are cached in (KILN_SIMT_CACHE, else under the build tree).
  static std::string cacheDir();

 private:
  HostModule() = default;
  using Entry = int (*)(long long, int, void**, char*, int);
  void* handle_ = nullptr;
  std::map<std::string, Entry> entries_;
};

}  // namespace kiln::simt
