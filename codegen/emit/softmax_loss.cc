// The softmax and loss emitter: Row kernels for softmax, softmax cross-entropy's per-row losses
// and its gradient; the losses' totals are folds (fold.h), so a loss over 100M elements is cut
// over many blocks rather than summed by one. softmax and bce_with_logits compute a pointwise
// producer chain of their group inline.
#include "codegen/emit/emitter_registry.h"
#include "codegen/emit/fold.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// A Row kernel over `axis` of x, with x's value at each row element.
struct AxisRowKernel {
  KernelBuilder kb;
  AxisRow row;
  int x = -1;
};
Expected<AxisRowKernel> axisRowKernel(GroupLowering& gl, std::string name, const Value* x,
                                      const std::vector<int64_t>& xs, int64_t axis) {
  AxisRowKernel r{KernelBuilder::ofKind(std::move(name), KernelKind::Row), {}, -1};
  r.row = GroupLowering::axisRow(r.kb.k, xs, axis);
  KILN_ASSIGN_OR_RETURN(auto v, gl.valueAt(r.kb, x, r.row.coords));
  r.x = v;
  return r;
}

// Whether a loss (or its gradient) is averaged over its elements rather than summed.
bool isMean(const Op& op) { return op.strAttr("reduction", "mean") == "mean"; }

Status lowerSoftmax(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  int64_t axis = op.intAttr("axis", -1);
  if (axis < 0) axis += static_cast<int64_t>(xs.size());
  KILN_ASSIGN_OR_RETURN(auto rk, axisRowKernel(gl, "softmax", x, xs, axis));
  Kernel& k = rk.kb.k;
  ExprGraph& g = k.exprs;
  DType ct = g.typeOf(rk.x);
  int shifted = GroupLowering::expShiftedRow(k, rk.x);
  Phase map;
  int out = gl.bindValue(rk.kb, op.result(), true);
  map.stores.push_back(
      {out, rowMajorOffset(g, rk.row.coords, xs),
       g.cast(g.binary(ExprOp::Div, shifted, g.rowValue(1, ct)), op.result()->type().dtype()), -1});
  k.phases.push_back(map);
  return gl.finish(rk.kb);
}

Status lowerBce(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  const Value* y = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  Fold f{"bce_with_logits", xs, std::vector<bool>(xs.size(), true), Combiner::Sum,
         isMean(op) ? 1.0 / static_cast<double>(product(xs)) : 1.0, op.result(),
         [&](KernelBuilder& kb, const std::vector<int>& coords) -> Expected<int> {
           ExprGraph& g = kb.g();
           KILN_ASSIGN_OR_RETURN(auto xv, gl.valueAt(kb, x, coords));
           KILN_ASSIGN_OR_RETURN(auto yv, gl.valueAt(kb, y, coords));
           const int yy = g.cast(yv, g.typeOf(xv));
           // max(x, 0) - x*y + log1p(exp(-|x|)): no overflow for large |x|.
           return g.binary(
               ExprOp::Add, g.binary(ExprOp::Sub, g.unary(ExprOp::Relu, xv), g.binary(ExprOp::Mul, xv, yy)),
               g.unary(ExprOp::Log1p, g.unary(ExprOp::Exp, g.unary(ExprOp::Neg, g.unary(ExprOp::Abs, xv)))));
         }};
  return lowerFold(gl, f);
}

