// A whole CUDA program run on the host: what CudaExecutor runs on the GPU
// (codegen::buildCudaProgram's buffers, arena plan, streams, events and steps, the generated
// kernels), with host memory for device memory, HostModule for NVRTC and gemmAsCublasLt for
// cuBLASLt.
//
// Streams interleave: at each point one stream whose next instruction may run (a wait only once
// its event's record has run) is picked at random from `seed`, so a missing event shows up as
// a wrong result under some seed rather than never. Inputs, parameters and the arena live in
// guarded buffers, the arena is poisoned (0xFF: NaN) before each run.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "codegen/cuda_program.h"
#include "ir/ir.h"
#include "ir/status.h"
#include "ir/tensor_view.h"
#include "runtime/cpu/executor.h"
#include "runtime/parameter_store.h"

namespace kiln::simt {

// C = epilogue(op(A) op(B) [+ R] + bias) computed the way cuBLASLt reads the column-major problem
// cuda::toColumnMajor(s) describes (its A is our B, its bias runs along its rows), with f32
// accumulation and bf16 rounding of bf16 outputs; a bias-gradient epilogue writes the sum over
// K of op(A) or op(B) to `bias` instead. ReluAux and BiasReluAux also write the ReLU's bit mask
// to `aux` (bit i + j * reluMaskLd of cuBLASLt's element (i, j), bit b of a byte being 1 << b);
// DRelu multiplies by that mask, DGelu by GELU's derivative at the [M, N] input `aux`. With
// s.residual, `residual` (laid out as C) is added to the product before the bias (beta = 1).
// `a`, `b`, `c`, `bias`, `aux` and `residual` are what the executor passes to
// CublasLt::matmul, as host pointers.
// (The mask's bit order is this emulation's: on a GPU only cuBLASLt writes and reads it.)
void gemmAsCublasLt(const codegen::GemmShape& s, const void* a, const void* b, void* c, void* bias,
                    void* aux = nullptr, const void* residual = nullptr);

class HostProgram {
 public:
  static Expected<std::unique_ptr<HostProgram>> create(const ir::Function& f, const ir::SymbolBindings& symbols);
  ~HostProgram();

  // Runs the function once over `batch` with the store's parameters (updated in place, as the
  // training step updates them on the device); returns its results in order.
  Expected<std::vector<ir::HostTensor>> run(const runtime::cpu::Batch& batch, runtime::ParameterStore& params,
                                            uint64_t seed);

  int numKernels() const;
  int numGemms() const;

  struct Impl;

 private:
  HostProgram() = default;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::simt
