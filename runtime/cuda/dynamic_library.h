// A shared library opened at run time (dlopen), never linked: the CUDA backend loads the
// driver, NVRTC and cuBLASLt this way so `kiln` starts on machines that have none of them.
#pragma once

#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::cuda {

class DynamicLibrary {
 public:
  DynamicLibrary() = default;
  ~DynamicLibrary();
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  DynamicLibrary(DynamicLibrary&& o) noexcept : handle_(o.handle_), path_(std::move(o.path_)) { o.handle_ = nullptr; }
  DynamicLibrary& operator=(DynamicLibrary&& o) noexcept;

  // Opens the first of `names` that loads (plain names go through the loader's search path;
  // then each name is tried under each of `dirs`). The error lists what was tried.
  static Expected<DynamicLibrary> open(const std::vector<std::string>& names, const std::vector<std::string>& dirs = {});

  // The address of `symbol`, or nullptr.
  void* symbol(const char* name) const;
  const std::string& path() const { return path_; }
  bool isOpen() const { return handle_ != nullptr; }

 private:
  void* handle_ = nullptr;
  std::string path_;
};

// Directories where the CUDA toolkit's libraries may live: $CUDA_HOME/lib64 and
// $CUDA_PATH/lib64 when set, the toolkit found at build time, /usr/local/cuda/lib64.
std::vector<std::string> cudaLibraryDirs();

}  // namespace kiln::cuda
