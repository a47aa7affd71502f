#include "codegen/kernel_lowering.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "ir/op_def.h"
#include "ir/optimizer.h"

namespace kiln::codegen {

using ir::Op;
using ir::Value;

Expected<std::vector<int64_t>> concreteShape(const ir::TensorType& t, const ir::SymbolBindings& symbols) {
  std::vector<int64_t> s;
  for (const ir::Dim& d : t.shape()) {
    auto v = d.evaluate(symbols);
    if (!v) return Status::errorf("dimension '{}' of {} has no value (bind it, e.g. --batch)", d.str(), t.str());
    s.push_back(*v);
  }
  return s;
}

const Value* outerValue(const Value* v) {
  for (;;) {
    if (v->isBlockArgument()) {
      const ir::Block* b = v->parentBlock();
      const Op* fused = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
      if (!fused || fused->name() != "kiln.fused" || v->index() >= fused->numOperands()) return v;
      v = fused->operand(v->index());
      continue;
    }
    const Value* yielded_as = nullptr;
    for (const ir::Use& u : v->uses())
      if (u.user->name() == "kiln.yield") {
        const ir::Block* b = u.user->parentBlock();
        const Op* fused = b && b->parentRegion() ? b->parentRegion()->parentOp() : nullptr;
        if (fused && fused->name() == "kiln.fused" && u.operand_index < fused->numResults())
          yielded_as = fused->result(u.operand_index);
      }
    if (!yielded_as) return v;
    v = yielded_as;
  }
}

bool isSourceOrTerminator(const Op& op) {
  return op.hasTrait(ir::kSource) || op.hasTrait(ir::kTerminator) || op.name() == "kiln.constant";
}

namespace {

const std::set<std::string, std::less<>>& movementOps() {
  static const std::set<std::string, std::less<>> s = {"kiln.broadcast", "kiln.reshape", "kiln.transpose",
                                                       "kiln.slice",     "kiln.concat",  "kiln.gather",
                                                       "kiln.cast",      "kiln.compare", "kiln.select",
                                                       "kiln.activation_grad", "kiln.bce_with_logits_grad"};
  return s;
}

std::string opLabel(const Op& op) {
  std::string s = "'" + op.name() + "'";
  if (op.location().known()) s += " at " + op.location().str();
  return s;
}

std::string valueName(const Value* v) {
  if (!v->nameHint().empty()) return v->nameHint();
  if (Op* d = v->definingOp()) {
    if (d->hasAttr("name")) return d->strAttr("name");
    return d->name().substr(d->name().find('.') + 1) + "#" + std::to_string(v->index());
  }
  return "arg" + std::to_string(v->index());
}

std::string shortOpName(const Op& op) { return op.name().substr(op.name().find('.') + 1); }

int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

int64_t nextPow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Builds the kernels of one group, binding kernel buffers to group buffers.
class GroupLowering {
 public:
  GroupLowering(const std::vector<const Op*>& ops, const ir::SymbolBindings& symbols)
      : symbols_(symbols), in_group_(ops.begin(), ops.end()) {
    out_.ops = ops;
  }

  LoweredGroup take() { return std::move(out_); }

  Expected<std::vector<int64_t>> shapeOf(const Value* v) { return concreteShape(v->type(), symbols_); }

  int groupBuffer(const Value* inner, bool written) {
    const Value* v = outerValue(inner);
    bool defined = inner->definingOp() && in_group_.count(inner->definingOp());
    auto it = value_buffer_.find(v);
    if (it != value_buffer_.end()) {
      out_.buffers[static_cast<size_t>(it->second)].written |= written;
      out_.buffers[static_cast<size_t>(it->second)].defined |= defined;
      return it->second;
    }
    auto shape = shapeOf(v);
    GroupBuffer b{v, valueName(v), v->type().dtype(), shape ? product(*shape) : 0, written, defined};
    out_.buffers.push_back(b);
    int id = static_cast<int>(out_.buffers.size() - 1);
    value_buffer_[v] = id;
    return id;
  }

  int tempBuffer(std::string name, DType dtype, int64_t elements) {
    out_.buffers.push_back({nullptr, std::move(name), dtype, elements, true});
    return static_cast<int>(out_.buffers.size() - 1);
  }

  // One kernel under construction.
  struct KB {
    Kernel k;
    std::vector<int> args;
    std::map<int, int> kernel_buffer;  // group buffer -> kernel buffer
    std::map<std::pair<const Value*, std::vector<int>>, int> memo;
  };

  int bind(KB& kb, int group_buffer, bool written) {
    auto it = kb.kernel_buffer.find(group_buffer);
    const GroupBuffer& gb = out_.buffers[static_cast<size_t>(group_buffer)];
    if (it != kb.kernel_buffer.end()) {
      kb.k.buffers[static_cast<size_t>(it->second)].written |= written;
      return it->second;
    }
    int id = kb.k.addBuffer(gb.name, gb.dtype, gb.elements, written);
    kb.kernel_buffer[group_buffer] = id;
    kb.args.push_back(group_buffer);
    return id;
  }
  int bindValue(KB& kb, const Value* v, bool written) { return bind(kb, groupBuffer(v, written), written); }

  Status finish(KB& kb) {
    KILN_RETURN_IF_ERROR(validate(kb.k));
    out_.kernels.push_back(std::move(kb.k));
    out_.args.push_back(std::move(kb.args));
    return Status::ok();
  }

  bool computedInGroup(const Value* v) const {
    const Op* d = v->definingOp();
    return d && in_group_.count(d) && isPointwiseOp(*d);
  }

  // Leaves of the expressions: splat constants inline, everything else from its buffer.
  Expected<int> load(KB& kb, const Value* v, int offset) {
    ExprGraph& g = kb.k.exprs;
    const Op* d = outerValue(v)->definingOp();
    if (d && d->name() == "kiln.constant" && d->attr("value") && d->attr("value")->isNumber())
      return g.constant(d->attr("value")->asDouble(), v->type().dtype());
    DType t = v->type().dtype();
    if (t != DType::f32 && t != DType::bf16 && t != DType::f64 && t != DType::i32 && t != DType::i64 &&
        t != DType::i1)
      return Status::errorf("the CUDA backend does not support {} tensors ({})", ir::dtypeName(t), v->type().str());
    return g.load(bindValue(kb, v, false), t, offset);
  }

  // The expression for v at `coords` (node ids, one per dim of v).
  Expected<int> valueAt(KB& kb, const Value* v, const std::vector<int>& coords) {
    auto key = std::make_pair(v, coords);
    auto it = kb.memo.find(key);
    if (it != kb.memo.end()) return it->second;
    auto r = computeValueAt(kb, v, coords);
    if (r) kb.memo[key] = *r;
    return r;
  }

