// Elementwise and broadcasting kernels over f32 and bf16 storage (f32 compute), threaded over
// rows of the collapsed iteration space.
#include <algorithm>
#include <cmath>

#include "runtime/cpu/kernels/broadcast.h"
#include "runtime/cpu/kernels/kernels.h"

namespace kiln::runtime::cpu {
namespace {

struct F32 {
  using T = float;
  static float load(const T* p, int64_t i) { return p[i]; }
  static void store(T* p, int64_t i, float v) { p[i] = v; }
};
struct BF16 {
  using T = uint16_t;
  static float load(const T* p, int64_t i) { return ir::bf16ToFloat(p[i]); }
  static void store(T* p, int64_t i, float v) { p[i] = ir::floatToBf16(v); }
};

enum class Fn { Add, Sub, Mul, Div, Max, Min, Pow, Neg, Abs, Exp, Log, Sqrt, Rsqrt, Sigmoid, Tanh, Relu, Gelu, Silu };

template <Fn F>
inline float apply(float a, float b) {
  if constexpr (F == Fn::Add) return a + b;
  if constexpr (F == Fn::Sub) return a - b;
  if constexpr (F == Fn::Mul) return a * b;
  if constexpr (F == Fn::Div) return a / b;
  if constexpr (F == Fn::Max) return a > b ? a : b;
  if constexpr (F == Fn::Min) return a < b ? a : b;
  if constexpr (F == Fn::Pow) return std::pow(a, b);
  if constexpr (F == Fn::Neg) return -a;
  if constexpr (F == Fn::Abs) return std::fabs(a);
  if constexpr (F == Fn::Exp) return std::exp(a);
  if constexpr (F == Fn::Log) return std::log(a);
  if constexpr (F == Fn::Sqrt) return std::sqrt(a);
  if constexpr (F == Fn::Rsqrt) return 1.0f / std::sqrt(a);
  if constexpr (F == Fn::Sigmoid) return 1.0f / (1.0f + std::exp(-a));
  if constexpr (F == Fn::Tanh) return std::tanh(a);
  if constexpr (F == Fn::Relu) return a > 0.0f ? a : 0.0f;
  if constexpr (F == Fn::Gelu) {
    constexpr float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * a * (1.0f + std::tanh(k * (a + 0.044715f * a * a * a)));
  }
  if constexpr (F == Fn::Silu) return a / (1.0f + std::exp(-a));
  (void)b;
  return 0;
}

constexpr bool isUnary(Fn f) { return f >= Fn::Neg; }

template <typename S, Fn F>
void runTyped(const BroadcastIter& it, const std::vector<const ir::TensorView*>& in, ir::TensorView* out,
              ThreadPool& pool) {
  using T = typename S::T;
  const T* a = in[0]->as<T>();
  const T* b = isUnary(F) ? a : in[1]->as<T>();
  T* c = out->as<T>();
  const int64_t inner = it.innerSize();
  const int64_t sa = it.innerStride(0), sb = isUnary(F) ? sa : it.innerStride(1);
  // About 32K elements per chunk keeps scheduling overhead small.
  int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1));
  pool.parallelFor(it.outerSize(), grain, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> offs(in.size());
    for (int64_t r = r0; r < r1; ++r) {
      it.rowOffsets(r, offs);
      const T* pa = a + offs[0];
      const T* pb = b + (isUnary(F) ? offs[0] : offs[1]);
      T* pc = c + r * inner;
      if (sa == 1 && sb == 1) {
        for (int64_t j = 0; j < inner; ++j) S::store(pc, j, apply<F>(S::load(pa, j), S::load(pb, j)));
      } else {
        for (int64_t j = 0; j < inner; ++j) S::store(pc, j, apply<F>(S::load(pa, j * sa), S::load(pb, j * sb)));
      }
    }
  });
}

template <Fn F>
Status runElementwise(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                      const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  std::vector<const std::vector<int64_t>*> shapes;
  for (const auto* v : in) shapes.push_back(&v->shape);
  auto result_shape = broadcastConcrete(shapes);
  if (!result_shape) return Status::errorf("'{}': {}", op.name(), result_shape.status().message());
  out[0]->shape = *result_shape;
  BroadcastIter it(*result_shape, shapes);
  if (out[0]->dtype == ir::DType::bf16) runTyped<BF16, F>(it, in, out[0], *ctx.pool);
  else runTyped<F32, F>(it, in, out[0], *ctx.pool);
  return Status::ok();
}

bool sameFloatTypes(const ir::Op& op) {
  ir::DType t = op.result()->type().dtype();
  if (!isF32OrBf16(t)) return false;
  for (ir::Value* v : op.operands())
    if (v->type().dtype() != t) return false;
  return true;
}

}  // namespace

void registerElementwiseKernels(KernelTable& t) {
#define KILN_EW(NAME, FN) addKernel(t, NAME, {"ew_" #FN, runElementwise<Fn::FN>, sameFloatTypes})
  KILN_EW("kiln.add", Add);
  KILN_EW("kiln.sub", Sub);
  KILN_EW("kiln.mul", Mul);
  KILN_EW("kiln.div", Div);
  KILN_EW("kiln.max", Max);
  KILN_EW("kiln.min", Min);
  KILN_EW("kiln.pow", Pow);
  KILN_EW("kiln.neg", Neg);
  KILN_EW("kiln.abs", Abs);
  KILN_EW("kiln.exp", Exp);
  KILN_EW("kiln.log", Log);
  KILN_EW("kiln.sqrt", Sqrt);
  KILN_EW("kiln.rsqrt", Rsqrt);
  KILN_EW("kiln.sigmoid", Sigmoid);
  KILN_EW("kiln.tanh", Tanh);
  KILN_EW("kiln.relu", Relu);
  KILN_EW("kiln.gelu", Gelu);
  KILN_EW("kiln.silu", Silu);
#undef KILN_EW
}

}  // namespace kiln::runtime::cpu
