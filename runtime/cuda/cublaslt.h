// GEMMs through cuBLASLt, loaded at run time (libcublasLt.so.13, .so.12 or .so; never linked):
// row-major C[M, N] = op(A)[M, K] * op(B)[K, N] (+ bias[N], then ReLU/GELU, the ReLU's mask
// written beside; or writing the bias gradient, the sum over K of op(A) or op(B); or times the
// ReLU/GELU derivative read from an aux buffer), f32 or bf16 in and out, f32 accumulation,
// optionally batched. The algorithm for each distinct problem is
// chosen once by cuBLASLt's heuristic and cached. The problem is a codegen::GemmShape
// (codegen/cuda_program.h), as the Program's steps carry it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "codegen/cuda_program.h"
#include "ir/status.h"
#include "ir/types.h"
#include "runtime/cuda/cuda_driver.h"

namespace kiln::cuda {

// The column-major problem cuBLASLt solves for a row-major one: C^T = op(B)^T op(A)^T, so
// cuBLASLt's A is our B. Pure arithmetic, tested without a GPU.
struct ColumnMajorGemm {
  int64_t m, n, k;           // cuBLASLt's
  bool trans_first, trans_second;
  int64_t rows_first, cols_first, ld_first;    // layout of cuBLASLt's A (our B)
  int64_t rows_second, cols_second, ld_second; // layout of cuBLASLt's B (our A)
  int64_t ld_c;
};
ColumnMajorGemm toColumnMajor(const codegen::GemmShape& s);

// The device workspace each session's cuBLASLt handle holds (counted by the session's memory
// check, driver/session.h).
inline constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;

#ifdef KILN_HAVE_CUDA_HEADERS

class CublasLt {
 public:
  // Loads cuBLASLt and creates a handle and a workspace on the current context.
  static Expected<std::unique_ptr<CublasLt>> create(CudaDriver* drv,
                                                    size_t workspace_bytes = kCublasLtWorkspaceBytes);
  ~CublasLt();

  // C = epilogue(op(A) op(B) [+ R] + bias); all pointers are device addresses, bias may be 0
  // unless the epilogue reads a bias or writes a bias gradient there, aux unless it writes or
  // reads the ReLU mask or reads the GELU input there (codegen::Epilogue), residual (R, laid out
  // as C) unless s.residual.
  Status matmul(const codegen::GemmShape& s, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, CUdeviceptr bias,
                CUdeviceptr aux, CUdeviceptr residual, CUstream stream);

  size_t cachedAlgorithms() const { return algos_.size(); }
  size_t version() const { return version_; }

 private:
  CublasLt() = default;
  struct Api;
  struct Plan;
  Expected<Plan*> plan(const codegen::GemmShape& s);

  CudaDriver* drv_ = nullptr;
  DynamicLibrary lib_;
  std::unique_ptr<Api> api_;
  void* handle_ = nullptr;
  DeviceBuffer workspace_;
  size_t version_ = 0;
  std::map<decltype(codegen::GemmShape{}.key()), std::unique_ptr<Plan>> algos_;
};

#endif

}  // namespace kiln::cuda
