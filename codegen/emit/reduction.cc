// The reduction emitter: Row kernels folding axes of a value (reduce, sum_to; reduce and sum_to
// compute a pointwise producer chain of their group inline) and max's gradient.
#include <algorithm>
#include <set>

#include "codegen/emit/emitter_registry.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

std::set<int64_t> axesOf(const Op& op, size_t rank) {
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(rank) : a);
  return axes;
}

// The outer and row spaces of a Row kernel folding `axes` of a value of shape xs.
std::pair<std::vector<int64_t>, std::vector<int64_t>> splitAxes(const std::vector<int64_t>& xs,
                                                                const std::set<int64_t>& axes) {
  std::vector<int64_t> outer, row;
  for (size_t i = 0; i < xs.size(); ++i) (axes.count(static_cast<int64_t>(i)) ? row : outer).push_back(xs[i]);
  return {outer, row};
}

Status lowerReduce(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  if (!ir::isFloat(x->type().dtype()))
    return Status::errorf("{} on the CUDA backend needs a float operand", opLabel(op));
  const std::set<int64_t> axes = axesOf(op, xs.size());
  auto [outer, row] = splitAxes(xs, axes);
  KernelBuilder kb = KernelBuilder::row("reduce_" + op.strAttr("kind"), outer, row);
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  std::vector<int> coords(xs.size());
  int outer_i = 0, row_i = static_cast<int>(k.space.size());
  for (size_t i = 0; i < xs.size(); ++i)
    coords[i] = axes.count(static_cast<int64_t>(i)) ? g.coord(row_i++) : g.coord(outer_i++);
  KILN_ASSIGN_OR_RETURN(auto v, gl.valueAt(kb, x, coords));
  std::string kind = op.strAttr("kind");
  Phase p;
  p.kind = Phase::Kind::Reduce;
  p.combiner = kind == "max" ? Combiner::Max : Combiner::Sum;
  p.value = v;
  k.phases.push_back(p);
  DType ct = g.typeOf(v);
  int acc = g.rowValue(0, ct);
  if (kind == "mean")
    acc = g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(k.rowSize()), ct));
  std::vector<int> oc = kb.spaceCoords();
  int out = gl.bindValue(kb, op.result(), true);
  k.stores.push_back({out, rowMajorOffset(g, oc, k.space), g.cast(acc, op.result()->type().dtype()), -1});
  return gl.finish(kb);
}

// sum_to: sums x over the dims along which the result type broadcasts to it.
Status lowerSumTo(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  if (!ir::isFloat(op.numResults() ? op.result()->type().dtype() : DType::f32))
    return Status::errorf("{} on the CUDA backend needs float values", opLabel(op));
  const Value* x = op.operand(0);
  auto xs = gl.shapeOf(x);
  auto os = gl.shapeOf(op.result());
  if (!xs || !os) return !xs ? xs.status() : os.status();
  size_t lead = xs->size() - os->size();
  std::vector<size_t> reduced;
  std::vector<int64_t> row;
  for (size_t i = 0; i < xs->size(); ++i)
    if (i < lead || ((*os)[i - lead] == 1 && (*xs)[i] != 1)) reduced.push_back(i);
  for (size_t i : reduced) row.push_back((*xs)[i]);
  if (row.empty()) row = {1};
  KernelBuilder kb = KernelBuilder::row("sum_to", *os, row);
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  std::vector<int> coords(xs->size());
  int ri = static_cast<int>(k.space.size());
  for (size_t i = 0; i < xs->size(); ++i) {
    bool red = std::find(reduced.begin(), reduced.end(), i) != reduced.end();
    coords[i] =
        red ? g.coord(ri++) : ((*xs)[i] == 1 ? g.intConstant(0) : g.coord(static_cast<int>(i - lead)));
  }
  KILN_ASSIGN_OR_RETURN(auto v, gl.valueAt(kb, x, coords));
  k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, v, {}});
  std::vector<int> oc = kb.spaceCoords();
  k.stores.push_back({gl.bindValue(kb, op.result(), true), rowMajorOffset(g, oc, k.space),
                      g.cast(g.rowValue(0, g.typeOf(v)), op.result()->type().dtype()), -1});
  return gl.finish(kb);
}

// max: the gradient goes to the maxima of each reduced slice, split evenly among ties.
Status lowerReduceMaxGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* gval = op.operand(0);
  const Value* x = op.operand(1);
  const Value* y = op.operand(2);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  const std::set<int64_t> axes = axesOf(op, xs.size());
  bool keep = op.boolAttr("keepdims");
  auto [outer, row] = splitAxes(xs, axes);
  KernelBuilder kb = KernelBuilder::row("reduce_max_grad", outer, row);
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  std::vector<int> coords(xs.size()), kept;
  int oi = 0, ri = static_cast<int>(k.space.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    bool red = axes.count(static_cast<int64_t>(i));
    coords[i] = red ? g.coord(ri++) : g.coord(oi++);
    if (!red)
      kept.push_back(coords[i]);
    else if (keep)
      kept.push_back(g.intConstant(0));
  }
  auto xv = gl.valueAt(kb, x, coords);
  auto yv = gl.valueAt(kb, y, kept);
  auto gv = gl.valueAt(kb, gval, kept);
  if (!xv || !yv || !gv) return !xv ? xv.status() : !yv ? yv.status() : gv.status();
  DType ct = g.typeOf(*xv);
  int hit = g.binary(ExprOp::Eq, *xv, *yv);
  k.phases.push_back(
      {Phase::Kind::Reduce, Combiner::Sum, g.select(hit, g.constant(1, ct), g.constant(0, ct)), {}});
  Phase map;
  map.stores.push_back(
      {gl.bindValue(kb, op.result(), true), rowMajorOffset(g, coords, xs),
       g.cast(g.select(hit, g.binary(ExprOp::Div, *gv, g.rowValue(0, ct)), g.constant(0, ct)),
              op.result()->type().dtype()),
       -1});
  k.phases.push_back(map);
  return gl.finish(kb);
}

}  // namespace

void registerReductionEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::Reduce, {"reduction", lowerReduce, GroupForm::kPointwiseInputs});
  r.addOpEmitter(ir::OpCode::SumTo, {"reduction", lowerSumTo, GroupForm::kPointwiseInputs});
  // sum and mean gradients are expressions (pointwise.cc).
  r.addOpEmitter(ir::OpCode::ReduceGrad, {"reduction", lowerReduceMaxGrad, GroupForm::kAlone,
                                          [](const Op& op) { return op.strAttr("kind") == "max"; }});
  // A fused reduction region: a Row kernel computing its pointwise producers inline.
  r.addFusedEmitter("reduction",
                    [](GroupLowering& gl, const std::vector<const Op*>&) { return lowerOps(gl); });
}

}  // namespace kiln::codegen::emit
