// Losses, reduced to a scalar.
//   kiln.bce_with_logits(logits[...], labels[...])  binary cross entropy on logits, stable form
//   kiln.softmax_cross_entropy(logits[N, C], labels[N] (class ids) or [N, C] (probabilities))
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

Status inferBce(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& y = op.operand(1)->type();
  if (!isFloat(x.dtype()) || !isFloat(y.dtype()))
    return Status::errorf("'kiln.bce_with_logits' needs float operands, got {} and {}", x.str(), y.str());
  if (x.shape() != y.shape())
    return Status::errorf("'kiln.bce_with_logits' logits {} and labels {} differ in shape", x.str(), y.str());
  out = {TensorType(DType::f32, {})};
  return Status::ok();
}

Status inferSoftmaxCE(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& y = op.operand(1)->type();
  if (x.rank() != 2 || !isFloat(x.dtype()))
    return Status::errorf("'kiln.softmax_cross_entropy' logits must be float [N, C], got {}", x.str());
  if (y.rank() == 1) {
    if (!isInteger(y.dtype()) || !(y.dim(0) == x.dim(0)))
      return Status::errorf("'kiln.softmax_cross_entropy' class labels must be integer [{}], got {}",
                            x.dim(0).str(), y.str());
  } else if (y.shape() != x.shape() || !isFloat(y.dtype())) {
    return Status::errorf("'kiln.softmax_cross_entropy' labels must be class ids [N] or probabilities {}, got {}",
                          x.str(), y.str());
  }
  out = {TensorType(DType::f32, {})};
  return Status::ok();
}

}  // namespace

void registerLossOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.bce_with_logits", .summary = "Binary cross entropy on logits",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure, .infer = inferBce});
  r.add({.name = "kiln.softmax_cross_entropy", .summary = "Cross entropy of softmax(logits) against labels",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"reduction", K::String, false, Attribute("mean"), {"mean", "sum"}}},
         .traits = kPure, .infer = inferSoftmaxCE});
}

}  // namespace kiln::ir
