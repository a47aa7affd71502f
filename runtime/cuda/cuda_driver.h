// The CUDA driver API, loaded at run time from libcuda.so.1 (never linked), and thin RAII
// helpers over it: a context on one device, device memory, streams, events, modules, graphs.
// Every failing call becomes a Status naming the call and what it was doing, e.g.
// "cuLaunchKernel (kiln_softmax_1a2b...): CUDA_ERROR_INVALID_VALUE: invalid argument".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ir/status.h"
#include "runtime/cuda/dynamic_library.h"

#ifdef KILN_HAVE_CUDA_HEADERS
#include <cuda.h>
#endif

namespace kiln::cuda {

#ifdef KILN_HAVE_CUDA_HEADERS

class CudaDriver {
 public:
  // The process-wide driver, loaded and cuInit'ed once. Errors: "no CUDA driver: libcuda.so.1
  // not found ..." on machines without one, or cuInit's error (e.g. no device).
  static Expected<CudaDriver*> get();

  // A failed CUresult as a Status: "<call> (<what>): CUDA_ERROR_...: <description>".
  Status check(CUresult r, const char* call, const std::string& what = "") const;

#define KILN_CU_FN(name) decltype(&::name) name = nullptr;
#include "runtime/cuda/driver_functions.def"
#undef KILN_CU_FN

  int version() const { return version_; }
  const std::string& libraryPath() const { return lib_.path(); }

 private:
  DynamicLibrary lib_;
  int version_ = 0;
};

// Checks a driver call inside a function returning Status or Expected<T>.
#define KILN_CU(drv, call, what)                                        \
  do {                                                                  \
    ::kiln::Status kiln_cu_status_ = (drv)->check((drv)->call, #call, what); \
    if (!kiln_cu_status_.isOk()) return kiln_cu_status_;                \
  } while (0)

// The primary context of one device, current on the calling thread.
class CudaContext {
 public:
  static Expected<std::unique_ptr<CudaContext>> create(int device = 0);
  ~CudaContext();
  CudaDriver* driver() const { return drv_; }
  CUdevice device() const { return device_; }
  const std::string& name() const { return name_; }
  // "sm_90" for compute capability 9.0.
  const std::string& arch() const { return arch_; }
  int multiprocessors() const { return sms_; }
  Status makeCurrent() const;

 private:
  CudaDriver* drv_ = nullptr;
  CUdevice device_ = 0;
  CUcontext ctx_ = nullptr;
  std::string name_, arch_;
  int sms_ = 0;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Expected<DeviceBuffer> allocate(CudaDriver* drv, size_t bytes, const std::string& what);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : drv_(o.drv_), ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  CUdeviceptr ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Status upload(const void* host, size_t bytes, size_t offset = 0) const;
  Status download(void* host, size_t bytes, size_t offset = 0) const;

 private:
  CudaDriver* drv_ = nullptr;
  CUdeviceptr ptr_ = 0;
  size_t bytes_ = 0;
};

class Stream {
 public:
  static Expected<std::unique_ptr<Stream>> create(CudaDriver* drv);
  ~Stream();
  CUstream get() const { return s_; }
  Status synchronize() const;

 private:
  CudaDriver* drv_ = nullptr;
  CUstream s_ = nullptr;
};

// An event for ordering work across streams (timing disabled: it only orders).
class Event {
 public:
  static Expected<std::unique_ptr<Event>> create(CudaDriver* drv, const std::string& what);
  ~Event();
  CUevent get() const { return e_; }

 private:
  CudaDriver* drv_ = nullptr;
  CUevent e_ = nullptr;
};

// Page-locked host memory: copies from it are truly asynchronous (a pageable source makes
// cuMemcpyHtoDAsync stage through a driver buffer and block the host).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static Expected<PinnedBuffer> allocate(CudaDriver* drv, size_t bytes, const std::string& what);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept : drv_(o.drv_), ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  CudaDriver* drv_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A loaded CUBIN (or PTX, which the driver JIT-compiles) and its kernels.
class LoadedModule {
 public:
  static Expected<std::unique_ptr<LoadedModule>> load(CudaDriver* drv, const std::vector<char>& cubin);
  // `image`: a CUBIN, or PTX text followed by a NUL (a std::string's data() is); `what` names it
  // in errors.
  static Expected<std::unique_ptr<LoadedModule>> loadImage(CudaDriver* drv, const char* image,
                                                           const std::string& what);
  ~LoadedModule();
  Expected<CUfunction> function(const std::string& name) const;

 private:
  CudaDriver* drv_ = nullptr;
  CUmodule m_ = nullptr;
};

// Launches `fn` with one pointer argument per buffer.
Status launchKernel(CudaDriver* drv, CUfunction fn, const std::string& name, int64_t grid, int block,
                    const std::vector<CUdeviceptr>& args, CUstream stream);

// A captured sequence of stream work, replayed with one launch.
class CudaGraph {
 public:
  ~CudaGraph();
  static Status beginCapture(CudaDriver* drv, CUstream s);
  static Expected<std::unique_ptr<CudaGraph>> endCapture(CudaDriver* drv, CUstream s);
  Status launch(CUstream s) const;

 private:
  CudaDriver* drv_ = nullptr;
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
};

#endif  // KILN_HAVE_CUDA_HEADERS

// True when a CUDA driver loads and reports at least one device; `why` says why not.
bool cudaAvailable(std::string* why = nullptr);

}  // namespace kiln::cuda
