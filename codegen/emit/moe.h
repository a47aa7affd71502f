// The CUDA kernels of the Mixture-of-Experts ops (docs/moe.md): routing, balancing losses,
// dispatch, token permutation and the experts' grouped GEMMs. Each is a KernelKind::Source
// kernel: its body is CUDA text written here, specialized to the op's shapes and attributes.
//
// The kernel builders take plain descriptions (no IR), so tests build and run them directly;
// codegen/emit/moe.cc lowers the ops to these descriptions and registers the emitters.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel_ir.h"

namespace kiln::codegen::emit {

// Device functions the MoE kernels share (warp selections and scans, the tensor-core MMA),
// printed in every module's prelude (cuda_emitter.cc).
const std::string& moeDeviceFunctions();

// kiln.topk of x viewed as [outer, n, inner] along n: values (x's dtype) and i32 indices, both
// [outer, k, inner]. One warp per (outer, inner) row.
Kernel topkKernel(DType x, int64_t outer, int64_t n, int64_t inner, int64_t k);

struct RouterShape {
  int64_t tokens = 0, experts = 0, topk = 1;
  bool sigmoid = false, pre_softmax = false, bias = false;
  int64_t groups = 1, group_topk = 1;
  double scale = 1.0;
};
// kiln.moe_router: buffers logits, [bias,] probs, experts. One warp per token.
Kernel routerKernel(const RouterShape& r);
// kiln.moe_router_grad: buffers logits, experts, dprobs, dlogits. One warp per token.
Kernel routerGradKernel(const RouterShape& r);

struct AuxLossShape {
  int64_t tokens = 0, experts = 0, topk = 1, seq_len = 0;  // seq_len 0: one sequence of all tokens
  bool sigmoid = false;
  double coeff = 0;
};
// kiln.moe_aux_loss: two kernels: per-sequence sums (logits, experts, partial[S]), then the
// mean over sequences (partial, loss).
std::vector<Kernel> auxLossKernels(const AuxLossShape& a);
// kiln.moe_aux_loss_grad: per-sequence counts (experts, counts[S*E]), then one warp per token
// (logits, counts, g, dlogits).
std::vector<Kernel> auxLossGradKernels(const AuxLossShape& a);
// kiln.moe_z_loss (logits, loss) and its gradient (logits, g, dlogits).
Kernel zLossKernel(int64_t tokens, int64_t experts, double coeff);
Kernel zLossGradKernel(int64_t tokens, int64_t experts, double coeff);

struct DispatchShape {
  int64_t tokens = 0, experts = 0, topk = 1;
  int64_t capacity = 0;  // C per expert; 0: dropless
  bool by_probs = true, pad = false;
  int64_t rows = 0;  // the rows buffer's size (the bound of R)
};
// kiln.moe_dispatch: a plan per expert (experts, probs, plan[4E]), the offsets (plan, offsets,
// counts, rows), then the rows (experts, probs, plan, offsets, rows).
std::vector<Kernel> dispatchKernels(const DispatchShape& d);
// Megatron's get_capacity: ceil(N*k*cf / E).
int64_t expertCapacity(int64_t tokens, int64_t topk, int64_t experts, double capacity_factor);

// kiln.moe_permute (x, rows, probs, y) with y of `rows` rows of width `hidden`.
Kernel permuteKernel(DType x, int64_t tokens, int64_t topk, int64_t hidden, int64_t rows, bool apply_probs);
// kiln.moe_unpermute: the slot -> row map (rows, slot_row temp), then one block per token
// (y, slot_row, probs, out).
std::vector<Kernel> unpermuteKernels(DType y, int64_t tokens, int64_t topk, int64_t hidden, int64_t rows,
                                     bool apply_probs);
// kiln.moe_row_dot (a, rows, b, out): zero out, then one warp per row.
std::vector<Kernel> rowDotKernels(DType a, DType b, int64_t tokens, int64_t topk, int64_t hidden,
                                  int64_t rows);
// kiln.moe_expert_bias_update (bias, counts), in place.
Kernel expertBiasUpdateKernel(int64_t experts, double rate);

// kiln.grouped_matmul: y[rows, m] = x_e w[e] over expert e's rows [offsets[e], offsets[e+1]),
// offsets read on the device. Buffers x, w, offsets, y. bf16: tensor cores (mma.sync), f32: SIMT.
struct GroupedGemmShape {
  DType dtype = DType::f32;
  int64_t rows = 0, k = 0, m = 0, experts = 0;
  bool transpose_b = false;  // w is [E, M, K]
};
Kernel groupedMatmulKernel(const GroupedGemmShape& s);
// kiln.grouped_matmul_wgrad: w[e] = x_e^T dy_e ([E, K, M], or [E, M, K] with transpose).
// Buffers x, dy, offsets, w.
struct WgradShape {
  DType dtype = DType::f32;
  int64_t rows = 0, k = 0, m = 0, experts = 0;
  bool transpose = false;
};
Kernel groupedWgradKernel(const WgradShape& s);

}  // namespace kiln::codegen::emit
