#include "ir/target.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <thread>

namespace kiln {

bool FlopRates::narrow(ir::DType t) {
  return t == ir::DType::bf16 || t == ir::DType::f16 || t == ir::DType::f8e4m3 || t == ir::DType::f8e5m2;
}

namespace {

int cpuCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int64_t cpuMemoryBytes() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

// The two Hopper parts share one die (GH100, 132 SMs on the SXM board) and its compute: per
// the H100 and H200 datasheets (nvidia.com/en-us/data-center/h100/ and .../h200/), 1,979
// TFLOP/s BF16 with sparsity, so 989 dense, and 67 TFLOP/s FP32. Planned at 786 and 60.
// NVLink 4: 900 GB/s, both directions together. Between nodes, one 400 Gb/s NDR InfiniBand
// port per GPU (DGX H100/H200).
Target hopper(std::string name, std::string description, double hbm_bytes_per_s, int64_t memory_bytes) {
  Target t;
  t.name = std::move(name);
  t.description = std::move(description);
  t.kind = TargetKind::gpu;
  t.cores = 132;
  t.cuda_arch = "sm_90";
  t.shared_bytes_per_sm = 228 * 1024;
  // TF32: 494.7 TFLOP/s dense on the SXM parts, planned at 80% as bf16 is.
  t.gemm_flops_per_s = {6.0e13, 7.86e14, 3.96e14};
  t.vector_flops_per_s = {6.0e13, 6.0e13};
  t.bytes_per_s = hbm_bytes_per_s;
  t.launch_s = 4.0e-6;
  t.memory_bytes = memory_bytes;
  t.intra_node = {450e9, 3e-6};
  t.inter_node = {50e9, 6e-6};
  return t;
}

}  // namespace

Target cpuTarget() {
  // The machine does not change while we run; read it once.
  static const Target cpu = [] {
    Target t;
    t.name = "cpu";
    t.kind = TargetKind::cpu;
    t.cores = cpuCores();
    t.memory_bytes = cpuMemoryBytes();
    t.description = fmt::format("this machine's CPU ({} cores, {:.1f} GiB)", t.cores,
                                static_cast<double>(t.memory_bytes) / (1024.0 * 1024.0 * 1024.0));
    // A two-socket-class server with OpenBLAS: ~200 GFLOP/s f32 GEMM (bf16 is widened to f32,
    // so no faster), ~20 GFLOP/s in scalar loops, ~20 GB/s to DRAM, ~2 us to dispatch one op to
    // the thread pool. Not scaled by `cores`: the plan must not depend on where it was made.
    t.gemm_flops_per_s = {2.0e11, 2.0e11};
    t.vector_flops_per_s = {2.0e10, 2.0e10};
    t.bytes_per_s = 2.0e10;
    t.launch_s = 2.0e-6;
    // Ranks of one machine exchange through shared memory; machines over 100 Gb Ethernet.
    t.intra_node = {2.0e10, 1e-6};
    t.inter_node = {12.5e9, 10e-6};
    return t;
  }();
  return cpu;
}

Target h200Target() {
  // H200 SXM: 141 GB of HBM3e at 4.8 TB/s, planned at 4.3.
  return hopper("h200", "NVIDIA H200 SXM (141 GB HBM3e)", 4.3e12, 141'000'000'000);
}

Target h100Target() {
  // H100 SXM: 80 GB of HBM3 at 3.35 TB/s, planned at 3.0.
  return hopper("h100", "NVIDIA H100 SXM (80 GB HBM3)", 3.0e12, 80'000'000'000);
}

Target a100Target() {
  // A100 SXM4 80GB, per NVIDIA's A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
  // 312 TFLOP/s dense BF16 (planned at 248), 19.5 FP32 (17.5), 2,039 GB/s HBM2e (1.84 TB/s),
  // 108 SMs; NVLink 3 at 600 GB/s both directions; one 200 Gb/s HDR port per GPU (DGX A100).
  Target t;
  t.name = "a100";
  t.description = "NVIDIA A100 SXM4 (80 GB HBM2e)";
  t.kind = TargetKind::gpu;
  t.cores = 108;
  t.cuda_arch = "sm_80";
  t.shared_bytes_per_sm = 164 * 1024;
  t.gemm_flops_per_s = {1.75e13, 2.48e14, 1.24e14};  // TF32: 156 dense, planned at 124
  t.vector_flops_per_s = {1.75e13, 1.75e13};
  t.bytes_per_s = 1.84e12;
  t.launch_s = 4.0e-6;
  t.memory_bytes = 80'000'000'000;
  t.intra_node = {300e9, 3e-6};
  t.inter_node = {25e9, 6e-6};
  return t;
}

Occupancy blocksPerSm(const Target& target, int block, int registers, int64_t shared_bytes) {
  constexpr int kRegisters = 65536, kThreads = 2048, kBlocks = 32, kReservedShared = 1024;
  Occupancy o{kThreads / std::max(block, 1), "threads"};
  const int warps = (std::max(block, 1) + 31) / 32;
  const int per_warp = (registers * 32 + 255) / 256 * 256;
  if (per_warp > 0) {
    const int by_registers = kRegisters / per_warp / warps;
    if (by_registers < o.blocks) o = {by_registers, "registers"};
  }
  if (shared_bytes > 0 && target.shared_bytes_per_sm > 0) {
    const int by_shared = static_cast<int>(target.shared_bytes_per_sm / (shared_bytes + kReservedShared));
    if (by_shared < o.blocks) o = {by_shared, "shared memory"};
  }
  if (kBlocks < o.blocks) o = {kBlocks, "blocks"};
  return o;
}

const std::vector<std::string_view>& targetNames() {
  static const std::vector<std::string_view> names = {"cpu", "h200", "h100", "a100"};
  return names;
}

Expected<Target> targetByName(std::string_view name) {
  if (name == "cpu") return cpuTarget();
  if (name == "h200") return h200Target();
  if (name == "h100") return h100Target();
  if (name == "a100") return a100Target();
  return Status::errorf("unknown target '{}' (known targets: {})", name, fmt::join(targetNames(), ", "));
}

Target gpuTargetForDevice(std::string_view device_name) {
  std::string upper(device_name);
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
  if (upper.find("H100") != std::string::npos) return h100Target();
  if (upper.find("A100") != std::string::npos) return a100Target();
  return h200Target();
}

}  // namespace kiln
