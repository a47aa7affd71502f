// Compiled kernels as data: images of CUBIN (for one real GPU architecture, sm_XX) or PTX (for a
// virtual one, compute_XX, which the driver JIT-compiles for any newer GPU), each naming the
// extern "C" kernels it holds. compileKernelsAhead (runtime/cuda/ahead_compile.h) fills one;
// CudaExecutorOptions::kernels runs from one without NVRTC. Needs no CUDA headers.
//
// The serialized form is little-endian: the magic "KILNKSET", a u32 format version, a u32 image
// count, then per image its arch, its kernel names (a u32 count) and its bytes, each string as a
// u32 (bytes: u64) length and its bytes; last, a u64 FNV-1a hash of everything before it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"

namespace kiln::cuda {

struct KernelImage {
  std::string arch;                  // "sm_90" (CUBIN) or "compute_90" (PTX)
  std::vector<std::string> kernels;  // the extern "C" names it holds
  std::string bytes;

  bool isPtx() const { return arch.rfind("compute_", 0) == 0; }
};

struct KernelSet {
  std::vector<KernelImage> images;

  // Adds the images of another set (another function, or another batch): an image whose arch
  // already has every one of its kernels in this set is dropped.
  void merge(KernelSet other);
  // The archs of the images, each once: CUBIN archs by number, then PTX archs by number
  // ("sm_80", "sm_90", "compute_90").
  std::vector<std::string> archs() const;
  // Every kernel name of every image, each once, sorted.
  std::vector<std::string> kernelNames() const;

  static constexpr std::string_view kMagic = "KILNKSET";
  static constexpr uint32_t kVersion = 1;
  std::string serialize() const;
  // `what` names the bytes' origin in errors ("kiln-runner's cuda.kernels").
  static Expected<KernelSet> deserialize(std::string_view bytes, std::string_view what);

  // The images a GPU of `device_arch` (e.g. "sm_90") loads for `names`: the CUBIN of exactly that
  // arch if it holds them all, else the PTX of the newest compute_XX <= the device's arch that
  // holds them all (the driver JIT-compiles it), else an error naming the set's archs and the
  // GPU's. Only images holding a name not yet covered are returned, in the set's order.
  Expected<std::vector<const KernelImage*>> select(const std::string& device_arch,
                                                   const std::vector<std::string>& names) const;
};

// The number of an arch name: 90 for "sm_90", "sm_90a" and "compute_90"; -1 for anything else.
int archNumber(std::string_view arch);

}  // namespace kiln::cuda
