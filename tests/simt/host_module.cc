#include "tests/simt/host_module.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

namespace kiln::simt {

namespace {

size_t pageBytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a shell command; returns its exit status and its output (stdout and stderr).
int runCommand(const std::string& command, std::string* output) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) output->append(buf, n);
  return pclose(p);
}

// The module's source followed by one exported launcher per kernel.
std::string hostSource(const codegen::CudaModule& m) {
  std::string src = m.source;
  src += "\n// Host launchers (simt).\n";
  std::set<std::string> seen;
  for (const codegen::EmittedKernel& k : m.kernels) {
    if (!seen.insert(k.name).second) continue;
    src += fmt::format(
        "static void kiln_simt_body_{0}(void** a) {{ kiln_simt::call({0}, a); }}\n"
        "extern \"C\" __attribute__((visibility(\"default\"))) int kiln_simt_launch_{0}(long long grid, int block, "
        "void** args, char* err, int err_bytes) {{\n"
        "  return kiln_simt::launch(kiln_simt_body_{0}, args, grid, block, \"{0}\", err, err_bytes);\n}}\n",
        k.name);
  }
  return src;
}

}  // namespace

Expected<GuardedBuffer> GuardedBuffer::allocate(size_t bytes, size_t align) {
  const size_t page = pageBytes();
  const size_t data_pages = (bytes + align + page - 1) / page;
  GuardedBuffer b;
  b.map_bytes_ = (data_pages + 1) * page;
  b.map_ = mmap(nullptr, b.map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b.map_ == MAP_FAILED) {
    b.map_ = nullptr;
    return Status::errorf("simt: cannot map {} bytes", b.map_bytes_);
  }
  char* guard = static_cast<char*>(b.map_) + data_pages * page;
  if (mprotect(guard, page, PROT_NONE) != 0) return Status::errorf("simt: cannot protect a guard page");
  const uintptr_t end = reinterpret_cast<uintptr_t>(guard);
  b.data_ = reinterpret_cast<void*>((end - bytes) / align * align);
  b.bytes_ = bytes;
  return b;
}

GuardedBuffer& GuardedBuffer::operator=(GuardedBuffer&& o) noexcept {
  if (this != &o) {
    if (map_) munmap(map_, map_bytes_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

GuardedBuffer::~GuardedBuffer() {
  if (map_) munmap(map_, map_bytes_);
}

std::string HostModule::cacheDir() {
  if (const char* d = std::getenv("KILN_SIMT_CACHE"); d && *d) return d;
  return std::string(KILN_BINARY_DIR) + "/simt-cache";
}

Expected<std::unique_ptr<HostModule>> HostModule::compile(const codegen::CudaModule& module) {
  const std::string prelude = KILN_SIMT_PRELUDE;
  const std::string flags = "-std=c++17 -O1 -w -fPIC -shared -fvisibility=hidden -U_FORTIFY_SOURCE";
  std::string source = hostSource(module);
  // The key covers everything the object depends on: source, prelude, compiler and flags.
  std::string key = source + '\0' + readFile(prelude) + '\0' + KILN_SIMT_CXX + '\0' + flags;
  std::string stem = fmt::format("{:016x}{:016x}", codegen::fnv1a64(key), codegen::fnv1a64(key, 0x84222325cbf29ce4ull));
  std::string dir = cacheDir();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::errorf("simt: cannot create '{}': {}", dir, ec.message());
  std::string so = fmt::format("{}/{}.so", dir, stem);
  if (!std::filesystem::exists(so)) {
    // Concurrent test processes may build the same module: each writes its own files, and
    // the rename into place is atomic.
    std::string tmp = fmt::format("{}/{}.{}", dir, stem, static_cast<long>(getpid()));
    {
      std::ofstream out(tmp + ".cc");
      out << source;
      if (!out) return Status::errorf("simt: cannot write '{}.cc'", tmp);
    }
    std::string log;
    int rc = runCommand(fmt::format("'{}' {} -include '{}' '{}.cc' -o '{}.so'", KILN_SIMT_CXX, flags, prelude, tmp, tmp),
                        &log);
    if (rc != 0) {
      if (log.size() > 4000) log = log.substr(0, 4000) + "\n...";
      return Status::errorf("simt: the host compiler rejected the module (kept in {}.cc):\n{}", tmp, log);
    }
    std::remove((tmp + ".cc").c_str());
    if (std::rename((tmp + ".so").c_str(), so.c_str()) != 0) return Status::errorf("simt: cannot move {}.so", tmp);
  }
  std::unique_ptr<HostModule> m(new HostModule());
  m->handle_ = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!m->handle_) return Status::errorf("simt: cannot load {}: {}", so, dlerror());
  for (const codegen::EmittedKernel& k : module.kernels) {
    void* sym = dlsym(m->handle_, ("kiln_simt_launch_" + k.name).c_str());
    if (!sym) return Status::errorf("simt: {} has no launcher for {}", so, k.name);
    m->entries_[k.name] = reinterpret_cast<Entry>(sym);
  }
  return m;
}

HostModule::~HostModule() {
  if (handle_) dlclose(handle_);
}

Status HostModule::launch(const std::string& name, const codegen::LaunchConfig& launch,
                          const std::vector<void*>& args) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return Status::errorf("simt: the module has no kernel '{}'", name);
  std::vector<void*> a = args;
  char err[512] = {0};
  if (it->second(launch.grid, launch.block, a.data(), err, sizeof err) != 0) return Status::errorf("simt: {}", err);
  return Status::ok();
}

}  // namespace kiln::simt
