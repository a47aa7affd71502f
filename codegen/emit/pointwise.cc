// The pointwise emitter: elementwise math and data movement as expressions of their operands
// (registered as expression rules, so reductions and losses compute such producers inline
// too), and a group of only such ops as ONE Pointwise kernel storing the values that leave it.

#include "codegen/emit/emitter_registry.h"
#include "ir/op_def.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// The operands of `op` at the result's coordinates (broadcast), in order.
Expected<std::vector<int>> operandsAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, unsigned n,
                                      const std::vector<int>& coords) {
  std::vector<int> xs;
  for (unsigned i = 0; i < n; ++i) {
    KILN_ASSIGN_OR_RETURN(auto x, gl.operandAt(kb, op, i, coords));
    xs.push_back(x);
  }
  return xs;
}

// An axis attribute made non-negative for a value of `rank` dims.
int64_t axisOf(const Op& op, size_t rank) {
  int64_t axis = op.intAttr("axis");
  return axis < 0 ? axis + static_cast<int64_t>(rank) : axis;
}

// f(x) or f(x, y) for the function of scalar_fn.def the op applies (a comparison's predicate).
Expected<int> scalarFnAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  const ir::ScalarFn fn = *ir::scalarFnOf(op);
  const int arity = ir::scalarFnInfo(fn).arity;
  KILN_ASSIGN_OR_RETURN(std::vector<int> xs, operandsAt(gl, kb, op, static_cast<unsigned>(arity), at.coords));
  return arity == 1 ? kb.g().unary(exprOpOf(fn), xs[0]) : kb.g().binary(exprOpOf(fn), xs[0], xs[1]);
}

Expected<int> selectAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  KILN_ASSIGN_OR_RETURN(auto cxy, operandsAt(gl, kb, op, 3, at.coords));
  return kb.g().select((cxy)[0], (cxy)[1], (cxy)[2]);
}

Expected<int> broadcastAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  return gl.operandAt(kb, op, 0, at.coords);
}

Expected<int> activationGradAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  // dy * f'(x), f' the activation's derivative in scalar_fn.def.
  KILN_ASSIGN_OR_RETURN(std::vector<int> xdy, operandsAt(gl, kb, op, 2, at.coords));
  const auto act = ir::findScalarFn(ir::ScalarFnKind::Activation, op.strAttr("activation"));
  ExprGraph& g = kb.g();
  return g.binary(ExprOp::Mul, xdy[1], g.unary(exprOpOf(*ir::scalarFnInfo(*act).partner), xdy[0]));
}

Expected<int> castAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  auto x = gl.operandAt(kb, op, 0, at.coords);
  if (!x) return x;
  DType to = at.value->type().dtype();
  if (to == DType::i1) {
    DType from = g.typeOf(*x);
    return g.binary(ExprOp::Ne, *x, ir::isFloat(from) ? g.constant(0, from) : g.intConstant(0, from));
  }
  int r = g.cast(*x, to);
  if (to == DType::bf16) r = g.unary(ExprOp::RoundBf16, r);
  return r;
}

// g (sigmoid(x) - y), divided by the element count for a mean.
Expected<int> bceWithLogitsGradAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  KILN_ASSIGN_OR_RETURN(auto xy, operandsAt(gl, kb, op, 2, at.coords));
  const int x = (xy)[0], y = (xy)[1];
  DType ct = g.typeOf(x);
  auto gv = gl.valueAt(kb, op.operand(2), {});
  if (!gv) return gv;
  int scale = g.cast(*gv, ct);
  if (op.strAttr("reduction", "mean") == "mean")
    scale = g.binary(ExprOp::Mul, scale, g.constant(1.0 / static_cast<double>(product(at.shape)), ct));
  return g.binary(ExprOp::Mul, scale, g.binary(ExprOp::Sub, g.unary(ExprOp::Sigmoid, x), g.cast(y, ct)));
}

