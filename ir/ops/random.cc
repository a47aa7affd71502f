// Random and hashing ops. The randomness is counter-based: every random bit is a pure function of (run
// seed, training step, the op's salt, element index), so a step recomputes exactly, a resumed
// run draws what the uninterrupted run drew, and the backward recomputes a mask instead of
// storing it.
//   kiln.dropout(x[, step]) {p, seed, salt, training}
//       training = false (@forward: eval, predict): x.
//       training = true (@train_step; the autodiff pass sets it and adds the step operand):
//       keep element i with probability 1 - p and scale it by 1 / (1 - p) (inverted dropout),
//       else 0; the mask is dropoutKeeps(seed, step, salt, i).
//   kiln.hash_cross(ids_0, ..., ids_k) {buckets, salt}  -> i64, shaped like each ids_j
//       Wide & Deep's crossed columns (Cheng et al. 2016; TensorFlow's crossed_column): element
//       i hashes (ids_0[i], ..., ids_k[i]) with splitmix64 into [0, buckets), a new feature's id.
//       Integer: no gradient.
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

uint64_t hashCrossStart(int64_t salt) { return splitMix64(static_cast<uint64_t>(salt)); }

uint64_t hashMix(uint64_t h, int64_t id) { return splitMix64(h ^ static_cast<uint64_t>(id)); }

// The signed remainder, moved into [0, buckets): the same integer arithmetic a kernel does.
int64_t crossBucket(uint64_t h, int64_t buckets) {
  const auto s = static_cast<int64_t>(h);
  return (s % buckets + buckets) % buckets;
}

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

Status inferHashCross(const Op& op, std::vector<TensorType>& out) {
  const TensorType& first = op.operand(0)->type();
  for (unsigned j = 0; j < op.numOperands(); ++j) {
    const TensorType& t = op.operand(j)->type();
    if (!isInteger(t.dtype()))
      return Status::errorf("'kiln.hash_cross' crosses integer ids, but operand #{} is {}", j, t.str());
    if (t.shape() != first.shape())
      return Status::errorf("'kiln.hash_cross' operands must have one shape: #0 is {}, #{} is {}",
                            first.str(), j, t.str());
  }
  out = {TensorType(DType::i64, first.shape())};
  return Status::ok();
}

Status verifyHashCross(const Op& op) {
  if (op.intAttr("buckets", 0) < 1)
    return Status::errorf("'kiln.hash_cross': buckets must be positive, got {}", op.intAttr("buckets", 0));
  return Status::ok();
}

Status cpuHashCross(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, in[0]->shape));
  const int64_t buckets = op.intAttr("buckets");
  const uint64_t start = hashCrossStart(op.intAttr("salt", 0));
  auto* pr = static_cast<int64_t*>(r.data);
  for (int64_t i = 0, n = in[0]->numel(); i < n; ++i) {
    uint64_t h = start;
    for (const TensorView* ids : in) h = hashMix(h, loadIndex(*ids, i));
    pr[i] = crossBucket(h, buckets);
  }
  return Status::ok();
}

// Reads every operand, writes the result; a few multiplies per feature.
OpCost costHashCross(const Op& op, const SymbolBindings& symbols) {
  double bytes = typeBytes(op.result()->type(), symbols);
  for (const Value* v : op.operands()) bytes += typeBytes(v->type(), symbols);
  return {6.0 * op.numOperands() * typeBytes(op.result()->type(), symbols) / 8, bytes};
}

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
  r.add({.name = "kiln.hash_cross",
         .summary = "Hashed cross of two or more id features into [0, buckets) (splitmix64 of the ids)",
         .min_operands = 2,
         .max_operands = -1,
         .attrs = {{"buckets", Attribute::Kind::Int, true},
                   {"salt", Attribute::Kind::Int, false, Attribute(int64_t{0})}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferHashCross,
         .verify = verifyHashCross,
         .cost = costHashCross,
         .cpu = cpuHashCross});
}

}  // namespace kiln::ir
