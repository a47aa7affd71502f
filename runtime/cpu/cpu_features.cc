#include "runtime/cpu/cpu_features.h"

#include <cpuid.h>
#include <dlfcn.h>
#include <strings.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "runtime/cpu/gemm.h"

namespace kiln::runtime::cpu {
namespace {

struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return {};
  return r;
}

bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

// The register state the OS saves on a context switch (XCR0); without it the instructions fault.
uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

CpuFeatures readHost() {
  CpuFeatures f;
  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  Regs v = cpuid(0, 0);
  char vendor[13] = {};
  std::memcpy(vendor, &v.ebx, 4);
  std::memcpy(vendor + 4, &v.edx, 4);
  std::memcpy(vendor + 8, &v.ecx, 4);
  f.vendor = vendor;
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      Regs b = cpuid(0x80000002 + i, 0);
      std::memcpy(brand + 16 * i, &b, 16);
    }
    f.model_name = brand;
    while (!f.model_name.empty() && f.model_name.back() == ' ') f.model_name.pop_back();
    while (!f.model_name.empty() && f.model_name.front() == ' ') f.model_name.erase(0, 1);
  }
  if (max_leaf < 1) return f;
  Regs l1 = cpuid(1, 0);
  const bool osxsave = bit(l1.ecx, 27);
  const uint64_t xcr = osxsave ? xcr0() : 0;
  const bool os_avx = (xcr & 0x6) == 0x6;                  // SSE and AVX state
  const bool os_avx512 = os_avx && (xcr & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr & 0x60000) == 0x60000;         // XTILECFG, XTILEDATA
  f.sse42 = bit(l1.ecx, 20);
  f.avx = os_avx && bit(l1.ecx, 28);
  f.fma = f.avx && bit(l1.ecx, 12);
  if (max_leaf >= 7) {
    Regs l7 = cpuid(7, 0);
    f.avx2 = f.avx && bit(l7.ebx, 5);
    f.avx512f = os_avx512 && bit(l7.ebx, 16);
    f.avx512bw = f.avx512f && bit(l7.ebx, 30);
    f.avx512vl = f.avx512f && bit(l7.ebx, 31);
    f.amx_bf16 = os_amx && bit(l7.edx, 22);
    f.amx_tile = os_amx && bit(l7.edx, 24);
    if (l7.eax >= 1) f.avx512_bf16 = f.avx512f && bit(cpuid(7, 1).eax, 5);
  }
  return f;
}

}  // namespace

std::string CpuFeatures::isaLevel() const {
  if (amx_tile && amx_bf16 && avx512_bf16) return "amx";
  if (avx512_bf16) return "avx512-bf16";
  if (avx512f && avx512bw && avx512vl) return "avx512";
  if (avx2 && fma) return "avx2";
  if (sse42) return "sse4.2";
  return "generic";
}

int isaRank(std::string_view level) {
  static constexpr std::string_view kLevels[] = {"generic", "sse4.2", "avx2", "avx512", "avx512-bf16", "amx"};
  for (int i = 0; i < static_cast<int>(std::size(kLevels)); ++i)
    if (kLevels[i] == level) return i;
  return 0;
}

std::string CpuFeatures::summary() const {
  const std::string level = isaLevel();
  if (level == "amx") return "avx512+amx-bf16";
  if (level == "avx512-bf16") return "avx512+bf16";
  return level;
}

const CpuFeatures& hostCpu() {
  static const CpuFeatures f = readHost();
  return f;
}

CpuFeatures featuresFromCpuinfoFlags(std::string_view flags_line) {
  CpuFeatures f;
  std::istringstream in{std::string(flags_line)};
  std::string flag;
  while (in >> flag) {
    if (flag == "sse4_2") f.sse42 = true;
    else if (flag == "avx") f.avx = true;
    else if (flag == "avx2") f.avx2 = true;
    else if (flag == "fma") f.fma = true;
    else if (flag == "avx512f") f.avx512f = true;
    else if (flag == "avx512bw") f.avx512bw = true;
    else if (flag == "avx512vl") f.avx512vl = true;
    else if (flag == "avx512_bf16") f.avx512_bf16 = true;
    else if (flag == "amx_tile") f.amx_tile = true;
    else if (flag == "amx_bf16") f.amx_bf16 = true;
  }
  return f;
}

std::vector<std::string> cpuLibraryWarnings() {
  std::vector<std::string> warnings;
  const CpuFeatures& cpu = hostCpu();
  // oneDNN: the level it dispatches to must be the CPU's own.
  const OnednnIsa dnnl = onednnIsa();
  if (isaRank(dnnl.level) < isaRank(cpu.isaLevel())) {
    const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
    warnings.push_back(fmt::format(
        "oneDNN {} runs its {} kernels on a CPU with {} ({}); {}", dnnl.version, dnnl.name, cpu.summary(),
        cpu.model_name,
        cap ? fmt::format("ONEDNN_MAX_CPU_ISA={} caps it: unset it", cap)
            : std::string("this oneDNN predates the CPU's instructions: install a newer libdnnl")));
  }
  // Any OpenBLAS in the process (a host program of the C API may bring one): an unknown CPU
  // model makes it fall back to its oldest kernels, 4-6x slower, without a word.
  using CorenameFn = char* (*)();
  if (auto corename = reinterpret_cast<CorenameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    const std::string core = corename() ? corename() : "";
    static const char* const kGeneric[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom",
                                           "Katmai", "Coppermine", "Northwood", "Banias", "generic", "Unknown"};
    bool generic = core.empty();
    for (const char* g : kGeneric) generic |= strcasecmp(core.c_str(), g) == 0;
    if (generic && cpu.avx2)
      warnings.push_back(fmt::format(
          "OpenBLAS in this process runs its generic '{}' kernels on a CPU with {}; set OPENBLAS_CORETYPE={} before "
          "starting the program",
          core, cpu.summary(), cpu.avx512f ? "SkylakeX" : "Haswell"));
  }
  return warnings;
}

}  // namespace kiln::runtime::cpu
