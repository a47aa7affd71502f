// The machine a compilation plans for, as XLA's se::DeviceDescription describes a GPU: how many
// cores, how fast it multiplies and moves bytes, what a launch costs, how much memory it has,
// and how fast its links to other ranks are. Passes get one at construction (passes/pass.h) and
// cost their choices over it (passes/cost_model.h); `--target NAME` picks it on every command.
//
// The GPU figures are derived from NVIDIA's datasheets (target.cc names each source); the
// planning rates are what a well-tuned kernel reaches, not the peaks: about 80% of the dense
// tensor-core peak for GEMMs and 90% of the FP32 peak and of the HBM bandwidth, as measured for
// the H200 when its rates were first written down. The CPU's core count and memory are read off
// the machine; its rates are a fixed server-class estimate, so that a plan made on a laptop is
// the plan the server makes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ir/status.h"
#include "ir/types.h"

namespace kiln {

enum class TargetKind { cpu, gpu };

// FLOP/s by the dtype of the inputs: 16- and 8-bit floats run at `bf16`, everything else at
// `f32`. A GPU's GEMMs of f32 inputs run at `tf32` where the precision allows TF32
// (ir/precision.h: cuBLASLt's CUBLAS_COMPUTE_32F_FAST_TF32), at `f32` under f32_strict; a target
// without TF32 (the CPU) has tf32 = 0 and runs them at `f32`. Kiln's GEMMs use no FP8 mode.
struct FlopRates {
  double f32 = 0;
  double bf16 = 0;
  double tf32 = 0;
  double of(ir::DType t) const { return narrow(t) ? bf16 : f32; }
  static bool narrow(ir::DType t);  // runs at the `bf16` rate
};

// One kind of link between ranks: per direction, per device.
struct LinkRates {
  double bytes_per_s = 0;
  double latency_s = 0;  // a small message's one-way time, software included
};

struct Target {
  std::string name;         // what --target takes: "cpu", "h200", ...
  std::string description;  // one line for --list-targets
  TargetKind kind = TargetKind::cpu;
  int cores = 0;                 // CPU cores this process may run on; a GPU's streaming multiprocessors
  FlopRates gemm_flops_per_s;    // dense matrix multiply (tensor cores on a GPU)
  FlopRates vector_flops_per_s;  // everything else; the kernels widen bf16 to f32 for the math
  double bytes_per_s = 0;        // memory bandwidth (a copy's rate)
  double launch_s = 0;           // fixed cost of one kernel launch (or one op dispatch on a CPU)
  int64_t memory_bytes = 0;      // device memory; host memory for the CPU
  // A GPU's NVRTC architecture ("sm_90") and what one SM holds at once, for occupancy: static
  // plus dynamic shared memory (228 KiB on Hopper, 164 KiB on the A100; 1 KiB of it per block
  // is the system's), 64K 32-bit registers, 2048 threads and 32 blocks on both.
  std::string cuda_arch;
  int64_t shared_bytes_per_sm = 0;
  LinkRates intra_node;          // between devices of one machine (NVLink; shared memory on a CPU)
  LinkRates inter_node;          // between machines (InfiniBand, Ethernet)
};

// Blocks of `block` threads that one SM of GPU `target` holds at once, given a kernel's registers
// per thread and static shared memory per block (ptxas's report), and what limits it: "threads"
// (2048 an SM), "registers" (64K, allocated per warp in units of 256), "shared memory" (the
// target's, less 1 KiB per block for the system) or "blocks" (32).
struct Occupancy {
  int blocks = 0;
  const char* limit = "";
};
Occupancy blocksPerSm(const Target& target, int block, int registers, int64_t shared_bytes);

// This machine's CPU: its cores (sched_getaffinity) and memory (sysconf), fixed rates.
Target cpuTarget();
// NVIDIA's SXM data-center GPUs.
Target h200Target();
Target h100Target();
Target a100Target();

// Every known target, in the order errors and --list-targets name them.
const std::vector<std::string_view>& targetNames();
// By name; an error lists the known names.
Expected<Target> targetByName(std::string_view name);
// The target of a CUDA device, by the name the driver reports ("NVIDIA H100 80GB HBM3"); the
// H200 when the name is not one of the known GPUs.
Target gpuTargetForDevice(std::string_view device_name);

}  // namespace kiln
