// Running state: tensors the train step moves outside the gradient, which eval and predict then
// read. Each is a non-trainable parameter (so checkpoints carry it) with a pure op that reads it
// in @forward and an in-place update that the autodiff pass adds to @train_step.
//
//   kiln.running_stat(batch, running) {momentum, training}  -> running's type
//       Batch norm's statistics (Ioffe & Szegedy 2015): the batch's statistic in training, the
//       running one in eval and predict. The autodiff pass sets training = true in @train_step
//       and follows the op with kiln.running_stat_update(running, batch); canonicalization folds
//       the op into the operand it selects, so the other side is dead code.
//   kiln.running_stat_update(running, batch) {momentum}
//       running = (1 - momentum) * running + momentum * batch, in place (PyTorch's convention).
//
//   kiln.log_frequency(ids, state[H, 2]) {prior, alpha}  -> f32, shaped like ids
//       The log-Q correction's log q (Yi et al. 2019, "Sampling-Bias-Corrected Neural Modeling for
//       Large Corpus Item Recommendations"): an id's sampling probability per step estimated as
//       1 / period, its streaming estimate of the steps between two sightings. Row id % H of the
//       state holds (last step seen, period); a row never seen (period 0) has period `prior`.
//       The autodiff pass follows it in @train_step with kiln.frequency_update {alpha}.
//   kiln.frequency_update(state[H, 2], ids, step)
//       The streaming frequency estimator of that paper, in place: a row seen c times in this
//       batch at step t gets period = (1 - alpha) * period + alpha * (t - last) / c (the first
//       sighting takes (t - last) / c as it is) and last = t. Counting a batch's duplicates
//       together makes the update independent of the ids' order.
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

// ---- running_stat, running_stat_update --------------------------------------------------------

Status checkMomentum(const Op& op) {
  const double m = op.floatAttr("momentum", 0.1);
  if (!(m >= 0 && m <= 1)) return Status::errorf("'{}': momentum must lie in [0, 1], got {}", op.name(), m);
  return Status::ok();
}

Status checkStatPair(const Op& op, const TensorType& batch, const TensorType& running) {
  if (!isFloat(running.dtype()) || running.dtype() != batch.dtype() || running.shape() != batch.shape())
    return Status::errorf("'{}': the batch statistic {} and the running one {} must be floats of one type",
                          op.name(), batch.str(), running.str());
  return checkMomentum(op);
}

Status inferRunningStat(const Op& op, std::vector<TensorType>& out) {
  const TensorType& batch = op.operand(0)->type();
  const TensorType& running = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(checkStatPair(op, batch, running));
  out = {running.withSharding(std::nullopt)};
  return Status::ok();
}

unsigned selectedOperand(const Op& op) { return op.boolAttr("training", false) ? 0 : 1; }

Status cpuRunningStat(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[selectedOperand(op)];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, x.shape));
  std::memcpy(r.data, x.data, static_cast<size_t>(x.bytes()));
  return Status::ok();
}

// The result is the selected operand, so its gradient goes there alone.
Status gradRunningStat(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  ctx.operand_grads[selectedOperand(op)] = ctx.result_grads[0];
  return Status::ok();
}

Status inferRunningStatUpdate(const Op& op, std::vector<TensorType>& out) {
  out.clear();
  return checkStatPair(op, op.operand(1)->type(), op.operand(0)->type());
}

Status cpuRunningStatUpdate(const Op& op, const CpuOperands& in, const CpuResults&, const CpuContext&) {
  const TensorView& running = *in[0];
  const TensorView& batch = *in[1];
  if (running.numel() != batch.numel())
    return Status::errorf("'{}': a batch statistic of {} elements for a running one of {}", op.name(),
                          batch.numel(), running.numel());
  const double m = op.floatAttr("momentum", 0.1);
  return visitFloat(op, running.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    using C = typename T::Compute;
    auto* pr = data<T>(running);  // updated in place
    const auto* pb = data<T>(batch);
    for (int64_t i = 0, n = running.numel(); i < n; ++i)
      pr[i] = T::store((C(1) - C(m)) * T::load(pr[i]) + C(m) * T::load(pb[i]));
    return Status::ok();
  });
}

std::vector<unsigned> writtenFirst(const Op&) { return {0}; }

// ---- log_frequency, frequency_update -----------------------------------------------------------

Status checkFrequencyState(const Op& op, const TensorType& state, const TensorType& ids) {
  if (state.dtype() != DType::f32 || state.rank() != 2 || !state.dim(1).isStatic() ||
      state.dim(1).size() != 2)
    return Status::errorf("'{}': the estimator state must be f32[H, 2] (last step seen, period), got {}",
                          op.name(), state.str());
  if (!isInteger(ids.dtype()))
    return Status::errorf("'{}': ids must be integers, got {}", op.name(), ids.str());
  return Status::ok();
}

Status inferLogFrequency(const Op& op, std::vector<TensorType>& out) {
  const TensorType& ids = op.operand(0)->type();
  KILN_RETURN_IF_ERROR(checkFrequencyState(op, op.operand(1)->type(), ids));
  if (!(op.floatAttr("prior", 1.0) >= 1))
    return Status::errorf("'{}': prior must be a period of at least 1 step, got {}", op.name(),
                          op.floatAttr("prior", 1.0));
  out = {TensorType(DType::f32, ids.shape())};
  return Status::ok();
}

// The state row of an id: id mod H, in [0, H).
int64_t stateRow(int64_t id, int64_t rows) { return (id % rows + rows) % rows; }

