#include "runtime/cuda/dynamic_library.h"

#include <dlfcn.h>

#include <cstdlib>

namespace kiln::cuda {

DynamicLibrary::~DynamicLibrary() {
  if (handle_) dlclose(handle_);
}

DynamicLibrary& DynamicLibrary::operator=(DynamicLibrary&& o) noexcept {
  if (this != &o) {
    if (handle_) dlclose(handle_);
    handle_ = o.handle_;
    path_ = std::move(o.path_);
    o.handle_ = nullptr;
  }
  return *this;
}

Expected<DynamicLibrary> DynamicLibrary::open(const std::vector<std::string>& names, const std::vector<std::string>& dirs) {
  std::vector<std::string> candidates = names;
  for (const std::string& d : dirs)
    for (const std::string& n : names) candidates.push_back(d + "/" + n);
  std::string tried;
  for (const std::string& c : candidates) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      DynamicLibrary lib;
      lib.handle_ = h;
      lib.path_ = c;
      return lib;
    }
    const char* why = dlerror();
    tried += "\n  " + c + (why ? std::string(": ") + why : "");
  }
  return Status::errorf("{} not found; tried:{}", names.empty() ? "library" : names.front(), tried);
}

void* DynamicLibrary::symbol(const char* name) const { return handle_ ? dlsym(handle_, name) : nullptr; }

std::vector<std::string> cudaLibraryDirs() {
  std::vector<std::string> dirs;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(var); v && *v) dirs.push_back(std::string(v) + "/lib64");
#ifdef KILN_CUDA_LIBRARY_DIR
  dirs.push_back(KILN_CUDA_LIBRARY_DIR);
#endif
  dirs.push_back("/usr/local/cuda/lib64");
  return dirs;
}

}  // namespace kiln::cuda
