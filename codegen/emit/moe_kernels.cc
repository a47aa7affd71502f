// The CUDA text of the Mixture-of-Experts kernels (moe.h). Shapes and attributes are baked into
// each body as constants, as the other kernel kinds are specialized to their shapes.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "codegen/emit/moe.h"

namespace kiln::codegen::emit {
namespace {

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Warps of 256-thread blocks covering `items` (one warp each), grid-stride past 65536 blocks.
int64_t warpGrid(int64_t items) { return std::clamp<int64_t>(ceilDiv(items, 8), 1, 1 << 16); }
int64_t threadGrid(int64_t items) { return std::clamp<int64_t>(ceilDiv(items, 256), 1, 1 << 16); }

std::string f32Literal(double v) {
  std::string s = fmt::format("{:.9g}", static_cast<float>(v));
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return "(" + s + "f)";
}

Kernel sourceKernel(std::string name, int64_t grid, int block, std::string body) {
  Kernel k;
  k.name = std::move(name);
  k.kind = KernelKind::Source;
  k.grid = grid;
  k.block = block;
  k.source = std::move(body);
  return k;
}

// The loop every warp-per-item kernel starts with: `item` runs over [0, count), one warp each.
std::string warpLoop(int64_t count, const char* item) {
  return fmt::format(
      "  const int lane = threadIdx.x & 31;\n"
      "  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);\n"
      "  for (long long {1} = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; {1} < {0}LL; {1} += "
      "warps) {{\n",
      count, item);
}
std::string threadLoop(int64_t count, const char* item) {
  return fmt::format(
      "  for (long long {1} = (long long)blockIdx.x * blockDim.x + threadIdx.x; {1} < {0}LL;\n"
      "       {1} += (long long)gridDim.x * blockDim.x) {{\n",
      count, item);
}

// Loads one token's logits into lane-strided registers l[j] = logits[n, lane + 32 j] and
// declares E and J; absent experts read -inf-free zeros and are masked by `e < E` checks.
std::string loadRow(int64_t experts, const char* buffer) {
  return fmt::format(
      "    constexpr int E = {0}, J = {1};\n"
      "    float l[J];\n"
      "#pragma unroll\n"
      "    for (int j = 0; j < J; ++j) {{\n"
      "      const int e = lane + 32 * j;\n"
      "      l[j] = e < E ? kiln_ld({2}, n * E + e) : 0.0f;\n"
      "    }}\n",
      experts, ceilDiv(experts, 32), buffer);
}

// m = the row's max, z = sum exp(l - m) (all lanes), over the registers of loadRow.
constexpr const char* kRowSoftmaxStats =
    "    float m = kiln_fn::lowest<float>();\n"
    "    for (int j = 0; j < J; ++j) if (lane + 32 * j < E) m = fmaxf(m, l[j]);\n"
    "    m = kiln_moe_warp_max(m);\n"
    "    float z = 0.0f;\n"
    "    for (int j = 0; j < J; ++j) if (lane + 32 * j < E) z += expf(l[j] - m);\n"
    "    z = kiln_moe_warp_sum(z);\n";

}  // namespace

const std::string& moeDeviceFunctions() {
  static const std::string text = R"CUDA(
// Mixture-of-Experts (codegen/emit/moe_kernels.cc). A top-k candidate is (value, index); the
// larger value wins, ties go to the lower index; index < 0 is no candidate.
__device__ __forceinline__ bool kiln_moe_better(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}
// The warp's best candidate, on every lane.
__device__ __forceinline__ void kiln_moe_warp_best(float* v, int* i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, *v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, *i, o);
    if (kiln_moe_better(ov, oi, *v, *i)) { *v = ov; *i = oi; }
  }
}
// Whether (v, i) comes after the pick (pv, pi) in top-k order (pi < 0: nothing picked yet).
__device__ __forceinline__ bool kiln_moe_after(float v, int i, float pv, int pi) {
  return pi < 0 || v < pv || (v == pv && i > pi);
}
__device__ __forceinline__ float kiln_moe_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float kiln_moe_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ int kiln_moe_warp_scan(int v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}
// Block-wide inclusive prefix sum (blockDim.x a multiple of 32); *total gets the block's sum.
// `scratch` holds 32 ints; the leading barrier lets consecutive calls share it.
__device__ __forceinline__ int kiln_moe_block_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = kiln_moe_warp_scan(v);
  __syncthreads();
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int w = kiln_moe_warp_scan(lane < warps ? scratch[lane] : 0);
    if (lane < warps) scratch[lane] = w;
  }
  __syncthreads();
  *total = scratch[warps - 1];
  return v + (warp > 0 ? scratch[warp - 1] : 0);
}
__device__ __forceinline__ int kiln_moe_block_sum(int v, int* scratch) {
  int total = 0;
  kiln_moe_block_scan(v, scratch, &total);
  return total;
}
// An unsigned key ordered as the floats are (negative values below positive ones).
__device__ __forceinline__ unsigned kiln_moe_order_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// v[j] for a warp-uniform j, without indexing the array by a run-time value (which would put it
// in local memory).
template <int J>
__device__ __forceinline__ float kiln_moe_slot(const float (&v)[J], int j) {
  float r = 0.0f;
#pragma unroll
  for (int i = 0; i < J; ++i) if (i == j) r = v[i];
  return r;
}
__device__ __forceinline__ float kiln_moe_bf16_half(unsigned pair, int hi) {
  return __uint_as_float(((pair >> (16 * hi)) & 0xffffu) << 16);
}
// One warp's d += a b for a 16x16 (row-major) by 16x8 (column-major) bf16 product with f32
// accumulation: PTX mma.sync m16n8k16, the instruction nvcuda::wmma lowers to (no header is
// needed, so modules stay self-contained). Fragments as PTX lays them out, with g = lane / 4 and
// t = lane % 4: a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; d = D[g][2t, 2t+1], D[g+8][2t, 2t+1].
// Without a GPU (simt) the same fragments are multiplied through shuffles, so the layout the
// kernels load is checked on the host.
__device__ __forceinline__ void kiln_mma_bf16_16x8x16(float* d, const unsigned* a, const unsigned* b) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k = 0; k < 16; ++k) {
    const int owner = (k & 7) >> 1, hi = k & 1, upper = k >> 3;
    const float a_top = kiln_moe_bf16_half(__shfl_sync(0xffffffffu, a[2 * upper], g * 4 + owner), hi);
    const float a_low = kiln_moe_bf16_half(__shfl_sync(0xffffffffu, a[2 * upper + 1], g * 4 + owner), hi);
    const float b0 = kiln_moe_bf16_half(__shfl_sync(0xffffffffu, b[upper], (2 * t) * 4 + owner), hi);
    const float b1 = kiln_moe_bf16_half(__shfl_sync(0xffffffffu, b[upper], (2 * t + 1) * 4 + owner), hi);
    d[0] += a_top * b0;
    d[1] += a_top * b1;
    d[2] += a_low * b0;
    d[3] += a_low * b1;
  }
#endif
}
// cp.async (sm_80+): 16 bytes from global to shared memory without a pass through registers;
// the bytes from `valid` on are zero-filled (no global byte past them is read). Copies issued
// since the last commit form a group; kiln_cp_async_wait<N> waits until at most N groups are
// in flight. The global address must be 16-byte aligned. On the host (simt) the copy completes
// at once, so the commits and waits have nothing to do.
__device__ __forceinline__ void kiln_cp_async16(unsigned short* smem, const void* gmem, int valid) {
#ifdef __CUDA_ARCH__
  unsigned long long s;
  asm("cvta.to.shared.u64 %0, %1;\n" : "=l"(s) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((unsigned)s), "l"(gmem), "r"(valid * 2));
#else
  const unsigned short* g = (const unsigned short*)gmem;
  for (int i = 0; i < 8; ++i) smem[i] = i < valid ? g[i] : (unsigned short)0;
#endif
}
// The same copy through registers, for a source that is not 16-byte aligned.
__device__ __forceinline__ void kiln_copy8(unsigned short* smem, const void* gmem, int valid) {
  const unsigned short* g = (const unsigned short*)gmem;
#pragma unroll
  for (int i = 0; i < 8; ++i) smem[i] = i < valid ? g[i] : (unsigned short)0;
}
__device__ __forceinline__ void kiln_cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void kiln_cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
// A staged 128 x 32 bf16 operand tile of the tensor-core GEMMs, in one of two swizzled layouts
// chosen by which of its dimensions is contiguous in global memory, so that 16-byte chunks of
// eight consecutive elements copy straight in and the warps' fragment reads (mmaTile's
// operandReads, which folds these formulas into per-thread bases) hit 32 distinct banks:
//   k-major   [128 rows][32 k]: 4 chunks per row, chunk c stored at c ^ ((row >> 1) & 3);
//   row-major [32 k][128 rows]: 16 chunks per k, chunk c stored at c ^ (k & 7).
__device__ __forceinline__ int kiln_tile_kmajor(int r, int k) {
  return r * 32 + ((((k >> 3) ^ (r >> 1)) & 3) << 3) + (k & 7);
}
__device__ __forceinline__ int kiln_tile_rowmajor(int r, int k) {
  return k * 128 + (((r >> 3) ^ (k & 7)) << 3) + (r & 7);
}
)CUDA";
  return text;
}