  Expected<int> computeValueAt(KB& kb, const Value* v, const std::vector<int>& coords) {
    ExprGraph& g = kb.k.exprs;
    auto shape = shapeOf(v);
    if (!shape) return shape.status();
    if (!computedInGroup(v)) return load(kb, v, rowMajorOffset(g, coords, *shape));
    const Op& op = *v->definingOp();
    auto operandAt = [&](unsigned i) -> Expected<int> {
      // numpy broadcasting: trailing dims align; size-1 dims read coordinate 0.
      const Value* x = op.operand(i);
      auto xs = shapeOf(x);
      if (!xs) return xs.status();
      std::vector<int> c;
      size_t lead = coords.size() - xs->size();
      for (size_t j = 0; j < xs->size(); ++j)
        c.push_back((*xs)[j] == 1 ? g.intConstant(0) : coords[lead + j]);
      return valueAt(kb, x, c);
    };
    const std::string& name = op.name();
    if (auto fn = ir::scalarFnOf(op)) {  // elementwise functions and comparisons
      auto x = operandAt(0);
      if (!x) return x;
      if (ir::scalarFnInfo(*fn).arity == 1) return g.unary(exprOpOf(*fn), *x);
      auto y = operandAt(1);
      if (!y) return y;
      return g.binary(exprOpOf(*fn), *x, *y);
    }
    if (name == "kiln.select") {
      auto c = operandAt(0);
      if (!c) return c;
      auto x = operandAt(1);
      if (!x) return x;
      auto y = operandAt(2);
      if (!y) return y;
      return g.select(*c, *x, *y);
    }
    if (name == "kiln.broadcast") return operandAt(0);
    if (name == "kiln.cast") {
      auto x = operandAt(0);
      if (!x) return x;
      DType to = v->type().dtype();
      if (to == DType::i1) {
        DType from = g.typeOf(*x);
        return g.binary(ExprOp::Ne, *x, ir::isFloat(from) ? g.constant(0, from) : g.intConstant(0, from));
      }
      int r = g.cast(*x, to);
      if (to == DType::bf16) r = g.unary(ExprOp::RoundBf16, r);
      return r;
    }
    if (name == "kiln.activation_grad") {
      auto x = operandAt(0);
      if (!x) return x;
      auto dy = operandAt(1);
      if (!dy) return dy;
      // dy * f'(x), f' the activation's derivative in scalar_fn.def.
      auto act = ir::findScalarFn(ir::ScalarFnKind::Activation, op.strAttr("activation"));
      return g.binary(ExprOp::Mul, *dy, g.unary(exprOpOf(*ir::scalarFnInfo(*act).partner), *x));
    }
    if (name == "kiln.bce_with_logits_grad") {
      // g (sigmoid(x) - y), divided by the element count for a mean.
      auto x = operandAt(0);
      if (!x) return x;
      auto y = operandAt(1);
      if (!y) return y;
      DType ct = g.typeOf(*x);
      auto gv = valueAt(kb, op.operand(2), {});
      if (!gv) return gv;
      int scale = g.cast(*gv, ct);
      if (op.strAttr("reduction", "mean") == "mean")
        scale = g.binary(ExprOp::Mul, scale, g.constant(1.0 / static_cast<double>(product(*shape)), ct));
      return g.binary(ExprOp::Mul, scale, g.binary(ExprOp::Sub, g.unary(ExprOp::Sigmoid, *x), g.cast(*y, ct)));
    }
    if (name == "kiln.reduce_grad") {
      // sum/mean: the kept element's gradient, spread (and divided by the count for a mean).
      std::set<int64_t> axes;
      for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(coords.size()) : a);
      bool keep = op.boolAttr("keepdims");
      std::vector<int> gc;
      int64_t count = 1;
      for (size_t i = 0; i < coords.size(); ++i) {
        if (axes.count(static_cast<int64_t>(i))) {
          count *= (*shape)[i];
          if (keep) gc.push_back(g.intConstant(0));
        } else {
          gc.push_back(coords[i]);
        }
      }
      auto gv = valueAt(kb, op.operand(0), gc);
      if (!gv) return gv;
      if (op.strAttr("kind") == "mean")
        return g.binary(ExprOp::Mul, *gv, g.constant(1.0 / static_cast<double>(count), g.typeOf(*gv)));
      return gv;
    }
    if (name == "kiln.reshape") {
      int flat = rowMajorOffset(g, coords, *shape);
      const Value* x = op.operand(0);
      auto xs = shapeOf(x);
      if (!xs) return xs.status();
      if (!computedInGroup(x)) return load(kb, x, flat);
      std::vector<int> c(xs->size());
      int rest = flat;
      for (size_t j = xs->size(); j-- > 0;) {
        c[j] = g.binary(ExprOp::Rem, rest, g.intConstant((*xs)[j]));
        rest = g.binary(ExprOp::Div, rest, g.intConstant((*xs)[j]));
      }
      return valueAt(kb, x, c);
    }
    if (name == "kiln.transpose") {
      std::vector<int64_t> perm = op.intsAttr("perm");
      std::vector<int> c(coords.size());
      for (size_t j = 0; j < perm.size(); ++j) c[static_cast<size_t>(perm[j])] = coords[j];
      return valueAt(kb, op.operand(0), c);
    }
    if (name == "kiln.slice") {
      int64_t axis = op.intAttr("axis");
      if (axis < 0) axis += static_cast<int64_t>(coords.size());
      std::vector<int> c = coords;
      c[static_cast<size_t>(axis)] = g.binary(ExprOp::Add, coords[static_cast<size_t>(axis)], g.intConstant(op.intAttr("start")));
      return valueAt(kb, op.operand(0), c);
    }
    if (name == "kiln.concat") {
      int64_t axis = op.intAttr("axis");
      if (axis < 0) axis += static_cast<int64_t>(coords.size());
      std::vector<int64_t> starts;
      int64_t at = 0;
      for (const Value* x : op.operands()) {
        auto xs = shapeOf(x);
        if (!xs) return xs.status();
        starts.push_back(at);
        at += (*xs)[static_cast<size_t>(axis)];
      }
      int ca = coords[static_cast<size_t>(axis)];
      int result = -1;
      // A chain of selects, lazily evaluated: each element reads one operand only.
      for (size_t i = op.numOperands(); i-- > 0;) {
        std::vector<int> c = coords;
        c[static_cast<size_t>(axis)] = g.binary(ExprOp::Sub, ca, g.intConstant(starts[i]));
        auto x = valueAt(kb, op.operand(static_cast<unsigned>(i)), c);
        if (!x) return x;
        if (result < 0) {
          result = *x;
        } else {
          int64_t end = starts[i + 1];
          result = g.select(g.binary(ExprOp::Lt, ca, g.intConstant(end)), *x, result);
        }
      }
      return result;
    }
    if (name == "kiln.gather") {
      const Value* x = op.operand(0);
      const Value* idx = op.operand(1);
      auto xs = shapeOf(x);
      if (!xs) return xs.status();
      int64_t axis = op.intAttr("axis");
      if (axis < 0) axis += static_cast<int64_t>(xs->size());
      size_t ri = static_cast<size_t>(idx->type().rank());
      std::vector<int> ic(coords.begin() + axis, coords.begin() + axis + static_cast<int64_t>(ri));
      auto iv = valueAt(kb, idx, ic);
      if (!iv) return iv;
      int i64 = g.cast(*iv, DType::i64);
      std::vector<int> c(coords.begin(), coords.begin() + axis);
      c.push_back(i64);
      c.insert(c.end(), coords.begin() + axis + static_cast<int64_t>(ri), coords.end());
      auto loaded = valueAt(kb, x, c);
      if (!loaded) return loaded;
      // Out-of-range indices read zero rather than stray memory.
      int in_range = g.binary(ExprOp::And, g.binary(ExprOp::Ge, i64, g.intConstant(0)),
                              g.binary(ExprOp::Lt, i64, g.intConstant((*xs)[static_cast<size_t>(axis)])));
      DType t = g.typeOf(*loaded);
      return g.select(in_range, *loaded, ir::isFloat(t) ? g.constant(0, t) : g.intConstant(0, t));
    }
    return Status::errorf("{} has no CUDA lowering", opLabel(op));
  }

  // Values defined in the group that something outside it reads (or nothing reads at all).
  std::vector<const Value*> liveOuts() const {
    std::vector<const Value*> outs;
    for (const Op* op : out_.ops)
      for (const Value* r : op->results()) {
        bool escapes = !r->hasUses();
        for (const ir::Use& u : r->uses())
          if (!in_group_.count(u.user)) escapes = true;
        if (escapes) outs.push_back(r);
      }
    return outs;
  }

  Status lowerPointwise() {
    std::vector<const Value*> outs = liveOuts();
    if (outs.empty()) return Status::ok();
    auto space = shapeOf(outs.front());
    if (!space) return space.status();
    for (const Value* v : outs) {
      auto s = shapeOf(v);
      if (!s || *s != *space)
        return Status::errorf("a fused group's outputs must share one shape: {} and {}", outs.front()->type().str(),
                              v->type().str());
    }
    KB kb;
    std::string stem;
    for (const Op* op : out_.ops) stem += (stem.empty() ? "" : "_") + shortOpName(*op);
    if (stem.size() > 40) stem = stem.substr(0, 40);
    kb.k.name = stem;
    kb.k.kind = KernelKind::Pointwise;
    kb.k.space = *space;
    std::vector<int> coords;
    for (size_t i = 0; i < space->size(); ++i) coords.push_back(kb.k.exprs.coord(static_cast<int>(i)));
    int flat = rowMajorOffset(kb.k.exprs, coords, *space);
    for (const Value* v : outs) {
      auto x = valueAt(kb, v, coords);
      if (!x) return x.status();
      int buf = bindValue(kb, v, true);
      kb.k.stores.push_back({buf, flat, kb.k.exprs.cast(*x, v->type().dtype()), -1});
    }
    return finish(kb);
  }

  // ---- Row kernels ----------------------------------------------------------------------------

