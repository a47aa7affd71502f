// `kiln calibrate --device cuda`: the rates of this machine's GPU, measured with the runtime's
// own CUDA kernels (CudaExecutor::profile: device events around each launch, the best of several
// profiles):
//
//   memory   kiln.reduce(sum) of the 16 KiB rows of a device-resident f32 parameter of
//            `memory_bytes` (a block a row): the bytes read a second (the HBM rate the planner
//            divides lookups' bytes by);
//   lookups  kiln.embedding_bag of a device-resident f32 table of `table_bytes` (far beyond the
//            L2), uniformly random ids, by row bytes and pooling factor: the rows' bytes a
//            second, over the memory rate (the cost table's lookup_efficiency);
//   gemm     kiln.matmul through cuBLASLt at n x n x n, f32 and bf16: 2 n^3 flops a call.
//
// What one GPU cannot measure keeps the built-in table of the device's target (gpuTargetForDevice):
// the links (NVLink, the network; all_to_all needs peers), PCIe, the launch cost and the
// elementwise rate. Without a GPU (or without the CUDA headers at build time) it returns the
// reason as an error.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ir/status.h"

namespace kiln::cli {

struct GpuCalibrationOptions {
  int64_t memory_bytes = int64_t{1} << 30;
  int64_t table_bytes = int64_t{1} << 30;
  int64_t lookup_bytes_per_call = int64_t{256} << 20;  // rows gathered a call
  int64_t gemm_n = 8192;
  int repeats = 3;
  std::vector<int64_t> row_bytes;  // the cost table's grid
  std::vector<int64_t> pooling;
  std::function<void(const std::string&)> progress;  // one line per measurement; may be empty
};

struct GpuCalibration {
  std::string device;                                   // the driver's name of GPU 0
  std::string target;                                   // its built-in target (h200, h100, a100)
  double read_bytes_per_s = 0;                          // memory
  std::vector<std::vector<double>> lookup_bytes_per_s;  // [row_bytes][pooling]
  double gemm_f32_flops_per_s = 0, gemm_bf16_flops_per_s = 0;
};

Expected<GpuCalibration> calibrateGpu(const GpuCalibrationOptions& options);

}  // namespace kiln::cli