// ---- Selection ----

Kernel topkKernel(DType x, int64_t outer, int64_t n, int64_t inner, int64_t k) {
  // Pass j picks the best element after pick j-1: O(k n / 32) per row, no sort and no shared
  // memory, which suits router-sized rows (n = E <= a few hundred, k <= 8).
  std::string body = warpLoop(outer * inner, "row");
  body += fmt::format(
      "    const long long o = row / {1}LL, in = row % {1}LL;\n"
      "    const long long base = o * {0}LL * {1}LL + in;\n"
      "    float pv = 0.0f;\n"
      "    int pi = -1;\n"
      "    for (int j = 0; j < {2}; ++j) {{\n"
      "      float bv = 0.0f;\n"
      "      int bi = -1;\n"
      "      for (int i = lane; i < {0}; i += 32) {{\n"
      "        const float v = kiln_ld(b0, base + (long long)i * {1}LL);\n"
      "        if (kiln_moe_after(v, i, pv, pi) && kiln_moe_better(v, i, bv, bi)) {{ bv = v; bi = i; }}\n"
      "      }}\n"
      "      kiln_moe_warp_best(&bv, &bi);\n"
      "      if (lane == 0) {{\n"
      "        const long long at = (o * {2}LL + j) * {1}LL + in;\n"
      "        kiln_st(b1, at, bi >= 0 ? bv : 0.0f);\n"
      "        kiln_st(b2, at, bi);\n"
      "      }}\n"
      "      pv = bv;\n"
      "      pi = bi;\n"
      "    }}\n"
      "  }}\n",
      n, inner, k);
  Kernel kern = sourceKernel("topk", warpGrid(outer * inner), 256, body);
  kern.addBuffer("x", x, outer * n * inner);
  kern.addBuffer("values", x, outer * k * inner, true);
  kern.addBuffer("indices", DType::i32, outer * k * inner, true);
  return kern;
}

// ---- Routing ----

namespace {

// Scores s[j] of the router's registers l[j]: softmax over all E, sigmoid, or the logits.
std::string routerScores(const RouterShape& r) {
  std::string out = "    float s[J];\n";
  if (r.sigmoid) return out + "    for (int j = 0; j < J; ++j) s[j] = 1.0f / (1.0f + expf(-l[j]));\n";
  if (!r.pre_softmax) return out + "    for (int j = 0; j < J; ++j) s[j] = l[j];\n";
  return out + kRowSoftmaxStats + "    for (int j = 0; j < J; ++j) s[j] = expf(l[j] - m) / z;\n";
}

}  // namespace

Kernel routerKernel(const RouterShape& r) {
  const int64_t E = r.experts, K = r.topk, G = r.groups;
  std::string body = warpLoop(r.tokens, "n") + loadRow(E, "b0") + routerScores(r);
  // Selection scores (scores + bias) and eligibility.
  body += "    float sel[J];\n    bool ok[J];\n";
  body += fmt::format(
      "    for (int j = 0; j < J; ++j) {{\n"
      "      const int e = lane + 32 * j;\n"
      "      ok[j] = e < E;\n"
      "      sel[j] = s[j]{};\n"
      "    }}\n",
      r.bias ? " + (e < E ? kiln_ld(b1, e) : 0.0f)" : "");
  if (G > 1) {
    // A group's score: the sum of its top k/group_topk selection scores; only the best
    // group_topk groups stay eligible. Every lane computes the same group choice.
    body += fmt::format(
        "    {{\n"
        "      constexpr int G = {0}, EG = {1}, PER = {2}, PICK = {3};\n"
        "      float gs[G];\n"
        "      for (int g = 0; g < G; ++g) {{\n"
        "        float pv = 0.0f, sum = 0.0f;\n"
        "        int pi = -1;\n"
        "        for (int p = 0; p < PER; ++p) {{\n"
        "          float bv = 0.0f;\n"
        "          int bi = -1;\n"
        "          for (int j = 0; j < J; ++j) {{\n"
        "            const int e = lane + 32 * j;\n"
        "            if (ok[j] && e / EG == g && kiln_moe_after(sel[j], e, pv, pi) && "
        "kiln_moe_better(sel[j], e, bv, bi)) {{ bv = sel[j]; bi = e; }}\n"
        "          }}\n"
        "          kiln_moe_warp_best(&bv, &bi);\n"
        "          if (bi >= 0) sum += bv;\n"
        "          pv = bv;\n"
        "          pi = bi;\n"
        "        }}\n"
        "        gs[g] = sum;\n"
        "      }}\n"
        "      bool chosen[G];\n"
        "      for (int g = 0; g < G; ++g) chosen[g] = false;\n"
        "      for (int p = 0; p < PICK; ++p) {{\n"
        "        int best = -1;\n"
        "        for (int g = 0; g < G; ++g)\n"
        "          if (!chosen[g] && (best < 0 || gs[g] > gs[best])) best = g;\n"
        "        if (best >= 0) chosen[best] = true;\n"
        "      }}\n"
        "      for (int j = 0; j < J; ++j) ok[j] = ok[j] && chosen[(lane + 32 * j) / EG];\n"
        "    }}\n",
        G, E / G, K / r.group_topk, r.group_topk);
  }
  // The top k of the eligible selection scores, then their probabilities.
  body += fmt::format(
      "    constexpr int K = {0};\n"
      "    int ex[K];\n"
      "    float sc[K];\n"
      "    float pv = 0.0f;\n"
      "    int pi = -1;\n"
      "#pragma unroll\n"
      "    for (int p = 0; p < K; ++p) {{\n"
      "      float bv = 0.0f;\n"
      "      int bi = -1;\n"
      "      for (int j = 0; j < J; ++j) {{\n"
      "        const int e = lane + 32 * j;\n"
      "        if (ok[j] && kiln_moe_after(sel[j], e, pv, pi) && kiln_moe_better(sel[j], e, bv, bi)) {{ bv = "
      "sel[j]; bi = e; }}\n"
      "      }}\n"
      "      kiln_moe_warp_best(&bv, &bi);\n"
      "      ex[p] = bi;\n"
      "      const int at = bi >= 0 ? bi : 0;\n"
      "      sc[p] = __shfl_sync(0xffffffffu, kiln_moe_slot(s, at >> 5), at & 31);\n"
      "      pv = bv;\n"
      "      pi = bi;\n"
      "    }}\n",
      K);
  if (!r.sigmoid && !r.pre_softmax) {
    // Softmax over the chosen logits (Mixtral's renormalization).
    body +=
        "    float top = kiln_fn::lowest<float>(), sum = 0.0f;\n"
        "    for (int p = 0; p < K; ++p) top = fmaxf(top, sc[p]);\n"
        "    for (int p = 0; p < K; ++p) { sc[p] = expf(sc[p] - top); sum += sc[p]; }\n"
        "    for (int p = 0; p < K; ++p) sc[p] /= sum;\n";
  } else if (r.sigmoid && K > 1) {
    body +=
        "    float sum = 0.0f;\n"
        "    for (int p = 0; p < K; ++p) sum += sc[p];\n"
        "    for (int p = 0; p < K; ++p) sc[p] /= sum + 1e-20f;\n";
  }
  const int probs = r.bias ? 2 : 1;
  body += fmt::format(
      "    if (lane < K) {{\n"
      "      float v = 0.0f;\n"
      "      int e = -1;\n"
      "      for (int p = 0; p < K; ++p) if (p == lane) {{ v = sc[p]; e = ex[p]; }}\n"
      "      kiln_st(b{0}, n * K + lane, e >= 0 ? v * {2} : 0.0f);\n"
      "      kiln_st(b{1}, n * K + lane, e);\n"
      "    }}\n"
      "  }}\n",
      probs, probs + 1, f32Literal(r.scale));
  Kernel k = sourceKernel("moe_router", warpGrid(r.tokens), 256, body);
  k.addBuffer("logits", DType::f32, r.tokens * E);
  if (r.bias) k.addBuffer("bias", DType::f32, E);
  k.addBuffer("probs", DType::f32, r.tokens * K, true);
  k.addBuffer("experts", DType::i32, r.tokens * K, true);
  return k;
}

