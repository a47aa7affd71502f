// Reductions over axes, and softmax along one axis.
#include <algorithm>
#include <set>

#include "ir/op_def.h"

namespace kiln::ir {
namespace {

Status inferReduce(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) {
    auto n = normalizeAxis(op, a, in.rank());
    if (!n) return n.status();
    if (!axes.insert(*n).second) return Status::errorf("'kiln.reduce' repeats axis {}", a);
  }
  if (axes.empty()) return Status::error("'kiln.reduce' needs at least one axis");
  bool keep = op.boolAttr("keepdims");
  Shape s;
  for (int64_t i = 0; i < in.rank(); ++i) {
    if (!axes.count(i))
      s.push_back(in.dim(i));
    else if (keep)
      s.push_back(Dim::fixed(1));
  }
  out = {TensorType(in.dtype(), std::move(s))};
  return Status::ok();
}

Status inferSoftmax(const Op& op, std::vector<TensorType>& out) {
  const TensorType& in = op.operand(0)->type();
  auto axis = normalizeAxis(op, op.intAttr("axis", -1), in.rank());
  if (!axis) return axis.status();
  if (!isFloat(in.dtype())) return Status::errorf("'kiln.softmax' needs a float operand, got {}", in.str());
  out = {in.withSharding(std::nullopt)};
  return Status::ok();
}

}  // namespace

void registerReduceOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.reduce", .summary = "sum, mean or max over axes",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"kind", K::String, true, std::nullopt, {"sum", "mean", "max"}},
                   {"axes", K::Array, true},
                   {"keepdims", K::Bool, false, Attribute(false)}},
         .traits = kPure | kReduction, .infer = inferReduce});
  r.add({.name = "kiln.softmax", .summary = "exp(x) / sum(exp(x)) along an axis",
         .min_operands = 1, .max_operands = 1,
         .attrs = {{"axis", K::Int, false, Attribute(int64_t{-1})}},
         .traits = kPure, .infer = inferSoftmax});
}

}  // namespace kiln::ir
