// Elementwise and broadcasting kernels over f32 and bf16 storage (f32 compute), threaded over
// rows of the collapsed iteration space.
#include <algorithm>
#include <cmath>

#include "ir/scalar_fn.h"
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

constexpr bool isUnary(ir::ScalarFn f) { return ir::arityOf(f) == 1; }

template <typename S, ir::ScalarFn F>
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
        for (int64_t j = 0; j < inner; ++j)
          S::store(pc, j, ir::scalar::apply<F, float>(S::load(pa, j), S::load(pb, j)));
      } else {
        for (int64_t j = 0; j < inner; ++j)
          S::store(pc, j, ir::scalar::apply<F, float>(S::load(pa, j * sa), S::load(pb, j * sb)));
      }
    }
  });
}

template <ir::ScalarFn F>
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

// dy * f'(x) for the activation the op names, f32 compute over f32 or bf16 storage, threaded.
// The derivative is chosen once per launch and inlined into the loop (a call per element through
// a function pointer kept the loop scalar).
template <typename S, ir::ScalarFn D>
void activationGradLoop(const ir::TensorView& x, const ir::TensorView& dy, ir::TensorView& r, ThreadPool& pool) {
  using T = typename S::T;
  const T* px = x.as<T>();
  const T* pd = dy.as<T>();
  T* pr = r.as<T>();
  pool.parallelFor(x.numel(), 32768, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) S::store(pr, i, S::load(pd, i) * ir::scalar::apply<D, float>(S::load(px, i)));
  });
}

template <typename S>
void runActivationGradTyped(ir::ScalarFn derivative, const ir::TensorView& x, const ir::TensorView& dy,
                            ir::TensorView& r, ThreadPool& pool) {
  switch (derivative) {
#define KILN_EACH(Name, arity)                                                      \
  case ir::ScalarFn::Name:                                                          \
    if constexpr (arity == 1) activationGradLoop<S, ir::ScalarFn::Name>(x, dy, r, pool); \
    return;
#include "ir/scalar_fn_each.def"
  }
}

Status runActivationGrad(const ir::Op& op, const std::vector<const ir::TensorView*>& in,
                         const std::vector<ir::TensorView*>& out, const KernelContext& ctx) {
  const ir::TensorView& x = *in[0];
  const ir::TensorView& dy = *in[1];
  if (x.shape != dy.shape) return Status::errorf("'{}': x and dy differ in run-time shape", op.name());
  const std::optional<ir::ScalarFn> fn =
      ir::findScalarFn(ir::ScalarFnKind::Activation, op.strAttr("activation"));
  if (!fn || !ir::scalarFnInfo(*fn).partner) return Status::errorf("'{}': unknown activation", op.name());
  out[0]->shape = x.shape;
  if (x.dtype == ir::DType::bf16)
    runActivationGradTyped<BF16>(*ir::scalarFnInfo(*fn).partner, x, dy, *out[0], *ctx.pool);
  else
    runActivationGradTyped<F32>(*ir::scalarFnInfo(*fn).partner, x, dy, *out[0], *ctx.pool);
  return Status::ok();
}

}  // namespace

void registerElementwiseKernels(KernelTable& t) {
  addKernel(t, ir::OpCode::ActivationGrad, {"activation_grad", runActivationGrad, sameFloatTypes});
  // Every op of ir/scalar_fn.def, f32 compute over f32 or bf16 storage.
#define KILN_EW(Name, spelling) \
  addKernel(t, ir::OpCode::Name, {"ew_" #Name, runElementwise<ir::ScalarFn::Name>, sameFloatTypes});
#define KILN_UNARY(Name, spelling, ...) KILN_EW(Name, spelling)
#define KILN_ACTIVATION(Name, spelling, ...) KILN_EW(Name, spelling)
#define KILN_BINARY(Name, spelling, ...) KILN_EW(Name, spelling)
#include "ir/scalar_fn.def"
#undef KILN_EW
}

}  // namespace kiln::runtime::cpu
