// The CUDA executor: runs one Function (the training step or the forward pass) on one GPU.
//
// create() lowers the function to kernel groups (codegen::lowerFunction) and takes the Program
// codegen::buildCudaProgram (codegen/cuda_program.h) builds from them: one launch per group on
// the group's stream (the schedule pass's `kiln.stream`: embedding lookups and sparse updates on
// stream 1), record/wait events where a group reads, or updates in place, what another stream
// touches, and one device arena laid out by the stream-aware memory planner. The executor only
// maps that Program's buffers to device memory and launches its steps: it compiles the kernels
// with NVRTC, split into several programs compiled on a small thread pool through the disk cache
// (runtime/cuda/ahead_compile.h), or takes them from a KernelSet compiled ahead of time
// (CudaExecutorOptions::kernels: NVRTC is then never loaded), and resolves every kernel argument
// to a device address.
// A run goes through the input pipeline (input_pipeline.h): stage() copies the batch into a
// pinned slot and uploads it (a batch the data thread already copied into a buffer of
// stagingPool(): that buffer) on the executor's copy stream into a device landing slot; launch()
// makes stream 0 wait for that upload, copy the landing slot into the step's input buffers, run
// each Program stream on its own CUstream (kiln.matmul through cuBLASLt) and download the results
// and the embedding kernels' error flags into a pinned result slot; collect() waits for that
// download alone (an event; never a device or stream synchronize) and checks the flags. run() is
// the three in a row; a training loop stages batch i+1 between launch and collect of step i, so
// its upload overlaps step i. From the second launch on, the step is captured once as a CUDA
// graph (stream 0 forks the other streams through an event and joins them at the end, so the
// graph keeps the cross-stream edges) and replayed (shapes are static per executor): the graph
// reads the same input buffers every step, whichever slot the batch came through.
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

#include "codegen/cuda_program.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/executor.h"
#include "runtime/cuda/cublaslt.h"
#include "runtime/cuda/input_pipeline.h"
#include "runtime/cuda/kernel_set.h"
#include "runtime/parameter_store.h"
#include "runtime/trace.h"

namespace kiln::data {
class StagingPool;
}

namespace kiln::cuda {

struct CudaSessionOptions {
  int device = 0;
  std::string cache_dir;  // empty: defaultCacheDir()
  std::string arch;       // empty: the device's own (sm_90 on the H200)
};

// One GPU's context, stream (stream 0 of every executor), NVRTC (loaded at the first JIT
// compile, so executors run from a KernelSet never load it), cuBLASLt and the device copies of a
// model's parameters.
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
  // The device memory free now and in all (cuMemGetInfo), for the session's memory check.
  struct MemoryInfo {
    uint64_t free_bytes = 0, total_bytes = 0;
  };
  Expected<MemoryInfo> memoryInfo() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  CudaSession() = default;
  std::unique_ptr<Impl> impl_;
};

struct CudaExecutorOptions {
  bool use_graph = true;      // capture the step as a CUDA graph on the second run
  bool poison_arena = false;  // fill the arena with 0xFF bytes (NaN) before each run (tests)
  // While this tracer records, run() goes eagerly (not through the graph) with a timing event
  // before and after every kernel and GEMM on its own stream: each becomes an event on the
  // stream's track, placed on the host clock by an event the host waits for at the start; the
  // host's final wait is a "wait" event on the host track.
  runtime::Tracer* tracer = nullptr;
  int rank = 0;  // the trace's pid
  // Kernels compiled ahead of time (compileKernelsAhead at the same symbols): create() loads the
  // images selected for the session's arch and never touches NVRTC. The set must outlive
  // create() only.
  const KernelSet* kernels = nullptr;
  int nvrtc_threads = 0;  // JIT compile threads; 0: nvrtcThreads() ($KILN_NVRTC_THREADS or all)
  // Batches that may be staged ahead of launch (each slot: one pinned and one device copy of the
  // inputs, one pinned copy of the results). One already hides the upload in the trainer's order
  // (launch i, stage i+1, collect i); two let a caller stage two batches ahead.
  int input_slots = InputPipeline::kDefaultSlots;
};

