// Finite-difference checks of every gradient rule in the op table, in f64.
//
// For an op y = op(x...), the test builds L = sum(y * w) for a fixed random w, so dL/dy = w.
// It calls the op's gradient rule with result gradient w, evaluates the operand gradients it
// builds with the reference interpreter, and compares them with central differences of L.
#include <cmath>
#include <memory>
#include <random>
#include <set>

#include "tests/ops/op_test_util.h"

namespace kiln::ir::testing {
namespace {

struct GradCase {
  std::string label;  // the test's name
  std::string op;
  std::vector<HostTensor> operands;
  AttrDict attrs = {};
  std::vector<TensorType> result_types = {};  // for ops with stated result types
  // Float operands the rule must leave without a gradient (the embedding table: autodiff owns it).
  std::set<unsigned> no_grad = {};
  double eps = 1e-6;
  double tol = 1e-6;
};

// gtest prints a case by its label rather than its bytes.
void PrintTo(const GradCase& c, std::ostream* os) { *os << c.label << " (" << c.op << ")"; }

std::mt19937& rng() {
  static std::mt19937 r(1234);
  return r;
}

// Uniform in [lo, hi].
HostTensor uniform(std::vector<int64_t> shape, double lo = -1, double hi = 1) {
  HostTensor t(DType::f64, std::move(shape));
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.as<double>()[i] = u(rng());
  return t;
}
// Uniform magnitudes in [0.2, 1] with random signs: away from the kinks of relu, abs, max.
HostTensor awayFromZero(std::vector<int64_t> shape) {
  HostTensor t = uniform(std::move(shape), 0.2, 1);
  std::bernoulli_distribution sign(0.5);
  for (int64_t i = 0; i < t.numel(); ++i)
    if (sign(rng())) t.as<double>()[i] *= -1;
  return t;
}
// Distinct values, shuffled: no ties for max.
HostTensor distinct(std::vector<int64_t> shape) {
  HostTensor t(DType::f64, std::move(shape));
  std::vector<double> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(-1 + 0.37 * static_cast<double>(i));
  std::shuffle(v.begin(), v.end(), rng());
  for (int64_t i = 0; i < t.numel(); ++i) t.as<double>()[i] = v[static_cast<size_t>(i)];
  return t;
}

AttrDict attrs(std::initializer_list<std::pair<const std::string, Attribute>> l) { return AttrDict(l); }
TensorType f64Type(std::vector<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return TensorType(DType::f64, s);
}

std::vector<GradCase> gradCases() {
  using A = Attribute;
  std::vector<GradCase> c;
  // Elementwise, with broadcasting in both directions.
  c.push_back({"AddRowBroadcast", "kiln.add", {uniform({2, 3}), uniform({3})}});
  c.push_back({"AddOuterBroadcast", "kiln.add", {uniform({2, 1}), uniform({1, 3})}});
  c.push_back({"SubScalar", "kiln.sub", {uniform({}), uniform({2, 3})}});
  c.push_back({"MulBroadcast", "kiln.mul", {uniform({2, 3}), uniform({2, 1})}});
  c.push_back({"Div", "kiln.div", {uniform({2, 3}), uniform({3}, 0.5, 2)}});
  HostTensor a = distinct({2, 3}), b = distinct({2, 3});
  for (int64_t i = 0; i < 6; ++i) b.as<double>()[i] = a.as<double>()[i] + (i % 2 ? 0.3 : -0.3);
  c.push_back({"Max", "kiln.max", {a, b}});
  c.push_back({"Min", "kiln.min", {a, b}});
  c.push_back({"Pow", "kiln.pow", {uniform({2, 3}, 0.5, 2), uniform({3}, -1.5, 1.5)}});
  c.push_back({"Neg", "kiln.neg", {uniform({2, 3})}});
  // Dropout: linear in x for a fixed (seed, step, salt); the step gets no gradient.
  c.push_back(
      {"DropoutTraining",
       "kiln.dropout",
       {uniform({4, 5}), tensor(DType::f32, {}, {7})},
       attrs({{"p", A(0.4)}, {"seed", A(int64_t{3})}, {"salt", A(int64_t{99})}, {"training", A(true)}}),
       {},
       {1}});
  c.push_back({"DropoutEval", "kiln.dropout", {uniform({2, 3})}, attrs({{"p", A(0.4)}})});
  // Batch norm's statistic: the gradient goes to the operand the mode selects.
  c.push_back({"RunningStatTraining",
               "kiln.running_stat",
               {uniform({4}), uniform({4})},
               attrs({{"training", A(true)}}),
               {},
               {1}});
  c.push_back({"RunningStatEval", "kiln.running_stat", {uniform({4}), uniform({4})}, {}, {}, {0}});
  // Away from the kink at 0; the scalar alpha and the per-channel slope get their gradients
  // summed over the broadcast dims.
  c.push_back({"Elu", "kiln.elu", {awayFromZero({2, 3}), uniform({}, 0.5, 1.5)}});
  c.push_back({"PreluPerChannel", "kiln.prelu", {awayFromZero({3, 4}), uniform({4}, 0.1, 0.5)}});
  c.push_back({"PreluShared", "kiln.prelu", {awayFromZero({2, 3}), uniform({1}, -0.5, 0.5)}});
  c.push_back({"Abs", "kiln.abs", {awayFromZero({2, 3})}});
  c.push_back({"Exp", "kiln.exp", {uniform({2, 3})}});
  c.push_back({"Log", "kiln.log", {uniform({2, 3}, 0.5, 2)}});
  c.push_back({"Sqrt", "kiln.sqrt", {uniform({2, 3}, 0.5, 2)}});
  c.push_back({"Rsqrt", "kiln.rsqrt", {uniform({2, 3}, 0.5, 2)}});
  c.push_back({"Sigmoid", "kiln.sigmoid", {uniform({2, 3}, -3, 3)}});
  c.push_back({"Tanh", "kiln.tanh", {uniform({2, 3}, -2, 2)}});
  c.push_back({"Relu", "kiln.relu", {awayFromZero({2, 3})}});
  c.push_back({"Gelu", "kiln.gelu", {uniform({2, 3}, -3, 3)}});
  c.push_back({"Silu", "kiln.silu", {uniform({2, 3}, -3, 3)}});
  c.push_back({"Softplus", "kiln.softplus", {uniform({2, 3}, -4, 4)}});
  // Away from the corners at -3 and 3.
  c.push_back({"Hardswish",
               "kiln.hardswish",
               {tensor(DType::f64, {2, 4}, {-4.5, -2.5, -1.2, -0.3, 0.4, 1.9, 2.7, 5.1})}});
  c.push_back({"Select",
               "kiln.select",
               {tensor(DType::i1, {2, 3}, {1, 0, 0, 1, 1, 0}), uniform({2, 3}), uniform({3})}});
  // Matmul, every transpose combination and broadcast batch dims.
  c.push_back({"Matmul", "kiln.matmul", {uniform({2, 3}), uniform({3, 4})}});
  c.push_back({"MatmulTransposeA",
               "kiln.matmul",
               {uniform({3, 2}), uniform({3, 4})},
               attrs({{"transpose_a", A(true)}})});
  c.push_back({"MatmulTransposeB",
               "kiln.matmul",
               {uniform({2, 3}), uniform({4, 3})},
               attrs({{"transpose_b", A(true)}})});
  c.push_back({"MatmulTransposeBoth",
               "kiln.matmul",
               {uniform({3, 2}), uniform({4, 3})},
               attrs({{"transpose_a", A(true)}, {"transpose_b", A(true)}})});
  c.push_back({"MatmulBatchBroadcast", "kiln.matmul", {uniform({2, 2, 3}), uniform({3, 2})}});
  // Data movement.
  c.push_back({"Broadcast", "kiln.broadcast", {uniform({2, 1})}, {}, {f64Type({3, 2, 4})}});
  c.push_back({"Reshape", "kiln.reshape", {uniform({2, 3})}, {}, {f64Type({3, 2})}});
  c.push_back({"Transpose", "kiln.transpose", {uniform({2, 3, 2})}, attrs({{"perm", A::ints({2, 0, 1})}})});
  c.push_back({"Concat",
               "kiln.concat",
               {uniform({2, 2}), uniform({2, 1}), uniform({2, 3})},
               attrs({{"axis", A(int64_t{1})}})});
  c.push_back({"Slice",
               "kiln.slice",
               {uniform({2, 5})},
               attrs({{"axis", A(int64_t{1})}, {"start", A(int64_t{1})}, {"limit", A(int64_t{4})}})});
  c.push_back({"Pad",
               "kiln.pad",
               {uniform({2, 2})},
               attrs({{"axis", A(int64_t{0})}, {"low", A(int64_t{1})}, {"high", A(int64_t{2})}})});
  c.push_back({"GatherWithDuplicates", "kiln.gather", {uniform({4, 2}), i64({3}, {2, 0, 2})}});
  c.push_back({"GatherAxis1",
               "kiln.gather",
               {uniform({2, 3}), i32({2, 2}, {0, 2, 2, 1})},
               attrs({{"axis", A(int64_t{1})}})});
  c.push_back({"ScatterAdd", "kiln.scatter_add", {uniform({3, 2}), i64({4}, {1, 0, 1, 2}), uniform({4, 2})}});
  c.push_back({"SumTo", "kiln.sum_to", {uniform({2, 2, 3})}, {}, {f64Type({2, 1})}});
  c.push_back({"CastF64", "kiln.cast", {uniform({2, 3})}, attrs({{"to", A("f64")}})});
  GradCase cast32{
      "CastF32ToF64", "kiln.cast", {tensor(DType::f32, {3}, {0.5, -0.25, 1})}, attrs({{"to", A("f64")}})};
  cast32.eps = 1e-3;  // perturbations of an f32 operand
  cast32.tol = 1e-3;
  c.push_back(cast32);
  // Reductions and softmax.
  c.push_back(
      {"ReduceSum", "kiln.reduce", {uniform({2, 3})}, attrs({{"kind", A("sum")}, {"axes", A::ints({1})}})});
  c.push_back({"ReduceMeanAll",
               "kiln.reduce",
               {uniform({2, 3})},
               attrs({{"kind", A("mean")}, {"axes", A::ints({0, 1})}})});
  c.push_back({"ReduceMaxKeepdims",
               "kiln.reduce",
               {distinct({2, 3})},
               attrs({{"kind", A("max")}, {"axes", A::ints({-1})}, {"keepdims", A(true)}})});
  c.push_back({"Softmax", "kiln.softmax", {uniform({2, 3}, -2, 2)}});
  c.push_back({"SoftmaxAxis0", "kiln.softmax", {uniform({3, 2}, -2, 2)}, attrs({{"axis", A(int64_t{0})}})});
  // Embeddings: the table's gradient belongs to autodiff; weights get theirs here.
  c.push_back(
      {"EmbeddingBag", "kiln.embedding_bag", {uniform({5, 3}), i64({2, 2}, {1, 4, 4, 0})}, {}, {}, {0}});
  c.push_back({"EmbeddingBagWeighted",
               "kiln.embedding_bag",
               {uniform({5, 3}), i64({2, 2}, {1, 4, 4, 0}), uniform({2, 2})},
               {},
               {},
               {0}});
  c.push_back({"EmbeddingBagFlatWeightedMean",
               "kiln.embedding_bag",
               {uniform({5, 3}), i32({5}, {3, 1, 1, 0, 4}), i32({3}, {2, 0, 3}), uniform({5})},
               attrs({{"mode", A("mean")}}),
               {},
               {0}});
  // Losses: logits only.
  c.push_back({"BceWithLogits",
               "kiln.bce_with_logits",
               {uniform({2, 3}, -3, 3), uniform({2, 3}, 0, 1)},
               {},
               {},
               {1}});
  c.push_back({"BceWithLogitsSum",
               "kiln.bce_with_logits",
               {uniform({4}, -3, 3), uniform({4}, 0, 1)},
               attrs({{"reduction", A("sum")}}),
               {},
               {1}});
  c.push_back({"SoftmaxCrossEntropyIds",
               "kiln.softmax_cross_entropy",
               {uniform({3, 4}, -2, 2), i64({3}, {0, 3, 1})}});
  c.push_back({"SoftmaxCrossEntropyProbs",
               "kiln.softmax_cross_entropy",
               {uniform({2, 3}, -2, 2), f64({2, 3}, {0.2, 0.3, 0.5, 0.6, 0.4, 0.0})},
               attrs({{"reduction", A("sum")}}),
               {},
               {1}});
  // Collectives on one rank (the identity); tests/collectives/ checks them on 1 to 4 ranks.
  const AttrDict one_rank = attrs({{"ranks", A(int64_t{1})}});
  c.push_back({"AllReduceOneRank", "kiln.all_reduce", {uniform({2, 3})}, one_rank});
  c.push_back({"ReduceScatterOneRank", "kiln.reduce_scatter", {uniform({2, 3})}, one_rank});
  c.push_back({"AllGatherOneRank", "kiln.all_gather", {uniform({2, 3})}, one_rank});
  c.push_back({"AllToAllOneRank", "kiln.all_to_all", {uniform({2, 3})}, one_rank});
  c.push_back({"AllToAllVOneRank",
               "kiln.all_to_all_v",
               {uniform({3, 2}), i64({1}, {3})},
               one_rank,
               {TensorType(DType::f64, {Dim::bounded(Dim::fixed(3)), Dim::fixed(2)}),
                TensorType(DType::i64, {Dim::fixed(1)})}});
  // MoE routing (ir/ops/routing.cc): distinct logits, so that no selection flips within eps.
  c.push_back({"TopKMiddleAxis",
               "kiln.topk",
               {distinct({2, 4, 3})},
               attrs({{"k", A(int64_t{2})}, {"axis", A(int64_t{1})}})});
  c.push_back({"TakeAlongMiddleAxis",
               "kiln.take_along_axis",
               {uniform({2, 3, 2}), i32({2, 4, 2}, {0, 2, 2, 1, 1, 1, 0, 0, 2, 0, 1, 2, 0, 0, 2, 1})},
               attrs({{"axis", A(int64_t{1})}})});
  c.push_back({"ScatterAlongMiddleAxis",
               "kiln.scatter_along_axis",
               {uniform({2, 4, 2}), i32({2, 4, 2}, {0, 2, 2, 1, 1, 1, 0, 0, 2, 0, 1, 2, 0, 0, 2, 1})},
               attrs({{"axis", A(int64_t{1})}, {"size", A(int64_t{3})}})});
  const auto router = [&](std::string label, AttrDict a, bool bias) {
    std::vector<HostTensor> ops = {distinct({3, 8})};
    if (bias) ops.push_back(uniform({8}, -0.1, 0.1));
    c.push_back({std::move(label), "kiln.moe_router", ops, std::move(a), {}, {1}});
  };
  router("RouterSoftmax", attrs({{"topk", A(int64_t{2})}}), false);
  router("RouterSoftmaxBiasScaled", attrs({{"topk", A(int64_t{3})}, {"scale", A(2.5)}}), true);
  router("RouterPreSoftmax", attrs({{"topk", A(int64_t{2})}, {"pre_softmax", A(true)}}), true);
  router("RouterSigmoid", attrs({{"topk", A(int64_t{2})}, {"score", A("sigmoid")}}), false);
  router("RouterSigmoidTop1", attrs({{"topk", A(int64_t{1})}, {"score", A("sigmoid")}}), true);
  router("RouterSigmoidGroupsBias",
         attrs({{"topk", A(int64_t{4})},
                {"score", A("sigmoid")},
                {"groups", A(int64_t{4})},
                {"group_topk", A(int64_t{2})}}),
         true);
  router("RouterSoftmaxGroups",
         attrs({{"topk", A(int64_t{2})}, {"groups", A(int64_t{2})}, {"group_topk", A(int64_t{1})}}), false);
  const HostTensor experts = i32({4, 2}, {0, 3, 1, 3, 3, 2, 0, 1});
  c.push_back({"AuxLossSoftmax",
               "kiln.moe_aux_loss",
               {uniform({4, 4}, -2, 2), experts},
               attrs({{"coeff", A(0.1)}, {"score", A("softmax")}, {"topk", A(int64_t{2})}})});
  c.push_back({"AuxLossSigmoidPerSequence",
               "kiln.moe_aux_loss",
               {uniform({4, 4}, -2, 2), experts},
               attrs({{"coeff", A(0.3)},
                      {"score", A("sigmoid")},
                      {"topk", A(int64_t{2})},
                      {"seq_len", A(int64_t{2})}})});
  c.push_back({"AuxLossSoftmaxPerSequence",
               "kiln.moe_aux_loss",
               {uniform({4, 4}, -2, 2), experts},
               attrs({{"coeff", A(0.3)},
                      {"score", A("softmax")},
                      {"topk", A(int64_t{2})},
                      {"seq_len", A(int64_t{2})}})});
  // The global-batch loss of expert parallelism: f from given counts (unlike this batch's own).
  c.push_back({"AuxLossSoftmaxGlobalCounts",
               "kiln.moe_aux_loss",
               {uniform({4, 4}, -2, 2), experts, i64({4}, {5, 1, 0, 6})},
               attrs({{"coeff", A(0.2)}, {"score", A("softmax")}, {"topk", A(int64_t{2})}})});
  c.push_back({"AuxLossSigmoidGlobalCounts",
               "kiln.moe_aux_loss",
               {uniform({4, 4}, -2, 2), experts, i32({4}, {2, 7, 3, 0})},
               attrs({{"coeff", A(0.2)}, {"score", A("sigmoid")}, {"topk", A(int64_t{2})}})});
  c.push_back({"ZLoss", "kiln.moe_z_loss", {uniform({3, 5}, -2, 2)}, attrs({{"coeff", A(0.01)}})});
  // Experts (docs/moe.md): 4 tokens, top-2, 3 experts; expert 1 has no rows, slots 2 and 5 are
  // dropped, and experts 0 and 2 end in a padding row.
  const HostTensor rows = i32({8}, {0, 3, 6, -1, 1, 4, 7, -1});
  const HostTensor offsets = i32({4}, {0, 4, 4, 8});
  for (bool apply : {false, true}) {
    const std::string suffix = apply ? "ApplyProbs" : "";
    const std::set<unsigned> probs_grad = apply ? std::set<unsigned>{} : std::set<unsigned>{2};
    c.push_back({"MoePermute" + suffix,
                 "kiln.moe_permute",
                 {uniform({4, 3}), rows, uniform({4, 2}, 0.1, 1)},
                 attrs({{"apply_probs", A(apply)}}),
                 {},
                 probs_grad});
    c.push_back({"MoeUnpermute" + suffix,
                 "kiln.moe_unpermute",
                 {uniform({8, 3}), rows, uniform({4, 2}, 0.1, 1)},
                 attrs({{"apply_probs", A(apply)}}),
                 {},
                 probs_grad});
  }
  // Expert parallelism: 7 rows from 2 peers of 3 local experts, two chunks empty.
  for (bool inverse : {false, true})
    c.push_back({inverse ? "MoeSortChunksInverse" : "MoeSortChunks",
                 "kiln.moe_sort_chunks",
                 {uniform({7, 2}), i64({6}, {2, 0, 1, 1, 3, 0})},
                 attrs({{"chunks", A(int64_t{3})}, {"inverse", A(inverse)}})});
  c.push_back({"GroupedMatmul", "kiln.grouped_matmul", {uniform({8, 3}), uniform({3, 3, 2}), offsets}});
  c.push_back({"GroupedMatmulTransposeB",
               "kiln.grouped_matmul",
               {uniform({8, 3}), uniform({3, 2, 3}), offsets},
               attrs({{"transpose_b", A(true)}})});
  return c;
}

// Builds y = op(x0, x1, ...) and L = sum(y * w) into f; returns the op and L.
struct Forward {
  Op* op = nullptr;
  Value* loss = nullptr;
  Value* w = nullptr;
};
Expected<Forward> buildForward(Function& f, Builder& b, const GradCase& gc) {
  std::vector<Value*> xs;
  for (size_t i = 0; i < gc.operands.size(); ++i) {
    auto in = b.createWithTypes("kiln.input", {}, {typeOf(gc.operands[i])},
                                {{"name", Attribute("x" + std::to_string(i))}});
    if (!in) return in.status();
    xs.push_back((*in)->result());
  }
  auto op = gc.result_types.empty() ? b.create(gc.op, xs, gc.attrs)
                                    : b.createWithTypes(gc.op, xs, gc.result_types, gc.attrs);
  if (!op) return op.status();
  Value* y = (*op)->result();
  auto w = b.createWithTypes("kiln.input", {}, {y->type()}, {{"name", Attribute("w")}});
  if (!w) return w.status();
  auto yw = b.createValue("kiln.mul", {y, (*w)->result()});
  if (!yw) return yw.status();
  Value* loss = *yw;
  if (y->type().rank() > 0) {
    std::vector<int64_t> axes;
    for (int64_t i = 0; i < y->type().rank(); ++i) axes.push_back(i);
    auto s =
        b.createValue("kiln.reduce", {loss}, {{"kind", Attribute("sum")}, {"axes", Attribute::ints(axes)}});
    if (!s) return s.status();
    loss = *s;
  }
  return Forward{*op, loss, (*w)->result()};
}

Status finish(Function& f, Builder& b, const std::vector<Value*>& results) {
  std::vector<TensorType> types;
  for (Value* v : results) types.push_back(v->type());
  auto ret = b.createWithTypes("func.return", results, {});
  if (!ret) return ret.status();
  f.setResultTypes(types);
  return verify(f);
}

double scalarOf(const HostTensor& t) { return values(t).at(0); }

class GradCheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(GradCheck, RuleMatchesCentralDifferences) {
  const GradCase& gc = GetParam();
  Module m;
  // @loss: L(x).
  Function& lf = m.addFunction("loss");
  Builder lb(lf.entry());
  auto fwd = buildForward(lf, lb, gc);
  ASSERT_TRUE(fwd) << fwd.status().str();
  ASSERT_TRUE(finish(lf, lb, {fwd->loss})) << "loss function does not verify";
  // @grad: the operand gradients the op's rule builds from dL/dy = w.
  Function& gf = m.addFunction("grad");
  Builder gb(gf.entry());
  auto gfwd = buildForward(gf, gb, gc);
  ASSERT_TRUE(gfwd);
  const OpDef* def = gfwd->op->def();
  ASSERT_TRUE(def && def->grad) << gc.op << " has no gradient rule";
  GradContext ctx{gb, {gfwd->w}, {}};
  Status s = def->grad(ctx, *gfwd->op);
  ASSERT_TRUE(s) << s.str();
  ASSERT_EQ(ctx.operand_grads.size(), gc.operands.size());
  std::vector<unsigned> checked;
  std::vector<Value*> grads;
  for (unsigned i = 0; i < gc.operands.size(); ++i) {
    const bool is_float = isFloat(gc.operands[i].view.dtype);
    if (!is_float || gc.no_grad.count(i)) {
      EXPECT_EQ(ctx.operand_grads[i], nullptr) << "operand #" << i << " should get no gradient";
      continue;
    }
    ASSERT_NE(ctx.operand_grads[i], nullptr) << "operand #" << i << " got no gradient";
    EXPECT_EQ(ctx.operand_grads[i]->type().withSharding(std::nullopt), gfwd->op->operand(i)->type())
        << "gradient of operand #" << i << " has the wrong type";
    checked.push_back(i);
    grads.push_back(ctx.operand_grads[i]);
  }
  Status vs = finish(gf, gb, grads);
  ASSERT_TRUE(vs) << vs.str();