// sum/mean: the kept element's gradient, spread (and divided by the count for a mean).
Expected<int> reduceGradAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(at.coords.size()) : a);
  bool keep = op.boolAttr("keepdims");
  std::vector<int> gc;
  int64_t count = 1;
  for (size_t i = 0; i < at.coords.size(); ++i) {
    if (axes.count(static_cast<int64_t>(i))) {
      count *= at.shape[i];
      if (keep) gc.push_back(g.intConstant(0));
    } else {
      gc.push_back(at.coords[i]);
    }
  }
  auto gv = gl.valueAt(kb, op.operand(0), gc);
  if (!gv) return gv;
  if (op.strAttr("kind") == "mean")
    return g.binary(ExprOp::Mul, *gv, g.constant(1.0 / static_cast<double>(count), g.typeOf(*gv)));
  return gv;
}

Expected<int> reshapeAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  int flat = rowMajorOffset(g, at.coords, at.shape);
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  if (!gl.computedInGroup(x)) return gl.load(kb, x, flat);
  std::vector<int> c(xs.size());
  int rest = flat;
  for (size_t j = xs.size(); j-- > 0;) {
    c[j] = g.binary(ExprOp::Rem, rest, g.intConstant((xs)[j]));
    rest = g.binary(ExprOp::Div, rest, g.intConstant((xs)[j]));
  }
  return gl.valueAt(kb, x, c);
}

Expected<int> transposeAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  std::vector<int64_t> perm = op.intsAttr("perm");
  std::vector<int> c(at.coords.size());
  for (size_t j = 0; j < perm.size(); ++j) c[static_cast<size_t>(perm[j])] = at.coords[j];
  return gl.valueAt(kb, op.operand(0), c);
}

Expected<int> sliceAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  const size_t axis = static_cast<size_t>(axisOf(op, at.coords.size()));
  std::vector<int> c = at.coords;
  c[axis] = kb.g().binary(ExprOp::Add, at.coords[axis], kb.g().intConstant(op.intAttr("start")));
  return gl.valueAt(kb, op.operand(0), c);
}

// Zeros around x along `axis`: position c reads x[c - low] when that lies in x, else zero (the
// select evaluates the load only where it is in range).
Expected<int> padAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  const size_t axis = static_cast<size_t>(axisOf(op, at.coords.size()));
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(op.operand(0)));
  std::vector<int> c = at.coords;
  c[axis] = g.binary(ExprOp::Sub, at.coords[axis], g.intConstant(op.intAttr("low")));
  auto x = gl.valueAt(kb, op.operand(0), c);
  if (!x) return x;
  int in_range = g.binary(ExprOp::And, g.binary(ExprOp::Ge, c[axis], g.intConstant(0)),
                          g.binary(ExprOp::Lt, c[axis], g.intConstant(xs[axis])));
  DType t = g.typeOf(*x);
  return g.select(in_range, *x, ir::isFloat(t) ? g.constant(0, t) : g.intConstant(0, t));
}

Expected<int> concatAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  const size_t axis = static_cast<size_t>(axisOf(op, at.coords.size()));
  std::vector<int64_t> starts;
  int64_t end = 0;
  for (const Value* x : op.operands()) {
    KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
    starts.push_back(end);
    end += (xs)[axis];
  }
  int ca = at.coords[axis];
  int result = -1;
  // A chain of selects, lazily evaluated: each element reads one operand only.
  for (size_t i = op.numOperands(); i-- > 0;) {
    std::vector<int> c = at.coords;
    c[axis] = g.binary(ExprOp::Sub, ca, g.intConstant(starts[i]));
    auto x = gl.valueAt(kb, op.operand(static_cast<unsigned>(i)), c);
    if (!x) return x;
    result = result < 0 ? *x : g.select(g.binary(ExprOp::Lt, ca, g.intConstant(starts[i + 1])), *x, result);
  }
  return result;
}

