// kiln calibrate --device cuda's measurements on the GPU (tools/calibrate_gpu.h): rates a GPU can
// have, lookups no faster than a little over the memory rate (the rows are read from HBM, the
// table far beyond the L2), bf16 GEMMs faster than f32. Skips without a GPU (label gpu).
#include <gtest/gtest.h>

#include "runtime/cuda/cuda_driver.h"
#include "tests/gpu/gpu_test_util.h"
#include "tools/calibrate_gpu.h"

namespace kiln::testing {
namespace {

TEST(GpuCalibrate, RatesArePlausibleForTheDevice) {
  SKIP_WITHOUT_GPU();
  cli::GpuCalibrationOptions o;
  o.memory_bytes = int64_t{256} << 20;
  o.table_bytes = int64_t{512} << 20;
  o.lookup_bytes_per_call = int64_t{32} << 20;
  o.gemm_n = 2048;
  o.repeats = 2;
  o.row_bytes = {128, 512};
  o.pooling = {1, 16};
  auto c = cli::calibrateGpu(o);
  ASSERT_TRUE(c) << c.status().message();
  EXPECT_FALSE(c->device.empty());
  EXPECT_GT(c->read_bytes_per_s, 1e11);  // any datacenter GPU's HBM
  EXPECT_LT(c->read_bytes_per_s, 1e13);
  ASSERT_EQ(c->lookup_bytes_per_s.size(), 2u);
  for (const auto& row : c->lookup_bytes_per_s) {
    ASSERT_EQ(row.size(), 2u);
    for (double r : row) {
      EXPECT_GT(r, 1e9);
      EXPECT_LT(r, 1.5 * c->read_bytes_per_s);
    }
  }
  EXPECT_GT(c->gemm_f32_flops_per_s, 1e12);
  EXPECT_GT(c->gemm_bf16_flops_per_s, c->gemm_f32_flops_per_s);
}

TEST(GpuCalibrate, WithoutAGpuTheReasonIsTheError) {
  std::string why;
  if (cuda::cudaAvailable(&why)) GTEST_SKIP() << "a GPU is present";
  auto c = cli::calibrateGpu({});
  ASSERT_FALSE(c);
  EXPECT_NE(c.status().message().find("no CUDA GPU to calibrate"), std::string::npos) << c.status().message();
}

}  // namespace
}  // namespace kiln::testing