// Per-row losses into a temporary, then their sum (or mean): a fold.
Status lowerSoftmaxCrossEntropy(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  const Value* y = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  int64_t n = (xs)[0], c = (xs)[1];
  int rows = gl.tempBuffer("row_losses", DType::f32, n);
  {
    KILN_ASSIGN_OR_RETURN(auto rk, axisRowKernel(gl, "softmax_xent_rows", x, xs, 1));
    KernelBuilder& kb = rk.kb;
    Kernel& k = kb.k;
    ExprGraph& g = k.exprs;
    const AxisRow& ar = rk.row;
    const int xv = rk.x;
    DType ct = g.typeOf(xv);
    GroupLowering::expShiftedRow(k, xv);
    int m = g.rowValue(0, ct);
    int lse = g.binary(ExprOp::Add, m, g.unary(ExprOp::Log, g.rowValue(1, ct)));
    int loss;
    if (y->type().rank() == 1) {
      // lse - x[n, label]; an out-of-range label contributes lse (x read as 0 is not used).
      KILN_ASSIGN_OR_RETURN(auto label, gl.valueAt(kb, y, {ar.outer[0]}));
      int li = g.cast(label, DType::i64);
      KILN_ASSIGN_OR_RETURN(auto picked, gl.valueAt(kb, x, {ar.outer[0], li}));
      int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, li, g.intConstant(0)),
                        g.binary(ExprOp::Lt, li, g.intConstant(c)));
      loss = g.binary(ExprOp::Sub, lse, g.select(ok, picked, g.constant(0, ct)));
    } else {
      // sum_c y_c (lse - x_c) = lse * sum(y) - sum(y * x)
      KILN_ASSIGN_OR_RETURN(auto yv, gl.valueAt(kb, y, ar.coords));
      int yc = g.cast(yv, ct);
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.binary(ExprOp::Mul, yc, xv), {}});
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, yc, {}});
      loss = g.binary(ExprOp::Sub, g.binary(ExprOp::Mul, lse, g.rowValue(3, ct)), g.rowValue(2, ct));
    }
    k.stores.push_back({gl.bind(kb, rows, true), ar.outer[0], g.cast(loss, DType::f32), -1});
    KILN_RETURN_IF_ERROR(gl.finish(kb));
  }
  Fold f{"softmax_xent_total", {n}, {true}, Combiner::Sum, isMean(op) ? 1.0 / static_cast<double>(n) : 1.0,
         op.result(), [&](KernelBuilder& kb, const std::vector<int>& coords) -> Expected<int> {
           return kb.g().load(gl.bind(kb, rows, false), DType::f32, coords[0]);
         }};
  return lowerFold(gl, f);
}

// g (softmax(x) * sum_c p - p) per row, / N for a mean; p is one-hot for class ids.
Status lowerSoftmaxCrossEntropyGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  const Value* y = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  KILN_ASSIGN_OR_RETURN(auto rk, axisRowKernel(gl, "softmax_xent_grad", x, xs, 1));
  KernelBuilder& kb = rk.kb;
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  const AxisRow& ar = rk.row;
  DType ct = g.typeOf(rk.x);
  KILN_ASSIGN_OR_RETURN(auto gv, gl.valueAt(kb, op.operand(2), {}));
  int scale = g.cast(gv, ct);
  if (isMean(op)) scale = g.binary(ExprOp::Mul, scale, g.constant(1.0 / static_cast<double>((xs)[0]), ct));
  int e = GroupLowering::expShiftedRow(k, rk.x);
  int p = g.binary(ExprOp::Div, e, g.rowValue(1, ct));
  int target, mass;
  if (y->type().rank() == 1) {
    KILN_ASSIGN_OR_RETURN(auto label, gl.valueAt(kb, y, {ar.outer[0]}));
    target = g.select(g.binary(ExprOp::Eq, g.cast(label, DType::i64), ar.coords[1]), g.constant(1, ct),
                      g.constant(0, ct));
    mass = g.constant(1, ct);
  } else {
    KILN_ASSIGN_OR_RETURN(auto yv, gl.valueAt(kb, y, ar.coords));
    target = g.cast(yv, ct);
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, target, {}});
    mass = g.rowValue(2, ct);
  }
  Phase map;
  map.stores.push_back(
      {gl.bindValue(kb, op.result(), true), rowMajorOffset(g, ar.coords, xs),
       g.cast(g.binary(ExprOp::Mul, scale, g.binary(ExprOp::Sub, g.binary(ExprOp::Mul, p, mass), target)),
              op.result()->type().dtype()),
       -1});
  k.phases.push_back(map);
  return gl.finish(kb);
}

}  // namespace

void registerSoftmaxLossEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::Softmax, {"softmax_loss", lowerSoftmax, GroupForm::kPointwiseInputs});
  r.addOpEmitter(ir::OpCode::BceWithLogits, {"softmax_loss", lowerBce, GroupForm::kPointwiseInputs});
  r.addOpEmitter(ir::OpCode::SoftmaxCrossEntropy, {"softmax_loss", lowerSoftmaxCrossEntropy});
  r.addOpEmitter(ir::OpCode::SoftmaxCrossEntropyGrad, {"softmax_loss", lowerSoftmaxCrossEntropyGrad});
}

}  // namespace kiln::codegen::emit