  // Reductions and softmax read their operand through valueAt, so a producing chain in the same
  // group is computed inline.
  Status lowerReduce(const Op& op) {
    const Value* x = op.operand(0);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    if (!ir::isFloat(x->type().dtype())) return Status::errorf("{} on the CUDA backend needs a float operand", opLabel(op));
    std::set<int64_t> axes;
    for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(xs->size()) : a);
    KB kb;
    Kernel& k = kb.k;
    k.name = "reduce_" + op.strAttr("kind");
    k.kind = KernelKind::Row;
    for (size_t i = 0; i < xs->size(); ++i) (axes.count(static_cast<int64_t>(i)) ? k.row_space : k.space).push_back((*xs)[i]);
    if (k.space.empty()) k.space = {1};  // a full reduction: one outer element, coordinate 0 unused
    ExprGraph& g = k.exprs;
    std::vector<int> coords(xs->size());
    int outer_i = 0, row_i = static_cast<int>(k.space.size());
    for (size_t i = 0; i < xs->size(); ++i)
      coords[i] = axes.count(static_cast<int64_t>(i)) ? g.coord(row_i++) : g.coord(outer_i++);
    auto v = valueAt(kb, x, coords);
    if (!v) return v.status();
    std::string kind = op.strAttr("kind");
    Phase p;
    p.kind = Phase::Kind::Reduce;
    p.combiner = kind == "max" ? Combiner::Max : Combiner::Sum;
    p.value = *v;
    k.phases.push_back(p);
    DType ct = g.typeOf(*v);
    int acc = g.rowValue(0, ct);
    if (kind == "mean") acc = g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(k.rowSize()), ct));
    std::vector<int> oc;
    for (size_t i = 0; i < k.space.size(); ++i) oc.push_back(g.coord(static_cast<int>(i)));
    int out = bindValue(kb, op.result(), true);
    k.stores.push_back({out, rowMajorOffset(g, oc, k.space), g.cast(acc, op.result()->type().dtype()), -1});
    return finish(kb);
  }

  // Moves `axis` last: outer = the other dims, row = [axis]; coords of x in its own order.
  struct AxisRow {
    std::vector<int> coords;  // per dim of x
    std::vector<int> outer;   // outer coordinates
  };
  AxisRow axisRow(Kernel& k, const std::vector<int64_t>& xs, int64_t axis) {
    AxisRow r;
    for (size_t i = 0; i < xs.size(); ++i)
      if (static_cast<int64_t>(i) != axis) k.space.push_back(xs[i]);
    k.row_space = {xs[static_cast<size_t>(axis)]};
    if (k.space.empty()) k.space = {1};
    int oi = 0;
    int row_coord = k.exprs.coord(static_cast<int>(k.space.size()));
    for (size_t i = 0; i < xs.size(); ++i)
      r.coords.push_back(static_cast<int64_t>(i) == axis ? row_coord : k.exprs.coord(oi++));
    for (size_t i = 0; i < k.space.size(); ++i) r.outer.push_back(k.exprs.coord(static_cast<int>(i)));
    return r;
  }

  Status lowerSoftmax(const Op& op) {
    const Value* x = op.operand(0);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    int64_t axis = op.intAttr("axis", -1);
    if (axis < 0) axis += static_cast<int64_t>(xs->size());
    KB kb;
    Kernel& k = kb.k;
    k.name = "softmax";
    k.kind = KernelKind::Row;
    AxisRow ar = axisRow(k, *xs, axis);
    ExprGraph& g = k.exprs;
    auto v = valueAt(kb, x, ar.coords);
    if (!v) return v.status();
    DType ct = g.typeOf(*v);
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Max, *v, {}});
    int shifted = g.unary(ExprOp::Exp, g.binary(ExprOp::Sub, *v, g.rowValue(0, ct)));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, shifted, {}});
    Phase map;
    int out = bindValue(kb, op.result(), true);
    map.stores.push_back({out, rowMajorOffset(g, ar.coords, *xs),
                          g.cast(g.binary(ExprOp::Div, shifted, g.rowValue(1, ct)), op.result()->type().dtype()), -1});
    k.phases.push_back(map);
    return finish(kb);
  }

  Status lowerBce(const Op& op) {
    const Value* x = op.operand(0);
    const Value* y = op.operand(1);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    KB kb;
    Kernel& k = kb.k;
    k.name = "bce_with_logits";
    k.kind = KernelKind::Row;
    k.space = {1};
    k.row_space = *xs;
    if (k.row_space.empty()) k.row_space = {1};
    ExprGraph& g = k.exprs;
    std::vector<int> coords;
    for (size_t i = 0; i < xs->size(); ++i) coords.push_back(g.coord(static_cast<int>(i) + 1));
    auto xv = valueAt(kb, x, coords);
    if (!xv) return xv.status();
    auto yv = valueAt(kb, y, coords);
    if (!yv) return yv.status();
    DType ct = g.typeOf(*xv);
    int yy = g.cast(*yv, ct);
    // max(x, 0) - x*y + log1p(exp(-|x|)): no overflow for large |x|.
    int loss = g.binary(ExprOp::Add,
                        g.binary(ExprOp::Sub, g.unary(ExprOp::Relu, *xv), g.binary(ExprOp::Mul, *xv, yy)),
                        g.unary(ExprOp::Log1p, g.unary(ExprOp::Exp, g.unary(ExprOp::Neg, g.unary(ExprOp::Abs, *xv)))));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, loss, {}});
    int acc = g.rowValue(0, ct);
    if (op.strAttr("reduction", "mean") == "mean")
      acc = g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(product(*xs)), ct));
    int out = bindValue(kb, op.result(), true);
    k.stores.push_back({out, g.intConstant(0), g.cast(acc, op.result()->type().dtype()), -1});
    return finish(kb);
  }

  // Two kernels: per-row losses into a temporary, then their sum (or mean).
  Status lowerSoftmaxCrossEntropy(const Op& op) {
    const Value* x = op.operand(0);
    const Value* y = op.operand(1);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    int64_t n = (*xs)[0], c = (*xs)[1];
    int rows = tempBuffer("row_losses", DType::f32, n);
    {
      KB kb;
      Kernel& k = kb.k;
      k.name = "softmax_xent_rows";
      k.kind = KernelKind::Row;
      AxisRow ar = axisRow(k, *xs, 1);
      ExprGraph& g = k.exprs;
      auto xv = valueAt(kb, x, ar.coords);
      if (!xv) return xv.status();
      DType ct = g.typeOf(*xv);
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Max, *xv, {}});
      int m = g.rowValue(0, ct);
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.unary(ExprOp::Exp, g.binary(ExprOp::Sub, *xv, m)), {}});
      int lse = g.binary(ExprOp::Add, m, g.unary(ExprOp::Log, g.rowValue(1, ct)));
      int loss;
      if (y->type().rank() == 1) {
        // lse - x[n, label]; an out-of-range label contributes lse (x read as 0 is not used).
        auto label = valueAt(kb, y, {ar.outer[0]});
        if (!label) return label.status();
        int li = g.cast(*label, DType::i64);
        auto picked = valueAt(kb, x, {ar.outer[0], li});
        if (!picked) return picked.status();
        int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, li, g.intConstant(0)), g.binary(ExprOp::Lt, li, g.intConstant(c)));
        loss = g.binary(ExprOp::Sub, lse, g.select(ok, *picked, g.constant(0, ct)));
      } else {
        // sum_c y_c (lse - x_c) = lse * sum(y) - sum(y * x)
        auto yv = valueAt(kb, y, ar.coords);
        if (!yv) return yv.status();
        int yc = g.cast(*yv, ct);
        k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.binary(ExprOp::Mul, yc, *xv), {}});
        k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, yc, {}});
        loss = g.binary(ExprOp::Sub, g.binary(ExprOp::Mul, lse, g.rowValue(3, ct)), g.rowValue(2, ct));
      }
      k.stores.push_back({bind(kb, rows, true), ar.outer[0], g.cast(loss, DType::f32), -1});
      KILN_RETURN_IF_ERROR(finish(kb));
    }
    KB kb;
    Kernel& k = kb.k;
    k.name = "softmax_xent_total";
    k.kind = KernelKind::Row;
    k.space = {1};
    k.row_space = {n};
    ExprGraph& g = k.exprs;
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.load(bind(kb, rows, false), DType::f32, g.coord(1)), {}});
    int acc = g.rowValue(0, DType::f32);
    if (op.strAttr("reduction", "mean") == "mean")
      acc = g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(n), DType::f32));
    k.stores.push_back({bindValue(kb, op.result(), true), g.intConstant(0), g.cast(acc, op.result()->type().dtype()), -1});
    return finish(kb);
  }

  // sum_to: sums x over the dims along which the result type broadcasts to it.
  Status lowerSumTo(const Op& op) {
    const Value* x = op.operand(0);
    auto xs = shapeOf(x);
    auto os = shapeOf(op.result());
    if (!xs || !os) return !xs ? xs.status() : os.status();
    KB kb;
    Kernel& k = kb.k;
    k.name = "sum_to";
    k.kind = KernelKind::Row;
    k.space = os->empty() ? std::vector<int64_t>{1} : *os;
    size_t lead = xs->size() - os->size();
    std::vector<size_t> reduced;
    for (size_t i = 0; i < xs->size(); ++i)
      if (i < lead || ((*os)[i - lead] == 1 && (*xs)[i] != 1)) reduced.push_back(i);
    for (size_t i : reduced) k.row_space.push_back((*xs)[i]);
    if (k.row_space.empty()) k.row_space = {1};
    ExprGraph& g = k.exprs;
    std::vector<int> coords(xs->size());
    int ri = static_cast<int>(k.space.size());
    for (size_t i = 0; i < xs->size(); ++i) {
      bool red = std::find(reduced.begin(), reduced.end(), i) != reduced.end();
      coords[i] = red ? g.coord(ri++) : ((*xs)[i] == 1 ? g.intConstant(0) : g.coord(static_cast<int>(i - lead)));
    }
    auto v = valueAt(kb, x, coords);
    if (!v) return v.status();
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, *v, {}});
    std::vector<int> oc;
    for (size_t j = 0; j < k.space.size(); ++j) oc.push_back(g.coord(static_cast<int>(j)));
    k.stores.push_back({bindValue(kb, op.result(), true), rowMajorOffset(g, oc, k.space),
                        g.cast(g.rowValue(0, g.typeOf(*v)), op.result()->type().dtype()), -1});
    return finish(kb);
  }

  // max: the gradient goes to the maxima of each reduced slice, split evenly among ties.
  Status lowerReduceMaxGrad(const Op& op) {
    const Value* gval = op.operand(0);
    const Value* x = op.operand(1);
    const Value* y = op.operand(2);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    std::set<int64_t> axes;
    for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(xs->size()) : a);
    bool keep = op.boolAttr("keepdims");
    KB kb;
    Kernel& k = kb.k;
    k.name = "reduce_max_grad";
    k.kind = KernelKind::Row;
    for (size_t i = 0; i < xs->size(); ++i) (axes.count(static_cast<int64_t>(i)) ? k.row_space : k.space).push_back((*xs)[i]);
    if (k.space.empty()) k.space = {1};
    ExprGraph& g = k.exprs;
    std::vector<int> coords(xs->size()), kept;
    int oi = 0, ri = static_cast<int>(k.space.size());
    for (size_t i = 0; i < xs->size(); ++i) {
      bool red = axes.count(static_cast<int64_t>(i));
      coords[i] = red ? g.coord(ri++) : g.coord(oi++);
      if (!red) kept.push_back(coords[i]);
      else if (keep) kept.push_back(g.intConstant(0));
    }
    auto xv = valueAt(kb, x, coords);
    auto yv = valueAt(kb, y, kept);
    auto gv = valueAt(kb, gval, kept);
    if (!xv || !yv || !gv) return !xv ? xv.status() : !yv ? yv.status() : gv.status();
    DType ct = g.typeOf(*xv);
    int hit = g.binary(ExprOp::Eq, *xv, *yv);
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.select(hit, g.constant(1, ct), g.constant(0, ct)), {}});
    Phase map;
    map.stores.push_back({bindValue(kb, op.result(), true), rowMajorOffset(g, coords, *xs),
                          g.cast(g.select(hit, g.binary(ExprOp::Div, *gv, g.rowValue(0, ct)), g.constant(0, ct)),
                                 op.result()->type().dtype()), -1});
    k.phases.push_back(map);
    return finish(kb);
  }

  // g (softmax(x) * sum_c p - p) per row, / N for a mean; p is one-hot for class ids.
  Status lowerSoftmaxCrossEntropyGrad(const Op& op) {
    const Value* x = op.operand(0);
    const Value* y = op.operand(1);
    auto xs = shapeOf(x);
    if (!xs) return xs.status();
    KB kb;
    Kernel& k = kb.k;
    k.name = "softmax_xent_grad";
    k.kind = KernelKind::Row;
    AxisRow ar = axisRow(k, *xs, 1);
    ExprGraph& g = k.exprs;
    auto xv = valueAt(kb, x, ar.coords);
    if (!xv) return xv.status();
    DType ct = g.typeOf(*xv);
    auto gv = valueAt(kb, op.operand(2), {});
    if (!gv) return gv.status();
    int scale = g.cast(*gv, ct);
    if (op.strAttr("reduction", "mean") == "mean")
      scale = g.binary(ExprOp::Mul, scale, g.constant(1.0 / static_cast<double>((*xs)[0]), ct));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Max, *xv, {}});
    int e = g.unary(ExprOp::Exp, g.binary(ExprOp::Sub, *xv, g.rowValue(0, ct)));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, e, {}});
    int p = g.binary(ExprOp::Div, e, g.rowValue(1, ct));
    int target, mass;
    if (y->type().rank() == 1) {
      auto label = valueAt(kb, y, {ar.outer[0]});
      if (!label) return label.status();
      target = g.select(g.binary(ExprOp::Eq, g.cast(*label, DType::i64), ar.coords[1]), g.constant(1, ct), g.constant(0, ct));
      mass = g.constant(1, ct);
    } else {
      auto yv = valueAt(kb, y, ar.coords);
      if (!yv) return yv.status();
      target = g.cast(*yv, ct);
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, target, {}});
      mass = g.rowValue(2, ct);
    }
    Phase map;
    map.stores.push_back({bindValue(kb, op.result(), true), rowMajorOffset(g, ar.coords, *xs),
                          g.cast(g.binary(ExprOp::Mul, scale, g.binary(ExprOp::Sub, g.binary(ExprOp::Mul, p, mass), target)),
                                 op.result()->type().dtype()), -1});
    k.phases.push_back(map);
    return finish(kb);
  }

  // dw[p] = <table[ids[p]], g[b]> for id position p of bag b (/ the bag's size for a mean): one
  // row reduction per id position. Fixed hotness: p = (b, h). Jagged: p runs over the ids
  // buffer, b = the bag owning p (a BagOf search over the scanned offsets); positions past the
  // batch's last id (a bounded buffer's padding) get 0. An out-of-range id contributes 0 and
  // sets the group's error flag, as the CPU reference rejects it.
  Status lowerEmbeddingWeightGrad(const Op& op) {
    const Value* table = op.operand(0);
    const Value* ids = op.operand(1);
    const bool jagged = ids->type().rank() == 1;
    auto bag = bagIds(op, ids, jagged ? op.operand(2) : nullptr);
    if (!bag) return bag.status();
    if (jagged && bag->batch < 1) return Status::errorf("{}: jagged ids need at least one bag", opLabel(op));
    const Value* gval = op.operand(op.numOperands() - 1);
    auto ts = shapeOf(table);
    auto is = shapeOf(ids);
    if (!ts || !is) return !ts ? ts.status() : is.status();
    const int64_t rows = (*ts)[0], dim = (*ts)[1];
    if (jagged) KILN_RETURN_IF_ERROR(scanLengths({*bag}));
    KB kb;
    Kernel& k = kb.k;
    k.name = jagged ? "embedding_weight_grad_jagged" : "embedding_weight_grad";
    k.kind = KernelKind::Row;
    k.space = *is;
    k.row_space = {dim};
    ExprGraph& g = k.exprs;
    const int d = g.coord(static_cast<int>(is->size()));
    int b, live = -1, size = -1;  // size: a jagged bag's id count
    Expected<int> id = 0;
    if (jagged) {
      const int p = g.coord(0);
      const int offsets = bind(kb, offsets_of_.at(bag->lengths), false);
      auto offset = [&](int i) { return g.load(offsets, DType::i64, i); };
      live = g.binary(ExprOp::Lt, p, offset(g.intConstant(bag->batch)));
      b = g.bagOf(offsets, bag->batch, p);
      size = g.binary(ExprOp::Sub, offset(g.binary(ExprOp::Add, b, g.intConstant(1))), offset(b));
      id = valueAt(kb, ids, {p});
    } else {
      b = g.coord(0);
      id = valueAt(kb, ids, {b, g.coord(1)});
    }
    if (!id) return id.status();
    const int id64 = g.cast(*id, DType::i64);
    int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, id64, g.intConstant(0)), g.binary(ExprOp::Lt, id64, g.intConstant(rows)));
    int bad = g.unary(ExprOp::Not, ok);
    if (live >= 0) {
      ok = g.binary(ExprOp::And, live, ok);
      bad = g.binary(ExprOp::And, live, bad);  // padding is never checked
    }
    auto w = valueAt(kb, table, {id64, d});
    auto gv = valueAt(kb, gval, {b, d});
    if (!w || !gv) return !w ? w.status() : gv.status();
    const DType ct = g.typeOf(*w);
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum,
                        g.select(ok, g.binary(ExprOp::Mul, *w, g.cast(*gv, ct)), g.constant(0, ct)), {}});
    int acc = g.rowValue(0, ct);
    if (op.strAttr("mode", "sum") == "mean") {
      // A live position's bag holds at least that id, so size > 0.
      acc = jagged ? g.binary(ExprOp::Div, acc, g.cast(size, ct))
                   : g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(bag->hotness), ct));
    }
    if (live >= 0) acc = g.select(live, acc, g.constant(0, ct));
    const DType rt = op.result()->type().dtype();
    std::vector<int> at;
    for (size_t i = 0; i < is->size(); ++i) at.push_back(g.coord(static_cast<int>(i)));
    k.stores.push_back({bindValue(kb, op.result(), true), rowMajorOffset(g, at, *is), g.cast(acc, rt), -1});
    // {1, table} for a bad id, unless an earlier error holds the flag.
    k.error_flag = bind(kb, errorFlag(), true);
    const int table_index = errorSubject(valueName(table), rows);
    const int clear = g.binary(ExprOp::Eq, g.load(k.error_flag, DType::i32, g.intConstant(0)), g.intConstant(0, DType::i32));
    const int report = g.binary(ExprOp::And, bad, clear);
    k.stores.push_back({k.error_flag, g.intConstant(1), g.intConstant(table_index, DType::i32), report});
    k.stores.push_back({k.error_flag, g.intConstant(0), g.intConstant(1, DType::i32), report});
    return finish(kb);
  }

  // ---- Optimizers -----------------------------------------------------------------------------

  struct Hyper {
    int lr = -1, step = -1, scale = -1;  // nodes
    double eps, beta1, beta2, weight_decay, momentum;
    bool nesterov;
  };

  Hyper hyper(KB& kb, const Op& op, int lr_operand, int step_operand, int scale_operand, DType ct) {
    ExprGraph& g = kb.k.exprs;
    Hyper h;
    auto scalar = [&](int i) {
      const Value* v = op.operand(static_cast<unsigned>(i));
      return g.cast(g.load(bindValue(kb, v, false), v->type().dtype(), g.intConstant(0)), ct);
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

  // The per-element update of adagrad/adam/sgd: stores new values of w and its state. `st(i)`
  // loads state i at the element, `store_st(i, v)` stores it; returns the new w.
  template <typename LoadSt, typename StoreSt>
  static int elementUpdate(ExprGraph& g, const std::string& kind, const Hyper& h, int w, int grad, DType ct,
                           LoadSt st, StoreSt store_st) {
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

  Status lowerOptimizerUpdate(const Op& op) {
    std::string kind = op.strAttr("kind");
    size_t nstate = ir::denseOptimizerState(kind, op.attrs()).size();
    const Value* p = op.operand(0);
    auto ps = shapeOf(p);
    if (!ps) return ps.status();
    KB kb;
    Kernel& k = kb.k;
    k.name = "optimizer_" + kind;
    k.kind = KernelKind::Pointwise;
    k.space = {product(*ps)};
    ExprGraph& g = k.exprs;
    DType ct = computeType(p->type().dtype());
    int s = 2 + static_cast<int>(nstate);
    Hyper h = hyper(kb, op, s, s + 1, op.boolAttr("scaled") ? s + 2 : -1, ct);
    int i = g.coord(0);
    int pw = bindValue(kb, p, true);
    int w = g.load(pw, p->type().dtype(), i);
    int grad = g.cast(g.load(bindValue(kb, op.operand(1), false), op.operand(1)->type().dtype(), i), ct);
    auto st = [&](int j) {
      const Value* sv = op.operand(static_cast<unsigned>(2 + j));
      return g.load(bindValue(kb, sv, true), sv->type().dtype(), i);
    };
    auto store_st = [&](int j, int v) {
      const Value* sv = op.operand(static_cast<unsigned>(2 + j));
      k.stores.push_back({bindValue(kb, sv, true), i, g.cast(v, sv->type().dtype()), -1});
    };
    int nw = elementUpdate(g, kind, h, w, grad, ct, st, store_st);
    k.stores.push_back({pw, i, g.cast(nw, p->type().dtype()), -1});
    return finish(kb);
  }

  // ---- Embeddings -----------------------------------------------------------------------------

  // The ids of one bag op: [B, H] (fixed hotness) or [N] with lengths [B] (jagged).
  struct BagIds {
    const Value* ids = nullptr;
    const Value* lengths = nullptr;
    int64_t batch = 0, hotness = 0, num_ids = 0;
  };
  Expected<BagIds> bagIds(const Op& op, const Value* ids, const Value* lengths) {
    BagIds b;
    b.ids = ids;
    auto is = shapeOf(ids);
    if (!is) return is.status();
    if (ids->type().rank() == 2) {
      b.batch = (*is)[0];
      b.hotness = (*is)[1];
      return b;
    }
    if (ids->type().rank() != 1 || !lengths)
      return Status::errorf("{}: ids must be [batch, hotness], or [N] with lengths [batch]", opLabel(op));
    auto ls = shapeOf(lengths);
    if (!ls) return ls.status();
    b.lengths = lengths;
    b.batch = (*ls)[0];
    b.num_ids = (*is)[0];
    return b;
  }
  // Positions of an embedding_bag's operands: (table, ids[, weights]) or (table, ids, lengths[, weights]).
  Expected<BagIds> bagIdsOf(const Op& bag) {
    const bool flat = bag.operand(1)->type().rank() == 1;
    return bagIds(bag, bag.operand(1), flat && bag.numOperands() > 2 ? bag.operand(2) : nullptr);
  }
  const Value* bagWeights(const Op& bag) {
    const unsigned at = bag.operand(1)->type().rank() == 1 ? 3 : 2;
    return bag.numOperands() > at ? bag.operand(at) : nullptr;
  }

  // Offsets of jagged bags, computed on the device: ONE BagOffsets kernel scans the lengths of
  // every jagged bag not scanned yet in this group (bags sharing lengths share offsets). Runs
  // before the kernels that read them, which bind `offsets_of_[lengths]`.
  Status scanLengths(const std::vector<BagIds>& bags) {
    KB kb;
    Kernel& k = kb.k;
    k.name = "bag_offsets";
    k.kind = KernelKind::BagOffsets;
    for (const BagIds& b : bags) {
      if (!b.lengths || offsets_of_.count(b.lengths)) continue;
      if (!k.tables.empty() && b.batch != k.batch)
        return Status::errorf("jagged bags of one group must share the batch ({} vs {})", b.batch, k.batch);
      k.batch = b.batch;
      int offsets = tempBuffer(valueName(b.lengths) + ".offsets", DType::i64, b.batch + 1);
      offsets_of_[b.lengths] = offsets;
      EmbeddingTable t;
      t.lengths = bindValue(kb, b.lengths, false);
      t.offsets = bind(kb, offsets, true);
      t.num_ids = b.num_ids;
      t.flag_index = errorSubject(valueName(b.lengths), b.num_ids);
      k.tables.push_back(t);
    }
    if (k.tables.empty()) return Status::ok();
    k.error_flag = bind(kb, errorFlag(), true);
    return finish(kb);
  }

  // Sets a table's ids (and, for jagged bags, offsets and count) in kernel `kb`.
  void bindIds(KB& kb, EmbeddingTable& t, const BagIds& b) {
    t.ids = bindValue(kb, b.ids, false);
    t.hotness = b.hotness;
    if (b.lengths) {
      t.offsets = bind(kb, offsets_of_.at(b.lengths), false);
      t.num_ids = b.num_ids;
    }
  }

  Status lowerEmbeddingForward(const std::vector<const Op*>& ops) {
    std::vector<BagIds> bags;
    for (const Op* op : ops) {
      auto b = bagIdsOf(*op);
      if (!b) return b.status();
      if (!bags.empty() && b->batch != bags.front().batch)
        return Status::errorf("{}: the bags of one kernel must share the batch", opLabel(*op));
      bags.push_back(*b);
    }
    KILN_RETURN_IF_ERROR(scanLengths(bags));
    KB kb;
    Kernel& k = kb.k;
    k.name = "embedding_bags";
    k.kind = KernelKind::EmbeddingForward;
    k.batch = bags.empty() ? 0 : bags.front().batch;
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op* op = ops[i];
      const Value* table = op->operand(0);
      auto ts = shapeOf(table);
      if (!ts) return ts.status();
      EmbeddingTable t;
      t.weight = bindValue(kb, table, false);
      bindIds(kb, t, bags[i]);
      if (const Value* w = bagWeights(*op)) t.weights = bindValue(kb, w, false);
      t.rows = (*ts)[0];
      t.dim = (*ts)[1];
      t.mean = op->strAttr("mode", "sum") == "mean";
      t.out = bindValue(kb, op->result(), true);
      t.out_stride = t.dim;
      t.out_offset = 0;
      t.flag_index = errorSubject(valueName(table), t.rows);
      k.tables.push_back(t);
    }
    k.error_flag = bind(kb, errorFlag(), true);
    return finish(kb);
  }

  int errorFlag() {
    if (error_flag_ < 0) error_flag_ = tempBuffer("embedding_errors", DType::i32, 2);
    return error_flag_;
  }
  // Numbers what the kernel being built (the next one finished) checks: its index in
  // error_subjects is what the kernel writes as the flag's `table`, the same in every kernel of
  // the group.
  int errorSubject(std::string name, int64_t bound) {
    out_.error_subjects.push_back({std::move(name), bound, static_cast<int>(out_.kernels.size())});
    return static_cast<int>(out_.error_subjects.size() - 1);
  }

  // Clear, insert, accumulate: duplicate ids of the batch combined into a hash table of summed
  // gradients, one table per update. The clear resets only the keys and the distinct count; the
  // insert zeroes the rows it claims, so the gradient rows (capacity x dim floats, gigabytes at
  // R1's scale) are never swept. ONE insert and ONE accumulate kernel serve every table of a
  // group, as ONE lookup kernel serves every bag.
  // Where an update reads its pooled-output gradient: columns [offset, offset + dim) of rows of
  // `stride` elements of `value` (the concatenated gradient, when a fused group drops the slice).
  struct GradSource {
    const Value* value;
    int64_t stride, offset;
  };
  struct Accumulated {
    int keys = -1, accum = -1, distinct = -1;
    int64_t capacity = 0, dim = 0;
    int64_t bound = 0;  // distinct ids at most: min(occurrences, rows)
    // What the insert and accumulate kernels read.
    const Op* op = nullptr;
    ir::EmbeddingUpdateLayout layout;
    BagIds bag;
    int64_t rows = 0;  // -1: unchecked (a squared-norm probe has no table)
    std::optional<GradSource> source;
  };

  // One table's buffers and its clear kernel. The jagged lengths are scanned by accumulateAll.
  Expected<Accumulated> prepareAccumulate(const Op& op, const ir::EmbeddingUpdateLayout& l, int64_t rows,
                                          const GradSource* source) {
    const Value* ids = op.operand(static_cast<unsigned>(l.ids));
    const Value* grad = op.operand(static_cast<unsigned>(l.grad_out));
    auto bag = bagIds(op, ids, l.lengths >= 0 ? op.operand(static_cast<unsigned>(l.lengths)) : nullptr);
    if (!bag) return bag.status();
    auto is = shapeOf(ids);
    auto gs = shapeOf(grad);
    if (!is || !gs) return !is ? is.status() : gs.status();
    Accumulated a;
    a.op = &op;
    a.layout = l;
    a.bag = *bag;
    a.rows = rows;
    if (source) a.source = *source;
    a.dim = (*gs)[1];
    int64_t n = product(*is);
    a.bound = std::min(n, rows > 0 ? rows : n);
    a.capacity = std::max<int64_t>(32, nextPow2(2 * a.bound));
    std::string stem = op.hasAttr("table") ? op.strAttr("table") : valueName(grad);
    a.keys = tempBuffer(stem + ".unique_ids", DType::i64, a.capacity);
    a.accum = tempBuffer(stem + ".row_grads", DType::f32, a.capacity * a.dim);
    a.distinct = tempBuffer(stem + ".distinct_slots", DType::i64, 1 + a.capacity);
    KB kb;
    Kernel& k = kb.k;
    k.name = "embedding_grad_clear";
    k.kind = KernelKind::Pointwise;
    k.space = {a.capacity};
    ExprGraph& g = k.exprs;
    int slot = g.coord(0);
    k.stores.push_back({bind(kb, a.keys, true), slot, g.intConstant(-1), -1});
    k.stores.push_back({bind(kb, a.distinct, true), g.intConstant(0), g.intConstant(0),
                        g.binary(ExprOp::Eq, slot, g.intConstant(0))});
    KILN_RETURN_IF_ERROR(finish(kb));
    return a;
  }

  // The jagged scan, then ONE insert and ONE accumulate kernel over every table of `tables`.
  Status accumulateAll(const std::vector<Accumulated>& tables) {
    std::vector<BagIds> bags;
    for (const Accumulated& a : tables) {
      if (a.bag.batch != tables.front().bag.batch)
        return Status::errorf("{}: the updates of one kernel must share the batch", opLabel(*a.op));
      bags.push_back(a.bag);
    }
    KILN_RETURN_IF_ERROR(scanLengths(bags));
    // The insert checks the ids; the accumulate after it reports an id it cannot find there.
    std::vector<int> flag_index;
    for (const Accumulated& a : tables) {
      const ir::EmbeddingUpdateLayout& l = a.layout;
      flag_index.push_back(
          errorSubject(valueName(a.op->operand(static_cast<unsigned>(l.table >= 0 ? l.table : l.ids))), a.rows));
    }
    for (KernelKind kind : {KernelKind::EmbeddingInsert, KernelKind::EmbeddingAccumulate}) {
      const bool insert = kind == KernelKind::EmbeddingInsert;
      KB kb;
      Kernel& k = kb.k;
      k.name = insert ? "embedding_grad_insert" : "embedding_grad_combine";
      k.kind = kind;
      k.batch = tables.front().bag.batch;
      for (size_t i = 0; i < tables.size(); ++i) {
        const Accumulated& a = tables[i];
        const Op& op = *a.op;
        EmbeddingTable t;
        bindIds(kb, t, a.bag);
        t.rows = a.rows;
        t.dim = a.dim;
        t.keys = bind(kb, a.keys, true);
        t.accum = bind(kb, a.accum, true);
        t.capacity = a.capacity;
        t.flag_index = flag_index[i];
        if (insert) {
          t.distinct = bind(kb, a.distinct, true);
        } else {
          if (a.layout.weights >= 0) t.weights = bindValue(kb, op.operand(static_cast<unsigned>(a.layout.weights)), false);
          t.mean = op.strAttr("mode", "sum") == "mean";
          const Value* grad = op.operand(static_cast<unsigned>(a.layout.grad_out));
          t.out = bindValue(kb, a.source ? a.source->value : grad, false);
          t.out_stride = a.source ? a.source->stride : a.dim;
          t.out_offset = a.source ? a.source->offset : 0;
        }
        k.tables.push_back(t);
      }
      k.error_flag = bind(kb, errorFlag(), true);
      KILN_RETURN_IF_ERROR(finish(kb));
    }
    return Status::ok();
  }

  // The slot of the o-th distinct id of an accumulated table, and whether there is one:
  // (o < distinct[0], distinct[1 + o]).
  std::pair<int, int> distinctSlot(KB& kb, const Accumulated& a, int o) {
    ExprGraph& g = kb.k.exprs;
    int list = bind(kb, a.distinct, false);
    int present = g.binary(ExprOp::Lt, o, g.load(list, DType::i64, g.intConstant(0)));
    int slot = g.load(list, DType::i64, g.binary(ExprOp::Add, o, g.intConstant(1)));
    return {present, slot};
  }

  // An embedding_bag_update's table: its buffers and clear kernel (accumulateAll follows).
  Expected<Accumulated> prepareUpdate(const Op& op, const GradSource* source = nullptr) {
    auto l = ir::embeddingUpdateLayout(op);
    if (!l) return Status::errorf("{} has an unknown optimizer", opLabel(op));
    auto ts = shapeOf(op.operand(static_cast<unsigned>(l->table)));
    if (!ts) return ts.status();
    return prepareAccumulate(op, *l, (*ts)[0], source);
  }

  Status lowerEmbeddingUpdate(const Op& op) {
    auto a = prepareUpdate(op);
    if (!a) return a.status();
    KILN_RETURN_IF_ERROR(accumulateAll({*a}));
    return updateRows(*a);
  }

  // The sparse optimizer applied to the rows of an accumulated table's distinct ids.
  Status updateRows(const Accumulated& a) {
    const Op& op = *a.op;
    const ir::EmbeddingUpdateLayout& l = a.layout;
    const Value* table = op.operand(static_cast<unsigned>(l.table));
    std::string kind = op.strAttr("optimizer");
    // One row per distinct id, walking the insert's list (not the whole hash table).
    KB kb;
    Kernel& k = kb.k;
    k.name = "embedding_update_" + kind;
    k.kind = KernelKind::Row;
    k.space = {a.bound};
    k.row_space = {a.dim};
    ExprGraph& g = k.exprs;
    DType ct = computeType(table->type().dtype());
    Hyper h = hyper(kb, op, l.lr, l.step, l.grad_scale, ct);
    int d = g.coord(1);
    auto [present, slot] = distinctSlot(kb, a, g.coord(0));
    k.guard = present;
    int key = g.load(bind(kb, a.keys, false), DType::i64, slot);
    int elem = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, key, g.intConstant(a.dim)), d);
    int tw = bindValue(kb, table, true);
    int w = g.load(tw, table->type().dtype(), elem);
    int grad = g.cast(g.load(bind(kb, a.accum, false), DType::f32, rowMajorOffset(g, {slot, d}, {a.capacity, a.dim})), ct);
    auto state = [&](int j) { return op.operand(static_cast<unsigned>(l.state_begin + j)); };
    Phase map;
    if (kind == "rowwise_adagrad") {
      auto c = [&](double v) { return g.constant(v, ct); };
      int gr = h.scale >= 0 ? g.binary(ExprOp::Mul, grad, h.scale) : grad;
      if (h.weight_decay != 0) gr = g.binary(ExprOp::Add, gr, g.binary(ExprOp::Mul, c(h.weight_decay), w));
      k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.binary(ExprOp::Mul, gr, gr), {}});
      int sb = bindValue(kb, state(0), true);
      int s = g.binary(ExprOp::Add, g.load(sb, state(0)->type().dtype(), key),
                       g.binary(ExprOp::Mul, g.rowValue(0, ct), c(1.0 / static_cast<double>(a.dim))));
      int step = g.binary(ExprOp::Div, h.lr, g.binary(ExprOp::Add, g.unary(ExprOp::Sqrt, s), c(h.eps)));
      map.stores.push_back({tw, elem, g.cast(g.binary(ExprOp::Sub, w, g.binary(ExprOp::Mul, step, gr)), table->type().dtype()), -1});
      k.phases.push_back(map);
      // After every thread has read the old accumulator (phases end with a barrier).
      k.stores.push_back({sb, key, g.cast(s, state(0)->type().dtype()), -1});
    } else {
      auto st = [&](int j) { return g.load(bindValue(kb, state(j), true), state(j)->type().dtype(), elem); };
      auto store_st = [&](int j, int v) {
        map.stores.push_back({bindValue(kb, state(j), true), elem, g.cast(v, state(j)->type().dtype()), -1});
      };
      int nw = elementUpdate(g, kind, h, w, grad, ct, st, store_st);
      map.stores.push_back({tw, elem, g.cast(nw, table->type().dtype()), -1});
      k.phases.push_back(map);
    }
    return finish(kb);
  }

  Status lowerGradSqnorm(const Op& op) {
    auto l = ir::embeddingUpdateLayout(op);
    auto a = prepareAccumulate(op, *l, -1, nullptr);
    if (!a) return a.status();
    KILN_RETURN_IF_ERROR(accumulateAll({*a}));
    KB kb;
    Kernel& k = kb.k;
    k.name = "embedding_grad_sqnorm";
    k.kind = KernelKind::Row;
    k.space = {1};
    k.row_space = {a->bound, a->dim};
    ExprGraph& g = k.exprs;
    // The rows of the distinct ids; the rest of the table is never written.
    auto [present, slot] = distinctSlot(kb, *a, g.coord(1));
    int v = g.load(bind(kb, a->accum, false), DType::f32, rowMajorOffset(g, {slot, g.coord(2)}, {a->capacity, a->dim}));
    int sq = g.select(present, g.binary(ExprOp::Mul, v, v), g.constant(0, DType::f32));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, sq, {}});
    k.stores.push_back({bindValue(kb, op.result(), true), g.intConstant(0),
                        g.cast(g.rowValue(0, DType::f32), op.result()->type().dtype()), -1});
    return finish(kb);
  }

  // ---- Scatter-add ----------------------------------------------------------------------------

  // result = base, then result[..., indices[j], ...] += updates[..., j, ...] with atomic adds.
  // Atomics rather than a deterministic owner-computes kernel (each output element searching the
  // indices for its updates): that costs O(outputs x indices), atomics O(updates). The order of
  // additions only matters where indices repeat; DLRM's interaction pairs are distinct, so its
  // backward is exact. Out-of-range indices add nothing (the CPU reference reports them).
  Status lowerScatterAdd(const Op& op) {
    const Value* base = op.operand(0);
    const Value* idx = op.operand(1);
    const Value* upd = op.operand(2);
    auto bs = shapeOf(base);
    auto is = shapeOf(idx);
    auto us = shapeOf(upd);
    if (!bs || !is || !us) return !bs ? bs.status() : !is ? is.status() : us.status();
    DType t = op.result()->type().dtype();
    if (t == DType::i1) return Status::errorf("{} on the CUDA backend needs numeric values, not i1", opLabel(op));
    int64_t axis = op.intAttr("axis");
    if (axis < 0) axis += static_cast<int64_t>(bs->size());
    int out = groupBuffer(op.result(), true);
    {
      KB kb;
      Kernel& k = kb.k;
      k.name = "scatter_add_init";
      k.kind = KernelKind::Pointwise;
      k.space = *bs;
      ExprGraph& g = k.exprs;
      std::vector<int> coords;
      for (size_t i = 0; i < bs->size(); ++i) coords.push_back(g.coord(static_cast<int>(i)));
      auto x = valueAt(kb, base, coords);  // a splat zero base is a constant: the output is zeroed
      if (!x) return x.status();
      k.stores.push_back({bind(kb, out, true), rowMajorOffset(g, coords, *bs), g.cast(*x, t), -1});
      KILN_RETURN_IF_ERROR(finish(kb));
    }
    KB kb;
    Kernel& k = kb.k;
    k.name = "scatter_add";
    k.kind = KernelKind::Pointwise;
    k.space = *us;
    ExprGraph& g = k.exprs;
    std::vector<int> coords;
    for (size_t i = 0; i < us->size(); ++i) coords.push_back(g.coord(static_cast<int>(i)));
    const size_t a = static_cast<size_t>(axis), ri = is->size();
    auto iv = valueAt(kb, idx, std::vector<int>(coords.begin() + static_cast<int64_t>(a),
                                                coords.begin() + static_cast<int64_t>(a + ri)));
    if (!iv) return iv.status();
    int id = g.cast(*iv, DType::i64);
    int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, id, g.intConstant(0)),
                      g.binary(ExprOp::Lt, id, g.intConstant((*bs)[a])));
    std::vector<int> oc(coords.begin(), coords.begin() + static_cast<int64_t>(a));
    oc.push_back(id);
    oc.insert(oc.end(), coords.begin() + static_cast<int64_t>(a + ri), coords.end());
    auto v = valueAt(kb, upd, coords);
    if (!v) return v.status();
    Store st{bind(kb, out, true), rowMajorOffset(g, oc, *bs), g.cast(*v, t), ok};
    st.accumulate = true;
    k.stores.push_back(st);
    return finish(kb);
  }

  // ---- GEMMs ----------------------------------------------------------------------------------

  // A matmul, optionally with its epilogue (bias add, then relu or gelu, then an output cast),
  // as ONE cuBLASLt call. Only what cuBLASLt computes as the ops do is accepted, with one
  // allowance (XLA's "excess precision"): a bf16 or f16 product that the group at once widens
  // back to f32 (mixed precision's `cast(matmul(bf16, bf16), f32)`) is taken from cuBLASLt's f32
  // accumulator without the rounding in between, so bias and activation run in cuBLASLt's f32
  // epilogue and only the result is stored. The CPU rounds there; the results differ by at most
  // that rounding.
  Status lowerGemm(const std::vector<const Op*>& ops) {
    const Op& mm = *ops.front();
    if (mm.name() != "kiln.matmul") return Status::errorf("a GEMM group starts with {}, not kiln.matmul", opLabel(mm));
    GemmCall call;
    const Value* cur = mm.result();
    const Value* bias = nullptr;
    // The group's ops after the matmul, less a widening cast right after a low-precision
    // product (taken as the accumulator's own f32).
    size_t first = 1;
    DType tm = mm.result()->type().dtype();
    if (ops.size() > 1 && ir::isWideningCast(mm, *ops[1])) {
      for (const ir::Use& u : cur->uses())
        if (u.user != ops[1])
          return Status::errorf("{} has another user; cuBLASLt writes only the epilogue's final result", opLabel(mm));
      cur = ops[1]->result();
      tm = DType::f32;
      first = 2;
    }
    for (size_t i = first; i < ops.size(); ++i) {
      const Op& e = *ops[i];
      bool consumes = e.numOperands() > 0 && (e.operand(0) == cur || (e.numOperands() > 1 && e.operand(1) == cur));
      if (!consumes) return Status::errorf("{} does not consume the GEMM's result", opLabel(e));
      for (const ir::Use& u : cur->uses())
        if (u.user != &e)
          return Status::errorf("{} has another user; cuBLASLt writes only the epilogue's final result", opLabel(*ops[i - 1]));
      if (i > first && ops[i - 1]->name() == "kiln.cast") return Status::errorf("{} follows the output cast", opLabel(e));
      if (e.name() == "kiln.add" && i == first && e.numOperands() == 2) {
        bias = e.operand(0) == cur ? e.operand(1) : e.operand(0);
        if (bias->type().rank() != 1) return Status::errorf("{} adds {}, not a bias vector", opLabel(e), bias->type().str());
      } else if ((e.name() == "kiln.relu" || e.name() == "kiln.gelu") && call.activation.empty()) {
        call.activation = shortOpName(e);
      } else if (e.name() == "kiln.cast") {
      } else {
        return Status::errorf("{} has no cuBLASLt epilogue (a bias add, then relu or gelu, then a cast)", opLabel(e));
      }
      cur = e.result();
    }
    DType ta = mm.operand(0)->type().dtype(), tb = mm.operand(1)->type().dtype();
    DType tc = cur->type().dtype();
    if (ta != tb || (ta != DType::f32 && ta != DType::bf16 && ta != DType::f16))
      return Status::errorf("{}: cuBLASLt multiplies f32, bf16 or f16 pairs, not {} x {}", opLabel(mm),
                            ir::dtypeName(ta), ir::dtypeName(tb));
    if (ops.size() > 1) {
      if (ta == DType::f32 && tc != DType::f32)
        return Status::errorf("{}: cuBLASLt has no f32 x f32 -> {} GEMM", opLabel(mm), ir::dtypeName(tc));
      if (tc != DType::f32 && tc != ta)
        return Status::errorf("{}: cuBLASLt has no {} x {} -> {} GEMM", opLabel(mm), ir::dtypeName(ta),
                              ir::dtypeName(ta), ir::dtypeName(tc));
      if (tm != DType::f32 && tc == DType::f32)  // widened after a bias or activation: not exact
        return Status::errorf("{}: the epilogue widens a {} product; cuBLASLt would skip its rounding", opLabel(mm),
                              ir::dtypeName(tm));
      if (bias && bias->type().dtype() != tc)
        return Status::errorf("{}: a {} bias on a {} output; cuBLASLt's bias has the output's type", opLabel(mm),
                              ir::dtypeName(bias->type().dtype()), ir::dtypeName(tc));
    }
    call.a = groupBuffer(mm.operand(0), false);
    call.b = groupBuffer(mm.operand(1), false);
    if (bias) call.bias = groupBuffer(bias, false);
    call.c = groupBuffer(cur, true);
    out_.gemm = &mm;
    out_.gemm_call = call;
    return Status::ok();
  }

  // ---- Fused embedding groups -------------------------------------------------------------------

  // Bags of a collection and their concat: ONE lookup kernel writing each bag's pooled rows at
  // its columns of the concatenated output; other concat operands (the dense features) are
  // copied into their columns by a Pointwise kernel each.
  Status lowerEmbeddingConcat(const std::vector<const Op*>& ops) {
    const Op& cat = *ops.back();
    if (cat.name() != "kiln.concat") return Status::errorf("an embedding group ends in {}, not kiln.concat", opLabel(cat));
    auto cs = shapeOf(cat.result());
    if (!cs) return cs.status();
    int64_t axis = cat.intAttr("axis");
    if (axis < 0) axis += static_cast<int64_t>(cs->size());
    if (cs->size() != 2 || axis != 1)
      return Status::errorf("{}: the lookup kernel writes a [batch, width] concatenation along axis 1", opLabel(cat));
    for (size_t i = 0; i + 1 < ops.size(); ++i)
      if (ops[i]->name() != "kiln.embedding_bag")
        return Status::errorf("{} in an embedding group is not an embedding_bag", opLabel(*ops[i]));
    const int64_t width = (*cs)[1];
    std::vector<BagIds> bags;
    for (size_t i = 0; i + 1 < ops.size(); ++i) {
      auto b = bagIdsOf(*ops[i]);
      if (!b) return b.status();
      if (b->batch != (*cs)[0]) return Status::errorf("{}: the bags of one kernel must share the batch", opLabel(*ops[i]));
      bags.push_back(*b);
    }
    KILN_RETURN_IF_ERROR(scanLengths(bags));
    int out = groupBuffer(cat.result(), true);
    KB kb;
    Kernel& k = kb.k;
    k.name = "embedding_bags_concat";
    k.kind = KernelKind::EmbeddingForward;
    k.batch = (*cs)[0];
    std::vector<std::pair<const Value*, int64_t>> copies;
    int64_t at = 0;
    for (const Value* x : cat.operands()) {
      auto xs = shapeOf(x);
      if (!xs) return xs.status();
      const Op* bag = x->definingOp();
      if (bag && in_group_.count(bag)) {
        const Value* table = bag->operand(0);
        auto ts = shapeOf(table);
        auto ids = bagIdsOf(*bag);
        if (!ts || !ids) return !ts ? ts.status() : ids.status();
        EmbeddingTable t;
        t.weight = bindValue(kb, table, false);
        bindIds(kb, t, *ids);
        if (const Value* w = bagWeights(*bag)) t.weights = bindValue(kb, w, false);
        t.rows = (*ts)[0];
        t.dim = (*ts)[1];
        t.mean = bag->strAttr("mode", "sum") == "mean";
        t.out = bind(kb, out, true);
        t.out_stride = width;
        t.out_offset = at;
        t.flag_index = errorSubject(valueName(table), t.rows);
        k.tables.push_back(t);
      } else {
        copies.push_back({x, at});
      }
      at += (*xs)[1];
    }
    if (k.tables.empty()) return Status::errorf("{}: the embedding group has no bag", opLabel(cat));
    k.error_flag = bind(kb, errorFlag(), true);
    KILN_RETURN_IF_ERROR(finish(kb));
    for (const auto& [x, offset] : copies) {
      auto xs = shapeOf(x);
      KB cb;
      Kernel& ck = cb.k;
      ck.name = "concat_columns";
      ck.kind = KernelKind::Pointwise;
      ck.space = *xs;
      ExprGraph& g = ck.exprs;
      int b = g.coord(0), c = g.coord(1);
      auto v = valueAt(cb, x, {b, c});
      if (!v) return v.status();
      int dst = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, b, g.intConstant(width)),
                         g.binary(ExprOp::Add, c, g.intConstant(offset)));
      ck.stores.push_back({bind(cb, out, true), dst, g.cast(*v, cat.result()->type().dtype()), -1});
      KILN_RETURN_IF_ERROR(finish(cb));
    }
    return Status::ok();
  }

  // Slices of one concatenated gradient and the sparse updates they feed: each update reads its
  // columns of the concatenated gradient directly (no slice is materialized).
  Status lowerEmbeddingUpdates(const std::vector<const Op*>& ops) {
    std::vector<Accumulated> tables;
    for (const Op* op : ops) {
      if (op->name() == "kiln.slice") continue;
      if (op->name() != "kiln.embedding_bag_update")
        return Status::errorf("{} in an embedding_update group is not a slice or embedding_bag_update", opLabel(*op));
      auto l = ir::embeddingUpdateLayout(*op);
      if (!l) return Status::errorf("{} has an unknown optimizer", opLabel(*op));
      const Value* grad = op->operand(static_cast<unsigned>(l->grad_out));
      const Op* slice = grad->definingOp();
      if (!slice || !in_group_.count(slice) || slice->name() != "kiln.slice")
        return Status::errorf("{}: its gradient is not a slice of the group", opLabel(*op));
      const Value* src = slice->operand(0);
      auto ss = shapeOf(src);
      if (!ss) return ss.status();
      int64_t axis = slice->intAttr("axis");
      if (axis < 0) axis += static_cast<int64_t>(ss->size());
      if (ss->size() != 2 || axis != 1)
        return Status::errorf("{}: the update reads columns of a [batch, width] gradient; this slices axis {} of {}",
                              opLabel(*slice), axis, src->type().str());
      for (const ir::Use& u : slice->result()->uses())
        if (u.user != op) return Status::errorf("{}: the gradient slice has other users", opLabel(*slice));
      GradSource source{src, (*ss)[1], slice->intAttr("start")};
      auto a = prepareUpdate(*op, &source);
      if (!a) return a.status();
      tables.push_back(*a);
    }
    KILN_RETURN_IF_ERROR(accumulateAll(tables));
    for (const Accumulated& a : tables) KILN_RETURN_IF_ERROR(updateRows(a));
    return Status::ok();
  }

  // A kiln.fused op's ops as one unit of `kind` work.
  Status lowerFused(const std::string& kind) {
    const std::vector<const Op*>& ops = out_.ops;
    if (ops.empty()) return Status::error("the fused group is empty");
    if (kind == "pointwise" || kind == "reduction") return lower();
    if (kind == "gemm_epilogue") return lowerGemm(ops);
    if (kind == "embedding") return lowerEmbeddingConcat(ops);
    if (kind == "embedding_update") return lowerEmbeddingUpdates(ops);
    return Status::errorf("the CUDA backend runs no '{}' group as one unit", kind);
  }

  Status lower() {
    const std::vector<const Op*>& ops = out_.ops;
    if (ops.empty()) return Status::ok();
    bool all_bags = std::all_of(ops.begin(), ops.end(), [](const Op* o) { return o->name() == "kiln.embedding_bag"; });
    if (all_bags) return lowerEmbeddingForward(ops);
    const Op& last = *ops.back();
    bool prefix_pointwise = std::all_of(ops.begin(), ops.end() - 1, [](const Op* o) { return isPointwiseOp(*o); });
    if (isPointwiseOp(last) && prefix_pointwise) return lowerPointwise();
    if (!prefix_pointwise || (ops.size() > 1 && !(last.name() == "kiln.reduce" || last.name() == "kiln.softmax" ||
                                                  last.name() == "kiln.bce_with_logits" || last.name() == "kiln.sum_to")))
      return Status::errorf("cannot lower a group ending in {} with other ops as one unit", opLabel(last));
    // Producers of a reduction must not escape the group: they are only computed inline.
    for (size_t i = 0; i + 1 < ops.size(); ++i)
      for (const ir::Use& u : ops[i]->result()->uses())
        if (!in_group_.count(u.user))
          return Status::errorf("{} is used outside its fused reduction group", opLabel(*ops[i]));
    const std::string& n = last.name();
    if (n == "kiln.matmul") return lowerGemm({&last});
    if (n == "kiln.scatter_add") return lowerScatterAdd(last);
    if (n == "kiln.reduce") return lowerReduce(last);
    if (!ir::isFloat(last.numResults() ? last.result()->type().dtype() : DType::f32) && last.name() == "kiln.sum_to")
      return Status::errorf("{} on the CUDA backend needs float values", opLabel(last));
    if (n == "kiln.softmax") return lowerSoftmax(last);
    if (n == "kiln.bce_with_logits") return lowerBce(last);
    if (n == "kiln.softmax_cross_entropy") return lowerSoftmaxCrossEntropy(last);
    if (n == "kiln.softmax_cross_entropy_grad") return lowerSoftmaxCrossEntropyGrad(last);
    if (n == "kiln.reduce_grad") return lowerReduceMaxGrad(last);
    if (n == "kiln.sum_to") return lowerSumTo(last);
    if (n == "kiln.embedding_bag_weight_grad") return lowerEmbeddingWeightGrad(last);
    if (n == "kiln.optimizer_update") return lowerOptimizerUpdate(last);
    if (n == "kiln.embedding_bag_update") return lowerEmbeddingUpdate(last);
    if (n == "kiln.embedding_bag_grad_sqnorm") return lowerGradSqnorm(last);
    return Status::errorf("{} has no CUDA lowering", opLabel(last));
  }

 private:
  const ir::SymbolBindings& symbols_;
  std::set<const Op*> in_group_;
  LoweredGroup out_;
  std::map<const Value*, int> value_buffer_;
  std::map<const Value*, int> offsets_of_;  // jagged lengths -> the temp holding their offsets
  int error_flag_ = -1;
};

}  // namespace

