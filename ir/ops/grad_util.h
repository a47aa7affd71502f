// Helpers for the gradient rules of the op table (ir/ops/*.cc): small builders for the ops a
// rule emits, so that a rule reads like its formula.
#pragma once

#include "ir/builder.h"
#include "ir/op_def.h"

// Unwraps an Expected<Value*> into `var`, or returns its error from the enclosing rule.
#define KILN_GRAD_VALUE(var, expr)           \
  auto var##_or_ = (expr);                   \
  if (!var##_or_) return var##_or_.status(); \
  ::kiln::ir::Value* var = *var##_or_

namespace kiln::ir::grads {

// Makes operand_grads one slot per operand, all "no gradient".
inline void resetOperandGrads(GradContext& ctx, const Op& op) {
  ctx.operand_grads.assign(op.numOperands(), nullptr);
}

// A scalar constant of the given element type (broadcasts against anything).
inline Expected<Value*> scalar(Builder& b, DType t, double v) {
  auto op = b.createWithTypes("kiln.constant", {}, {TensorType(t, {})}, {{"value", Attribute(v)}});
  if (!op) return op.status();
  return (*op)->result();
}

// A constant tensor of type t filled with v.
inline Expected<Value*> filled(Builder& b, const TensorType& t, double v) {
  auto op = b.createWithTypes("kiln.constant", {}, {t.withSharding(std::nullopt)}, {{"value", Attribute(v)}});
  if (!op) return op.status();
  return (*op)->result();
}

inline Expected<Value*> binary(Builder& b, const char* name, Value* x, Value* y) {
  return b.createValue(name, {x, y});
}
inline Expected<Value*> unary(Builder& b, const char* name, Value* x) { return b.createValue(name, {x}); }

// Sums g over the dims along which a value of type `target` was broadcast, giving g the target's
// shape (the adjoint of broadcasting). Integer targets get no gradient (nullptr).
inline Expected<Value*> sumTo(Builder& b, Value* g, const TensorType& target) {
  if (!isFloat(target.dtype())) return static_cast<Value*>(nullptr);
  if (g->type().shape() == target.shape()) return g;
  auto op = b.createWithTypes("kiln.sum_to", {g}, {TensorType(g->type().dtype(), target.shape())});
  if (!op) return op.status();
  return (*op)->result();
}

}  // namespace kiln::ir::grads
