// The gradient rules compose: a tiny DLRM-shaped function (bottom MLP, weighted embedding bag,
// concat, top layer, bce loss) differentiated by chaining every op's rule in reverse, checked
// against central differences in f64.
#include <cmath>
#include <random>
#include <unordered_map>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

TensorType f64Type(std::vector<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return TensorType(DType::f64, s);
}

Value* source(Builder& b, const char* kind, const std::string& name, TensorType t) {
  return (*b.createWithTypes(kind, {}, {t}, {{"name", Attribute(name)}}))->result();
}

// Reverse-mode over the ops of f's body that precede the return: gradients of `wrt` w.r.t. loss.
Expected<std::vector<Value*>> chainGradients(Function& f, Builder& b, Value* loss,
                                             const std::vector<Value*>& wrt) {
  std::unordered_map<Value*, Value*> grad;
  auto one = b.createWithTypes("kiln.constant", {}, {loss->type()}, {{"value", Attribute(1.0)}});
  if (!one) return one.status();
  grad[loss] = (*one)->result();
  std::vector<Op*> ops = f.entry().opList();
  for (auto it = ops.rbegin(); it != ops.rend(); ++it) {
    Op* op = *it;
    if (op == (*one) || op->hasTrait(kSource) || op->hasTrait(kTerminator) ||
        op->hasTrait(kNonDifferentiable))
      continue;
    std::vector<Value*> result_grads;
    bool any = false;
    for (Value* r : op->results()) {
      result_grads.push_back(grad.count(r) ? grad[r] : nullptr);
      any |= result_grads.back() != nullptr;
    }
    if (!any) continue;
    GradContext ctx{b, result_grads, {}};
    KILN_RETURN_IF_ERROR(op->def()->grad(ctx, *op));
    for (unsigned i = 0; i < op->numOperands(); ++i) {
      Value* g = i < ctx.operand_grads.size() ? ctx.operand_grads[i] : nullptr;
      if (!g) continue;
      Value*& acc = grad[op->operand(i)];
      if (!acc) {
        acc = g;
      } else {
        auto sum = b.createValue("kiln.add", {acc, g});
        if (!sum) return sum.status();
        acc = *sum;
      }
    }
  }
  std::vector<Value*> out;
  for (Value* v : wrt) {
    if (!grad.count(v)) return Status::error("a parameter got no gradient");
    out.push_back(grad[v]);
  }
  return out;
}

// logit = w2 . concat(relu(x w1^T + b1), embedding_bag(table, ids, weights)); loss = bce(logit, y)
Expected<Value*> buildModel(Builder& b, std::vector<Value*>& params) {
  Value* x = source(b, "kiln.input", "x", f64Type({4, 3}));
  Value* y = source(b, "kiln.input", "y", f64Type({4}));
  Value* ids = source(b, "kiln.input", "ids", TensorType(DType::i64, {Dim::fixed(4), Dim::fixed(2)}));
  Value* weights = source(b, "kiln.input", "weights", f64Type({4, 2}));
  Value* w1 = source(b, "kiln.parameter", "w1", f64Type({5, 3}));
  Value* b1 = source(b, "kiln.parameter", "b1", f64Type({5}));
  Value* table = source(b, "kiln.parameter", "table", f64Type({6, 2}));
  Value* w2 = source(b, "kiln.parameter", "w2", f64Type({1, 7}));
  params = {w1, b1, w2, weights};
  auto h = b.createValue("kiln.matmul", {x, w1}, {{"transpose_b", Attribute(true)}});
  if (!h) return h.status();
  auto hb = b.createValue("kiln.add", {*h, b1});
  if (!hb) return hb.status();
  auto a = b.createValue("kiln.relu", {*hb});
  if (!a) return a.status();
  auto e = b.createValue("kiln.embedding_bag", {table, ids, weights}, {{"table", Attribute("table")}});
  if (!e) return e.status();
  auto c = b.createValue("kiln.concat", {*a, *e}, {{"axis", Attribute(int64_t{1})}});
  if (!c) return c.status();
  auto logit2 = b.createValue("kiln.matmul", {*c, w2}, {{"transpose_b", Attribute(true)}});
  if (!logit2) return logit2.status();
  auto logit = b.createWithTypes("kiln.reshape", {*logit2}, {f64Type({4})});
  if (!logit) return logit.status();
  return b.createValue("kiln.bce_with_logits", {(*logit)->result(), y});
}

HostTensor random(std::vector<int64_t> shape, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-1, 1);
  HostTensor t(DType::f64, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.as<double>()[i] = u(rng);
  return t;
}

TEST(GradChain, TinyDlrmMatchesCentralDifferences) {
  Module m;
  Function& lf = m.addFunction("loss");
  Builder lb(lf.entry());
  std::vector<Value*> lparams;
  auto loss = buildModel(lb, lparams);
  ASSERT_TRUE(loss) << loss.status().str();
  lf.setResultTypes({(*loss)->type()});
  ASSERT_TRUE(lb.createWithTypes("func.return", {*loss}, {}));
  ASSERT_TRUE(verify(lf));

  Function& gf = m.addFunction("grad");
  Builder gb(gf.entry());
  std::vector<Value*> params;
  auto gloss = buildModel(gb, params);
  ASSERT_TRUE(gloss);
  auto grads = chainGradients(gf, gb, *gloss, params);
  ASSERT_TRUE(grads) << grads.status().str();
  std::vector<TensorType> types;
  for (Value* g : *grads) types.push_back(g->type());
  gf.setResultTypes(types);
  ASSERT_TRUE(gb.createWithTypes("func.return", *grads, {}));
  Status vs = verify(gf);
  ASSERT_TRUE(vs) << vs.str();

  std::mt19937 rng(99);
  std::map<std::string, HostTensor> in = {{"x", random({4, 3}, rng)},
                                          {"y", f64({4}, {1, 0, 0, 1})},
                                          {"ids", i64({4, 2}, {0, 5, 2, 2, 1, 3, 4, 0})},
                                          {"weights", random({4, 2}, rng)},
                                          {"w1", random({5, 3}, rng)},
                                          {"b1", random({5}, rng)},
                                          {"table", random({6, 2}, rng)},
                                          {"w2", random({1, 7}, rng)}};
  auto analytic = interpret(gf, in, {});
  ASSERT_TRUE(analytic) << analytic.status().str();
  const std::vector<std::string> names = {"w1", "b1", "w2", "weights"};
  const double eps = 1e-6;
  for (size_t k = 0; k < names.size(); ++k) {
    std::vector<double> an = values((*analytic)[k]);
    for (int64_t e = 0; e < in[names[k]].numel(); ++e) {
      auto at = [&](double d) {
        std::map<std::string, HostTensor> p = in;
        p[names[k]].as<double>()[e] += d;
        return values((*interpret(lf, p, {}))[0])[0];
      };
      const double fd = (at(eps) - at(-eps)) / (2 * eps);
      EXPECT_NEAR(an[static_cast<size_t>(e)], fd, 1e-6 * (1 + std::abs(fd))) << names[k] << "[" << e << "]";
    }
  }
}

}  // namespace
}  // namespace kiln::ir::testing
