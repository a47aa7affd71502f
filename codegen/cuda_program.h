// The Program of the CUDA backend, built from a function's lowered groups (kernel_lowering.h):
// buffers and their memory plan, streams and events, and the steps each launch runs. It is the
// CUDA twin of lower_cpu.h's Program. A runtime only maps its buffers to addresses and runs the
// steps: runtime/cuda/cuda_executor on a GPU, tests/simt's HostProgram on the host.
//
// Streams: group g runs on groups[g].stream. Waits come from ir::StreamHazards over the groups
// in order (a group reads the values it does not define; it writes in place the values it
// writes without defining them, i.e. an optimizer's parameters and state), one wait per producer
// stream (its latest launch). When there is more than one stream, stream 0 records a fork event
// first, which every other stream waits for before its first launch (the inputs are copied on
// stream 0, and a CUDA graph captured on stream 0 reaches the other streams this way), and waits
// at the end for an event each other stream records after its last launch (the join).
// Launch instructions carry attribute "group" (the group's index).
//
// Steps: what each launch instruction runs, in group order, with every argument a program
// buffer.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "codegen/cuda_emitter.h"
#include "codegen/kernel_lowering.h"
#include "codegen/program.h"
#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::codegen {

// What cuBLASLt does besides the product. BiasGradA and BiasGradB write a bias gradient instead
// of reading a bias: the sum over K of op(A) (length M) or of op(B) (length N), the reduction of
// a gradient that is also the GEMM's operand (a weight gradient dW = g^T x and db = sum_rows(g));
// A and B are the row-major operands here, so BiasGradA is cuBLASLt's BGRADB (cublaslt.cc).
//
// The activations' backward through an auxiliary buffer (cuBLASLt's EPILOGUE_AUX_POINTER):
// ReluAux and BiasReluAux are Relu and BiasRelu that also write the ReLU's bit mask (RELU_AUX);
// DRelu multiplies the product by the ReLU derivative that mask holds (DRELU), DGelu by GELU's
// derivative at the GELU input it reads (DGELU). So a layer's activation backward,
// g_z = g_h * f'(z) with g_h = g_next W^T, is the epilogue of the GEMM that makes g_h. Their
// BGRAD forms are not needed: the bias gradient of g_z is the BiasGradA/B of the weight-gradient
// GEMM that reads g_z anyway (passes/fusion.cc).
enum class Epilogue : uint8_t {
  None, Bias, Relu, BiasRelu, Gelu, BiasGelu, BiasGradA, BiasGradB, ReluAux, BiasReluAux, DRelu, DGelu
};
const char* epilogueName(Epilogue e);
// Whether the epilogue reads a bias (bias[N]), or writes a bias gradient (BiasGradA: [M],
// BiasGradB: [N]) through the same pointer.
// (Inline: runtime/cuda/cublaslt.cc uses them without linking the code generator.)
inline bool epilogueReadsBias(Epilogue e) {
  return e == Epilogue::Bias || e == Epilogue::BiasRelu || e == Epilogue::BiasGelu || e == Epilogue::BiasReluAux;
}
inline bool epilogueWritesBiasGradient(Epilogue e) {
  return e == Epilogue::BiasGradA || e == Epilogue::BiasGradB;
}
inline bool epilogueAppliesRelu(Epilogue e) {
  return e == Epilogue::Relu || e == Epilogue::BiasRelu || e == Epilogue::ReluAux || e == Epilogue::BiasReluAux;
}
// The auxiliary buffer: a ReLU bit mask written (ReluAux, BiasReluAux) or read (DRelu), or the
// GELU input read (DGelu, in the output's type and layout: [M, N], row stride N).
inline bool epilogueWritesReluMask(Epilogue e) { return e == Epilogue::ReluAux || e == Epilogue::BiasReluAux; }
inline bool epilogueHasAux(Epilogue e) {
  return epilogueWritesReluMask(e) || e == Epilogue::DRelu || e == Epilogue::DGelu;
}