class CudaExecutor {
 public:
  // Every parameter the function reads must already be in the session (uploadParameters).
  static Expected<std::unique_ptr<CudaExecutor>> create(const ir::Function& f, const ir::SymbolBindings& symbols,
                                                        std::shared_ptr<CudaSession> session,
                                                        const CudaExecutorOptions& options = {});
  ~CudaExecutor();

  // Runs the function once; returns its results in order as host tensors. Inputs must have
  // exactly their bound shapes. The same as collect(launch(stage(batch))).
  Expected<std::vector<ir::HostTensor>> run(const runtime::cpu::Batch& batch);

  // The input pipeline, for a loop that keeps the GPU busy (docs/runtime.md, "Feeding the GPU"):
  //   t0 = stage(b0); launch(t0); t1 = stage(b1); collect(t0); launch(t1); t2 = stage(b2); ...
  // Each call returns once its work is enqueued; only collect() waits, and only for its step.
  using Ticket = int64_t;
  // Checks the batch and copies it into a free pinned slot (waiting, if need be, for that slot's
  // previous upload), then enqueues its upload on the copy stream. The batch may be freed after.
  // A batch whose inputs lie in a buffer of stagingPool() at their places is not copied: the
  // upload reads that buffer (after the host writes the inputs outside it, such as lr and step,
  // into it), and the pool hands the buffer out again only once that upload is done.
  // At most options.input_slots batches may be staged and not launched.
  Expected<Ticket> stage(const runtime::cpu::Batch& batch);
  // Page-locked buffers (cuMemHostAlloc, portable) laid out as this executor's input slots, for
  // the data thread to copy batches into (data::Prefetcher::stageInto). Made at the first call
  // with `buffers` buffers; later calls return the same pool.
  Expected<std::shared_ptr<data::StagingPool>> stagingPool(int buffers);
  // How stage() found its batches: uploaded from their staging buffer, or copied by the host
  // into a pinned slot; and the bytes the host copied (in place: the inputs outside the buffer).
  struct StagingStats {
    int64_t in_place = 0, filled = 0;
    uint64_t host_bytes = 0;
  };
  StagingStats stagingStats() const;
  // Enqueues the step on a staged batch (the oldest staged first). The results of the ticket
  // input_slots before must have been collected. A launch that fails forgets its ticket.
  Status launch(Ticket ticket);
  // Waits for the step's results and returns them (or the error an embedding kernel flagged).
  Expected<std::vector<ir::HostTensor>> collect(Ticket ticket);
  // Forgets a staged batch that will not run (or a launched one whose results will not be read).
  Status drop(Ticket ticket);
  // Tickets staged and not launched, oldest first.
  std::vector<Ticket> staged() const;

  // Runs the function once more, eagerly and serialized on stream 0 (groups in order), with an
  // event around every kernel and GEMM: the device time of each, in order (for the benchmark's
  // bandwidth and TFLOP/s figures).
  struct Timing {
    std::string name;   // kernel symbol, or the GEMM's description
    bool gemm = false;
    double flops = 0;   // GEMMs: 2*M*N*K*batch
    double ms = 0;
  };
  Expected<std::vector<Timing>> profile(const runtime::cpu::Batch& batch);

  // The buffers, streams and arena plan (one launch per group).
  const codegen::Program& plan() const;
  int numKernels() const;
  int numGemms() const;
  bool graphCaptured() const;
  int kernelsCompiled() const;  // NVRTC invocations at create (0 when the cache had every program)
  int modulesLoaded() const;    // CUBIN or PTX modules loaded at create

  struct Impl;

 private:
  CudaExecutor() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::cuda
