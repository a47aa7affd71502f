#include "runtime/cuda/cuda_driver.h"

#include <algorithm>
#include <mutex>

#include <fmt/format.h>

namespace kiln::cuda {

#ifdef KILN_HAVE_CUDA_HEADERS

#define KILN_STR(x) #x
#define KILN_XSTR(x) KILN_STR(x)

Expected<CudaDriver*> CudaDriver::get() {
  static std::once_flag once;
  static CudaDriver* driver = nullptr;
  static Status error;
  std::call_once(once, [] {
    auto lib = DynamicLibrary::open({"libcuda.so.1", "libcuda.so"});
    if (!lib) {
      error = Status::errorf("no CUDA driver: libcuda.so.1 not found ({})", lib.status().message());
      return;
    }
    auto* d = new CudaDriver();
    d->lib_ = lib.take();
    std::string missing;
    // KILN_XSTR expands cuda.h's versioning macros, so the symbol matches the prototype.
#define KILN_CU_FN(name)                                                               \
  d->name = reinterpret_cast<decltype(d->name)>(d->lib_.symbol(KILN_XSTR(name)));     \
  if (!d->name) missing += std::string(missing.empty() ? "" : ", ") + KILN_XSTR(name);
#include "runtime/cuda/driver_functions.def"
#undef KILN_CU_FN
    if (!missing.empty()) {
      error = Status::errorf("the CUDA driver {} is too old: it lacks {}", d->lib_.path(), missing);
      delete d;
      return;
    }
    Status s = d->check(d->cuInit(0), "cuInit");
    if (s.isOk()) s = d->check(d->cuDriverGetVersion(&d->version_), "cuDriverGetVersion");
    if (!s.isOk()) {
      error = std::move(s);
      delete d;
      return;
    }
    driver = d;  // lives for the process: kernels and contexts may outlive any owner
  });
  if (!driver) return error;
  return driver;
}

Status CudaDriver::check(CUresult r, const char* call, const std::string& what) const {
  if (r == CUDA_SUCCESS) return Status::ok();
  const char* name = nullptr;
  const char* desc = nullptr;
  if (cuGetErrorName) cuGetErrorName(r, &name);
  if (cuGetErrorString) cuGetErrorString(r, &desc);
  return Status::errorf("{}{}: {}: {}", call, what.empty() ? "" : " (" + what + ")", name ? name : std::to_string(r),
                        desc ? desc : "unknown error");
}

Expected<std::unique_ptr<CudaContext>> CudaContext::create(int device) {
  auto drv = CudaDriver::get();
  if (!drv) return drv.status();
  CudaDriver* d = *drv;
  std::unique_ptr<CudaContext> c(new CudaContext());
  c->drv_ = d;
  int count = 0;
  KILN_CU(d, cuDeviceGetCount(&count), "");
  if (device < 0 || device >= count)
    return Status::errorf("CUDA device {} does not exist ({} device(s) present)", device, count);
  KILN_CU(d, cuDeviceGet(&c->device_, device), "");
  char name[256] = {};
  KILN_CU(d, cuDeviceGetName(name, sizeof(name), c->device_), "");
  c->name_ = name;
  int major = 0, minor = 0;
  KILN_CU(d, cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, c->device_), "");
  KILN_CU(d, cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, c->device_), "");
  KILN_CU(d, cuDeviceGetAttribute(&c->sms_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, c->device_), "");
  c->arch_ = fmt::format("sm_{}{}", major, minor);
  KILN_CU(d, cuDevicePrimaryCtxRetain(&c->ctx_, c->device_), "");
  KILN_RETURN_IF_ERROR(c->makeCurrent());
  return c;
}

CudaContext::~CudaContext() {
  if (ctx_) drv_->cuDevicePrimaryCtxRelease(device_);
}

Status CudaContext::makeCurrent() const { return drv_->check(drv_->cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); }

Expected<DeviceBuffer> DeviceBuffer::allocate(CudaDriver* drv, size_t bytes, const std::string& what) {
  DeviceBuffer b;
  b.drv_ = drv;
  b.bytes_ = bytes;
  if (bytes == 0) return b;
  KILN_CU(drv, cuMemAlloc(&b.ptr_, bytes), fmt::format("{} bytes for {}", bytes, what));
  return b;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) drv_->cuMemFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) drv_->cuMemFree(ptr_);
    drv_ = o.drv_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = 0;
  }
  return *this;
}

Status DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) return Status::errorf("upload of {} bytes at {} overruns a {}-byte buffer", bytes, offset, bytes_);
  KILN_RETURN_IF_ERROR(drv_->check(drv_->cuMemcpyHtoD(ptr_ + offset, host, bytes), "cuMemcpyHtoD"));
  // From pageable memory the copy may return before its DMA lands, and Kiln's streams do not
  // synchronize with the legacy stream it ran on: wait, so every later launch sees the data.
  return drv_->check(drv_->cuCtxSynchronize(), "cuCtxSynchronize after an upload");
}