// The ReLU bit mask of an [M, N] row-major output (cuBLASLt's column-major D is [N, M]): one bit
// per element, each of the M rows padded to a multiple of 128 bits (the leading dimension
// cuBLASLt requires). The mask rides in the buffer of the ReLU's output, after its data at a
// 256-byte boundary, so that it lives exactly as long as the output the backward reads anyway
// and the memory plan needs no value of its own (cuda_program.cc).
inline int64_t reluMaskLd(int64_t n) { return (n + 127) / 128 * 128; }  // bits
inline int64_t reluMaskBytes(int64_t m, int64_t n) { return m * reluMaskLd(n) / 8; }
inline int64_t reluMaskOffset(int64_t data_bytes) { return (data_bytes + 255) / 256 * 256; }

// A row-major GEMM: C[M, N] = op(A)[M, K] * op(B)[K, N] (+ bias[N], then ReLU/GELU; or with the
// bias gradient of A or B written beside it), as cuBLASLt runs it (runtime/cuda/cublaslt.h).
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  ir::DType a_type = ir::DType::f32, b_type = ir::DType::f32, c_type = ir::DType::f32;
  ir::DType bias_type = ir::DType::f32;
  Epilogue epilogue = Epilogue::None;
  int64_t batch = 1;  // batched with packed strides (M*K, K*N, M*N elements)
  // f32 inputs on the tensor cores in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32; ir::allowsTf32).
  bool tf32 = false;
  // C[M, N] = epilogue(op(A) op(B) + R + bias): a matrix R of C's type and layout added before
  // the bias and activation (cuBLASLt's C input with beta = 1; D is our C). Unbatched, and only
  // with None, Bias, the activations and their mask-writing forms.
  bool residual = false;
  auto key() const {
    return std::tuple(m, n, k, transpose_a, transpose_b, a_type, b_type, c_type, bias_type, epilogue, batch, tf32,
                      residual);
  }
  std::string str() const;  // "gemm 16384x512x13 f32 tf32 (B^T) + C -> f32 epilogue bias+relu"
};

// The row-major GEMM a kiln.matmul is, at concrete shapes (types from its operands, no
// epilogue): batch dims must match, or a shared right operand is folded into M.
Expected<GemmShape> gemmShapeOf(const ir::Op& matmul, const ir::SymbolBindings& symbols);

struct CudaStep {
  int group = 0;
  int kernel = -1;        // index into the group's kernels; -1: the group's GEMM
  std::string name;       // the kernel's symbol, or the GEMM's description
  LaunchConfig launch;    // kernels
  GemmShape gemm;         // the GEMM: shape, types and epilogue
  std::vector<int> args;  // a kernel's buffers in parameter order; a GEMM's a, b, c, bias, aux,
                          // residual (-1: none; bias is the bias gradient it writes with
                          // BiasGradA/BiasGradB)
  int64_t aux_offset = 0;  // a GEMM's aux lies this many bytes into its buffer (the ReLU mask)
  bool isGemm() const { return kernel < 0; }
};

// The Program and how its buffers map to the lowered groups.
struct CudaProgram {
  Program program;                                       // memory-planned
  std::vector<std::vector<int>> group_buffers;           // [group][group buffer] -> program buffer
  std::vector<std::vector<int64_t>> shapes;              // per program buffer, at the bound symbols
  std::vector<int> inputs;                               // buffers of kiln.input values
  std::vector<int> error_flags;                          // embedding error flags (outside the arena)
  std::vector<std::pair<int, const ir::Op*>> constants;  // buffer, its kiln.constant
  // Address tables (GroupBuffer::words), outside the arena, with each word's buffer a program
  // buffer (-1: a plain value): the runtime writes them once, when it has placed the buffers.
  struct AddressTable {
    int buffer = -1;
    std::vector<AddressWord> words;
    // The words at the buffers' addresses (address[b]: where program buffer b lives).
    std::vector<int64_t> at(const std::vector<uint64_t>& address) const;
  };
  std::vector<AddressTable> address_tables;
  std::vector<CudaStep> steps;                           // in group order
  std::vector<std::pair<size_t, size_t>> group_steps;    // [group] -> [begin, end) of steps
};

// Builds and memory-plans the Program of `groups` (lowerFunction(f, symbols)). Needs no GPU.
// Buffers outside the arena: inputs, parameters, constants (kind Parameter) and error flags.
Expected<CudaProgram> buildCudaProgram(const ir::Function& f, const std::vector<LoweredGroup>& groups,
                                       const ir::SymbolBindings& symbols, int64_t alignment = 256);

}  // namespace kiln::codegen