  std::map<std::string, HostTensor> inputs;
  for (size_t i = 0; i < gc.operands.size(); ++i) inputs["x" + std::to_string(i)] = gc.operands[i];
  std::vector<int64_t> y_shape;
  for (const Dim& d : gfwd->op->result()->type().shape()) y_shape.push_back(d.size());
  inputs["w"] = uniform(y_shape);
  auto analytic = interpret(gf, inputs, {});
  ASSERT_TRUE(analytic) << analytic.status().str();

  for (size_t k = 0; k < checked.size(); ++k) {
    const unsigned i = checked[k];
    const std::string name = "x" + std::to_string(i);
    const std::vector<double> an = values((*analytic)[k]);
    ASSERT_EQ(static_cast<int64_t>(an.size()), gc.operands[i].numel());
    for (int64_t e = 0; e < gc.operands[i].numel(); ++e) {
      auto perturbed = [&](double delta) {
        std::map<std::string, HostTensor> in = inputs;
        HostTensor& t = in[name];
        if (t.view.dtype == DType::f64)
          t.as<double>()[e] += delta;
        else
          t.as<float>()[e] = static_cast<float>(t.as<float>()[e] + delta);
        auto r = interpret(lf, in, {});
        EXPECT_TRUE(r) << r.status().str();
        return r ? scalarOf((*r)[0]) : 0.0;
      };
      const double fd = (perturbed(gc.eps) - perturbed(-gc.eps)) / (2 * gc.eps);
      EXPECT_NEAR(an[static_cast<size_t>(e)], fd, gc.tol * (1 + std::abs(fd)))
          << gc.op << " operand #" << i << " element " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryRule, GradCheck, ::testing::ValuesIn(gradCases()),
                         [](const ::testing::TestParamInfo<GradCase>& info) { return info.param.label; });

// No differentiable op may be forgotten: each has a CPU kernel, a gradient rule and a case above.
TEST(GradCoverage, EveryDifferentiableOpHasKernelRuleAndCheck) {
  std::set<std::string> covered;
  for (const GradCase& gc : gradCases()) covered.insert(gc.op);
  for (const OpDef* def : OpRegistry::get().all()) {
    if (def->has(kNonDifferentiable) || def->has(kSource) || def->has(kTerminator)) continue;
    // An op without results (an in-place update) has nothing to differentiate.
    if (def->num_results == 0) continue;
    if (def->name.rfind("test.", 0) == 0) continue;  // ops registered by the tests themselves
    EXPECT_NE(def->cpu, nullptr) << def->name << " has no CPU reference kernel";
    EXPECT_NE(def->grad, nullptr) << def->name << " has no gradient rule";
    EXPECT_TRUE(covered.count(def->name)) << def->name << " has no finite-difference gradient check";
  }
}

}  // namespace
}  // namespace kiln::ir::testing
