// Prints kernel IR as CUDA C++ for NVRTC.
//
// The source is self-contained: a small prelude (a bf16 storage type with round-to-nearest-even
// conversion, overloaded loads/stores and math, warp/block reductions, the embedding device
// functions) and one `extern "C" __global__` function per kernel, no host code and no #include,
// so NVRTC compiles it without the toolkit's include directory. A kernel's name is its stem plus
// a hash of its text (`kiln_add_relu_3f2a9c0d1e4b5a67`): the same kernel IR always prints the
// same name and source, and identical kernels of a module are printed once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"

namespace kiln::codegen {

struct LaunchConfig {
  int64_t grid = 1;
  int block = 256;
  bool operator==(const LaunchConfig& o) const = default;
};

// How a kernel is launched: one block per outer element for Row kernels, a grid-stride loop of
// 256-thread blocks for Pointwise kernels, one warp per bag (or per id) for embedding kernels.
// Pointwise, Row and ColumnReduce grids stop at a few full waves of the kernel's GPU (Kernel::sms
// x the blocks an SM holds, waveBlocks); their loops stride over the rest.
LaunchConfig launchConfig(const Kernel& k);

struct EmittedKernel {
  std::string name;  // the extern "C" symbol
  LaunchConfig launch;
  int first_line = 0, last_line = 0;  // 1-based lines of the module source, for NVRTC's log
};

struct CudaModule {
  std::string source;
  std::vector<EmittedKernel> kernels;  // in the order given, duplicates included
  // The kernel whose text holds a 1-based source line ("" for the prelude).
  std::string kernelAtLine(int line) const;
};

// The shared prelude every module starts with.
const std::string& cudaPrelude();

// One kernel's text (without the prelude); `name` receives its symbol.
std::string emitKernel(const Kernel& k, std::string* name = nullptr);

// A module holding the prelude and every kernel.
CudaModule emitModule(const std::vector<const Kernel*>& kernels);

// 64-bit FNV-1a, the content hash of names and cache keys.
uint64_t fnv1a64(std::string_view s, uint64_t seed = 1469598103934665603ull);

}  // namespace kiln::codegen
