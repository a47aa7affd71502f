// What the host CPU can do, read from CPUID (and XGETBV: whether the OS saves the AVX-512 and
// AMX register state), never from its model number: a new CPU is judged by its features. The
// CPU backend reports the level it found (`kiln version`, the progress header of `kiln train`)
// and warns where a library in the process runs below it (docs/runtime.md).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::runtime::cpu {

struct CpuFeatures {
  std::string vendor;      // "GenuineIntel", "AuthenticAMD"
  std::string model_name;  // the brand string
  bool sse42 = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_bf16 = false;
  bool amx_tile = false;
  bool amx_bf16 = false;

  // The vector level the CPU backend can use: "amx" (with AVX512-BF16 and AMX-BF16), "avx512-bf16",
  // "avx512", "avx2", "sse4.2", or "generic".
  std::string isaLevel() const;
  // The level in the form of the progress header: "avx512+amx-bf16", "avx512+bf16", "avx512",
  // "avx2", "sse4.2", "generic".
  std::string summary() const;
  // Whether bf16 GEMMs run natively (AVX512-BF16 or AMX-BF16) rather than emulated.
  bool nativeBf16() const { return avx512_bf16 || amx_bf16; }
};

// The order of the levels of isaLevel(): generic 0 up to amx 5.
int isaRank(std::string_view level);

// The host's features, read once.
const CpuFeatures& hostCpu();

// The same features as Linux's /proc/cpuinfo "flags" line names them (avx2, avx512f, avx512_bf16,
// amx_bf16, ...), for the test that checks CPUID against the kernel's view.
CpuFeatures featuresFromCpuinfoFlags(std::string_view flags_line);

// Warnings about libraries in this process that run below the CPU's level (an unknown CPU model
// falling back to generic kernels), each with its fix. Empty when all is well.
std::vector<std::string> cpuLibraryWarnings();

}  // namespace kiln::runtime::cpu