bool isPointwiseOp(const Op& op) {
  if (op.name() == "kiln.reduce_grad") return op.strAttr("kind") != "max";
  return (op.def() && op.def()->scalar_fn) || movementOps().count(op.name());
}

int streamOf(const Op& op) {
  const ir::Attribute* s = op.attr("kiln.stream");
  return s && s->isInt() ? static_cast<int>(s->asInt()) : 0;
}

std::vector<std::vector<const Op*>> groupOps(const std::vector<const Op*>& ops) {
  std::vector<std::vector<const Op*>> groups;
  // Bags over sources, per stream: each stream's bags form one group at its first bag's place.
  std::map<int, std::pair<size_t, std::vector<const Op*>>> bags;
  auto sourcesOnly = [](const Op* op) {
    for (const Value* v : op->operands())
      if (!v->definingOp() || !isSourceOrTerminator(*v->definingOp())) return false;
    return true;
  };
  std::vector<const Op*> current;
  std::set<const Value*> current_values;
  auto flush = [&] {
    if (!current.empty()) groups.push_back(current);
    current.clear();
    current_values.clear();
  };
  for (const Op* op : ops) {
    if (isSourceOrTerminator(*op)) continue;
    // Every bag over sources joins one group (per stream), at the first bag's place.
    if (op->name() == "kiln.embedding_bag" && sourcesOnly(op)) {
      flush();
      auto [it, first] = bags.try_emplace(streamOf(*op));
      if (first) {
        it->second.first = groups.size();
        groups.emplace_back();
      }
      it->second.second.push_back(op);
      continue;
    }
    bool joins = false;
    if (isPointwiseOp(*op) && !current.empty() && op->numResults() == 1 &&
        streamOf(*op) == streamOf(*current.back()) &&
        op->result()->type().shape() == current.back()->result()->type().shape())
      for (const Value* v : op->operands()) joins |= current_values.count(v) > 0;
    if (!joins) flush();
    current.push_back(op);
    for (const Value* r : op->results()) current_values.insert(r);
    if (!isPointwiseOp(*op)) flush();
  }
  flush();
  for (auto& [_, slot_bags] : bags) groups[slot_bags.first] = std::move(slot_bags.second);
  return groups;
}

