// Elementwise ops: binary arithmetic with numpy broadcasting, unary math and activations,
// comparison and selection.
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

Status inferBinary(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(1)->type();
  if (a.dtype() != b.dtype())
    return Status::errorf("'{}' operands have different element types: {} and {}", op.name(), a.str(), b.str());
  auto shape = broadcastShapes(a.shape(), b.shape());
  if (!shape) return Status::errorf("'{}': {}", op.name(), shape.status().message());
  out = {TensorType(a.dtype(), shape.take())};
  return Status::ok();
}

Status inferUnary(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  out = {a.withSharding(std::nullopt)};
  return Status::ok();
}

Status verifyFloatOperands(const Op& op) {
  for (Value* v : op.operands())
    if (!isFloat(v->type().dtype()))
      return Status::errorf("'{}' needs floating-point operands, got {}", op.name(), v->type().str());
  return Status::ok();
}

Status inferCompare(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(inferBinary(op, out));
  out[0] = out[0].withDType(DType::i1);
  return Status::ok();
}

Status inferSelect(const Op& op, std::vector<TensorType>& out) {
  const TensorType& c = op.operand(0)->type();
  const TensorType& a = op.operand(1)->type();
  const TensorType& b = op.operand(2)->type();
  if (c.dtype() != DType::i1)
    return Status::errorf("'kiln.select' condition must be i1, got {}", c.str());
  if (a.dtype() != b.dtype())
    return Status::errorf("'kiln.select' branches have different element types: {} and {}", a.str(), b.str());
  auto ab = broadcastShapes(a.shape(), b.shape());
  if (!ab) return Status::errorf("'kiln.select': {}", ab.status().message());
  auto all = broadcastShapes(c.shape(), *ab);
  if (!all) return Status::errorf("'kiln.select': {}", all.status().message());
  out = {TensorType(a.dtype(), all.take())};
  return Status::ok();
}

void addBinary(OpRegistry& r, const char* name, const char* summary, uint32_t extra, bool float_only) {
  r.add({.name = name, .summary = summary, .min_operands = 2, .max_operands = 2,
         .traits = kPure | kElementwise | kBroadcasting | extra,
         .infer = inferBinary,
         .verify = float_only ? verifyFloatOperands : nullptr});
}

void addUnary(OpRegistry& r, const char* name, const char* summary, bool float_only = true) {
  r.add({.name = name, .summary = summary, .min_operands = 1, .max_operands = 1,
         .traits = kPure | kElementwise,
         .infer = inferUnary,
         .verify = float_only ? verifyFloatOperands : nullptr});
}

}  // namespace

void registerElementwiseOps(OpRegistry& r) {
  addBinary(r, "kiln.add", "a + b", kCommutative, false);
  addBinary(r, "kiln.sub", "a - b", 0, false);
  addBinary(r, "kiln.mul", "a * b", kCommutative, false);
  addBinary(r, "kiln.div", "a / b", 0, true);
  addBinary(r, "kiln.max", "max(a, b)", kCommutative, false);
  addBinary(r, "kiln.min", "min(a, b)", kCommutative, false);
  addBinary(r, "kiln.pow", "a ** b", 0, true);

  addUnary(r, "kiln.neg", "-x", false);
  addUnary(r, "kiln.abs", "|x|", false);
  addUnary(r, "kiln.exp", "e ** x");
  addUnary(r, "kiln.log", "natural logarithm");
  addUnary(r, "kiln.sqrt", "square root");
  addUnary(r, "kiln.rsqrt", "1 / sqrt(x)");
  addUnary(r, "kiln.sigmoid", "1 / (1 + exp(-x))");
  addUnary(r, "kiln.tanh", "hyperbolic tangent");
  addUnary(r, "kiln.relu", "max(x, 0)");
  addUnary(r, "kiln.gelu", "x * Phi(x), the tanh approximation");
  addUnary(r, "kiln.silu", "x * sigmoid(x)");

  r.add({.name = "kiln.compare", .summary = "Elementwise comparison, an i1 result",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"predicate", Attribute::Kind::String, true, std::nullopt,
                    {"eq", "ne", "lt", "le", "gt", "ge"}}},
         .traits = kPure | kElementwise | kBroadcasting | kNonDifferentiable,
         .infer = inferCompare});
  r.add({.name = "kiln.select", .summary = "cond ? a : b, elementwise with broadcasting",
         .min_operands = 3, .max_operands = 3,
         .traits = kPure | kElementwise | kBroadcasting,
         .infer = inferSelect});
}

}  // namespace kiln::ir
