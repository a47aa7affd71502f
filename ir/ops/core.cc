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

// A fused group (passes/fusion.cc): one block whose arguments take the operands and whose
// kiln.yield gives the results.
Status verifyFused(const Op& op) {
  if (op.regions().size() != 1 || op.regions().front()->blocks().size() != 1)
    return Status::error("'kiln.fused' must hold one region with one block");
  const Block& body = op.regions().front()->front();
  if (body.numArguments() != op.numOperands())
    return Status::errorf("'kiln.fused' body takes {} arguments for {} operands", body.numArguments(), op.numOperands());
  for (unsigned i = 0; i < op.numOperands(); ++i)
    if (!(body.argument(i)->type() == op.operand(i)->type()))
      return Status::errorf("'kiln.fused' argument {} is {} but operand {} is {}", i, body.argument(i)->type().str(), i,
                            op.operand(i)->type().str());
  const Op* yield = body.back();
  if (!yield || yield->name() != "kiln.yield") return Status::error("'kiln.fused' body must end in kiln.yield");
  if (yield->numOperands() != op.numResults())
    return Status::errorf("'kiln.fused' yields {} values for {} results", yield->numOperands(), op.numResults());
  for (unsigned i = 0; i < op.numResults(); ++i)
    if (!(yield->operand(i)->type() == op.result(i)->type()))
      return Status::errorf("'kiln.fused' yields {} as result {} of type {}", yield->operand(i)->type().str(), i,
                            op.result(i)->type().str());
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

  // Not kPure: a group may hold side-effecting ops (embedding updates); its region says what
  // it does. No cpu hook: the interpreter runs the region.
  r.add({.name = "kiln.fused",
         .summary = "A fused group: its region holds the ops that run as one kernel",
         .min_operands = 0, .max_operands = -1, .num_results = -1,
         .attrs = {{"kind", K::String, true, std::nullopt,
                    {"pointwise", "reduction", "gemm_epilogue", "embedding", "embedding_update"}}},
         .traits = kTypeGiven | kNonDifferentiable,
         .verify = verifyFused});
}

}  // namespace kiln::ir
