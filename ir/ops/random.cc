// Random ops. Their randomness is counter-based: every random bit is a pure function of (run
// seed, training step, the op's salt, element index), so a step recomputes exactly, a resumed
// run draws what the uninterrupted run drew, and the backward recomputes a mask instead of
// storing it.
//   kiln.dropout(x[, step]) {p, seed, salt, training}
//       training = false (@forward: eval, predict): x.
//       training = true (@train_step; the autodiff pass sets it and adds the step operand):
//       keep element i with probability 1 - p and scale it by 1 / (1 - p) (inverted dropout),
//       else 0; the mask is dropoutKeeps(seed, step, salt, i).
#include "ir/random.h"

#include <cmath>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {

uint64_t splitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t randomStream(uint64_t seed, int64_t step, int64_t salt) {
  uint64_t s = splitMix64(seed);
  s = splitMix64(s ^ static_cast<uint64_t>(step));
  return splitMix64(s ^ static_cast<uint64_t>(salt));
}

double uniformAt(uint64_t stream, int64_t index) {
  // The index-th output of the splitmix64 sequence started at `stream`; its top 53 bits as a
  // double in [0, 1), exact on every platform.
  const uint64_t h = splitMix64(stream + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(index));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

bool dropoutKeeps(uint64_t stream, int64_t index, double p) { return uniformAt(stream, index) >= p; }

namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

bool isTraining(const Op& op) { return op.boolAttr("training", false); }

Status inferDropout(const Op& op, std::vector<TensorType>& out) {
  out = {op.operand(0)->type().withSharding(std::nullopt)};
  return Status::ok();
}

Status verifyDropout(const Op& op) {
  const TensorType& x = op.operand(0)->type();
  if (!isFloat(x.dtype())) return Status::errorf("'kiln.dropout' needs a float operand, got {}", x.str());
  const double p = op.floatAttr("p", 0.0);
  if (!(p >= 0 && p < 1)) return Status::errorf("'kiln.dropout': p must lie in [0, 1), got {}", p);
  if (op.intAttr("seed", 0) < 0)
    return Status::errorf("'kiln.dropout': seed must be >= 0, got {}", op.intAttr("seed", 0));
  if (isTraining(op)) {
    if (op.numOperands() != 2)
      return Status::error("'kiln.dropout' in training needs the step operand (the autodiff pass adds it)");
    const TensorType& step = op.operand(1)->type();
    if (step.dtype() != DType::f32 || step.rank() != 0)
      return Status::errorf("'kiln.dropout': the step operand must be f32[], got {}", step.str());
  }
  return Status::ok();
}

// The step operand holds a 1-based step count, exact in f32 up to 2^24.
Expected<int64_t> stepOf(const Op& op, const TensorView& step) {
  const double s = *static_cast<const float*>(step.data);
  if (!(s >= 0) || s > 16777216.0 || s != std::floor(s))
    return Status::errorf("'{}': the step {} is not a whole number in [0, 2^24]", op.name(), s);
  return static_cast<int64_t>(s);
}

Status cpuDropout(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  const double p = op.floatAttr("p", 0.0);
  const bool drops = isTraining(op) && p > 0;
  uint64_t stream = 0;
  if (drops) {
    KILN_ASSIGN_OR_RETURN(int64_t step, stepOf(op, *in[1]));
    stream = randomStream(static_cast<uint64_t>(op.intAttr("seed", 0)), step, op.intAttr("salt", 0));
  }
  return visitFloat(op, x.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    using C = typename T::Compute;
    const auto* px = data<T>(x);
    auto* pr = data<T>(r);
    const C scale = static_cast<C>(1.0 / (1.0 - p));
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
      if (!drops)
        pr[i] = px[i];
      else
        pr[i] = T::store(dropoutKeeps(stream, i, p) ? T::load(px[i]) * scale : C(0));
    }
    return Status::ok();
  });
}

// The same mask, recomputed from the same counter, applied to the result's gradient: dropout is
// linear in x, so its adjoint is itself. The step gets no gradient.
Status gradDropout(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  if (!isTraining(op)) {
    ctx.operand_grads[0] = g;
    return Status::ok();
  }
  KILN_GRAD_VALUE(dx, ctx.builder.createValue("kiln.dropout", {g, op.operand(1)}, op.attrs()));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

OpCost costDropout(const Op& op, const SymbolBindings& symbols) { return elementwiseCost(op, symbols, 8); }

}  // namespace

void registerRandomOps(OpRegistry& r) {
  r.add({.name = "kiln.dropout",
         .summary =
             "inverted dropout in training (a counter-based mask of (seed, step, salt, element)), else x",
         .min_operands = 1,
         .max_operands = 2,
         .attrs = {{"p", Attribute::Kind::Float, true},
                   {"seed", Attribute::Kind::Int, false, Attribute(int64_t{0})},
                   {"salt", Attribute::Kind::Int, false, Attribute(int64_t{0})},
                   {"training", Attribute::Kind::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferDropout,
         .verify = verifyDropout,
         .cost = costDropout,
         .grad = gradDropout,
         .cpu = cpuDropout});
}

}  // namespace kiln::ir