Status cpuLogFrequency(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& ids = *in[0];
  const TensorView& state = *in[1];
  TensorView& r = *out[0];
  KILN_RETURN_IF_ERROR(setResultShape(op, r, ids.shape));
  const int64_t rows = state.shape[0];
  if (rows < 1) return Status::errorf("'{}': the estimator state has no rows", op.name());
  const double prior = op.floatAttr("prior", 1.0);
  const auto* ps = static_cast<const float*>(state.data);
  auto* pr = static_cast<float*>(r.data);
  for (int64_t i = 0, n = ids.numel(); i < n; ++i) {
    const double period = ps[2 * stateRow(loadIndex(ids, i), rows) + 1];
    pr[i] = static_cast<float>(-std::log(period > 0 ? period : prior));
  }
  return Status::ok();
}

Status inferFrequencyUpdate(const Op& op, std::vector<TensorType>& out) {
  out.clear();
  KILN_RETURN_IF_ERROR(checkFrequencyState(op, op.operand(0)->type(), op.operand(1)->type()));
  const TensorType& step = op.operand(2)->type();
  if (step.dtype() != DType::f32 || step.rank() != 0)
    return Status::errorf("'{}': the step must be f32[], got {}", op.name(), step.str());
  const double alpha = op.floatAttr("alpha", 0.01);
  if (!(alpha > 0 && alpha <= 1))
    return Status::errorf("'{}': alpha must lie in (0, 1], got {}", op.name(), alpha);
  return Status::ok();
}

Status cpuFrequencyUpdate(const Op& op, const CpuOperands& in, const CpuResults&, const CpuContext&) {
  const TensorView& state = *in[0];
  const TensorView& ids = *in[1];
  const double step = *static_cast<const float*>(in[2]->data);
  const int64_t rows = state.shape[0];
  if (rows < 1) return Status::errorf("'{}': the estimator state has no rows", op.name());
  const double alpha = op.floatAttr("alpha", 0.01);
  std::unordered_map<int64_t, int64_t> seen;  // row -> sightings in this batch
  for (int64_t i = 0, n = ids.numel(); i < n; ++i) ++seen[stateRow(loadIndex(ids, i), rows)];
  auto* ps = static_cast<float*>(state.data);  // updated in place
  for (const auto& [row, count] : seen) {
    float* s = ps + 2 * row;
    const double gap = (step - static_cast<double>(s[0])) / static_cast<double>(count);
    s[1] = static_cast<float>(s[1] > 0 ? (1 - alpha) * s[1] + alpha * gap : gap);
    s[0] = static_cast<float>(step);
  }
  return Status::ok();
}

OpCost costRunningStat(const Op& op, const SymbolBindings& symbols) {
  return elementwiseCost(op, symbols, 0);
}

// Reads both operands, writes the running one.
OpCost costRunningStatUpdate(const Op& op, const SymbolBindings& symbols) {
  const double bytes = typeBytes(op.operand(0)->type(), symbols);
  return {3 * typeElements(op.operand(0)->type(), symbols), 3 * bytes};
}

OpCost costLogFrequency(const Op& op, const SymbolBindings& symbols) {
  const double n = typeElements(op.result()->type(), symbols);
  return {4 * n, typeBytes(op.operand(0)->type(), symbols) + 12 * n};
}

OpCost costFrequencyUpdate(const Op& op, const SymbolBindings& symbols) {
  const double n = typeElements(op.operand(1)->type(), symbols);
  return {4 * n, typeBytes(op.operand(1)->type(), symbols) + 16 * n};
}

}  // namespace

void registerRunningStateOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.running_stat",
         .summary = "Batch norm's statistic: the batch's in training, the running one in eval and predict",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"momentum", K::Float, false, Attribute(0.1)},
                   {"training", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferRunningStat,
         .cost = costRunningStat,
         .grad = gradRunningStat,
         .cpu = cpuRunningStat});
  r.add({.name = "kiln.running_stat_update",
         .summary = "running = (1 - momentum) * running + momentum * batch, in place",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 0,
         .attrs = {{"momentum", K::Float, false, Attribute(0.1)}},
         .traits = kSideEffect | kNonDifferentiable,
         .infer = inferRunningStatUpdate,
         .cost = costRunningStatUpdate,
         .cpu = cpuRunningStatUpdate,
         .written = writtenFirst});
  r.add({.name = "kiln.log_frequency",
         .summary = "log q of ids from the streaming frequency estimator's state (the log-Q correction)",
         .min_operands = 2,
         .max_operands = 2,
         // alpha: the estimator's rate, which the train step's kiln.frequency_update takes.
         .attrs = {{"prior", K::Float, false, Attribute(1.0)}, {"alpha", K::Float, false, Attribute(0.01)}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferLogFrequency,
         .cost = costLogFrequency,
         .cpu = cpuLogFrequency});
  r.add({.name = "kiln.frequency_update",
         .summary = "The streaming frequency estimator's step over a batch of ids, in place",
         .min_operands = 3,
         .max_operands = 3,
         .num_results = 0,
         .attrs = {{"alpha", K::Float, false, Attribute(0.01)}},
         .traits = kSideEffect | kNonDifferentiable,
         .infer = inferFrequencyUpdate,
         .cost = costFrequencyUpdate,
         .cpu = cpuFrequencyUpdate,
         .written = writtenFirst});
}

}  // namespace kiln::ir
