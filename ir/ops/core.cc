// Core ops: sources of values (constants, inputs, parameters) and terminators.
#include <algorithm>

#include "ir/op_def.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

// `value` is a number (a splat) or an array with one number per element.
Status verifyConstant(const Op& op) {
  const Attribute* v = op.attr("value");
  if (!v) return Status::error("'kiln.constant' requires attribute 'value'");
  if (v->isArray()) {
    const TensorType& t = op.result()->type();
    if (!t.isStatic()) return Status::error("'kiln.constant' with an array value needs a static shape");
    auto n = t.numElements({});
    if (static_cast<int64_t>(v->asArray().size()) != *n)
      return Status::errorf("'kiln.constant' has {} values for type {}", v->asArray().size(), t.str());
    for (const auto& e : v->asArray())
      if (!e.isNumber()) return Status::error("'kiln.constant' values must be numbers");
  } else if (!v->isNumber()) {
    return Status::error("'kiln.constant' value must be a number or an array of numbers");
  }
  return Status::ok();
}

// Materializes the value at the result's allocated size (a splat fills any shape).
Status cpuConstant(const Op& op, const std::vector<const TensorView*>&, const std::vector<TensorView*>& out,
                   const CpuContext&) {
  TensorView& r = *out[0];
  const Attribute* v = op.attr("value");
  return kernels::visitAny(op, r.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    using Acc = typename T::Acc;
    auto* pr = kernels::data<T>(r);
    const int64_t n = r.numel();
    if (v->isArray()) {
      const AttrArray& a = v->asArray();
      for (int64_t i = 0; i < n; ++i) {
        const Attribute& e = a[static_cast<size_t>(i)];
        pr[i] = T::store(e.isInt() ? static_cast<Acc>(e.asInt()) : static_cast<Acc>(e.asDouble()));
      }
    } else {
      const auto x = T::store(v->isInt() ? static_cast<Acc>(v->asInt()) : static_cast<Acc>(v->asDouble()));
      std::fill(pr, pr + n, x);
    }
    return Status::ok();
  });
}

OpCost costConstant(const Op& op, const SymbolBindings& symbols) {
  return {0, kernels::typeBytes(op.result()->type(), symbols)};
}

Status verifyParameter(const Op& op) {
  if (op.result()->type().hasBoundedDims())
    return Status::error("'kiln.parameter' cannot have a data-dependent dimension");
  return Status::ok();
}

}  // namespace

void registerCoreOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.constant",
         .summary = "A constant tensor: a splat of one number, or every element listed",
         .min_operands = 0, .max_operands = 0,
         .traits = kPure | kTypeGiven | kNonDifferentiable,
         .verify = verifyConstant, .cost = costConstant, .cpu = cpuConstant});

  r.add({.name = "kiln.input",
         .summary = "A named input of the model (a batch of features, labels, ids)",
         .min_operands = 0, .max_operands = 0,
         .attrs = {{"name", K::String, true}},
         .traits = kTypeGiven | kSource | kNonDifferentiable});

  r.add({.name = "kiln.parameter",
         .summary = "A named trainable tensor with its initializer",
         .min_operands = 0, .max_operands = 0,
         .attrs = {{"name", K::String, true},
                   {"init", K::String, false, Attribute("zeros"),
                    {"zeros", "ones", "constant", "normal", "uniform", "xavier_uniform", "xavier_normal"}},
                   {"value", K::Float},
                   {"mean", K::Float},
                   {"std", K::Float},
                   {"low", K::Float},
                   {"high", K::Float},
                   {"trainable", K::Bool, false, Attribute(true)}},
         .traits = kTypeGiven | kSource,
         .verify = verifyParameter});

  r.add({.name = "func.return",
         .summary = "Returns values from a function",
         .min_operands = 0, .max_operands = -1, .num_results = 0,
         .traits = kTerminator | kTypeGiven});

  r.add({.name = "kiln.yield",
         .summary = "Yields values from a region (a fused group's body)",
         .min_operands = 0, .max_operands = -1, .num_results = 0,
         .traits = kTerminator | kTypeGiven});
}

}  // namespace kiln::ir