Kernel routerGradKernel(const RouterShape& r) {
  const int64_t E = r.experts, K = r.topk;
  std::string body = warpLoop(r.tokens, "n") + loadRow(E, "b0");
  body += fmt::format(
      "    constexpr int K = {0};\n"
      "    const float scale = {1};\n"
      "    int ex[K];\n"
      "    float dp[K];\n"
      "    for (int p = 0; p < K; ++p) {{ ex[p] = kiln_ld(b1, n * K + p); dp[p] = scale * kiln_ld(b2, n * K "
      "+ p); }}\n"
      "    float d[J];\n"
      "    for (int j = 0; j < J; ++j) d[j] = 0.0f;\n",
      K, f32Literal(r.scale));
  // The chosen logits (or scores) lc[p] of every slot, on every lane.
  const char* chosen_logits =
      "    float lc[K];\n"
      "    for (int p = 0; p < K; ++p) {\n"
      "      const int at = ex[p] >= 0 && ex[p] < E ? ex[p] : 0;\n"
      "      lc[p] = __shfl_sync(0xffffffffu, kiln_moe_slot(l, at >> 5), at & 31);\n"
      "    }\n";
  if (r.sigmoid) {
    body += chosen_logits;
    body +=
        "    float sg[K], ds[K], sum = 0.0f, dot = 0.0f;\n"
        "    for (int p = 0; p < K; ++p) { sg[p] = 1.0f / (1.0f + expf(-lc[p])); sum += sg[p]; dot += dp[p] "
        "* sg[p]; }\n";
    body += K > 1 ? "    sum += 1e-20f;\n"
                    "    for (int p = 0; p < K; ++p) ds[p] = dp[p] / sum - dot / (sum * sum);\n"
                  : "    for (int p = 0; p < K; ++p) ds[p] = dp[p];\n";
    body +=
        "    for (int j = 0; j < J; ++j)\n"
        "      for (int p = 0; p < K; ++p)\n"
        "        if (ex[p] == lane + 32 * j) d[j] += ds[p] * sg[p] * (1.0f - sg[p]);\n";
  } else if (r.pre_softmax) {
    // probs are scores of the softmax over all E: its Jacobian-vector product.
    body += kRowSoftmaxStats;
    body +=
        "    float dot = 0.0f, sm[J], dsm[J];\n"
        "    for (int j = 0; j < J; ++j) {\n"
        "      sm[j] = lane + 32 * j < E ? expf(l[j] - m) / z : 0.0f;\n"
        "      dsm[j] = 0.0f;\n"
        "      for (int p = 0; p < K; ++p) if (ex[p] == lane + 32 * j) dsm[j] += dp[p];\n"
        "      dot += sm[j] * dsm[j];\n"
        "    }\n"
        "    dot = kiln_moe_warp_sum(dot);\n"
        "    for (int j = 0; j < J; ++j) d[j] = sm[j] * (dsm[j] - dot);\n";
  } else {
    // probs = softmax over the chosen logits.
    body += chosen_logits;
    body +=
        "    float top = kiln_fn::lowest<float>(), sum = 0.0f, pr[K], dot = 0.0f;\n"
        "    for (int p = 0; p < K; ++p) top = fmaxf(top, lc[p]);\n"
        "    for (int p = 0; p < K; ++p) { pr[p] = expf(lc[p] - top); sum += pr[p]; }\n"
        "    for (int p = 0; p < K; ++p) { pr[p] /= sum; dot += pr[p] * dp[p]; }\n"
        "    for (int j = 0; j < J; ++j)\n"
        "      for (int p = 0; p < K; ++p)\n"
        "        if (ex[p] == lane + 32 * j) d[j] += pr[p] * (dp[p] - dot);\n";
  }
  body +=
      "    for (int j = 0; j < J; ++j)\n"
      "      if (lane + 32 * j < E) kiln_st(b3, n * E + lane + 32 * j, d[j]);\n"
      "  }\n";
  Kernel k = sourceKernel("moe_router_grad", warpGrid(r.tokens), 256, body);
  k.addBuffer("logits", DType::f32, r.tokens * E);
  k.addBuffer("experts", DType::i32, r.tokens * K);
  k.addBuffer("dprobs", DType::f32, r.tokens * K);
  k.addBuffer("dlogits", DType::f32, r.tokens * E, true);
  return k;
}

// ---- Balancing losses ----

namespace {

int64_t sequenceLength(const AuxLossShape& a) { return a.seq_len > 0 ? a.seq_len : a.tokens; }

// Per token, what normalizes its scores: softmax's max and sum of exps, or the sum of sigmoids
// (+ 1e-20). stats[2n], stats[2n + 1].
Kernel auxStatsKernel(const AuxLossShape& a) {
  std::string body = warpLoop(a.tokens, "n") + loadRow(a.experts, "b0");
  if (a.sigmoid)
    body +=
        "    float z = 0.0f;\n"
        "    for (int j = 0; j < J; ++j) if (lane + 32 * j < E) z += 1.0f / (1.0f + expf(-l[j]));\n"
        "    z = kiln_moe_warp_sum(z) + 1e-20f;\n"
        "    const float m = 0.0f;\n";
  else
    body += kRowSoftmaxStats;
  body += "    if (lane == 0) { b1[2 * n] = m; b1[2 * n + 1] = z; }\n  }\n";
  Kernel k = sourceKernel("moe_aux_stats", warpGrid(a.tokens), 256, body);
  k.addBuffer("logits", DType::f32, a.tokens * a.experts);
  k.addBuffer("stats", DType::f32, 2 * a.tokens, true);
  return k;
}

// The score of expert i for token t, given the stats.
std::string auxScore(const AuxLossShape& a, const char* logits, const char* stats) {
  return a.sigmoid
             ? fmt::format("(1.0f / (1.0f + expf(-kiln_ld({0}, t * E + i))) / {1}[2 * t + 1])", logits, stats)
             : fmt::format("(expf(kiln_ld({0}, t * E + i) - {1}[2 * t]) / {1}[2 * t + 1])", logits, stats);
}

// Block s, thread i: the slots of sequence s routed to expert i.
constexpr const char* kSequenceCounts =
    "    int c = 0;\n"
    "    for (long long t = s * T; t < (s + 1) * T; ++t)\n"
    "      for (int p = 0; p < K; ++p) c += kiln_ld(b_experts, t * K + p) == i;\n";

int expertBlock(int64_t experts) {
  return static_cast<int>(std::max<int64_t>(32, ceilDiv(experts, 32) * 32));
}

}  // namespace

