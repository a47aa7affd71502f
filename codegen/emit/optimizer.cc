// The dense optimizer emitter: kiln.optimizer_update as one Pointwise kernel over the
// parameter's elements, updating the parameter and its state in place.
#include "codegen/emit/optimizer.h"

#include "codegen/emit/emitter_registry.h"
#include "ir/optimizer.h"

namespace kiln::codegen::emit {

using ir::Op;
using ir::Value;

Hyper hyper(GroupLowering& gl, KernelBuilder& kb, const Op& op, int lr_operand, int step_operand,
            int scale_operand, DType ct) {
  ExprGraph& g = kb.g();
  Hyper h;
  auto scalar = [&](int i) {
    const Value* v = op.operand(static_cast<unsigned>(i));
    return g.cast(g.load(gl.bindValue(kb, v, false), v->type().dtype(), g.intConstant(0)), ct);
  };
  h.lr = g.binary(ExprOp::Mul, g.constant(op.floatAttr("lr"), ct), scalar(lr_operand));
  h.step = scalar(step_operand);
  h.scale = scale_operand >= 0 ? scalar(scale_operand) : -1;
  h.eps = op.floatAttr("eps", 1e-8);
  h.beta1 = op.floatAttr("beta1", 0.9);
  h.beta2 = op.floatAttr("beta2", 0.999);
  h.weight_decay = op.floatAttr("weight_decay");
  h.momentum = op.floatAttr("momentum");
  h.nesterov = op.boolAttr("nesterov");
  return h;
}

int elementUpdate(ExprGraph& g, const std::string& kind, const Hyper& h, int w, int grad, DType ct,
                  const std::function<int(int)>& st, const std::function<void(int, int)>& store_st) {
  auto c = [&](double v) { return g.constant(v, ct); };
  auto mul = [&](int a, int b) { return g.binary(ExprOp::Mul, a, b); };
  auto add = [&](int a, int b) { return g.binary(ExprOp::Add, a, b); };
  auto sub = [&](int a, int b) { return g.binary(ExprOp::Sub, a, b); };
  auto div = [&](int a, int b) { return g.binary(ExprOp::Div, a, b); };
  int gr = h.scale >= 0 ? mul(grad, h.scale) : grad;
  if (kind == "adamw") {
    if (h.weight_decay != 0) w = sub(w, mul(mul(h.lr, c(h.weight_decay)), w));
  } else if (h.weight_decay != 0) {
    gr = add(gr, mul(c(h.weight_decay), w));
  }
  if (kind == "sgd") {
    int d = gr;
    if (h.momentum != 0) {
      int m = add(mul(c(h.momentum), st(0)), gr);
      store_st(0, m);
      d = h.nesterov ? add(gr, mul(c(h.momentum), m)) : m;
    }
    return sub(w, mul(h.lr, d));
  }
  if (kind == "adagrad") {
    int s = add(st(0), mul(gr, gr));
    store_st(0, s);
    return sub(w, div(mul(h.lr, gr), add(g.unary(ExprOp::Sqrt, s), c(h.eps))));
  }
  // adam, adamw
  int m = add(mul(c(h.beta1), st(0)), mul(c(1 - h.beta1), gr));
  int v = add(mul(c(h.beta2), st(1)), mul(mul(c(1 - h.beta2), gr), gr));
  store_st(0, m);
  store_st(1, v);
  int bias1 = sub(c(1), g.binary(ExprOp::Pow, c(h.beta1), h.step));
  int bias2 = sub(c(1), g.binary(ExprOp::Pow, c(h.beta2), h.step));
  return sub(w, div(mul(h.lr, div(m, bias1)), add(g.unary(ExprOp::Sqrt, div(v, bias2)), c(h.eps))));
}

namespace {

Status lowerOptimizerUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  std::string kind = op.strAttr("kind");
  size_t nstate = ir::denseOptimizerState(kind, op.attrs()).size();
  const Value* p = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto ps, gl.shapeOf(p));
  KernelBuilder kb = KernelBuilder::pointwise("optimizer_" + kind, {product(ps)});
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  DType ct = computeType(p->type().dtype());
  int s = 2 + static_cast<int>(nstate);
  Hyper h = hyper(gl, kb, op, s, s + 1, op.boolAttr("scaled") ? s + 2 : -1, ct);
  int i = g.coord(0);
  int pw = gl.bindValue(kb, p, true);
  int w = g.load(pw, p->type().dtype(), i);
  int grad = g.cast(g.load(gl.bindValue(kb, op.operand(1), false), op.operand(1)->type().dtype(), i), ct);
  auto st = [&](int j) {
    const Value* sv = op.operand(static_cast<unsigned>(2 + j));
    return g.load(gl.bindValue(kb, sv, true), sv->type().dtype(), i);
  };
  auto store_st = [&](int j, int v) {
    const Value* sv = op.operand(static_cast<unsigned>(2 + j));
    k.stores.push_back({gl.bindValue(kb, sv, true), i, g.cast(v, sv->type().dtype()), -1});
  };
  int nw = elementUpdate(g, kind, h, w, grad, ct, st, store_st);
  k.stores.push_back({pw, i, g.cast(nw, p->type().dtype()), -1});
  return gl.finish(kb);
}

}  // namespace

void registerOptimizerEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::OptimizerUpdate, {"optimizer", lowerOptimizerUpdate});
}

}  // namespace kiln::codegen::emit
