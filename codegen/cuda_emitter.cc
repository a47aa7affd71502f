#include "codegen/cuda_emitter.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

#include "codegen/emit/embedding_sort.h"
#include "codegen/emit/moe.h"
#include "codegen/emit/optimizer.h"

namespace kiln::codegen {

uint64_t fnv1a64(std::string_view s, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

namespace {

// The primitives scalar_fn.def's bodies are written in (ir/scalar_fn.h has their host versions),
// over CUDA's math library: no fast-math approximations; an integer quotient or remainder by
// zero is zero.
constexpr const char* kCudaPrimitives = R"CUDA(
namespace kiln_fn {
__device__ __forceinline__ float exp(float x) { return ::expf(x); }
__device__ __forceinline__ double exp(double x) { return ::exp(x); }
__device__ __forceinline__ float log(float x) { return ::logf(x); }
__device__ __forceinline__ double log(double x) { return ::log(x); }
__device__ __forceinline__ float log1p(float x) { return ::log1pf(x); }
__device__ __forceinline__ double log1p(double x) { return ::log1p(x); }
__device__ __forceinline__ float sqrt(float x) { return ::sqrtf(x); }
__device__ __forceinline__ double sqrt(double x) { return ::sqrt(x); }
__device__ __forceinline__ float tanh(float x) { return ::tanhf(x); }
__device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float pow(float a, float b) { return ::powf(a, b); }
__device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
__device__ __forceinline__ int pow(int a, int b) { return (int)::pow((double)a, (double)b); }
__device__ __forceinline__ long long pow(long long a, long long b) { return (long long)::pow((double)a, (double)b); }
__device__ __forceinline__ float abs(float x) { return ::fabsf(x); }
__device__ __forceinline__ double abs(double x) { return ::fabs(x); }
__device__ __forceinline__ int abs(int x) { return x < 0 ? -x : x; }
__device__ __forceinline__ long long abs(long long x) { return x < 0 ? -x : x; }
__device__ __forceinline__ float max(float a, float b) { return ::fmaxf(a, b); }
__device__ __forceinline__ double max(double a, double b) { return ::fmax(a, b); }
__device__ __forceinline__ int max(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ long long max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ float min(float a, float b) { return ::fminf(a, b); }
__device__ __forceinline__ double min(double a, double b) { return ::fmin(a, b); }
__device__ __forceinline__ int min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ long long min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ float quotient(float a, float b) { return a / b; }
__device__ __forceinline__ double quotient(double a, double b) { return a / b; }
__device__ __forceinline__ int quotient(int a, int b) { return b ? a / b : 0; }
__device__ __forceinline__ long long quotient(long long a, long long b) { return b ? a / b : 0; }
__device__ __forceinline__ float rem(float a, float b) { return ::fmodf(a, b); }
__device__ __forceinline__ double rem(double a, double b) { return ::fmod(a, b); }
__device__ __forceinline__ int rem(int a, int b) { return b ? a % b : 0; }
__device__ __forceinline__ long long rem(long long a, long long b) { return b ? a % b : 0; }
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ long long hash_mix(long long a, long long b) {
  return (long long)splitmix64((unsigned long long)a ^ (unsigned long long)b);
}
__device__ __forceinline__ long long counter_bits(long long stream, long long index) {
  return (long long)(splitmix64((unsigned long long)stream + 0x9e3779b97f4a7c15ull * (unsigned long long)index) >> 11);
}
template <class T> __device__ __forceinline__ T hash_mix(T a, T b) { return (T)hash_mix((long long)a, (long long)b); }
template <class T> __device__ __forceinline__ T counter_bits(T a, T b) { return (T)counter_bits((long long)a, (long long)b); }
template <class T> __device__ __forceinline__ T lowest();
template <> __device__ __forceinline__ float lowest<float>() { return __uint_as_float(0xff800000u); }
template <> __device__ __forceinline__ double lowest<double>() { return (double)__uint_as_float(0xff800000u); }
template <> __device__ __forceinline__ int lowest<int>() { return -2147483647 - 1; }
template <> __device__ __forceinline__ long long lowest<long long>() { return -9223372036854775807LL - 1; }
)CUDA";

// Every function and combiner of ir/scalar_fn.def as a device function template in namespace
// kiln_fn, its body the entry's text: kiln_fn::Gelu<float>(x), kiln_fn::SumCombiner.
std::string scalarFunctionsCuda() {
  std::string out = "\n// The scalar functions of Kiln's ir/scalar_fn.def, over the primitives below.";
  out += kCudaPrimitives;
  for (const ir::ScalarFnInfo& f : ir::scalarFns()) {
    const char* ret = f.kind == ir::ScalarFnKind::Compare ? "bool" : "T";
    const char* params = f.arity == 1 ? "T x" : "T a, T b";
    out += fmt::format("template <class T> __device__ __forceinline__ {} {}({}) {{ {} }}\n", ret, f.name,
                       params, f.body);
  }
  for (const ir::CombinerInfo& c : ir::combiners())
    out += fmt::format(
        "struct {}Combiner {{\n"
        "  template <class T> __device__ __forceinline__ static T combine(T a, T b) {{ return {}<T>(a, b); "
        "}}\n"
        "  template <class T> __device__ __forceinline__ static T identity() {{ {} }}\n"
        "}};\n",
        c.name, ir::scalarFnInfo(c.combine).name, c.identity);
  out += "}  // namespace kiln_fn\n\n";
  return out;
}

}  // namespace

const std::string& cudaPrelude() {
  static const std::string prelude =
      std::string(R"CUDA(// Generated by Kiln. Self-contained for NVRTC: no includes, no host code.
struct kiln_bf16 { unsigned short bits; };
__device__ __forceinline__ float kiln_bf16_to_f32(kiln_bf16 h) { return __uint_as_float(((unsigned)h.bits) << 16); }
__device__ __forceinline__ kiln_bf16 kiln_f32_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  kiln_bf16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) { h.bits = (unsigned short)((u >> 16) | 0x40u); return h; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  h.bits = (unsigned short)(u >> 16);
  return h;
}
__device__ __forceinline__ float kiln_round_bf16(float f) { return kiln_bf16_to_f32(kiln_f32_to_bf16(f)); }

__device__ __forceinline__ float kiln_ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double kiln_ld(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ float kiln_ld(const kiln_bf16* p, long long i) { return kiln_bf16_to_f32(p[i]); }
__device__ __forceinline__ int kiln_ld(const int* p, long long i) { return p[i]; }
__device__ __forceinline__ long long kiln_ld(const long long* p, long long i) { return p[i]; }
__device__ __forceinline__ bool kiln_ld(const bool* p, long long i) { return p[i]; }
__device__ __forceinline__ void kiln_st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void kiln_st(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void kiln_st(kiln_bf16* p, long long i, float v) { p[i] = kiln_f32_to_bf16(v); }
__device__ __forceinline__ void kiln_st(int* p, long long i, int v) { p[i] = v; }
__device__ __forceinline__ void kiln_st(long long* p, long long i, long long v) { p[i] = v; }
__device__ __forceinline__ void kiln_st(bool* p, long long i, bool v) { p[i] = v; }

// Elements [4v, 4v + 4) as one 16-byte (f32, i32) or 8-byte (bf16) access: a vectorized
// Pointwise kernel's loads and stores at its flat index (the buffers are 256-byte aligned).
struct alignas(16) kiln_v4f { float x[4]; };
struct alignas(16) kiln_v4i { int x[4]; };
struct alignas(8) kiln_v4h { kiln_bf16 x[4]; };
__device__ __forceinline__ void kiln_ld4(const float* p, long long v, float (&out)[4]) {
  const kiln_v4f t = ((const kiln_v4f*)p)[v];
  for (int j = 0; j < 4; ++j) out[j] = t.x[j];
}
__device__ __forceinline__ void kiln_ld4(const int* p, long long v, int (&out)[4]) {
  const kiln_v4i t = ((const kiln_v4i*)p)[v];
  for (int j = 0; j < 4; ++j) out[j] = t.x[j];
}
__device__ __forceinline__ void kiln_ld4(const kiln_bf16* p, long long v, float (&out)[4]) {
  const kiln_v4h t = ((const kiln_v4h*)p)[v];
  for (int j = 0; j < 4; ++j) out[j] = kiln_bf16_to_f32(t.x[j]);
}
__device__ __forceinline__ void kiln_st4(float* p, long long v, const float (&in)[4]) {
  kiln_v4f t;
  for (int j = 0; j < 4; ++j) t.x[j] = in[j];
  ((kiln_v4f*)p)[v] = t;
}
__device__ __forceinline__ void kiln_st4(int* p, long long v, const int (&in)[4]) {
  kiln_v4i t;
  for (int j = 0; j < 4; ++j) t.x[j] = in[j];
  ((kiln_v4i*)p)[v] = t;
}
__device__ __forceinline__ void kiln_st4(kiln_bf16* p, long long v, const float (&in)[4]) {
  kiln_v4h t;
  for (int j = 0; j < 4; ++j) t.x[j] = kiln_f32_to_bf16(in[j]);
  ((kiln_v4h*)p)[v] = t;
}

// Scatter-adds. bf16 has no hardware atomic add of its own here (no cuda_bf16.h): a 16-bit CAS
// loop rounds each sum to nearest even like kiln_st does.
__device__ __forceinline__ void kiln_atomic_add(float* p, long long i, float v) { atomicAdd(p + i, v); }
__device__ __forceinline__ void kiln_atomic_add(double* p, long long i, double v) { atomicAdd(p + i, v); }
__device__ __forceinline__ void kiln_atomic_add(int* p, long long i, int v) { atomicAdd(p + i, v); }
__device__ __forceinline__ void kiln_atomic_add(long long* p, long long i, long long v) {
  atomicAdd((unsigned long long*)(p + i), (unsigned long long)v);  // two's complement wraps alike
}
__device__ __forceinline__ void kiln_atomic_add(kiln_bf16* p, long long i, float v) {
  unsigned short* a = &p[i].bits;
  unsigned short old = *a, seen;
  do {
    seen = old;
    kiln_bf16 cur; cur.bits = seen;
    old = atomicCAS(a, seen, kiln_f32_to_bf16(kiln_bf16_to_f32(cur) + v).bits);
  } while (old != seen);
}

)CUDA") +
      scalarFunctionsCuda() + R"CUDA(
// Block-wide fold with a combiner of scalar_fn.def; every thread gets the result. blockDim.x
// is a multiple of 32 and `scratch` holds 32 values. The leading barrier lets consecutive calls
// share scratch.
template <typename T, typename C>
__device__ T kiln_block_reduce(T v, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = C::template combine<T>(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? scratch[lane] : C::template identity<T>();
    for (int o = 16; o > 0; o >>= 1) v = C::template combine<T>(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

// Embeddings. An out-of-range id sets err = {1, table}, bad jagged lengths {2, table} (first
// one wins; `table` is numbered across the kernels sharing the flag); the offending id
// contributes nothing.
__device__ __forceinline__ void kiln_flag_error(int* err, int code, int table) {
  if (atomicCAS(err, 0, code) == 0) atomicExch(err + 1, table);
}
__device__ __forceinline__ void kiln_set_error(int* err, int table) { kiln_flag_error(err, 1, table); }

// One warp pools one bag, ids [lo, hi): lanes own dims lane, lane+32, ...; f32 accumulation in
// id order; a mean divides by the bag's size (an empty bag gives zeros).
template <int D, typename T, typename I, typename W, typename O>
__device__ __forceinline__ void kiln_bag_forward(const T* table, const I* ids, const W* wts, long long rows, bool mean,
                                                 long long lo, long long hi, O* out, long long out_at, int* err, int t,
                                                 int lane) {
  constexpr int kPer = (D + 31) / 32;
  float acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
  // Unrolled so several ids' rows are in flight at once: a many-hot bag (R1 has bags of 100)
  // is otherwise one dependent id-then-row load after another.
#pragma unroll 4
  for (long long p = lo; p < hi; ++p) {
    const long long id = (long long)ids[p];
    if (id < 0 || id >= rows) { if (lane == 0) kiln_set_error(err, t); continue; }
    const float w = wts ? kiln_ld(wts, p) : 1.0f;
    const T* row = table + id * D;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int d = lane + 32 * j;
      if (d < D) acc[j] += w * kiln_ld(row, d);
    }
  }
  const float s = mean && hi > lo ? 1.0f / (float)(hi - lo) : 1.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int d = lane + 32 * j;
    if (d < D) kiln_st(out, out_at + d, acc[j] * s);
  }
}

// The bag owning id position p of a jagged table: the b with offsets[b] <= p < offsets[b + 1]
// (binary search; empty bags are skipped).
__device__ __forceinline__ long long kiln_bag_of(const long long* offsets, long long batch, long long p) {
  long long lo = 0, hi = batch - 1;
  while (lo < hi) {
    const long long mid = (lo + hi) >> 1;
    if (offsets[mid + 1] > p) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// Exclusive scan of one jagged table's lengths by one block: offsets[0] = 0 and
// offsets[b + 1] = min(offsets[b] + max(lengths[b], 0), n), so readers stay inside the ids even
// when the lengths are wrong. n is the ids buffer's size (a bounded dim's bound: a batch may
// use fewer); a negative length or a total above n sets err = {2, t}.
template <typename L>
__device__ __forceinline__ void kiln_bag_offsets(const L* lengths, long long* offsets, long long batch, long long n,
                                                 int* err, int t) {
  __shared__ long long warp_sums[32];
  __shared__ long long carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = (int)(blockDim.x >> 5);
  if (tid == 0) { carry = 0; offsets[0] = 0; }
  bool negative = false;
  __syncthreads();
  for (long long base = 0; base < batch; base += blockDim.x) {
    const long long b = base + tid;
    long long v = b < batch ? (long long)lengths[b] : 0;
    if (v < 0) { negative = true; v = 0; }
    for (int o = 1; o < 32; o <<= 1) {
      const long long u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      long long w = lane < warps ? warp_sums[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const long long u = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += u;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const long long inclusive = carry + v + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (b < batch) offsets[b + 1] = inclusive < n ? inclusive : n;
    __syncthreads();  // every thread has read carry and warp_sums
    if (tid == (int)blockDim.x - 1) carry = inclusive;
    __syncthreads();
  }
  if (negative || (tid == 0 && carry > n)) kiln_flag_error(err, 2, t);
}
)CUDA" +
      emit::optimizerDeviceFunctions() + emit::embeddingSortDeviceFunctions() + emit::moeDeviceFunctions();
  return prelude;
}

namespace {

const char* cType(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::bf16: return "kiln_bf16";
    case DType::i32: return "int";
    case DType::i64: return "long long";
    case DType::i1: return "bool";
    default: return "void";
  }
}

std::string floatLiteral(double v, DType t) {
  bool f32 = t == DType::f32;
  if (std::isnan(v)) return f32 ? "__int_as_float(0x7fc00000)" : "__longlong_as_double(0x7ff8000000000000LL)";
  if (std::isinf(v)) {
    std::string inf = f32 ? "__int_as_float(0x7f800000)" : "__longlong_as_double(0x7ff0000000000000LL)";
    return v < 0 ? "(-" + inf + ")" : inf;
  }
  std::string s = f32 ? fmt::format("{:.9g}", static_cast<float>(v)) : fmt::format("{:.17g}", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  if (f32) s += "f";
  return v < 0 ? "(" + s + ")" : s;
}

// How a Pointwise kernel runs four consecutive elements per thread: the loads and stores at
// the kernel's flat index (a same-shape operand, the result) become one 16-byte (8 for bf16)
// access each, the rest stay per element (a broadcast bias, a transpose's gather).
struct VectorPlan {
  static constexpr int kWidth = 4;
  bool vectorized = false;
  std::vector<int> loads;       // Load nodes at the flat index
  std::vector<size_t> stores;   // indices into Kernel::stores, at the flat index
};

// A buffer can be accessed 4 elements at a time over the whole space: f32, i32 or bf16, and
// its allocation a multiple of 4 elements holding the space (so a hoisted load out of a
// select's branch stays in bounds, and host buffers ending at a page keep their alignment).
bool vectorizable(const KernelBuffer& b, int64_t n) {
  return (b.dtype == DType::f32 || b.dtype == DType::i32 || b.dtype == DType::bf16) && b.elements >= n &&
         b.elements % VectorPlan::kWidth == 0;
}

VectorPlan vectorPlan(const Kernel& k) {
  VectorPlan plan;
  const int64_t n = k.spaceSize();
  // Below a few thousand elements the launch dominates whatever the loads do.
  if (k.kind != KernelKind::Pointwise || n % VectorPlan::kWidth != 0 || n < 4096) return plan;
  // The flat index as the lowering writes it (rowMajorOffset of the coordinates): built again
  // in a copy, hash-consing finds the node if the kernel has one.
  ExprGraph copy = k.exprs;
  std::vector<int> coords;
  for (size_t d = 0; d < k.space.size(); ++d) coords.push_back(copy.coord(static_cast<int>(d)));
  const int flat = rowMajorOffset(copy, coords, k.space);
  if (flat >= static_cast<int>(k.exprs.size())) return plan;
  for (const Store& st : k.stores) {
    if (st.accumulate) return plan;
    if (st.index == flat && st.guard < 0 && vectorizable(k.buffers[static_cast<size_t>(st.buffer)], n))
      plan.stores.push_back(static_cast<size_t>(&st - k.stores.data()));
  }
  for (size_t id = 0; id < k.exprs.size(); ++id) {
    const Expr& e = k.exprs[static_cast<int>(id)];
    if (e.op == ExprOp::Load && e.a == flat && vectorizable(k.buffers[static_cast<size_t>(e.buffer)], n))
      plan.loads.push_back(static_cast<int>(id));
  }
  plan.vectorized = !plan.loads.empty() || !plan.stores.empty();
  return plan;
}

class KernelPrinter {
 public:
  explicit KernelPrinter(const Kernel& k) : k_(k), g_(k.exprs) {}

  std::string print(const std::string& name) {
    LaunchConfig lc = launchConfig(k_);
    out_ += fmt::format("// {} kernel '{}'", kernelKindName(k_.kind), k_.name);
    if (!k_.space.empty()) out_ += fmt::format(", space [{}]", fmt::join(k_.space, ", "));
    if (!k_.row_space.empty()) out_ += fmt::format(", rows [{}]", fmt::join(k_.row_space, ", "));
    out_ += fmt::format(", launch <<<{}, {}>>>\n", lc.grid, lc.block);
    for (size_t i = 0; i < k_.buffers.size(); ++i)
      out_ += fmt::format("//   b{}: {}{} {}[{}]\n", i, k_.buffers[i].written ? "" : "const ",
                          ir::dtypeName(k_.buffers[i].dtype), k_.buffers[i].name, k_.buffers[i].elements);
    std::string bounds = std::to_string(lc.block);
    if (k_.kind == KernelKind::Source && k_.min_blocks_per_sm > 0) bounds += fmt::format(", {}", k_.min_blocks_per_sm);
    out_ += fmt::format("extern \"C\" __global__ void __launch_bounds__({}) {}(", bounds, name);
    for (size_t i = 0; i < k_.buffers.size(); ++i)
      out_ += fmt::format("{}{}{}* b{}", i ? ", " : "", k_.buffers[i].written ? "" : "const ",
                          cType(k_.buffers[i].dtype), i);
    out_ += ") {\n";
    switch (k_.kind) {
      case KernelKind::Pointwise: printPointwise(); break;
      case KernelKind::Row: printRow(lc); break;
      case KernelKind::ColumnReduce: printColumnReduce(); break;
      case KernelKind::EmbeddingForward: printEmbeddingForward(); break;
      case KernelKind::BagOffsets: printBagOffsets(); break;
      case KernelKind::Source:
        out_ += k_.source;
        break;
    }
    out_ += "}\n";
    return out_;
  }

 private:
  void line(int indent, const std::string& s) { out_ += std::string(static_cast<size_t>(indent) * 2, ' ') + s + "\n"; }

  // Declares coordinates `first..` of `shape` from the flat index variable `flat`.
  void coords(int indent, const std::string& flat, const std::vector<int64_t>& shape, int first) {
    if (shape.size() == 1) {
      line(indent, fmt::format("const long long c{} = {};", first, flat));
      return;
    }
    // Below 2^32 elements the divisions by the shape's constants run in 32 bits: on a GPU a
    // 64-bit division by a constant is a multiply-high sequence several times as long.
    int64_t extent = 1;
    for (int64_t d : shape) extent *= d;
    const bool narrow = extent <= int64_t{UINT32_MAX};
    const char* type = narrow ? "unsigned" : "long long";
    const char* suffix = narrow ? "u" : "LL";
    line(indent, fmt::format("{0} rest{1} = ({0}){2};", type, first, flat));
    for (size_t j = shape.size(); j-- > 1;) {
      line(indent, fmt::format("const long long c{} = rest{} % {}{};", first + static_cast<int>(j), first, shape[j],
                               suffix));
      line(indent, fmt::format("rest{} /= {}{};", first, shape[j], suffix));
    }
    line(indent, fmt::format("const long long c{} = rest{};", first, first));
  }

  // The text of node id: its temporary's name if it has one, else the expression inline.
  std::string ref(int id) {
    auto it = named_.find(id);
    if (it != named_.end()) return it->second;
    return text(id);
  }

  std::string text(int id) {
    const Expr& e = g_[id];
    auto unaryFn = [&](const char* fn) { return fmt::format("{}({})", fn, ref(e.a)); };
    if (auto fn = scalarFnOf(e.op)) {  // a function of scalar_fn.def, in its operands' type
      const ir::ScalarFnInfo& info = ir::scalarFnInfo(*fn);
      const std::string t = cType(g_.typeOf(e.a));
      if (info.arity == 1) return fmt::format("kiln_fn::{}<{}>({})", info.name, t, ref(e.a));
      return fmt::format("kiln_fn::{}<{}>({}, {})", info.name, t, ref(e.a), ref(e.b));
    }
    switch (e.op) {
      case ExprOp::Const:
        if (ir::isFloat(e.type)) return floatLiteral(e.fvalue, e.type);
        if (e.type == DType::i1) return e.ivalue ? "true" : "false";
        if (e.type == DType::i32) return e.ivalue < 0 ? fmt::format("({})", e.ivalue) : std::to_string(e.ivalue);
        return e.ivalue < 0 ? fmt::format("({}LL)", e.ivalue) : fmt::format("{}LL", e.ivalue);
      case ExprOp::Coord: return fmt::format("c{}", e.index);
      case ExprOp::RowValue: return fmt::format("rv{}", e.index);
      case ExprOp::Load: return fmt::format("kiln_ld(b{}, {})", e.buffer, ref(e.a));
      case ExprOp::BagOf:
        return fmt::format("kiln_bag_of(b{}, {}LL, {})", e.buffer, e.ivalue, ref(e.a));
      case ExprOp::RoundBf16:
        return unaryFn("kiln_round_bf16");
      case ExprOp::Select: return fmt::format("({} ? {} : {})", ref(e.a), ref(e.b), ref(e.c));
      case ExprOp::Cast: return fmt::format("(({}){})", cType(e.type), ref(e.a));
      default: break;  // the scalar functions, above
    }
    return "0";
  }

  // Declares temporaries for the nodes `roots` need that are evaluated unconditionally: a node
  // reached only through a select's branches stays inline, so it is evaluated only when chosen
  // (a concat's or gather's loads). Consts and coordinates are always inline.
  void emitScope(int indent, const std::vector<int>& roots) {
    std::vector<char> eager(g_.size(), 0), used(g_.size(), 0);
    for (int r : roots)
      if (r >= 0) eager[static_cast<size_t>(r)] = used[static_cast<size_t>(r)] = 1;
    for (size_t i = g_.size(); i-- > 0;) {
      if (!used[i]) continue;
      const Expr& e = g_[static_cast<int>(i)];
      if (named_.count(static_cast<int>(i))) continue;
      auto mark = [&](int o, bool eagerly) {
        if (o < 0) return;
        used[static_cast<size_t>(o)] = 1;
        if (eagerly && eager[i]) eager[static_cast<size_t>(o)] = 1;
      };
      mark(e.a, true);
      mark(e.b, e.op != ExprOp::Select);
      mark(e.c, e.op != ExprOp::Select);
    }
    for (size_t i = 0; i < g_.size(); ++i) {
      const Expr& e = g_[static_cast<int>(i)];
      if (!eager[i] || named_.count(static_cast<int>(i))) continue;
      if (e.op == ExprOp::Const || e.op == ExprOp::Coord || e.op == ExprOp::RowValue) continue;
      std::string name = fmt::format("v{}", i);
      line(indent, fmt::format("const {} {} = {};", cType(e.type), name, text(static_cast<int>(i))));
      named_[static_cast<int>(i)] = name;
      scoped_.back().push_back(static_cast<int>(i));
    }
  }

  void openScope() { scoped_.emplace_back(); }
  void closeScope() {
    for (int id : scoped_.back()) named_.erase(id);
    scoped_.pop_back();
  }

  void emitStores(int indent, const std::vector<Store>& stores) {
    std::vector<int> roots;
    for (const Store& s : stores) roots.insert(roots.end(), {s.index, s.value, s.guard});
    emitScope(indent, roots);
    for (const Store& s : stores) {
      std::string st = fmt::format("{}(b{}, {}, {});", s.accumulate ? "kiln_atomic_add" : "kiln_st", s.buffer,
                                   ref(s.index), ref(s.value));
      line(indent, s.guard >= 0 ? fmt::format("if ({}) {}", ref(s.guard), st) : st);
    }
  }

  void printPointwise() {
    const int64_t n = k_.spaceSize();
    const VectorPlan plan = vectorPlan(k_);
    if (plan.vectorized) return printPointwiseVector(plan);
    if (n <= int64_t{UINT32_MAX} - (int64_t{1} << 24)) {
      // 32-bit index math: i plus a grid's stride (at most 16384 x 1024 threads) cannot wrap.
      line(1, fmt::format("const unsigned n = {}u;", n));
      line(1, "for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {");
    } else {
      line(1, fmt::format("const long long n = {}LL;", n));
      line(1, "for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;");
      line(1, "     i += (long long)gridDim.x * blockDim.x) {");
    }
    coords(2, "i", k_.space, 0);
    openScope();
    emitStores(2, k_.stores);
    closeScope();
    line(1, "}");
  }

  // Four consecutive elements a thread: the flat-index loads as one vector load each before
  // the elements' math, the flat-index stores gathered and written as one vector store after.
  void printPointwiseVector(const VectorPlan& plan) {
    const int64_t n = k_.spaceSize(), vectors = n / VectorPlan::kWidth;
    const bool narrow = n <= int64_t{UINT32_MAX} - (int64_t{1} << 24);
    const char* type = narrow ? "unsigned" : "long long";
    line(1, fmt::format("const {0} vectors = {1}{2};", type, vectors, narrow ? "u" : "LL"));
    line(1, fmt::format("for ({0} v = ({0})blockIdx.x * blockDim.x + threadIdx.x; v < vectors;", type));
    line(1, fmt::format("     v += ({})gridDim.x * blockDim.x) {{", type));
    for (int id : plan.loads) {
      const Expr& e = g_[id];
      line(2, fmt::format("{} l{}[4];", cType(e.type), id));
      line(2, fmt::format("kiln_ld4(b{}, v, l{});", e.buffer, id));
    }
    for (size_t s : plan.stores)
      line(2, fmt::format("{} s{}[4];", cType(computeType(k_.buffers[static_cast<size_t>(k_.stores[s].buffer)].dtype)), s));
    line(2, "#pragma unroll");
    line(2, "for (int j = 0; j < 4; ++j) {");
    line(3, fmt::format("const {} i = 4 * v + j;", type));
    coords(3, "i", k_.space, 0);
    openScope();
    for (int id : plan.loads) {
      named_[id] = fmt::format("l{}[j]", id);
      scoped_.back().push_back(id);
    }
    std::vector<int> roots;
    for (const Store& st : k_.stores) roots.insert(roots.end(), {st.index, st.value, st.guard});
    emitScope(3, roots);
    for (size_t s = 0; s < k_.stores.size(); ++s) {
      const Store& st = k_.stores[s];
      if (std::find(plan.stores.begin(), plan.stores.end(), s) != plan.stores.end()) {
        line(3, fmt::format("s{}[j] = {};", s, ref(st.value)));
        continue;
      }
      const std::string text = fmt::format("kiln_st(b{}, {}, {});", st.buffer, ref(st.index), ref(st.value));
      line(3, st.guard >= 0 ? fmt::format("if ({}) {}", ref(st.guard), text) : text);
    }
    closeScope();
    line(2, "}");
    for (size_t s : plan.stores) line(2, fmt::format("kiln_st4(b{}, v, s{});", k_.stores[s].buffer, s));
    line(1, "}");
  }

  void printRow(const LaunchConfig& lc) {
    int outer = static_cast<int>(k_.space.size());
    bool any_f32 = false, any_f64 = false;
    for (const Phase& p : k_.phases)
      if (p.kind == Phase::Kind::Reduce) (g_.typeOf(p.value) == DType::f64 ? any_f64 : any_f32) = true;
    if (any_f32) line(1, "__shared__ float scratch_f32[32];");
    if (any_f64) line(1, "__shared__ double scratch_f64[32];");
    line(1, fmt::format("for (long long o = blockIdx.x; o < {}LL; o += gridDim.x) {{", k_.spaceSize()));
    coords(2, "o", k_.space, 0);
    openScope();
    if (k_.guard >= 0) {
      emitScope(2, {k_.guard});
      line(2, fmt::format("if (!{}) continue;  // uniform across the block", ref(k_.guard)));
    }
    int reduce_index = 0;
    for (const Phase& p : k_.phases) {
      if (p.kind == Phase::Kind::Reduce) {
        DType t = g_.typeOf(p.value);
        const std::string combiner = fmt::format("kiln_fn::{}Combiner", ir::combinerInfo(p.combiner).name);
        line(2, fmt::format("{} rv{};", cType(t), reduce_index));
        line(2, "{");
        line(3, fmt::format("{} acc = {}::identity<{}>();", cType(t), combiner, cType(t)));
        line(3, fmt::format("for (long long r = threadIdx.x; r < {}LL; r += blockDim.x) {{", k_.rowSize()));
        coords(4, "r", k_.row_space, outer);
        openScope();
        emitScope(4, {p.value});
        line(4, fmt::format("acc = {}::combine<{}>(acc, {});", combiner, cType(t), ref(p.value)));
        closeScope();
        line(3, "}");
        line(3, fmt::format("rv{} = kiln_block_reduce<{}, {}>(acc, scratch_{});", reduce_index, cType(t),
                            combiner, ir::dtypeName(t)));
        line(2, "}");
        ++reduce_index;
      } else {
        line(2, fmt::format("for (long long r = threadIdx.x; r < {}LL; r += blockDim.x) {{", k_.rowSize()));
        coords(3, "r", k_.row_space, outer);
        openScope();
        emitStores(3, p.stores);
        closeScope();
        line(2, "}");
        line(2, "__syncthreads();  // the row's reads finish before the epilogue writes");
      }
    }
    if (!k_.stores.empty()) {
      line(2, "if (threadIdx.x == 0) {");
      openScope();
      emitStores(3, k_.stores);
      closeScope();
      line(2, "}");
    }
    closeScope();
    line(1, "}");
    (void)lc;
  }

  // A block is a tile of `lanes` consecutive columns by `groups` row groups (ColumnTile): tile t
  // is slab t / strips, columns from (t % strips) * lanes. Each thread folds its rows of the slab
  // in order, then the groups' partials meet in shared memory as a fixed tree.
  void printColumnReduce() {
    const ColumnTile t = columnTile(k_);
    const Phase& p = k_.phases[0];
    const std::string ty = cType(g_.typeOf(p.value));
    const std::string combiner = fmt::format("kiln_fn::{}Combiner", ir::combinerInfo(p.combiner).name);
    const std::vector<int64_t> kept(k_.space.begin() + 1, k_.space.end());
    const int outer = static_cast<int>(k_.space.size());
    line(1, fmt::format("__shared__ {} part[{}];", ty, ColumnTile::kThreads));
    line(1, fmt::format("const int lane = threadIdx.x % {}, group = threadIdx.x / {};", t.lanes, t.lanes));
    line(1, fmt::format("for (long long t = blockIdx.x; t < {}LL; t += gridDim.x) {{", t.slabs * t.strips));
    line(2, fmt::format("const long long c0 = t / {}LL;  // the slab", t.strips));
    line(2, fmt::format("const long long col = (t % {}LL) * {} + lane;", t.strips, t.lanes));
    if (!kept.empty()) coords(2, "col", kept, 1);
    openScope();
    line(2, fmt::format("{} acc = {}::identity<{}>();", ty, combiner, ty));
    line(2, fmt::format("if (col < {}LL) {{", t.columns));
    line(3, fmt::format("const long long end = c0 * {0}LL + {0}LL < {1}LL ? c0 * {0}LL + {0}LL : {1}LL;", t.slab_rows,
                        k_.rowSize()));
    line(3, fmt::format("for (long long r = c0 * {}LL + group; r < end; r += {}) {{", t.slab_rows, t.groups));
    if (!k_.row_space.empty()) coords(4, "r", k_.row_space, outer);
    openScope();
    emitScope(4, {p.value});
    line(4, fmt::format("acc = {}::combine<{}>(acc, {});", combiner, ty, ref(p.value)));
    closeScope();
    line(3, "}");
    line(2, "}");
    line(2, "part[threadIdx.x] = acc;");
    line(2, "__syncthreads();");
    line(2, fmt::format("for (int half = {}; half > 0; half >>= 1) {{", t.groups / 2));
    line(3, fmt::format("if (group < half) part[threadIdx.x] = {}::combine<{}>(part[threadIdx.x], part[threadIdx.x + half * {}]);",
                        combiner, ty, t.lanes));
    line(3, "__syncthreads();");
    line(2, "}");
    line(2, fmt::format("if (group == 0 && col < {}LL) {{", t.columns));
    line(3, fmt::format("const {} rv0 = part[lane];", ty));
    openScope();
    emitStores(3, k_.stores);
    closeScope();
    line(2, "}");
    line(2, "__syncthreads();  // every thread read its part before the next tile writes it");
    closeScope();
    line(1, "}");
  }

  std::string bufferOrNull(int b, const char* type) {
    return b >= 0 ? fmt::format("b{}", b) : fmt::format("(const {}*)nullptr", type);
  }

  void printEmbeddingForward() {
    int64_t tables = static_cast<int64_t>(k_.tables.size());
    line(1, "const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;");
    line(1, "const int lane = threadIdx.x & 31;");
    line(1, fmt::format("if (warp >= {}LL) return;", tables * k_.batch));
    line(1, fmt::format("const int t = (int)(warp / {}LL);", k_.batch));
    line(1, fmt::format("const long long b = warp % {}LL;", k_.batch));
    line(1, "switch (t) {");
    for (size_t i = 0; i < k_.tables.size(); ++i) {
      const EmbeddingTable& t = k_.tables[i];
      // Jagged bags span their offsets; fixed ones [b*H, b*H + H).
      std::string range = t.jagged() ? fmt::format("b{0}[b], b{0}[b + 1]", t.offsets)
                                     : fmt::format("b * {0}LL, b * {0}LL + {0}LL", t.hotness);
      line(2, fmt::format("case {}: kiln_bag_forward<{}>(b{}, b{}, {}, {}LL, {}, {}, b{}, b * {}LL + {}LL, b{}, {}, lane); break;",
                          i, t.dim, t.weight, t.ids, bufferOrNull(t.weights, "float"), t.rows,
                          t.mean ? "true" : "false", range, t.out, t.out_stride, t.out_offset, k_.error_flag,
                          t.flag_index));
    }
    line(1, "}");
  }

  // Block t scans table t's lengths.
  void printBagOffsets() {
    line(1, "switch (blockIdx.x) {");
    for (size_t i = 0; i < k_.tables.size(); ++i) {
      const EmbeddingTable& t = k_.tables[i];
      line(2, fmt::format("case {}: kiln_bag_offsets(b{}, b{}, {}LL, {}LL, b{}, {}); break;", i, t.lengths, t.offsets,
                          k_.batch, t.num_ids, k_.error_flag, t.flag_index));
    }
    line(1, "}");
  }

  const Kernel& k_;
  const ExprGraph& g_;
  std::string out_;
  std::map<int, std::string> named_;
  std::vector<std::vector<int>> scoped_;
};

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A grid-stride kernel's grid: the blocks its work needs (at least one), at most kGridWaves full
// waves of the kernel's GPU (PyTorch and OneFlow size grid-stride grids as SMs x resident blocks x
// waves). Whole waves leave no SM idle in the last one; a few of them, rather than one, even out
// blocks that finish unevenly and occupancy below the threads' (a kernel's registers).
constexpr int64_t kGridWaves = 4;
int64_t gridStrideBlocks(const Kernel& k, int64_t blocks_needed, int block) {
  return std::clamp<int64_t>(blocks_needed, 1, kGridWaves * waveBlocks(k.sms, block));
}

}  // namespace

LaunchConfig launchConfig(const Kernel& k) {
  switch (k.kind) {
    case KernelKind::Pointwise: {
      // A vectorized kernel's thread takes four elements.
      const int64_t threads = vectorPlan(k).vectorized ? k.spaceSize() / VectorPlan::kWidth : k.spaceSize();
      return {gridStrideBlocks(k, ceilDiv(threads, 256), 256), 256};
    }
    case KernelKind::Row: {
      int64_t rows = k.rowSize();
      int block = 32;
      // Rows enough for a wave of 256-thread blocks: smaller blocks, more of them.
      int cap = k.spaceSize() >= waveBlocks(k.sms, 256) ? 256 : 1024;
      while (block < rows && block < cap) block *= 2;
      // One block per outer element up to the waves; past that a block takes several in turn, so
      // an element its guard skips (an empty hash slot) costs a loop iteration, not a block.
      return {gridStrideBlocks(k, k.spaceSize(), block), block};
    }
    case KernelKind::ColumnReduce: {
      // A block per tile (slab x strip of columns) up to the waves; past that blocks take several.
      const ColumnTile t = columnTile(k);
      return {gridStrideBlocks(k, t.slabs * t.strips, ColumnTile::kThreads), ColumnTile::kThreads};
    }
    case KernelKind::EmbeddingForward:
      return {std::max<int64_t>(1, ceilDiv(static_cast<int64_t>(k.tables.size()) * k.batch, 8)), 256};
    case KernelKind::BagOffsets:
      // One block per table; 1024 threads so a scan of B lengths takes B/1024 steps.
      return {std::max<int64_t>(1, static_cast<int64_t>(k.tables.size())), 1024};
    case KernelKind::Source:
      return {k.grid, k.block};
  }
  return {};
}

std::string emitKernel(const Kernel& k, std::string* name) {
  const std::string placeholder = "KILN_KERNEL_NAME";
  std::string body = KernelPrinter(k).print(placeholder);
  std::string stem;
  for (char c : k.name) stem += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  std::string symbol = fmt::format("kiln_{}_{:016x}", stem, fnv1a64(body));
  size_t at = body.find(placeholder);
  body.replace(at, placeholder.size(), symbol);
  if (name) *name = symbol;
  return body;
}

CudaModule emitModule(const std::vector<const Kernel*>& kernels) {
  CudaModule m;
  m.source = cudaPrelude();
  std::set<std::string> seen;
  auto lines = [](const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); };
  std::map<std::string, std::pair<int, int>> where;
  for (const Kernel* k : kernels) {
    std::string name;
    std::string text = emitKernel(*k, &name);
    if (seen.insert(name).second) {
      int first = lines(m.source) + 2;  // after the blank separator line
      m.source += "\n" + text;
      where[name] = {first, lines(m.source)};
    }
    m.kernels.push_back({name, launchConfig(*k), where[name].first, where[name].second});
  }
  return m;
}

std::string CudaModule::kernelAtLine(int line) const {
  for (const EmittedKernel& k : kernels)
    if (line >= k.first_line && line <= k.last_line) return k.name;
  return "";
}

}  // namespace kiln::codegen