std::vector<Kernel> auxLossKernels(const AuxLossShape& a) {
  const int64_t T = sequenceLength(a), S = a.tokens / T, E = a.experts;
  std::vector<Kernel> out{auxStatsKernel(a)};
  // One block per sequence, one thread per expert: f_i P_i, summed over the block.
  std::string body = fmt::format(
      "  constexpr int E = {0}, K = {1};\n"
      "  constexpr long long T = {2}LL;\n"
      "  __shared__ float scratch[32];\n"
      "  const long long s = blockIdx.x;\n"
      "  const int i = threadIdx.x;\n"
      "  float v = 0.0f;\n"
      "  if (i < E) {{\n"
      "    const int* b_experts = b1;\n",
      E, a.topk, T);
  body += kSequenceCounts;
  body += fmt::format(
      "    float P = 0.0f;\n"
      "    for (long long t = s * T; t < (s + 1) * T; ++t) P += {0};\n"
      "    v = ((float)c / (float)(T * K)) * (P / (float)T);\n"
      "  }}\n"
      "  v = kiln_block_reduce<float, kiln_fn::SumCombiner>(v, scratch);\n"
      "  if (i == 0) b3[s] = {1} * (float)E * v;\n",
      auxScore(a, "b0", "b2"), f32Literal(a.coeff));
  Kernel seq = sourceKernel("moe_aux_sequences", S, expertBlock(E), body);
  seq.addBuffer("logits", DType::f32, a.tokens * E);
  seq.addBuffer("experts", DType::i32, a.tokens * a.topk);
  seq.addBuffer("stats", DType::f32, 2 * a.tokens);
  seq.addBuffer("partial", DType::f32, S, true);
  out.push_back(std::move(seq));
  // The mean over sequences, in one block (a fixed order: the same bits every run).
  std::string mean = fmt::format(
      "  __shared__ float scratch[32];\n"
      "  float v = 0.0f;\n"
      "  for (long long s = threadIdx.x; s < {0}LL; s += blockDim.x) v += b0[s];\n"
      "  v = kiln_block_reduce<float, kiln_fn::SumCombiner>(v, scratch);\n"
      "  if (threadIdx.x == 0) b1[0] = v / (float){0};\n",
      S);
  Kernel fin = sourceKernel("moe_aux_mean", 1, 256, mean);
  fin.addBuffer("partial", DType::f32, S);
  fin.addBuffer("loss", DType::f32, 1, true);
  out.push_back(std::move(fin));
  return out;
}

std::vector<Kernel> auxLossGradKernels(const AuxLossShape& a) {
  const int64_t T = sequenceLength(a), S = a.tokens / T, E = a.experts;
  std::vector<Kernel> out{auxStatsKernel(a)};
  std::string body = fmt::format(
      "  constexpr int E = {0}, K = {1};\n"
      "  constexpr long long T = {2}LL;\n"
      "  const long long s = blockIdx.x;\n"
      "  const int i = threadIdx.x;\n"
      "  if (i < E) {{\n"
      "    const int* b_experts = b0;\n",
      E, a.topk, T);
  body += kSequenceCounts;
  body += "    b1[s * E + i] = c;\n  }\n";
  Kernel counts = sourceKernel("moe_aux_counts", S, expertBlock(E), body);
  counts.addBuffer("experts", DType::i32, a.tokens * a.topk);
  counts.addBuffer("counts", DType::i32, S * E, true);
  out.push_back(std::move(counts));
  // d loss / d score(t, i) = g coeff E f_i^s / (S T), then through the score's normalization.
  std::string grad = warpLoop(a.tokens, "n") + loadRow(E, "b0");
  grad += fmt::format(
      "    const long long s = n / {0}LL;\n"
      "    const float unit = kiln_ld(b3, 0) * {1} * (float)E / ((float){2} * (float){0} * (float)({0}LL * "
      "{3}LL));\n"
      "    const float m = b1[2 * n], z = b1[2 * n + 1];\n"
      "    float w[J], q[J], dot = 0.0f;\n"
      "    for (int j = 0; j < J; ++j) {{\n"
      "      const int e = lane + 32 * j;\n"
      "      w[j] = e < E ? unit * (float)b2[s * E + e] : 0.0f;\n"
      "      q[j] = e < E ? {4} : 0.0f;\n"
      "      dot += w[j] * q[j];\n"
      "    }}\n"
      "    dot = kiln_moe_warp_sum(dot);\n"
      "    for (int j = 0; j < J; ++j) {{\n"
      "      const int e = lane + 32 * j;\n"
      "      if (e >= E) continue;\n"
      "      {5}\n"
      "    }}\n"
      "  }}\n",
      T, f32Literal(a.coeff), S, a.topk, a.sigmoid ? "1.0f / (1.0f + expf(-l[j])) / z" : "expf(l[j] - m) / z",
      a.sigmoid
          ? "const float sg = q[j] * z;\n      kiln_st(b4, n * E + e, (w[j] - dot) / z * sg * (1.0f - sg));"
          : "kiln_st(b4, n * E + e, q[j] * (w[j] - dot));");
  Kernel g = sourceKernel("moe_aux_grad", warpGrid(a.tokens), 256, grad);
  g.addBuffer("logits", DType::f32, a.tokens * E);
  g.addBuffer("stats", DType::f32, 2 * a.tokens);
  g.addBuffer("counts", DType::i32, S * E);
  g.addBuffer("g", DType::f32, 1);
  g.addBuffer("dlogits", DType::f32, a.tokens * E, true);
  out.push_back(std::move(g));
  return out;
}

Kernel zLossKernel(int64_t tokens, int64_t experts, double coeff) {
  // One block: warp w takes tokens w, w + 32, ...; lane 0 keeps the sum of lse^2, and the block
  // folds the warps' sums in a fixed order.
  std::string body = fmt::format(
      "  __shared__ float scratch[32];\n"
      "  const int lane = threadIdx.x & 31;\n"
      "  float acc = 0.0f;\n"
      "  for (long long n = threadIdx.x >> 5; n < {0}LL; n += blockDim.x >> 5) {{\n",
      tokens);
  body += loadRow(experts, "b0");
  body += kRowSoftmaxStats;
  body += fmt::format(
      "    const float lse = m + logf(z);\n"
      "    if (lane == 0) acc += lse * lse;\n"
      "  }}\n"
      "  acc = kiln_block_reduce<float, kiln_fn::SumCombiner>(acc, scratch);\n"
      "  if (threadIdx.x == 0) b1[0] = {0} * acc / (float){1};\n",
      f32Literal(coeff), tokens);
  Kernel k = sourceKernel("moe_z_loss", 1, 1024, body);
  k.addBuffer("logits", DType::f32, tokens * experts);
  k.addBuffer("loss", DType::f32, 1, true);
  return k;
}

Kernel zLossGradKernel(int64_t tokens, int64_t experts, double coeff) {
  std::string body = warpLoop(tokens, "n") + loadRow(experts, "b0") + kRowSoftmaxStats;
  body += fmt::format(
      "    const float lse = m + logf(z);\n"
      "    const float c = kiln_ld(b1, 0) * {0} * 2.0f * lse / (float){1};\n"
      "    for (int j = 0; j < J; ++j)\n"
      "      if (lane + 32 * j < E) kiln_st(b2, n * E + lane + 32 * j, c * expf(l[j] - m) / z);\n"
      "  }}\n",
      f32Literal(coeff), tokens);
  Kernel k = sourceKernel("moe_z_loss_grad", warpGrid(tokens), 256, body);
  k.addBuffer("logits", DType::f32, tokens * experts);
  k.addBuffer("g", DType::f32, 1);
  k.addBuffer("dlogits", DType::f32, tokens * experts, true);
  return k;
}

// ---- Dispatch ----

int64_t expertCapacity(int64_t tokens, int64_t topk, int64_t experts, double capacity_factor) {
  if (capacity_factor <= 0) return 0;
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * topk) * capacity_factor / static_cast<double>(experts)));
}

