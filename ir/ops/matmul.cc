// Matrix multiplication, optionally batched, with transpose flags:
//   a: [..., M, K] (or [..., K, M] with transpose_a), b: [..., K, N] (or [..., N, K] with
//   transpose_b); batch dims broadcast; result [..., M, N].
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

Status inferMatmul(const Op& op, std::vector<TensorType>& out) {
  const TensorType& a = op.operand(0)->type();
  const TensorType& b = op.operand(1)->type();
  if (a.rank() < 2 || b.rank() < 2)
    return Status::errorf("'kiln.matmul' needs operands of rank >= 2, got {} and {}", a.str(), b.str());
  if (a.dtype() != b.dtype())
    return Status::errorf("'kiln.matmul' operands have different element types: {} and {}", a.str(), b.str());
  bool ta = op.boolAttr("transpose_a"), tb = op.boolAttr("transpose_b");
  const Dim& m = a.dim(a.rank() - (ta ? 1 : 2));
  const Dim& ka = a.dim(a.rank() - (ta ? 2 : 1));
  const Dim& kb = b.dim(b.rank() - (tb ? 1 : 2));
  const Dim& n = b.dim(b.rank() - (tb ? 2 : 1));
  if (!(ka == kb))
    return Status::errorf("'kiln.matmul' contraction dims differ: {} ({}) vs {} ({})", ka.str(), a.str(),
                          kb.str(), b.str());
  Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  auto batch = broadcastShapes(ba, bb);
  if (!batch) return Status::errorf("'kiln.matmul' batch dims: {}", batch.status().message());
  Shape s = batch.take();
  s.push_back(m);
  s.push_back(n);
  out = {TensorType(a.dtype(), std::move(s))};
  return Status::ok();
}

Status verifyMatmul(const Op& op) {
  if (!isFloat(op.operand(0)->type().dtype()))
    return Status::errorf("'kiln.matmul' needs floating-point operands, got {}", op.operand(0)->type().str());
  return Status::ok();
}

}  // namespace

void registerMatmulOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.matmul",
         .summary = "(batched) matrix product with optional transposes",
         .min_operands = 2, .max_operands = 2,
         .attrs = {{"transpose_a", K::Bool, false, Attribute(false)},
                   {"transpose_b", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferMatmul,
         .verify = verifyMatmul});
}

}  // namespace kiln::ir