Expected<LoweredGroup> lowerGroup(const std::vector<const Op*>& ops, const ir::SymbolBindings& symbols) {
  GroupLowering gl(ops, symbols);
  KILN_RETURN_IF_ERROR(gl.lower());
  return gl.take();
}

Expected<LoweredGroup> lowerFusedGroup(const std::string& kind, const std::vector<const Op*>& ops,
                                       const ir::SymbolBindings& symbols) {
  GroupLowering gl(ops, symbols);
  KILN_RETURN_IF_ERROR(gl.lowerFused(kind));
  return gl.take();
}

Expected<std::vector<LoweredGroup>> lowerFunction(const ir::Function& f, const ir::SymbolBindings& symbols) {
  std::vector<LoweredGroup> out;
  // Ops outside fused groups are grouped greedily between them (a fused op is a barrier: it runs
  // where the fusion pass placed it).
  std::vector<const Op*> loose;
  auto lowerLoose = [&]() -> Status {
    for (const auto& group : groupOps(loose)) {
      auto g = lowerGroup(group, symbols);
      if (!g) return g.status();
      g->stream = streamOf(*group.front());
      out.push_back(g.take());
    }
    loose.clear();
    return Status::ok();
  };
  int fused_index = 0;
  for (const auto& op : f.entry().ops()) {
    if (op->name() != "kiln.fused") {
      loose.push_back(op.get());
      continue;
    }
    KILN_RETURN_IF_ERROR(lowerLoose());
    std::vector<const Op*> ops;
    if (!op->regions().empty() && !op->regions().front()->empty())
      for (const auto& inner : op->regions().front()->front().ops())
        if (!inner->hasTrait(ir::kTerminator)) ops.push_back(inner.get());
    std::string kind = op->strAttr("kind");
    // An op inside a fused group runs on the group's stream.
    const int stream = streamOf(*op);
    auto whole = lowerFusedGroup(kind, ops, symbols);
    if (whole) {
      whole->stream = stream;
      whole->fused_kind = kind;
      whole->fused_index = fused_index++;
      out.push_back(whole.take());
      continue;
    }
    // Not one unit on this backend: the greedy grouping over the group's ops, reason kept.
    for (const auto& group : groupOps(ops)) {
      auto g = lowerGroup(group, symbols);
      if (!g) return g.status();
      g->stream = stream;
      g->fused_kind = kind;
      g->fused_index = fused_index;
      g->split_reason = whole.status().message();
      out.push_back(g.take());
    }
    ++fused_index;
  }
  KILN_RETURN_IF_ERROR(lowerLoose());
  return out;
}

}  // namespace kiln::codegen