std::vector<Kernel> dispatchKernels(const DispatchShape& d) {
  // Everything stays on the device (the step needs no host sync): counts, offsets and rows are
  // made where the grouped GEMM reads them. Three kernels:
  // 1. plan, one block per expert: count its slots; when more than C arrived under the probs
  //    policy, find the C-th largest prob by a bitwise search over order-preserving keys (32
  //    block-wide counting passes) and how many slots equal to it still fit (ties keep the
  //    lower slot). plan[4e..4e+3] = kept, over capacity, threshold key, quota of equal keys;
  // 2. offsets, one block: the row counts' prefix sum (E is small), counts, and -1 in the rows
  //    past R (the bound's slack);
  // 3. rows, one block per expert: its kept slots in token order (block scans place them), then
  //    its padding rows.
  const std::string constants = fmt::format(
      "  constexpr int E = {0}, C = {3};\n"
      "  constexpr long long S = {1}LL, ROWS = {2}LL;\n"
      "  constexpr bool BY_PROBS = {4}, PAD = {5};\n",
      d.experts, d.tokens * d.topk, d.rows, d.capacity, d.by_probs ? "true" : "false",
      d.pad ? "true" : "false");
  std::vector<Kernel> out;
  std::string plan = constants + R"CUDA(  __shared__ int scratch[32];
  const int e = blockIdx.x;
  int mine = 0;
  for (long long s = threadIdx.x; s < S; s += blockDim.x) mine += b0[s] == e;
  const int routed = kiln_moe_block_sum(mine, scratch);
  const bool over = C > 0 && routed > C;
  unsigned t = 0;
  int quota = 0;
  if (over && BY_PROBS) {
    // The largest key t with at least C of the expert's keys >= t is the C-th largest.
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned cand = t | (1u << bit);
      int at_least = 0;
      for (long long s = threadIdx.x; s < S; s += blockDim.x)
        at_least += b0[s] == e && kiln_moe_order_key(kiln_ld(b1, s)) >= cand;
      if (kiln_moe_block_sum(at_least, scratch) >= C) t = cand;
    }
    int above = 0;
    for (long long s = threadIdx.x; s < S; s += blockDim.x) above += b0[s] == e && kiln_moe_order_key(kiln_ld(b1, s)) > t;
    quota = C - kiln_moe_block_sum(above, scratch);
  }
  if (threadIdx.x == 0) {
    b2[4 * e] = over ? C : routed;
    b2[4 * e + 1] = over;
    b2[4 * e + 2] = (int)t;
    b2[4 * e + 3] = quota;
  }
)CUDA";
  Kernel k1 = sourceKernel("moe_dispatch_plan", d.experts, 256, plan);
  k1.addBuffer("experts", DType::i32, d.tokens * d.topk);
  k1.addBuffer("probs", DType::f32, d.tokens * d.topk);
  k1.addBuffer("plan", DType::i32, 4 * d.experts, true);
  out.push_back(std::move(k1));
  std::string offsets = constants + R"CUDA(  __shared__ int offs[E + 1];
  if (threadIdx.x == 0) {
    offs[0] = 0;
    for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + (PAD ? C : b0[4 * e]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i <= E; i += blockDim.x) b1[i] = offs[i];
  for (int i = threadIdx.x; i < E; i += blockDim.x) b2[i] = b0[4 * i];
  // Rows past R hold no slot: readers treat them as padding.
  for (long long r = offs[E] + threadIdx.x; r < ROWS; r += blockDim.x) b3[r] = -1;
)CUDA";
  Kernel k2 = sourceKernel("moe_dispatch_offsets", 1, 1024, offsets);
  k2.addBuffer("plan", DType::i32, 4 * d.experts);
  k2.addBuffer("offsets", DType::i32, d.experts + 1, true);
  k2.addBuffer("counts", DType::i32, d.experts, true);
  k2.addBuffer("rows", DType::i32, d.rows, true);
  out.push_back(std::move(k2));
  std::string rows = constants + R"CUDA(  __shared__ int scratch[32];
  const int e = blockIdx.x;
  const int kept = b2[4 * e], quota = b2[4 * e + 3];
  const bool limited = b2[4 * e + 1] != 0;
  const unsigned threshold = (unsigned)b2[4 * e + 2];
  const long long first = b3[e];
  int written = 0, equal_seen = 0;
  for (long long base = 0; base < S; base += blockDim.x) {
    const long long s = base + threadIdx.x;
    const bool hit = s < S && b0[s] == e;
    bool take = hit;
    int total = 0;
    if (limited && BY_PROBS) {
      const unsigned key = hit ? kiln_moe_order_key(kiln_ld(b1, s)) : 0u;
      const bool equal = hit && key == threshold;
      const int equal_rank = equal_seen + kiln_moe_block_scan(equal, scratch, &total) - 1;
      equal_seen += total;
      take = hit && (key > threshold || (equal && equal_rank < quota));
    }
    const int position = written + kiln_moe_block_scan(take, scratch, &total) - 1;  // every thread scans
    written += total;
    if (take && position < kept && first + position < ROWS) b4[first + position] = (int)s;
  }
  if (PAD)
    for (int p = kept + threadIdx.x; p < C; p += blockDim.x)
      if (first + p < ROWS) b4[first + p] = -1;
)CUDA";
  Kernel k3 = sourceKernel("moe_dispatch_rows", d.experts, 256, rows);
  k3.addBuffer("experts", DType::i32, d.tokens * d.topk);
  k3.addBuffer("probs", DType::f32, d.tokens * d.topk);
  k3.addBuffer("plan", DType::i32, 4 * d.experts);
  k3.addBuffer("offsets", DType::i32, d.experts + 1);
  k3.addBuffer("rows", DType::i32, d.rows, true);
  out.push_back(std::move(k3));
  return out;
}

// ---- Permutation ----

Kernel permuteKernel(DType x, int64_t tokens, int64_t topk, int64_t hidden, int64_t rows, bool apply_probs) {
  std::string body = threadLoop(rows * hidden, "i");
  body += fmt::format(
      "    const long long r = i / {0}LL, h = i % {0}LL;\n"
      "    const long long s = kiln_ld(b1, r);\n"
      "    float v = 0.0f;\n"
      "    if (s >= 0 && s < {1}LL) v = kiln_ld(b0, (s / {2}LL) * {0}LL + h){3};\n"
      "    kiln_st(b3, i, v);\n"
      "  }}\n",
      hidden, tokens * topk, topk, apply_probs ? " * kiln_ld(b2, s)" : "");
  Kernel k = sourceKernel("moe_permute", threadGrid(rows * hidden), 256, body);
  k.addBuffer("x", x, tokens * hidden);
  k.addBuffer("rows", DType::i32, rows);
  k.addBuffer("probs", DType::f32, tokens * topk);
  k.addBuffer("y", x, rows * hidden, true);
  return k;
}

std::vector<Kernel> unpermuteKernels(DType y, int64_t tokens, int64_t topk, int64_t hidden, int64_t rows,
                                     bool apply_probs) {
  // Owner computes, not atomics: each output element sums its token's slots in slot order, so
  // the result is deterministic. The slot -> row map comes first.
  std::vector<Kernel> out;
  const int64_t slots = tokens * topk;
  std::string clear = threadLoop(slots, "i") + "    b0[i] = -1;\n  }\n";
  Kernel c = sourceKernel("moe_slot_rows_clear", threadGrid(slots), 256, clear);
  c.addBuffer("slot_row", DType::i32, slots, true);
  out.push_back(std::move(c));
  std::string map =
      threadLoop(rows, "r") +
      fmt::format("    const int s = b0[r];\n    if (s >= 0 && s < {}LL) b1[s] = (int)r;\n  }}\n", slots);
  Kernel m = sourceKernel("moe_slot_rows", threadGrid(rows), 256, map);
  m.addBuffer("rows", DType::i32, rows);
  m.addBuffer("slot_row", DType::i32, slots, true);
  out.push_back(std::move(m));
  std::string body = threadLoop(tokens * hidden, "i");
  body += fmt::format(
      "    const long long n = i / {0}LL, h = i % {0}LL;\n"
      "    float acc = 0.0f;\n"
      "    for (int p = 0; p < {1}; ++p) {{\n"
      "      const long long r = b1[n * {1}LL + p];\n"
      "      if (r >= 0) acc += {2}kiln_ld(b0, r * {0}LL + h);\n"
      "    }}\n"
      "    kiln_st(b3, i, acc);\n"
      "  }}\n",
      hidden, topk, apply_probs ? fmt::format("kiln_ld(b2, n * {}LL + p) * ", topk) : "");
  Kernel u = sourceKernel("moe_unpermute", threadGrid(tokens * hidden), 256, body);
  u.addBuffer("y", y, rows * hidden);
  u.addBuffer("slot_row", DType::i32, slots);
  u.addBuffer("probs", DType::f32, slots);
  u.addBuffer("out", y, tokens * hidden, true);
  out.push_back(std::move(u));
  return out;
}

