// Targets: every known name resolves, an unknown one is an error naming them all, the CPU is
// read off this machine, and the GPUs carry their datasheet-derived rates.
#include "ir/target.h"

#include <gtest/gtest.h>

#include <thread>

namespace kiln {
namespace {

TEST(Target, EveryKnownNameResolvesToItself) {
  ASSERT_EQ(targetNames().size(), 4u);
  for (std::string_view name : targetNames()) {
    auto t = targetByName(name);
    ASSERT_TRUE(t) << name << ": " << t.status().message();
    EXPECT_EQ(t->name, name);
    EXPECT_FALSE(t->description.empty()) << name;
    EXPECT_GT(t->cores, 0) << name;
    EXPECT_GT(t->gemm_flops_per_s.f32, 0) << name;
    EXPECT_GE(t->gemm_flops_per_s.bf16, t->gemm_flops_per_s.f32) << name;
    EXPECT_GT(t->vector_flops_per_s.f32, 0) << name;
    EXPECT_GT(t->bytes_per_s, 0) << name;
    EXPECT_GT(t->launch_s, 0) << name;
    EXPECT_GT(t->intra_node.bytes_per_s, 0) << name;
    EXPECT_GT(t->inter_node.latency_s, 0) << name;
    // A machine's own links are faster than the network between machines.
    EXPECT_GT(t->intra_node.bytes_per_s, t->inter_node.bytes_per_s) << name;
  }
}

TEST(Target, AnUnknownNameListsTheKnownOnes) {
  auto t = targetByName("tpu");
  ASSERT_FALSE(t);
  EXPECT_EQ(t.status().message(), "unknown target 'tpu' (known targets: cpu, h200, h100, a100)");
  EXPECT_FALSE(targetByName(""));
  EXPECT_FALSE(targetByName("H200"));  // names are lower case, as on the command line
}

TEST(Target, TheCpuIsReadOffThisMachine) {
  const Target cpu = cpuTarget();
  EXPECT_EQ(cpu.kind, TargetKind::cpu);
  EXPECT_GE(cpu.cores, 1);
  EXPECT_LE(cpu.cores, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_GT(cpu.memory_bytes, int64_t{64} << 20);
  // The rates are fixed, whatever the machine: plans do not depend on where they were made.
  EXPECT_EQ(cpu.gemm_flops_per_s.f32, 2.0e11);
  EXPECT_EQ(cpu.vector_flops_per_s.f32, 2.0e10);
  EXPECT_EQ(cpu.bytes_per_s, 2.0e10);
  EXPECT_EQ(cpu.launch_s, 2.0e-6);
}

TEST(Target, GpusFollowTheirDatasheets) {
  const Target h200 = h200Target(), h100 = h100Target(), a100 = a100Target();
  for (const Target* t : {&h200, &h100, &a100}) EXPECT_EQ(t->kind, TargetKind::gpu) << t->name;
  // One Hopper die: the same compute, the H200 has more and faster memory.
  EXPECT_EQ(h200.gemm_flops_per_s.bf16, h100.gemm_flops_per_s.bf16);
  EXPECT_GT(h200.bytes_per_s, h100.bytes_per_s);
  EXPECT_GT(h200.memory_bytes, h100.memory_bytes);
  EXPECT_GT(h100.gemm_flops_per_s.bf16, 3 * a100.gemm_flops_per_s.bf16);
  EXPECT_GT(h100.intra_node.bytes_per_s, a100.intra_node.bytes_per_s);
  // Exact f32 GEMMs run on the CUDA cores, TF32 and bf16 on the tensor cores (TF32 at half
  // bf16's rate, per NVIDIA's H100 and A100 datasheets); the CPU has no TF32.
  EXPECT_GT(h200.gemm_flops_per_s.bf16, 10 * h200.gemm_flops_per_s.f32);
  for (const Target* t : {&h200, &h100, &a100})
    EXPECT_NEAR(t->gemm_flops_per_s.tf32, t->gemm_flops_per_s.bf16 / 2, 0.02 * t->gemm_flops_per_s.bf16) << t->name;
  EXPECT_EQ(cpuTarget().gemm_flops_per_s.tf32, 0);
  EXPECT_EQ(h200.gemm_flops_per_s.of(ir::DType::bf16), h200.gemm_flops_per_s.bf16);
  EXPECT_EQ(h200.gemm_flops_per_s.of(ir::DType::f16), h200.gemm_flops_per_s.bf16);
  EXPECT_EQ(h200.gemm_flops_per_s.of(ir::DType::f32), h200.gemm_flops_per_s.f32);
}

TEST(Target, CudaDeviceNamesMapToTheirTargets) {
  EXPECT_EQ(gpuTargetForDevice("NVIDIA H200").name, "h200");
  EXPECT_EQ(gpuTargetForDevice("NVIDIA H100 80GB HBM3").name, "h100");
  EXPECT_EQ(gpuTargetForDevice("NVIDIA A100-SXM4-80GB").name, "a100");
  EXPECT_EQ(gpuTargetForDevice("NVIDIA GeForce RTX 4090").name, "h200");
}

// Occupancy by NVIDIA's rules (the CUDA occupancy calculator's), counted by hand: registers are
// allocated per warp in units of 256, every block takes 1 KiB of shared memory for the system.
TEST(Target, BlocksPerSmFollowTheRegisterSharedAndThreadLimits) {
  const Target h200 = h200Target(), a100 = a100Target();
  EXPECT_EQ(h200.cuda_arch, "sm_90");
  EXPECT_EQ(a100.cuda_arch, "sm_80");
  EXPECT_TRUE(cpuTarget().cuda_arch.empty());
  auto check = [](const Target& t, int block, int regs, int64_t smem, int blocks, const std::string& limit) {
    const Occupancy o = blocksPerSm(t, block, regs, smem);
    EXPECT_EQ(o.blocks, blocks) << t.name << " block " << block << " regs " << regs << " smem " << smem;
    EXPECT_EQ(std::string(o.limit), limit) << t.name << " block " << block << " regs " << regs;
  };
  // 106 x 32 = 3392 -> 3584 per warp; 65536 / 3584 = 18 warps, 2 blocks of 8. Shared: 233472 /
  // 50176 = 4 blocks.
  check(h200, 256, 106, 49152, 2, "registers");
  check(h200, 256, 128, 0, 2, "registers");  // 4096 per warp: 16 warps
  check(h200, 256, 129, 0, 1, "registers");  // 4352 per warp: 15 warps, one block of 8
  check(h200, 256, 32, 0, 8, "threads");     // 64 warps by registers; 2048 / 256 threads
  check(h200, 32, 16, 0, 32, "blocks");      // 64 by threads, 32 blocks at most
  // A100: 164 KiB per SM; 167936 / 50176 = 3 blocks; registers allow 51 warps, 12 blocks of 4.
  check(a100, 128, 40, 49152, 3, "shared memory");
}

}  // namespace
}  // namespace kiln