Expected<int> gatherAt(GroupLowering& gl, KernelBuilder& kb, const Op& op, const ExprSite& at) {
  ExprGraph& g = kb.g();
  const std::vector<int>& coords = at.coords;
  const Value* x = op.operand(0);
  const Value* idx = op.operand(1);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  const int64_t axis = axisOf(op, xs.size());
  const int64_t ri = idx->type().rank();
  auto iv = gl.valueAt(kb, idx, std::vector<int>(coords.begin() + axis, coords.begin() + axis + ri));
  if (!iv) return iv;
  int i64 = g.cast(*iv, DType::i64);
  std::vector<int> c(coords.begin(), coords.begin() + axis);
  c.push_back(i64);
  c.insert(c.end(), coords.begin() + axis + ri, coords.end());
  auto loaded = gl.valueAt(kb, x, c);
  if (!loaded) return loaded;
  // Out-of-range indices read zero rather than stray memory.
  int in_range = g.binary(ExprOp::And, g.binary(ExprOp::Ge, i64, g.intConstant(0)),
                          g.binary(ExprOp::Lt, i64, g.intConstant((xs)[static_cast<size_t>(axis)])));
  DType t = g.typeOf(*loaded);
  return g.select(in_range, *loaded, ir::isFloat(t) ? g.constant(0, t) : g.intConstant(0, t));
}

// ONE Pointwise kernel over the group's common output shape.
Status lowerPointwiseChain(GroupLowering& gl) {
  std::vector<const Value*> outs = gl.liveOuts();
  if (outs.empty()) return Status::ok();
  KILN_ASSIGN_OR_RETURN(auto space, gl.shapeOf(outs.front()));
  for (const Value* v : outs) {
    auto s = gl.shapeOf(v);
    if (!s || *s != space)
      return Status::errorf("a fused group's outputs must share one shape: {} and {}",
                            outs.front()->type().str(), v->type().str());
  }
  std::string stem;
  for (const Op* op : gl.ops()) stem += (stem.empty() ? "" : "_") + shortOpName(*op);
  if (stem.size() > 40) stem = stem.substr(0, 40);
  KernelBuilder kb = KernelBuilder::pointwise(stem, space);
  ExprGraph& g = kb.g();
  std::vector<int> coords = kb.spaceCoords();
  int flat = rowMajorOffset(g, coords, space);
  for (const Value* v : outs) {
    KILN_ASSIGN_OR_RETURN(auto x, gl.valueAt(kb, v, coords));
    int buf = gl.bindValue(kb, v, true);
    kb.k.stores.push_back({buf, flat, g.cast(x, v->type().dtype()), -1});
  }
  return gl.finish(kb);
}

}  // namespace

void registerPointwiseEmitters(EmitterRegistry& r) {
  // Every op of scalar_fn.def, and comparisons.
  for (const ir::ScalarFnInfo& f : ir::scalarFns())
    if (f.isOp()) r.addExpression(ir::opCodeOf(f.fn), scalarFnAt);
  r.addExpression(ir::OpCode::Compare, scalarFnAt);
  r.addExpression(ir::OpCode::Select, selectAt);
  r.addExpression(ir::OpCode::Broadcast, broadcastAt);
  r.addExpression(ir::OpCode::Cast, castAt);
  r.addExpression(ir::OpCode::ActivationGrad, activationGradAt);
  r.addExpression(ir::OpCode::BceWithLogitsGrad, bceWithLogitsGradAt);
  // max's gradient is a Row kernel (reduction.cc).
  r.addExpression(ir::OpCode::ReduceGrad, reduceGradAt,
                  [](const Op& op) { return op.strAttr("kind") != "max"; });
  r.addExpression(ir::OpCode::Reshape, reshapeAt);
  r.addExpression(ir::OpCode::Transpose, transposeAt);
  r.addExpression(ir::OpCode::Slice, sliceAt);
  r.addExpression(ir::OpCode::Concat, concatAt);
  r.addExpression(ir::OpCode::Pad, padAt);
  r.addExpression(ir::OpCode::Gather, gatherAt);
  r.setPointwiseChain(lowerPointwiseChain);
  // A fused pointwise region: the same chain (or whatever lowerOps makes of it).
  r.addFusedEmitter("pointwise",
                    [](GroupLowering& gl, const std::vector<const Op*>&) { return lowerOps(gl); });
}

}  // namespace kiln::codegen::emit