std::vector<Kernel> rowDotKernels(DType a, DType b, int64_t tokens, int64_t topk, int64_t hidden,
                                  int64_t rows) {
  const int64_t slots = tokens * topk;
  std::vector<Kernel> out;
  Kernel z = sourceKernel("moe_row_dot_clear", threadGrid(slots), 256,
                          threadLoop(slots, "i") + "    b0[i] = 0.0f;\n  }\n");
  z.addBuffer("out", DType::f32, slots, true);
  out.push_back(std::move(z));
  // Each slot is in at most one row, so the warp of that row is its only writer.
  std::string body = warpLoop(rows, "r");
  body += fmt::format(
      "    const long long s = b1[r];\n"
      "    if (s < 0 || s >= {0}LL) continue;\n"
      "    const long long n = s / {1}LL;\n"
      "    float acc = 0.0f;\n"
      "    for (long long h = lane; h < {2}LL; h += 32) acc += kiln_ld(b0, r * {2}LL + h) * kiln_ld(b2, n * "
      "{2}LL + h);\n"
      "    acc = kiln_moe_warp_sum(acc);\n"
      "    if (lane == 0) b3[s] = acc;\n"
      "  }}\n",
      slots, topk, hidden);
  Kernel d = sourceKernel("moe_row_dot", warpGrid(rows), 256, body);
  d.addBuffer("a", a, rows * hidden);
  d.addBuffer("rows", DType::i32, rows);
  d.addBuffer("b", b, tokens * hidden);
  d.addBuffer("out", DType::f32, slots, true);
  out.push_back(std::move(d));
  return out;
}

Kernel expertBiasUpdateKernel(int64_t experts, double rate) {
  // sign(mean - counts[i]) as the sign of the integer sum - E * counts[i]: exact, whatever the
  // float rounding of a mean would do at a tie.
  std::string body = fmt::format(
      "  __shared__ long long total;\n"
      "  if (threadIdx.x == 0) {{\n"
      "    long long t = 0;\n"
      "    for (int i = 0; i < {0}; ++i) t += b1[i];\n"
      "    total = t;\n"
      "  }}\n"
      "  __syncthreads();\n"
      "  for (int i = threadIdx.x; i < {0}; i += blockDim.x) {{\n"
      "    const long long d = total - {0}LL * (long long)b1[i];\n"
      "    b0[i] += {1} * (float)((d > 0) - (d < 0));\n"
      "  }}\n",
      experts, f32Literal(rate));
  Kernel k = sourceKernel("moe_expert_bias_update", 1, 256, body);
  k.addBuffer("bias", DType::f32, experts, true);
  k.addBuffer("counts", DType::i32, experts);
  return k;
}

// ---- Grouped GEMMs ----

