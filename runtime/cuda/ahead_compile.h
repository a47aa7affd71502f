// Compiling a function's kernels with NVRTC on several threads, for the executor's JIT path and
// ahead of time.
//
// A function's kernels (deduplicated by name, in the order the lowering first gives them) are
// split into groups of consecutive kernels, each compiled as its own NVRTC program: about
// ceil(kernels / (4 * threads)) kernels per program, at least kMinKernelsPerProgram so the
// prelude every program repeats stays a small part of its cost. Four programs per thread keep
// the threads busy when programs differ in size (the largest are started first). The groups
// depend only on the kernels and the thread count, so a rerun with the same threads hits the
// disk cache program by program.
//
// compileKernelsAhead lowers a function exactly as CudaExecutor::create does (the same kernel
// names) and compiles every group for every requested arch, plus PTX for the newest: a
// KernelSet that an executor on a machine without NVRTC runs from (CudaExecutorOptions::kernels).
#pragma once

#include <string>
#include <vector>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_ir.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "runtime/cuda/kernel_set.h"
#include "runtime/cuda/nvrtc_compiler.h"

namespace kiln::cuda {

inline constexpr int kMinKernelsPerProgram = 4;

// `requested` when positive, else $KILN_NVRTC_THREADS when it is a positive number, else the
// hardware's threads (at least 1).
int nvrtcThreads(int requested = 0);

// The kernels deduplicated by name (first occurrence kept), split into NVRTC programs for
// `threads` threads as described above; program sizes differ by at most one.
std::vector<std::vector<const codegen::Kernel*>> splitIntoPrograms(
    const std::vector<const codegen::Kernel*>& kernels, int threads);

struct CompileJob {
  const codegen::CudaModule* module = nullptr;
  std::string arch;  // sm_XX (CUBIN) or compute_XX (PTX)
};

// Compiles every job through `nvrtc` on up to `threads` threads (one: on the caller's thread),
// largest source first. The results are in job order; on a failure, the error of the first
// failing job in job order (jobs not yet started are skipped).
Expected<std::vector<CompiledModule>> compileInParallel(NvrtcCompiler& nvrtc,
                                                        const std::vector<CompileJob>& jobs, int threads);

struct AheadOptions {
  std::vector<std::string> archs{"sm_80", "sm_90"};  // CUBIN for each
  bool ptx = true;                                   // and PTX (compute_XX) of the newest
  int threads = 0;                                   // 0: nvrtcThreads()
  std::string cache_dir;                             // "": no disk cache
};

// Every kernel of `f` at `symbols`, compiled for every arch of `options` (see above). Errors:
// a bad arch name, NVRTC missing (saying so), the lowering's or NVRTC's errors.
Expected<KernelSet> compileKernelsAhead(const ir::Function& f, const ir::SymbolBindings& symbols,
                                        const AheadOptions& options);

}  // namespace kiln::cuda
