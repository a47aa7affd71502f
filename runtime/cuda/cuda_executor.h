// The CUDA executor: runs one Function (the training step or the forward pass) on one GPU.
//
// create() lowers the function to kernel groups (codegen::lowerFunction), plans one device
// arena for every value that crosses a group with the memory planner (a Program with one launch
// per group, so lifetimes follow the group order), compiles all kernels as one NVRTC module
// through the disk cache, and resolves every kernel argument to a device address. run() uploads
// the inputs, launches the groups in order on one stream (kiln.matmul through cuBLASLt), checks
// the embedding kernels' out-of-range flags and downloads the results. From the second run on,
// the step is captured once as a CUDA graph and replayed (shapes are static per executor).
//
// Parameters and optimizer state live in a CudaSession shared by the executors of one model, so
// @forward sees what @train_step wrote; they are copied from and back to a ParameterStore only
// when asked (at start, for checkpoints and evaluation on the host).
//
// Without the CUDA toolkit's headers at build time, or without a driver at run time, create()
// returns a clear error; nothing here crashes on a CPU-only machine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "codegen/program.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/executor.h"
#include "runtime/parameter_store.h"

namespace kiln::cuda {

struct CudaSessionOptions {
  int device = 0;
  std::string cache_dir;  // empty: defaultCacheDir()
  std::string arch;       // empty: the device's own (sm_90 on the H200)
};

// One GPU's context, stream, NVRTC, cuBLASLt and the device copies of a model's parameters.
class CudaSession {
 public:
  static Expected<std::shared_ptr<CudaSession>> create(const CudaSessionOptions& options = {});
  ~CudaSession();

  // Copies every tensor of the store to the device (allocating on first sight; a tensor whose
  // size changed is reallocated, which invalidates executors created before).
  Status uploadParameters(const runtime::ParameterStore& store);
  // Copies every device parameter back into the store's tensors.
  Status downloadParameters(runtime::ParameterStore& store) const;
  bool hasParameter(const std::string& name) const;

  std::string deviceName() const;
  std::string arch() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  CudaSession() = default;
  std::unique_ptr<Impl> impl_;
};

struct CudaExecutorOptions {
  bool use_graph = true;      // capture the step as a CUDA graph on the second run
  bool poison_arena = false;  // fill the arena with 0xFF bytes (NaN) before each run (tests)
};

class CudaExecutor {
 public:
  // Every parameter the function reads must already be in the session (uploadParameters).
  static Expected<std::unique_ptr<CudaExecutor>> create(const ir::Function& f, const ir::SymbolBindings& symbols,
                                                        std::shared_ptr<CudaSession> session,
                                                        const CudaExecutorOptions& options = {});
  ~CudaExecutor();

  // Runs the function once; returns its results in order as host tensors. Inputs must have
  // exactly their bound shapes.
  Expected<std::vector<ir::HostTensor>> run(const runtime::cpu::Batch& batch);

  // Runs the function once more, eagerly, with an event around every kernel and GEMM: the
  // device time of each, in order (for the benchmark's bandwidth and TFLOP/s figures).
  struct Timing {
    std::string name;   // kernel symbol, or the GEMM's description
    bool gemm = false;
    double flops = 0;   // GEMMs: 2*M*N*K*batch
    double ms = 0;
  };
  Expected<std::vector<Timing>> profile(const runtime::cpu::Batch& batch);

  // The buffers and arena plan (one launch per group).
  const codegen::Program& plan() const;
  int numKernels() const;
  int numGemms() const;
  bool graphCaptured() const;
  int kernelsCompiled() const;  // NVRTC invocations at create (0 when the cache had the module)

  struct Impl;

 private:
  CudaExecutor() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::cuda