namespace {

// How a block finds its tile: the flattened index walks the experts' row tiles (ceil(rows_e /
// BM) each, from the offsets on the device); indices past them zero the rows between R and the
// bound. Sets e (-1 for a tail tile), row0 and row_end.
std::string groupedTile(int64_t experts, int64_t rows, int bm, int64_t col_tiles) {
  return fmt::format(
      "  constexpr int E = {0}, BM = {2};\n"
      "  constexpr long long ROWS = {1}LL;\n"
      "  const int tn = (int)(blockIdx.x % {3}LL);\n"
      "  long long t = blockIdx.x / {3}LL, row0 = 0, row_end = 0;\n"
      "  int e = -1;\n"
      "  for (int i = 0; i < E && e < 0; ++i) {{\n"
      "    const long long lo = kiln_fn::min((long long)kiln_fn::max(b2[i], 0), ROWS);\n"
      "    const long long hi = kiln_fn::max(lo, kiln_fn::min((long long)b2[i + 1], ROWS));\n"
      "    const long long tiles = (hi - lo + BM - 1) / BM;\n"
      "    if (t < tiles) {{ e = i; row0 = lo + t * BM; row_end = hi; }} else t -= tiles;\n"
      "  }}\n"
      "  if (e < 0) {{\n"
      "    row0 = kiln_fn::min((long long)kiln_fn::max(b2[E], 0), ROWS) + t * BM;\n"
      "    row_end = kiln_fn::min(row0 + BM, ROWS);\n"
      "  }}\n"
      "  if (row0 >= row_end) return;  // uniform over the block\n",
      experts, rows, bm, col_tiles);
}

// Blocks of a grouped GEMM: expert row tiles (at most ceil(ROWS/BM) + E, one partial tile per
// expert) plus tail tiles (at most ceil(ROWS/BM)), times the column tiles.
int64_t groupedGrid(int64_t rows, int64_t experts, int bm, int64_t col_tiles) {
  return std::max<int64_t>(1, (2 * ceilDiv(rows, bm) + experts) * col_tiles);
}

std::string tailZero(int bn, int64_t m) {
  return fmt::format(
      "  if (e < 0) {{\n"
      "    for (int i = threadIdx.x; i < BM * {0}; i += blockDim.x) {{\n"
      "      const long long r = row0 + i / {0}, c = (long long)tn * {0} + i % {0};\n"
      "      if (r < row_end && c < {1}LL) kiln_st(b3, r * {1}LL + c, 0.0f);\n"
      "    }}\n"
      "    return;\n"
      "  }}\n",
      bn, m);
}

std::string simtGroupedBody(const GroupedGemmShape& s, int64_t col_tiles) {
  // 64x64 tiles, 16 deep; 256 threads of 4x4 outputs.
  std::string body = groupedTile(s.experts, s.rows, 64, col_tiles) + tailZero(64, s.m);
  body += fmt::format(
      "  constexpr int BN = 64, BK = 16;\n"
      "  constexpr long long KD = {0}LL, M = {1}LL;\n"
      "  __shared__ float As[BK][BM], Bs[BK][BN];\n"
      "  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;\n"
      "  float acc[4][4] = {{}};\n"
      "  for (long long k0 = 0; k0 < KD; k0 += BK) {{\n"
      "    for (int i = threadIdx.x; i < BM * BK; i += blockDim.x) {{\n"
      "      const int r = i / BK, kk = i % BK;\n"
      "      const long long gr = row0 + r, gk = k0 + kk;\n"
      "      As[kk][r] = gr < row_end && gk < KD ? kiln_ld(b0, gr * KD + gk) : 0.0f;\n"
      "    }}\n"
      "    for (int i = threadIdx.x; i < BK * BN; i += blockDim.x) {{\n"
      "      const int kk = {2}, c = {3};\n"
      "      const long long gk = k0 + kk, gc = (long long)tn * BN + c;\n"
      "      Bs[kk][c] = gk < KD && gc < M ? kiln_ld(b1, (long long)e * KD * M + {4}) : 0.0f;\n"
      "    }}\n"
      "    __syncthreads();\n"
      "#pragma unroll\n"
      "    for (int kk = 0; kk < BK; ++kk) {{\n"
      "      float a[4], b[4];\n"
      "      for (int i = 0; i < 4; ++i) {{ a[i] = As[kk][ty * 4 + i]; b[i] = Bs[kk][tx * 4 + i]; }}\n"
      "      for (int i = 0; i < 4; ++i)\n"
      "        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];\n"
      "    }}\n"
      "    __syncthreads();\n"
      "  }}\n"
      "  for (int i = 0; i < 4; ++i)\n"
      "    for (int j = 0; j < 4; ++j) {{\n"
      "      const long long gr = row0 + ty * 4 + i, gc = (long long)tn * BN + tx * 4 + j;\n"
      "      if (gr < row_end && gc < M) kiln_st(b3, gr * M + gc, acc[i][j]);\n"
      "    }}\n",
      s.k, s.m,
      // With w[e] as [M, K], consecutive threads read consecutive k.
      s.transpose_b ? "i % BK" : "i / BN", s.transpose_b ? "i / BK" : "i % BN",
      s.transpose_b ? "gc * KD + gk" : "gk * M + gc");
  return body;
}

// The operands of one tensor-core tile: out[row0..row_end, tn*128..] = sum over the reduction
// index gk in [red_lo, red_hi) of A(gr, gk) B(gk, gc). Index texts use gr, gk, gc; `*_kfast`
// says whether the operand is contiguous along gk (else along gr for A, gc for B), and `*_vec`
// whether every run of 8 elements along that dimension that a tile copies is 16-byte aligned
// (the strides are multiples of 8 elements; for a k-contiguous operand red_lo is too), so that
// it can be copied with cp.async; otherwise it goes through registers.
struct MmaOperands {
  std::string a_index;  // into b0
  bool a_kfast = true, a_vec = false;
  std::string b_index;  // into b1
  bool b_kfast = false, b_vec = false;
  int64_t cols = 0;         // the output's column count
  std::string store_index;  // into b3
};

// One operand's share of a stage: 512 chunks of 8 elements (a 128 x 32 tile), two per thread,
// each copied into its swizzled place (kiln_tile_kmajor / kiln_tile_rowmajor). `line` names
// the tile's row variable (gr or gc), `first` its first row and `limit` its end.
std::string stageCopy(const char* smem, const char* buffer, const std::string& index, bool kfast, bool vec,
                      const char* line, const std::string& first, const std::string& limit) {
  const char* copy = vec ? "kiln_cp_async16" : "kiln_copy8";
  if (kfast)
    return fmt::format(
        "      {{\n"
        "        const int r = c >> 2, kc = (c & 3) * 8;\n"
        "        const long long {0} = {1} + r, gk = k0 + kc;\n"
        "        const int valid = {0} < {2} ? (int)kiln_fn::max(0LL, kiln_fn::min(8LL, red_hi - gk)) : 0;\n"
        "        {3}({4} + kiln_tile_kmajor(r, kc), valid > 0 ? (const void*)({5} + ({6})) : (const void*){5}, "
        "valid);\n"
        "      }}\n",
        line, first, limit, copy, smem, buffer, index);
  return fmt::format(
      "      {{\n"
      "        const int kk = c >> 4, rc = (c & 15) * 8;\n"
      "        const long long {0} = {1} + rc, gk = k0 + kk;\n"
      "        const int valid = gk < red_hi ? (int)kiln_fn::max(0LL, kiln_fn::min(8LL, {2} - {0})) : 0;\n"
      "        {3}({4} + kiln_tile_rowmajor(rc, kk), valid > 0 ? (const void*)({5} + ({6})) : (const void*){5}, "
      "valid);\n"
      "      }}\n",
      line, first, limit, copy, smem, buffer, index);
}

// A thread's fragment reads from a staged tile (kiln_tile_kmajor / kiln_tile_rowmajor). Within a
// warp's part of the tile, a fragment's row is W + 8 j + g (g = lane / 4; W = wm * 64 for A,
// whose j = 2 mi + h, and wn * 32 for B, whose j = ni) and its k is ks + 8 t + 2 q (plus 1 for
// the pair's high half). The swizzled chunk bits and the other bits of an offset never overlap,
// so each read is a per-thread base, XOR compile-time chunk bits, plus a constant. Computing the
// offsets from one or two registers (instead of letting the compiler keep one per fragment live
// across the loop) is what fits a thread in 128 registers.
struct OperandReads {
  std::string bases;  // declarations, once before the loop
  std::string read;   // unsigned: the pair (row, k), (row, k + 1) of fragment (j, t)
};

OperandReads operandReads(const std::string& name, const std::string& smem, const std::string& warp_row,
                          const std::string& j, bool kfast) {
  OperandReads r;
  if (kfast) {  // [row][k]: row * 32 + ((k / 8) ^ ((row >> 1) & 3)) * 8 + k % 8
    r.bases = fmt::format("  const int {0}_base = ({1} + g) * 32 + 2 * q + (((g >> 1) & 3) << 3);\n", name, warp_row);
    r.read = fmt::format("*(const unsigned*)({0} + (({1}_base ^ (ks + 8 * t)) + {2} * 256))", smem, name, j);
    return r;
  }
  // [k][row]: k * 128 + ((row / 8) ^ (k % 8)) * 8 + row % 8, one 16-bit read per half.
  for (int d : {0, 1})
    r.bases += fmt::format(
        "  const int {0}_base{1} = (2 * q + {1}) * 128 + (({2}) & ~63) + g + (((({2}) >> 3 & 7) ^ (2 * q + {1})) << 3);\n",
        name, d, warp_row);
  r.read = fmt::format("((unsigned){0}[({1}_base0 ^ ({2} << 3)) + (ks + 8 * t) * 128] | "
                       "((unsigned){0}[({1}_base1 ^ ({2} << 3)) + (ks + 8 * t) * 128] << 16))",
                       smem, name, j);
  return r;
}

// 128x128 tiles, 32 deep; 8 warps as 2 x 4, each 64x32 = 4 x 4 mma tiles of 16x8. A three-stage
// cp.async pipeline: while the warps multiply stage s, the copies of stages s+1 and s+2 are in
// flight, and the copy into a stage starts only after the barrier that ends every warp's reads
// of it. The shared tiles hold bf16 bits in swizzled layouts (kiln_tile_*) without padding, so
// three stages of both operands take exactly the 48 KiB a block may declare statically, and
// with __launch_bounds__(256, 2) two blocks fit an SM: the two 16-deep halves of a stage run
// as a loop (unrolled, the compiler keeps both halves' fragments live: 60 more registers and
// spills), and a warp holds the B fragments of a half and one A fragment at a time.
// Expects row0, row_end, tn, red_lo and red_hi declared; an empty reduction stores zeros.
std::string mmaTile(const MmaOperands& o) {
  const OperandReads a = operandReads("a", "as", "wm * 64", "(mi * 2 + h)", o.a_kfast);
  const OperandReads b = operandReads("b", "bs", "wn * 32", "ni", o.b_kfast);
  return fmt::format(
             "  constexpr int BN = 128, BK = 32, STAGES = 3, TILE = 128 * BK;\n"
             "  constexpr long long COLS = {0}LL;\n"
             "  const long long steps = (red_hi - red_lo + BK - 1) / BK;\n"
             "  __shared__ __align__(128) unsigned short As[STAGES][TILE], Bs[STAGES][TILE];\n"
             "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
             "  const int wm = warp >> 2, wn = warp & 3, g = lane >> 2, q = lane & 3;\n"
             "  const long long col0 = (long long)tn * BN;\n"
             "  auto load = [&](int buf, long long step) {{\n"
             "    const long long k0 = red_lo + step * BK;\n"
             "#pragma unroll\n"
             "    for (int p = 0; p < 2; ++p) {{\n"
             "      const int c = threadIdx.x + 256 * p;\n",
             o.cols) +
         stageCopy("As[buf]", "b0", o.a_index, o.a_kfast, o.a_vec, "gr", "row0", "row_end") +
         stageCopy("Bs[buf]", "b1", o.b_index, o.b_kfast, o.b_vec, "gc", "col0", "COLS") +
         "    }\n"
         "  };\n" +
         a.bases + b.bases +
         fmt::format(
             "  float acc[4][4][4] = {{}};\n"
             "#pragma unroll\n"
             "  for (int s = 0; s < STAGES - 1; ++s) {{\n"
             "    if (s < steps) load(s, s);\n"
             "    kiln_cp_async_commit();\n"
             "  }}\n"
             "  for (long long step = 0; step < steps; ++step) {{\n"
             "    kiln_cp_async_wait<STAGES - 2>();  // this step's stage has landed (for this thread)\n"
             "    __syncthreads();                    // for every thread; and the oldest stage is free\n"
             "    const long long next = step + STAGES - 1;\n"
             "    if (next < steps) load((int)(next % STAGES), next);\n"
             "    kiln_cp_async_commit();  // an empty group near the end keeps the count\n"
             "    const unsigned short* as = As[step % STAGES];\n"
             "    const unsigned short* bs = Bs[step % STAGES];\n"
             "#pragma unroll 1\n"
             "    for (int ks = 0; ks < BK; ks += 16) {{\n"
             "      unsigned b[4][2];\n"
             "#pragma unroll\n"
             "      for (int ni = 0; ni < 4; ++ni)\n"
             "#pragma unroll\n"
             "        for (int t = 0; t < 2; ++t) b[ni][t] = {1};\n"
             "#pragma unroll\n"
             "      for (int mi = 0; mi < 4; ++mi) {{\n"
             "        unsigned a[4];\n"
             "#pragma unroll\n"
             "        for (int i = 0; i < 4; ++i) {{\n"
             "          const int h = i & 1, t = i >> 1;  // a[0]: (g, k), a[1]: (g + 8, k), a[2]: (g, k + 8), ...\n"
             "          a[i] = {0};\n"
             "        }}\n"
             "#pragma unroll\n"
             "        for (int ni = 0; ni < 4; ++ni) kiln_mma_bf16_16x8x16(acc[mi][ni], a, b[ni]);\n"
             "      }}\n"
             "    }}\n"
             "  }}\n"
             "  kiln_cp_async_wait<0>();\n"
             "#pragma unroll\n"
             "  for (int mi = 0; mi < 4; ++mi)\n"
             "#pragma unroll\n"
             "    for (int ni = 0; ni < 4; ++ni)\n"
             "#pragma unroll\n"
             "      for (int c = 0; c < 4; ++c) {{\n"
             "        const long long gr = row0 + wm * 64 + mi * 16 + g + (c >> 1) * 8;\n"
             "        const long long gc = col0 + wn * 32 + ni * 8 + 2 * q + (c & 1);\n"
             "        if (gr < row_end && gc < COLS) kiln_st(b3, {2}, acc[mi][ni][c]);\n"
             "      }}\n",
             a.read, b.read, o.store_index);
}

std::string tensorCoreGroupedBody(const GroupedGemmShape& s, int64_t col_tiles) {
  MmaOperands o;
  o.a_index = fmt::format("gr * {}LL + gk", s.k);
  o.a_kfast = true;
  // w[e] as [K, M], or [M, K] with transpose_b (then contiguous along k).
  o.b_index = s.transpose_b ? fmt::format("(long long)e * {0}LL * {1}LL + gc * {0}LL + gk", s.k, s.m)
                            : fmt::format("(long long)e * {0}LL * {1}LL + gk * {1}LL + gc", s.k, s.m);
  o.b_kfast = s.transpose_b;
  o.a_vec = s.k % 8 == 0;
  o.b_vec = (s.transpose_b ? s.k : s.m) % 8 == 0;
  o.cols = s.m;
  o.store_index = fmt::format("gr * {}LL + gc", s.m);
  return groupedTile(s.experts, s.rows, 128, col_tiles) + tailZero(128, s.m) +
         fmt::format("  const long long red_lo = 0, red_hi = {}LL;\n", s.k) + mmaTile(o);
}

}  // namespace