Status DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) return Status::errorf("download of {} bytes at {} overruns a {}-byte buffer", bytes, offset, bytes_);
  return drv_->check(drv_->cuMemcpyDtoH(host, ptr_ + offset, bytes), "cuMemcpyDtoH");
}

Expected<std::unique_ptr<Stream>> Stream::create(CudaDriver* drv) {
  std::unique_ptr<Stream> s(new Stream());
  s->drv_ = drv;
  KILN_CU(drv, cuStreamCreate(&s->s_, CU_STREAM_NON_BLOCKING), "");
  return s;
}

Stream::~Stream() {
  if (s_) drv_->cuStreamDestroy(s_);
}

Status Stream::synchronize() const { return drv_->check(drv_->cuStreamSynchronize(s_), "cuStreamSynchronize"); }

Expected<std::unique_ptr<Event>> Event::create(CudaDriver* drv, const std::string& what) {
  std::unique_ptr<Event> e(new Event());
  e->drv_ = drv;
  KILN_CU(drv, cuEventCreate(&e->e_, CU_EVENT_DISABLE_TIMING), what);
  return e;
}

Event::~Event() {
  if (e_) drv_->cuEventDestroy(e_);
}

Expected<PinnedBuffer> PinnedBuffer::allocate(CudaDriver* drv, size_t bytes, const std::string& what) {
  PinnedBuffer b;
  b.drv_ = drv;
  KILN_CU(drv, cuMemAllocHost(&b.ptr_, std::max<size_t>(bytes, 1)), fmt::format("{} pinned bytes for {}", bytes, what));
  b.bytes_ = bytes;
  return b;
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) drv_->cuMemFreeHost(ptr_);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) drv_->cuMemFreeHost(ptr_);
    drv_ = o.drv_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
  }
  return *this;
}

Expected<std::unique_ptr<LoadedModule>> LoadedModule::load(CudaDriver* drv, const std::vector<char>& cubin) {
  std::unique_ptr<LoadedModule> m(new LoadedModule());
  m->drv_ = drv;
  KILN_CU(drv, cuModuleLoadData(&m->m_, cubin.data()), fmt::format("a {}-byte CUBIN", cubin.size()));
  return m;
}

Expected<std::unique_ptr<LoadedModule>> LoadedModule::loadImage(CudaDriver* drv, const char* image,
                                                                const std::string& what) {
  std::unique_ptr<LoadedModule> m(new LoadedModule());
  m->drv_ = drv;
  KILN_CU(drv, cuModuleLoadData(&m->m_, image), what);
  return m;
}

LoadedModule::~LoadedModule() {
  if (m_) drv_->cuModuleUnload(m_);
}

Expected<CUfunction> LoadedModule::function(const std::string& name) const {
  CUfunction f = nullptr;
  KILN_CU(drv_, cuModuleGetFunction(&f, m_, name.c_str()), name);
  return f;
}

Status launchKernel(CudaDriver* drv, CUfunction fn, const std::string& name, int64_t grid, int block,
                    const std::vector<CUdeviceptr>& args, CUstream stream) {
  if (grid < 1 || grid > 0x7fffffff) return Status::errorf("kernel {}: grid of {} blocks is out of range", name, grid);
  std::vector<void*> params;
  params.reserve(args.size());
  for (const CUdeviceptr& a : args) params.push_back(const_cast<CUdeviceptr*>(&a));
  return drv->check(drv->cuLaunchKernel(fn, static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(block), 1, 1, 0,
                                        stream, params.data(), nullptr),
                    "cuLaunchKernel", name);
}

Status CudaGraph::beginCapture(CudaDriver* drv, CUstream s) {
  return drv->check(drv->cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
}

Expected<std::unique_ptr<CudaGraph>> CudaGraph::endCapture(CudaDriver* drv, CUstream s) {
  std::unique_ptr<CudaGraph> g(new CudaGraph());
  g->drv_ = drv;
  KILN_CU(drv, cuStreamEndCapture(s, &g->graph_), "");
  KILN_CU(drv, cuGraphInstantiateWithFlags(&g->exec_, g->graph_, 0), "");
  return g;
}

CudaGraph::~CudaGraph() {
  if (exec_) drv_->cuGraphExecDestroy(exec_);
  if (graph_) drv_->cuGraphDestroy(graph_);
}

Status CudaGraph::launch(CUstream s) const { return drv_->check(drv_->cuGraphLaunch(exec_, s), "cuGraphLaunch"); }

bool cudaAvailable(std::string* why) {
  auto drv = CudaDriver::get();
  if (!drv) {
    if (why) *why = drv.status().message();
    return false;
  }
  int count = 0;
  Status s = (*drv)->check((*drv)->cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (!s.isOk() || count == 0) {
    if (why) *why = s.isOk() ? "no CUDA device present" : s.message();
    return false;
  }
  return true;
}

#else

bool cudaAvailable(std::string* why) {
  if (why) *why = "this kiln was built without the CUDA toolkit's headers";
  return false;
}

#endif

}  // namespace kiln::cuda