Kernel groupedMatmulKernel(const GroupedGemmShape& s) {
  const bool tensor_cores = s.dtype == DType::bf16;
  const int bm = tensor_cores ? 128 : 64;
  const int64_t col_tiles = ceilDiv(s.m, bm);
  Kernel k = sourceKernel(tensor_cores ? "grouped_matmul_bf16_mma" : "grouped_matmul_f32",
                          groupedGrid(s.rows, s.experts, bm, col_tiles), 256,
                          tensor_cores ? tensorCoreGroupedBody(s, col_tiles) : simtGroupedBody(s, col_tiles));
  if (tensor_cores) k.min_blocks_per_sm = 2;  // mmaTile's register budget: 128 per thread
  k.addBuffer("x", s.dtype, s.rows * s.k);
  k.addBuffer("w", s.dtype, s.experts * s.k * s.m);
  k.addBuffer("offsets", DType::i32, s.experts + 1);
  k.addBuffer("y", s.dtype, s.rows * s.m, true);
  return k;
}

namespace {

// bf16: block (e, k tile, m tile) is a tensor-core tile of w[e] = x_e^T dy_e: its rows are k,
// its reduction expert e's rows.
Kernel tensorCoreWgradKernel(const WgradShape& s) {
  const int64_t kt = ceilDiv(s.k, 128), mt = ceilDiv(s.m, 128);
  MmaOperands o;
  o.a_index = fmt::format("gk * {}LL + gr", s.k);  // x[r][k]: contiguous along the tile's rows
  o.a_kfast = false;
  o.b_index = fmt::format("gk * {}LL + gc", s.m);  // dy[r][m]
  o.b_kfast = false;
  o.a_vec = s.k % 8 == 0;  // x[gk][gr..gr+8) with gr a multiple of 8 (row0 is one of 128)
  o.b_vec = s.m % 8 == 0;
  o.cols = s.m;
  o.store_index = s.transpose ? fmt::format("e * {0}LL * {1}LL + gc * {0}LL + gr", s.k, s.m)
                              : fmt::format("e * {0}LL * {1}LL + gr * {1}LL + gc", s.k, s.m);
  std::string body = fmt::format(
      "  constexpr long long ROWS = {0}LL;\n"
      "  const long long e = blockIdx.x / {1}LL;\n"
      "  const int tn = (int)(blockIdx.x % {2}LL);\n"
      "  const long long row0 = ((blockIdx.x / {2}LL) % {3}LL) * 128, row_end = kiln_fn::min(row0 + 128, "
      "{4}LL);\n"
      "  const long long red_lo = kiln_fn::min((long long)kiln_fn::max(b2[e], 0), ROWS);\n"
      "  const long long red_hi = kiln_fn::max(red_lo, kiln_fn::min((long long)b2[e + 1], ROWS));\n",
      s.rows, kt * mt, mt, kt, s.k);
  Kernel k = sourceKernel("grouped_matmul_wgrad_bf16_mma", std::max<int64_t>(1, s.experts * kt * mt), 256,
                          body + mmaTile(o));
  k.min_blocks_per_sm = 2;
  k.addBuffer("x", s.dtype, s.rows * s.k);
  k.addBuffer("dy", s.dtype, s.rows * s.m);
  k.addBuffer("offsets", DType::i32, s.experts + 1);
  k.addBuffer("w", s.dtype, s.experts * s.k * s.m, true);
  return k;
}

}  // namespace

Kernel groupedWgradKernel(const WgradShape& s) {
  if (s.dtype == DType::bf16) return tensorCoreWgradKernel(s);
  // Block (e, k-tile, m-tile) folds expert e's rows (offsets on the device) 16 at a time into
  // a 64x64 tile; 256 threads of 4x4 outputs. An expert without rows stores zeros.
  const int64_t kt = ceilDiv(s.k, 64), mt = ceilDiv(s.m, 64);
  std::string body = fmt::format(
      "  constexpr int T = 64, BR = 16;\n"
      "  constexpr long long KD = {0}LL, M = {1}LL, ROWS = {2}LL;\n"
      "  const long long e = blockIdx.x / {3}LL, tk = (blockIdx.x / {4}LL) % {5}LL, tm = blockIdx.x % "
      "{4}LL;\n"
      "  const long long lo = kiln_fn::min((long long)kiln_fn::max(b2[e], 0), ROWS);\n"
      "  const long long hi = kiln_fn::max(lo, kiln_fn::min((long long)b2[e + 1], ROWS));\n"
      "  __shared__ float Xs[BR][T], Ds[BR][T];\n"
      "  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;\n"
      "  float acc[4][4] = {{}};\n"
      "  for (long long r0 = lo; r0 < hi; r0 += BR) {{\n"
      "    for (int i = threadIdx.x; i < BR * T; i += blockDim.x) {{\n"
      "      const int rr = i / T, c = i % T;\n"
      "      const long long r = r0 + rr, gk = tk * T + c, gm = tm * T + c;\n"
      "      Xs[rr][c] = r < hi && gk < KD ? kiln_ld(b0, r * KD + gk) : 0.0f;\n"
      "      Ds[rr][c] = r < hi && gm < M ? kiln_ld(b1, r * M + gm) : 0.0f;\n"
      "    }}\n"
      "    __syncthreads();\n"
      "    for (int rr = 0; rr < BR; ++rr)\n"
      "      for (int i = 0; i < 4; ++i)\n"
      "        for (int j = 0; j < 4; ++j) acc[i][j] += Xs[rr][ty * 4 + i] * Ds[rr][tx * 4 + j];\n"
      "    __syncthreads();\n"
      "  }}\n"
      "  for (int i = 0; i < 4; ++i)\n"
      "    for (int j = 0; j < 4; ++j) {{\n"
      "      const long long gk = tk * T + ty * 4 + i, gm = tm * T + tx * 4 + j;\n"
      "      if (gk < KD && gm < M) kiln_st(b3, e * KD * M + {6}, acc[i][j]);\n"
      "    }}\n",
      s.k, s.m, s.rows, kt * mt, mt, kt, s.transpose ? "gm * KD + gk" : "gk * M + gm");
  Kernel k = sourceKernel("grouped_matmul_wgrad", std::max<int64_t>(1, s.experts * kt * mt), 256, body);
  k.addBuffer("x", s.dtype, s.rows * s.k);
  k.addBuffer("dy", s.dtype, s.rows * s.m);
  k.addBuffer("offsets", DType::i32, s.experts + 1);
  k.addBuffer("w", s.dtype, s.experts * s.k * s.m, true);
  return k;
}

}  // namespace kiln::codegen::emit
