// The training step built by autodiff, run through the reference interpreter, against central
// finite differences of @forward in f64. With SGD at lr = 1 a step moves each parameter by
// exactly minus its gradient, so the gradient the step applied (dense or sparse) is old - new.
#include "passes/autodiff.h"

#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ir/builder.h"
#include "ir/interpreter.h"
#include "ir/op_def.h"
#include "ir/verifier.h"
#include "passes/lr_schedule.h"
#include "passes/mixed_precision.h"

namespace kiln::passes {
namespace {

using namespace kiln::ir;  // NOLINT: tests read better with the IR's names unqualified

// A model under construction: @forward, its module attributes, and the tensors it binds.
class ModelBuilder {
 public:
  explicit ModelBuilder(DType dtype = DType::f64)
      : dtype_(dtype), m_(std::make_unique<Module>()), fwd_(m_->addFunction("forward")), b_(fwd_.entry()) {}

  Value* param(const std::string& name, std::vector<int64_t> shape, double scale = 0.5, AttrDict extra = {}) {
    Shape s;
    for (int64_t d : shape) s.push_back(Dim::fixed(d));
    AttrDict attrs = extra;
    attrs["name"] = name;
    Value* v = (*b_.createWithTypes("kiln.parameter", {}, {TensorType(dtype_, s)}, attrs))->result();
    v->setNameHint(name);
    tensors[name] = random(dtype_, shape, scale);
    return v;
  }
  Value* input(const std::string& name, DType t, Shape shape, HostTensor value) {
    Value* v = (*b_.createWithTypes("kiln.input", {}, {TensorType(t, shape)}, {{"name", name}}))->result();
    v->setNameHint(name);
    tensors[name] = std::move(value);
    return v;
  }
  Value* op(const std::string& name, std::vector<Value*> operands, AttrDict attrs = {}) {
    auto v = b_.createValue(name, operands, attrs);
    EXPECT_TRUE(v.isOk()) << name << ": " << v.status().str();
    return v.isOk() ? *v : nullptr;
  }
  Value* typed(const std::string& name, Value* x, TensorType t, AttrDict attrs = {}) {
    auto op = b_.createWithTypes(name, {x}, {t}, attrs);
    EXPECT_TRUE(op.isOk()) << name << ": " << op.status().str();
    return (*op)->result();
  }
  Value* constant(double v) {
    return (*b_.createWithTypes("kiln.constant", {}, {TensorType(dtype_, {})}, {{"value", v}}))->result();
  }
  // Ends @forward returning (logit, loss) and sets the training block.
  std::unique_ptr<Module> finish(Value* logit, Value* loss, AttrDict train) {
    (void)b_.createWithTypes("func.return", {logit, loss}, {});
    fwd_.setResultTypes({logit->type(), loss->type()});
    m_->mutableAttrs()["kiln.outputs"] = AttrArray{"logit", "loss"};
    train.emplace("loss", "loss");
    train.emplace("prediction", "logit");
    train.emplace("label", "label");
    m_->mutableAttrs()["kiln.train"] = train;
    Status s = verify(*m_);
    EXPECT_TRUE(s.isOk()) << s.str();
    return std::move(m_);
  }

  HostTensor random(DType t, const std::vector<int64_t>& shape, double scale) {
    HostTensor h(t, shape);
    std::uniform_real_distribution<double> u(-scale, scale);
    for (int64_t i = 0; i < h.numel(); ++i) set(h, i, u(rng_));
    return h;
  }
  static void set(HostTensor& h, int64_t i, double v) {
    if (h.view.dtype == DType::f64) h.as<double>()[i] = v;
    else if (h.view.dtype == DType::f32) h.as<float>()[i] = static_cast<float>(v);
    else if (h.view.dtype == DType::i64) h.as<int64_t>()[i] = static_cast<int64_t>(v);
    else if (h.view.dtype == DType::i32) h.as<int32_t>()[i] = static_cast<int32_t>(v);
  }
  static double get(const HostTensor& h, int64_t i) {
    return h.view.dtype == DType::f64 ? h.as<double>()[i] : h.as<float>()[i];
  }

  std::map<std::string, HostTensor> tensors;
  DType dtype_;

 private:
  std::unique_ptr<Module> m_;
  Function& fwd_;
  Builder b_;
  std::mt19937 rng_{1234};
};

HostTensor values(DType t, std::vector<int64_t> shape, const std::vector<double>& v) {
  HostTensor h(t, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) ModelBuilder::set(h, static_cast<int64_t>(i), v[i]);
  return h;
}

HostTensor f32Scalar(double v) { return values(DType::f32, {}, {v}); }

const SymbolBindings kSymbols{{"B", 3}};

// Adds the step inputs and zero-or-constant optimizer state the trainer would create.
void addStepTensors(const Function& step, std::map<std::string, HostTensor>& t, double lr = 1, double step_no = 1) {
  t["lr"] = f32Scalar(lr);
  t["step"] = f32Scalar(step_no);
  for (const auto& op : step.entry().ops()) {
    if (op->name() != "kiln.parameter" || !op->hasAttr("state_of")) continue;
    const TensorType& type = op->result()->type();
    std::vector<int64_t> shape;
    for (const Dim& d : type.shape()) shape.push_back(d.size());
    HostTensor h(type.dtype(), shape);
    for (int64_t i = 0; i < h.numel(); ++i) ModelBuilder::set(h, i, op->floatAttr("value", 0));
    t[op->strAttr("name")] = h;
  }
}

double forwardLoss(const Module& m, const std::map<std::string, HostTensor>& t) {
  auto out = interpret(*m.lookup("forward"), t, kSymbols);
  EXPECT_TRUE(out.isOk()) << out.status().str();
  return out.isOk() ? ModelBuilder::get((*out)[1], 0) : NAN;
}

std::set<std::string> trainableNames(const Module& m) {
  std::set<std::string> out;
  for (const auto& op : m.lookup("forward")->entry().ops())
    if (op->name() == "kiln.parameter" && op->boolAttr("trainable", true)) out.insert(op->strAttr("name"));
  return out;
}

// d loss / d name[i] for every entry i of parameter `name`: central differences of the forward
// loss, independent of the autodiff pass.
std::vector<double> centralDifferences(const Module& m, const std::map<std::string, HostTensor>& tensors,
                                       const std::string& name, double h = 1e-6) {
  const HostTensor& p0 = tensors.at(name);
  std::vector<double> grad;
  std::map<std::string, HostTensor> t = tensors;
  for (int64_t i = 0; i < p0.numel(); ++i) {
    const double x = ModelBuilder::get(p0, i);
    ModelBuilder::set(t[name], i, x + h);
    const double up = forwardLoss(m, t);
    ModelBuilder::set(t[name], i, x - h);
    const double down = forwardLoss(m, t);
    ModelBuilder::set(t[name], i, x);
    grad.push_back((up - down) / (2 * h));
  }
  return grad;
}

// Builds @train_step with SGD at lr 1, runs one step, and compares old - new of every trainable
// parameter with central differences of the forward loss.
void checkGradients(Module& m, const std::map<std::string, HostTensor>& tensors, double tol = 1e-6) {
  Status s = buildTrainStep(m);
  ASSERT_TRUE(s.isOk()) << s.str();
  const Function* step = m.lookup("train_step");
  ASSERT_NE(step, nullptr);
  std::map<std::string, HostTensor> after = tensors;
  addStepTensors(*step, after);
  auto out = interpretInPlace(*step, after, kSymbols);
  ASSERT_TRUE(out.isOk()) << out.status().str();
  double loss = forwardLoss(m, tensors);
  EXPECT_NEAR(ModelBuilder::get((*out)[0], 0), loss, 1e-12) << "train_step's loss is the forward loss";

  double largest = 0;
  ASSERT_FALSE(trainableNames(m).empty());
  for (const std::string& name : trainableNames(m)) {
    const std::vector<double> grad = centralDifferences(m, tensors, name);
    for (int64_t i = 0; i < static_cast<int64_t>(grad.size()); ++i) {
      const double fd = grad[static_cast<size_t>(i)];
      const double applied = ModelBuilder::get(tensors.at(name), i) - ModelBuilder::get(after.at(name), i);
      EXPECT_NEAR(applied, fd, tol * std::max(1.0, std::abs(fd))) << name << "[" << i << "]";
      largest = std::max(largest, std::abs(fd));
    }
  }
  EXPECT_GT(largest, 1e-3) << "the check needs gradients that are not all zero";
}

AttrDict sgd(double lr = 1.0) { return AttrDict{{"kind", "sgd"}, {"lr", lr}}; }

// MLP: dense[B, 4] -> linear 5 -> relu -> linear 1 -> bce against labels.
std::unique_ptr<Module> buildMlp(ModelBuilder& mb, AttrDict train) {
  DType f = mb.dtype_;
  Value* dense = mb.input("dense", f, {Dim::symbol("B"), Dim::fixed(4)}, mb.random(f, {3, 4}, 1.0));
  Value* label = mb.input("label", f, {Dim::symbol("B")}, values(f, {3}, {1, 0, 1}));
  Value* w0 = mb.param("bottom.0.weight", {5, 4});
  Value* b0 = mb.param("bottom.0.bias", {5});
  Value* w1 = mb.param("top.0.weight", {1, 5});
  Value* b1 = mb.param("top.0.bias", {1});
  Value* h = mb.op("kiln.relu", {mb.op("kiln.add", {mb.op("kiln.matmul", {dense, w0}, {{"transpose_b", true}}), b0})});
  Value* y = mb.op("kiln.add", {mb.op("kiln.matmul", {h, w1}, {{"transpose_b", true}}), b1});
  Value* logit = mb.typed("kiln.reshape", y, TensorType(f, {Dim::symbol("B")}));
  Value* loss = mb.op("kiln.bce_with_logits", {logit, label});
  train.emplace("optimizer", sgd());
  return mb.finish(logit, loss, train);
}

TEST(Autodiff, MlpMatchesFiniteDifferences) {
  ModelBuilder mb;
  auto m = buildMlp(mb, {});
  checkGradients(*m, mb.tensors);
}

// Two tables: fixed hotness with sum pooling (ids with duplicates), variable length with mean
// pooling and per-id weights; pooled rows concatenated with a dense projection.
std::unique_ptr<Module> buildEmbeddingModel(ModelBuilder& mb, AttrDict train) {
  DType f = mb.dtype_;
  Dim B = Dim::symbol("B");
  Value* dense = mb.input("dense", f, {B, Dim::fixed(2)}, mb.random(f, {3, 2}, 1.0));
  Value* label = mb.input("label", f, {B}, values(f, {3}, {0, 1, 1}));
  Value* ids0 = mb.input("cats.0", DType::i64, {B, Dim::fixed(2)}, values(DType::i64, {3, 2}, {1, 4, 4, 4, 0, 1}));
  Value* ids1 = mb.input("cats.1", DType::i32, {Dim::bounded(B.times(3))},
                         values(DType::i32, {5}, {2, 3, 2, 0, 2}));
  Value* len1 = mb.input("cats.1.lengths", DType::i32, {B}, values(DType::i32, {3}, {2, 0, 3}));
  Value* w1 = mb.input("cats.1.weights", f, {Dim::bounded(B.times(3))},
                       values(f, {5}, {0.5, 2.0, -1.0, 1.5, 0.25}));
  Value* t0 = mb.param("tables.0", {6, 3}, 0.5, {{"embedding", true}});
  Value* t1 = mb.param("tables.1", {4, 3}, 0.5, {{"embedding", true}});
  Value* e0 = mb.op("kiln.embedding_bag", {t0, ids0}, {{"mode", "sum"}});
  Value* e1 = mb.op("kiln.embedding_bag", {t1, ids1, len1, w1}, {{"mode", "mean"}});
  Value* wd = mb.param("bottom.weight", {3, 2});
  Value* d = mb.op("kiln.matmul", {dense, wd}, {{"transpose_b", true}});
  Value* x = mb.op("kiln.concat", {d, e0, e1}, {{"axis", 1}});
  Value* wt = mb.param("top.weight", {1, 9});
  Value* y = mb.op("kiln.matmul", {mb.op("kiln.tanh", {x}), wt}, {{"transpose_b", true}});
  Value* logit = mb.typed("kiln.reshape", y, TensorType(f, {B}));
  Value* loss = mb.op("kiln.bce_with_logits", {logit, label});
  train.emplace("optimizer", sgd());
  train.emplace("embedding_optimizer", sgd());
  return mb.finish(logit, loss, train);
}

TEST(Autodiff, EmbeddingModelMatchesFiniteDifferences) {
  ModelBuilder mb;
  auto m = buildEmbeddingModel(mb, {});
  checkGradients(*m, mb.tensors);
}

// One table shared by three features: fixed-hotness cats.0 and cats.1 (rows 1 and 4 hit by
// both), and variable-length weighted cats.2 and cats.3 sharing a second table.
std::unique_ptr<Module> buildSharedTableModel(ModelBuilder& mb, AttrDict train) {
  DType f = mb.dtype_;
  Dim B = Dim::symbol("B");
  Value* label = mb.input("label", f, {B}, values(f, {3}, {0, 1, 1}));
  Value* ids0 =
      mb.input("cats.0", DType::i64, {B, Dim::fixed(2)}, values(DType::i64, {3, 2}, {1, 4, 4, 4, 0, 1}));
  Value* ids1 =
      mb.input("cats.1", DType::i64, {B, Dim::fixed(2)}, values(DType::i64, {3, 2}, {4, 5, 1, 1, 2, 4}));
  Value* ids2 =
      mb.input("cats.2", DType::i32, {Dim::bounded(B.times(3))}, values(DType::i32, {4}, {2, 3, 2, 0}));
  Value* len2 = mb.input("cats.2.lengths", DType::i32, {B}, values(DType::i32, {3}, {2, 0, 2}));
  Value* w2 =
      mb.input("cats.2.weights", f, {Dim::bounded(B.times(3))}, values(f, {4}, {0.5, 2.0, -1.0, 1.5}));
  Value* ids3 =
      mb.input("cats.3", DType::i32, {Dim::bounded(B.times(3))}, values(DType::i32, {5}, {3, 2, 1, 1, 3}));
  Value* len3 = mb.input("cats.3.lengths", DType::i32, {B}, values(DType::i32, {3}, {1, 3, 1}));
  Value* w3 =
      mb.input("cats.3.weights", f, {Dim::bounded(B.times(3))}, values(f, {5}, {1.0, -0.5, 0.75, 1.25, 2.0}));
  Value* t0 = mb.param("tables.0", {6, 3}, 0.5, {{"embedding", true}});
  Value* t1 = mb.param("tables.1", {4, 3}, 0.5, {{"embedding", true}});
  Value* e0 = mb.op("kiln.embedding_bag", {t0, ids0}, {{"mode", "sum"}});
  Value* e1 = mb.op("kiln.embedding_bag", {t0, ids1}, {{"mode", "sum"}});
  Value* e2 = mb.op("kiln.embedding_bag", {t1, ids2, len2, w2}, {{"mode", "mean"}});
  Value* e3 = mb.op("kiln.embedding_bag", {t1, ids3, len3, w3}, {{"mode", "mean"}});
  Value* x = mb.op("kiln.concat", {e0, e1, e2, e3}, {{"axis", 1}});
  Value* wt = mb.param("top.weight", {1, 12});
  Value* y = mb.op("kiln.matmul", {mb.op("kiln.tanh", {x}), wt}, {{"transpose_b", true}});
  Value* logit = mb.typed("kiln.reshape", y, TensorType(f, {B}));
  Value* loss = mb.op("kiln.bce_with_logits", {logit, label});
  train.emplace("optimizer", sgd());
  if (!train.count("embedding_optimizer")) train.emplace("embedding_optimizer", sgd());
  return mb.finish(logit, loss, train);
}

// SGD at lr 1: each table's step is its whole gradient, the sum over the features sharing it.
TEST(Autodiff, SharedTableMatchesFiniteDifferences) {
  ModelBuilder mb;
  auto m = buildSharedTableModel(mb, {});
  checkGradients(*m, mb.tensors);
}

// Adagrad: a shared table gets one update, fed by the lookups side by side, and a row hit by
// both features takes one step with the summed gradient (not one step per feature). The
// gradient comes from central differences of the forward loss, independent of the pass.
TEST(Autodiff, SharedTableTakesOneAdagradStepWithTheSummedGradient) {
  ModelBuilder mb;
  const double lr = 0.1, acc0 = 0.1;
  auto m = buildSharedTableModel(
      mb,
      {{"embedding_optimizer", AttrDict{{"kind", "adagrad"}, {"lr", lr}, {"initial_accumulator", acc0}}}});
  ASSERT_TRUE(buildTrainStep(*m).isOk());
  const Function& step = *m->lookup("train_step");
  std::map<std::string, int> updates;
  for (const auto& op : step.entry().ops())
    if (op->name() == "kiln.embedding_bag_update") {
      ++updates[op->strAttr("table")];
      EXPECT_EQ(op->operand(1)->type().str(),
                op->strAttr("table") == "tables.0" ? "!kiln.tensor<2*Bx2xi64>" : "!kiln.tensor<?(6*B)xi32>");
    }
  EXPECT_EQ(updates, (std::map<std::string, int>{{"tables.0", 1}, {"tables.1", 1}}));

  std::map<std::string, HostTensor> after = mb.tensors;
  addStepTensors(step, after);
  for (const auto& op : step.entry().ops())  // the adagrad sums start at initial_accumulator
    if (op->name() == "kiln.parameter" && op->hasAttr("state_of"))
      for (int64_t i = 0; i < after.at(op->strAttr("name")).numel(); ++i)
        ModelBuilder::set(after[op->strAttr("name")], i, acc0);
  ASSERT_TRUE(interpretInPlace(step, after, kSymbols).isOk());
  int rows_with_both = 0;
  for (const char* name : {"tables.0", "tables.1"}) {
    const std::vector<double> grad = centralDifferences(*m, mb.tensors, name);
    for (int64_t i = 0; i < static_cast<int64_t>(grad.size()); ++i) {
      const double x = ModelBuilder::get(mb.tensors.at(name), i), g = grad[static_cast<size_t>(i)];
      const double expected = x - lr * g / (std::sqrt(acc0 + g * g) + 1e-10);
      EXPECT_NEAR(ModelBuilder::get(after.at(name), i), expected, 1e-7) << name << "[" << i << "]";
    }
  }
  // Rows 1 and 4 of tables.0 are read by cats.0 and cats.1: two sequential adagrad steps would
  // move them elsewhere, so the check above distinguishes one combined step.
  for (int64_t r : {1, 4})
    rows_with_both +=
        ModelBuilder::get(after.at("tables.0"), r * 3) != ModelBuilder::get(mb.tensors.at("tables.0"), r * 3);
  EXPECT_EQ(rows_with_both, 2);
}

// grad_clip counts a shared table's rows once, with their combined gradient: the same scale as
// the gradient norm computed from finite differences.
TEST(Autodiff, SharedTableGradientNormCombinesItsLookups) {
  ModelBuilder mb;
  auto m = buildSharedTableModel(mb, {{"grad_clip", 1e-3}});
  ASSERT_TRUE(buildTrainStep(*m).isOk());
  const Function& step = *m->lookup("train_step");
  std::map<std::string, HostTensor> after = mb.tensors;
  addStepTensors(step, after);
  ASSERT_TRUE(interpretInPlace(step, after, kSymbols).isOk());
  double sq = 0;
  std::map<std::string, std::vector<double>> grads;
  for (const std::string& name : trainableNames(*m)) {
    grads[name] = centralDifferences(*m, mb.tensors, name);
    for (double g : grads[name]) sq += g * g;
  }
  const double scale = std::min(1.0, 1e-3 / std::sqrt(sq));
  ASSERT_LT(scale, 1.0);
  for (const auto& [name, g] : grads)
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_NEAR(ModelBuilder::get(mb.tensors.at(name), static_cast<int64_t>(i)) -
                      ModelBuilder::get(after.at(name), static_cast<int64_t>(i)),
                  scale * g[i], 1e-9)
          << name << "[" << i << "]";
}

// The table's gradient is never dense: tables are read only by their lookup and its fused
// update, and rows no id selects keep their values.
TEST(Autodiff, EmbeddingUpdatesAreSparse) {
  ModelBuilder mb;
  auto m = buildEmbeddingModel(mb, {{"embedding_optimizer", AttrDict{{"kind", "rowwise_adagrad"}, {"lr", 0.1}}}});
  ASSERT_TRUE(buildTrainStep(*m).isOk());
  const Function& step = *m->lookup("train_step");
  int updates = 0, dense_updates = 0;
  for (const auto& op : step.entry().ops()) {
    if (op->name() == "kiln.embedding_bag_update") {
      ++updates;
      EXPECT_EQ(op->strAttr("optimizer"), "rowwise_adagrad");
    }
    if (op->name() == "kiln.optimizer_update") ++dense_updates;
    if (op->name() == "kiln.parameter" && op->strAttr("name").rfind("tables.", 0) == 0 && !op->hasAttr("state_of")) {
      for (const Use& u : op->result()->uses())
        EXPECT_TRUE(u.user->name() == "kiln.embedding_bag" || u.user->name() == "kiln.embedding_bag_update")
            << u.user->name() << " reads " << op->strAttr("name");
    }
    // No value shaped like a table other than the tables themselves and their state.
    for (Value* r : op->results())
      if (op->name() != "kiln.parameter" && r->type().rank() == 2 && r->type().dim(0) == Dim::fixed(6))
        ADD_FAILURE() << op->name() << " makes a table-shaped value";
  }
  EXPECT_EQ(updates, 2);
  EXPECT_EQ(dense_updates, 2);
  // Row-wise state: one accumulator per row, named after its table.
  const Op* state = nullptr;
  for (const auto& op : step.entry().ops())
    if (op->name() == "kiln.parameter" && op->strAttr("name") == "tables.0.rowwise_adagrad_sum") state = op.get();
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->result()->type().str(), "!kiln.tensor<6xf64>");
  EXPECT_FALSE(state->boolAttr("trainable", true));
  EXPECT_EQ(state->strAttr("state_of"), "tables.0");

  std::map<std::string, HostTensor> t = mb.tensors;
  addStepTensors(step, t);
  ASSERT_TRUE(interpretInPlace(step, t, kSymbols).isOk());
  std::set<int64_t> touched0{1, 4, 0}, touched1{2, 3, 0};
  for (auto [name, touched, rows] : {std::tuple{"tables.0", touched0, 6}, std::tuple{"tables.1", touched1, 4}}) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < 3; ++d) {
        double before = ModelBuilder::get(mb.tensors.at(name), r * 3 + d), now = ModelBuilder::get(t.at(name), r * 3 + d);
        if (touched.count(r)) {
          EXPECT_NE(before, now) << name << " row " << r;
        } else {
          EXPECT_EQ(before, now) << name << " row " << r;
        }
      }
  }
}

// Every differentiable op kind, in f64, feeding one loss.
TEST(Autodiff, EveryOpMatchesFiniteDifferences) {
  ModelBuilder mb;
  DType f = DType::f64;
  Dim B = Dim::symbol("B");
  Value* x = mb.input("x", f, {B, Dim::fixed(4)}, mb.random(f, {3, 4}, 1.0));
  Value* label = mb.input("label", f, {B}, values(f, {3}, {1, 0, 1}));
  Value* cls = mb.input("cls", DType::i64, {B}, values(DType::i64, {3}, {2, 0, 1}));
  Value* idx = mb.input("idx", DType::i64, {Dim::fixed(2)}, values(DType::i64, {2}, {3, 1}));
  Value* a = mb.param("a", {4, 4});
  Value* c = mb.param("c", {4});
  Value* p = mb.param("p", {1, 4}, 0.5);
  Value* q = mb.param("q", {2, 4, 3});

  Value* h = mb.op("kiln.matmul", {x, a});                                          // [B,4]
  Value* h1 = mb.op("kiln.sub", {mb.op("kiln.mul", {h, c}), mb.op("kiln.neg", {c})});
  Value* pos = mb.op("kiln.add", {mb.op("kiln.exp", {p}), mb.constant(0.5)});       // > 0.5
  Value* h2 = mb.op("kiln.div", {h1, pos});
  Value* h3 = mb.op("kiln.add", {mb.op("kiln.max", {h2, x}), mb.op("kiln.min", {h2, mb.op("kiln.abs", {x})})});
  Value* h4 = mb.op("kiln.add", {mb.op("kiln.sigmoid", {h3}), mb.op("kiln.tanh", {h2})});
  Value* h5 = mb.op("kiln.add", {mb.op("kiln.gelu", {h4}), mb.op("kiln.silu", {h3})});
  Value* sq = mb.op("kiln.add", {mb.op("kiln.mul", {h5, h5}), mb.constant(1.0)});   // >= 1
  Value* h6 = mb.op("kiln.add", {mb.op("kiln.log", {sq}), mb.op("kiln.sqrt", {sq})});
  Value* h7 = mb.op("kiln.add", {mb.op("kiln.rsqrt", {sq}), mb.op("kiln.pow", {sq, mb.op("kiln.sigmoid", {p})})});
  Value* cond = mb.op("kiln.compare", {h2, mb.constant(0.0)}, {{"predicate", "gt"}});
  Value* h8 = mb.op("kiln.select", {cond, h6, mb.op("kiln.relu", {h7})});          // [B,4]
  Value* t = mb.op("kiln.transpose", {h8}, {{"perm", Attribute::ints({1, 0})}});    // [4,B]
  Value* g = mb.op("kiln.gather", {t, idx}, {{"axis", 0}});                         // [2,B]
  Value* bq = mb.typed("kiln.broadcast", g, TensorType(f, {Dim::fixed(4), Dim::fixed(2), B}));
  Value* s = mb.op("kiln.slice", {bq}, {{"axis", 0}, {"start", 1}, {"limit", 3}});    // [2,2,B]
  Value* r = mb.op("kiln.reduce", {s}, {{"kind", "mean"}, {"axes", Attribute::ints({0})}});  // [2,B]
  Value* bm = mb.op("kiln.matmul", {mb.typed("kiln.reshape", h8, TensorType(f, {Dim::fixed(1), B, Dim::fixed(4)})), q},
                    {});  // [2,B,3] via batch broadcast
  Value* logits3 = mb.op("kiln.reduce", {bm}, {{"kind", "sum"}, {"axes", Attribute::ints({0})}});  // [B,3]
  Value* sm = mb.op("kiln.softmax", {logits3}, {{"axis", 1}});
  Value* cat = mb.op("kiln.concat", {sm, mb.op("kiln.transpose", {r}, {{"perm", Attribute::ints({1, 0})}})}, {{"axis", 1}});
  Value* mx = mb.op("kiln.reduce", {cat}, {{"kind", "max"}, {"axes", Attribute::ints({1})}});  // [B]
  Value* logit = mb.op("kiln.sub", {mb.op("kiln.reduce", {cat}, {{"kind", "sum"}, {"axes", Attribute::ints({1})}}), mx});
  Value* ce = mb.op("kiln.softmax_cross_entropy", {logits3, cls});
  Value* bce = mb.op("kiln.bce_with_logits", {logit, label});
  Value* loss = mb.op("kiln.add", {ce, bce});
  auto m = mb.finish(logit, loss, {{"optimizer", sgd()}});
  checkGradients(*m, mb.tensors, 1e-5);
}

// A value used several times gets the sum of its gradients; a non-trainable parameter and a
// kNonDifferentiable path get none.
TEST(Autodiff, SkipsFrozenParametersAndNonDifferentiablePaths) {
  ModelBuilder mb;
  DType f = DType::f64;
  Dim B = Dim::symbol("B");
  Value* x = mb.input("x", f, {B, Dim::fixed(2)}, mb.random(f, {3, 2}, 1.0));
  Value* label = mb.input("label", f, {B}, values(f, {3}, {1, 0, 0}));
  Value* w = mb.param("w", {2});
  Value* frozen = mb.param("frozen", {2}, 0.5, {{"trainable", false}});
  Value* xw = mb.op("kiln.mul", {x, w});
  Value* twice = mb.op("kiln.add", {mb.op("kiln.mul", {xw, frozen}), mb.op("kiln.mul", {xw, xw})});
  Value* logit = mb.op("kiln.reduce", {twice}, {{"kind", "sum"}, {"axes", Attribute::ints({1})}});
  Value* loss = mb.op("kiln.bce_with_logits", {logit, label});
  auto m = mb.finish(logit, loss, {{"optimizer", sgd()}});
  checkGradients(*m, mb.tensors);
  int updates = 0;
  for (const auto& op : m->lookup("train_step")->entry().ops())
    if (op->name() == "kiln.optimizer_update") {
      ++updates;
      EXPECT_EQ(op->strAttr("param"), "w");
    }
  EXPECT_EQ(updates, 1);
}

// Global-norm clipping: the applied step is the unclipped gradient scaled to norm `grad_clip`,
// where the norm covers dense gradients and the combined embedding row gradients.
TEST(Autodiff, GradientClippingScalesToTheGlobalNorm) {
  ModelBuilder plain_mb;
  auto plain = buildEmbeddingModel(plain_mb, {});
  ASSERT_TRUE(buildTrainStep(*plain).isOk());
  std::map<std::string, HostTensor> t_plain = plain_mb.tensors;
  addStepTensors(*plain->lookup("train_step"), t_plain);
  ASSERT_TRUE(interpretInPlace(*plain->lookup("train_step"), t_plain, kSymbols).isOk());

  std::map<std::string, std::vector<double>> grads;
  double norm2 = 0;
  for (const std::string& name : trainableNames(*plain)) {
    const HostTensor& before = plain_mb.tensors.at(name);
    for (int64_t i = 0; i < before.numel(); ++i) {
      double g = ModelBuilder::get(before, i) - ModelBuilder::get(t_plain.at(name), i);
      grads[name].push_back(g);
      norm2 += g * g;
    }
  }
  double norm = std::sqrt(norm2);
  ASSERT_GT(norm, 0.1);
  for (double clip : {norm / 4, norm * 2}) {
    ModelBuilder mb;
    auto m = buildEmbeddingModel(mb, {{"grad_clip", clip}});
    Status s = buildTrainStep(*m);
    ASSERT_TRUE(s.isOk()) << s.str();
    std::map<std::string, HostTensor> t = mb.tensors;
    addStepTensors(*m->lookup("train_step"), t);
    auto out = interpretInPlace(*m->lookup("train_step"), t, kSymbols);
    ASSERT_TRUE(out.isOk()) << out.status().str();
    double factor = std::min(1.0, clip / norm);
    for (const auto& [name, g] : grads)
      for (size_t i = 0; i < g.size(); ++i) {
        double applied = ModelBuilder::get(mb.tensors.at(name), static_cast<int64_t>(i)) -
                         ModelBuilder::get(t.at(name), static_cast<int64_t>(i));
        EXPECT_NEAR(applied, g[i] * factor, 1e-12) << name << "[" << i << "] clip " << clip;
      }
  }
}

// Adam on dense parameters and lazy Adam on tables, two steps: state is created, named and
// threaded through, and the step input drives bias correction (checked by the op tests).
TEST(Autodiff, AdamStateAndScheduleInputs) {
  ModelBuilder mb;
  auto m = buildEmbeddingModel(mb, {{"embedding_optimizer", AttrDict{{"kind", "adam"}, {"lr", 0.01}}},
                                    {"lr_schedule", AttrDict{{"kind", "warmup_decay"}, {"warmup_steps", 2}}}});
  m->mutableAttrs()["kiln.train"] = [&] {
    AttrDict train = m->attrs().at("kiln.train").asDict();
    train["optimizer"] = AttrDict{{"kind", "adamw"}, {"lr", 0.01}, {"weight_decay", 0.1}};
    return train;
  }();
  ASSERT_TRUE(buildTrainStep(*m).isOk());
  const Function& step = *m->lookup("train_step");
  std::set<std::string> state;
  std::set<std::string> roles;
  for (const auto& op : step.entry().ops()) {
    if (op->name() == "kiln.parameter" && op->hasAttr("state_of")) state.insert(op->strAttr("name"));
    if (op->name() == "kiln.input" && op->hasAttr("role")) roles.insert(op->strAttr("role"));
  }
  EXPECT_TRUE(roles.count("lr") && roles.count("step"));
  std::set<std::string> want{"tables.0.adam_m", "tables.0.adam_v", "tables.1.adam_m", "tables.1.adam_v",
                             "bottom.weight.adam_m", "bottom.weight.adam_v", "top.weight.adam_m", "top.weight.adam_v"};
  EXPECT_EQ(state, want);
  EXPECT_EQ(step.resultTypes().size(), 2u);

  std::map<std::string, HostTensor> t = mb.tensors;
  addStepTensors(step, t);
  for (int64_t k = 1; k <= 2; ++k) {
    t["lr"] = f32Scalar(learningRateFactor(m->attrs().at("kiln.train").asDict().at("lr_schedule").asDict(), k));
    t["step"] = f32Scalar(static_cast<double>(k));
    auto out = interpretInPlace(step, t, kSymbols);
    ASSERT_TRUE(out.isOk()) << out.status().str();
  }
  // After the first Adam step every touched element moved by about lr * factor (|m̂/√v̂| = 1).
  double moved = std::abs(ModelBuilder::get(t.at("tables.0.adam_m"), 4 * 3));
  EXPECT_GT(moved, 0);
  EXPECT_EQ(ModelBuilder::get(t.at("tables.0.adam_m"), 2 * 3), 0.0);  // row 2 of tables.0 never looked up
}

TEST(Autodiff, Errors) {
  auto message = [](std::unique_ptr<Module> m) {
    Status s = buildTrainStep(*m);
    EXPECT_EQ(m->lookup("train_step"), nullptr) << "no half-built @train_step on error";
    return s.isOk() ? std::string("ok") : s.message();
  };
  {
    ModelBuilder mb;
    auto m = buildMlp(mb, {});
    m->mutableAttrs().erase("kiln.train");
    EXPECT_EQ(message(std::move(m)), "the model has no training block ('kiln.train')");
  }
  {
    ModelBuilder mb;
    auto m = buildMlp(mb, {{"optimizer", AttrDict{{"kind", "lamb"}, {"lr", 0.1}}}});
    EXPECT_EQ(message(std::move(m)),
              "kiln.train optimizer: unknown optimizer 'lamb'; expected one of sgd, adagrad, adam, adamw");
  }
  {
    ModelBuilder mb;
    auto m = buildMlp(mb, {{"optimizer", AttrDict{{"kind", "sgd"}, {"lr", 0.1}, {"momentun", 0.9}}}});
    EXPECT_EQ(message(std::move(m)), "kiln.train optimizer: optimizer 'sgd' has no setting 'momentun'");
  }
  {
    ModelBuilder mb;
    auto m = buildMlp(mb, {{"lr_schedule", AttrDict{{"kind", "cosine"}}}});
    EXPECT_EQ(message(std::move(m)),
              "unknown lr_schedule kind 'cosine'; expected constant, warmup_decay or exponential");
  }
  {
    ModelBuilder mb;
    auto m = buildEmbeddingModel(mb, {{"embedding_optimizer", AttrDict{{"kind", "adamw"}, {"lr", 0.1}}}});
    EXPECT_EQ(message(std::move(m)),
              "parameter 'tables.0': unknown optimizer 'adamw'; expected one of sgd, adagrad, rowwise_adagrad, adam");
  }
  {
    // A shared table's lookups of two hotnesses cannot sit side by side in one update.
    ModelBuilder mb;
    Dim B = Dim::symbol("B");
    Value* label = mb.input("label", mb.dtype_, {B}, values(mb.dtype_, {3}, {0, 1, 1}));
    Value* a =
        mb.input("cats.0", DType::i64, {B, Dim::fixed(2)}, values(DType::i64, {3, 2}, {1, 2, 3, 4, 5, 0}));
    Value* c = mb.input("cats.1", DType::i64, {B, Dim::fixed(1)}, values(DType::i64, {3, 1}, {1, 2, 3}));
    Value* t = mb.param("tables.0", {6, 1}, 0.5, {{"embedding", true}});
    Value* sum = mb.op("kiln.add", {mb.op("kiln.embedding_bag", {t, a}, {{"mode", "sum"}}),
                                    mb.op("kiln.embedding_bag", {t, c}, {{"mode", "sum"}})});
    Value* logit = mb.typed("kiln.reshape", sum, TensorType(mb.dtype_, {B}));
    auto m = mb.finish(logit, mb.op("kiln.bce_with_logits", {logit, label}),
                       {{"optimizer", sgd()}, {"embedding_optimizer", sgd()}});
    EXPECT_EQ(message(std::move(m)),
              "embedding table 'tables.0' is shared by lookups of different forms (!kiln.tensor<Bx2xi64> and "
              "!kiln.tensor<Bx1xi64>); a shared table's lookups need one hotness, weighting and id type");
  }
}

// bf16: matmuls read and write bf16, parameters stay f32 and get f32 updates; the step's loss
// stays close to the f32 one.
TEST(MixedPrecision, MatmulsInBf16MasterWeightsF32) {
  ModelBuilder ref_mb(DType::f32);
  auto ref = buildMlp(ref_mb, {});
  ASSERT_TRUE(buildTrainStep(*ref).isOk());
  std::map<std::string, HostTensor> t_ref = ref_mb.tensors;
  addStepTensors(*ref->lookup("train_step"), t_ref, 0.1);
  ASSERT_TRUE(interpretInPlace(*ref->lookup("train_step"), t_ref, kSymbols).isOk());

  ModelBuilder mb(DType::f32);  // same seed: the same tensors as ref_mb
  auto m = buildMlp(mb, {{"precision", "bf16"}});
  double f32_loss = forwardLoss(*m, mb.tensors);
  auto changed = castMatmulsToBf16(*m->lookup("forward"));
  ASSERT_TRUE(changed.isOk() && *changed);
  ASSERT_TRUE(verify(*m).isOk());
  int matmuls = 0;
  for (const auto& op : m->lookup("forward")->entry().ops())
    if (op->name() == "kiln.matmul") {
      ++matmuls;
      EXPECT_EQ(op->operand(0)->type().dtype(), DType::bf16);
      EXPECT_EQ(op->result()->type().dtype(), DType::bf16);
    }
  EXPECT_EQ(matmuls, 2);
  EXPECT_NEAR(forwardLoss(*m, mb.tensors), f32_loss, 2e-2 * std::abs(f32_loss));
  ASSERT_TRUE(buildTrainStep(*m).isOk());
  for (const auto& op : m->lookup("train_step")->entry().ops()) {
    if (op->name() == "kiln.optimizer_update") {
      EXPECT_EQ(op->operand(1)->type().dtype(), DType::f32);
    }
  }
  std::map<std::string, HostTensor> t = mb.tensors;
  addStepTensors(*m->lookup("train_step"), t, 0.1);
  auto out = interpretInPlace(*m->lookup("train_step"), t, kSymbols);
  ASSERT_TRUE(out.isOk()) << out.status().str();
  // The bf16 step's updates agree with the f32 step's to bf16 precision.
  for (const std::string& name : trainableNames(*m)) {
    double max_update = 0;
    for (int64_t i = 0; i < t_ref.at(name).numel(); ++i)
      max_update = std::max(max_update, std::abs(ModelBuilder::get(t_ref.at(name), i) - ModelBuilder::get(mb.tensors.at(name), i)));
    ASSERT_GT(max_update, 0) << name;
    for (int64_t i = 0; i < t.at(name).numel(); ++i) {
      double want = ModelBuilder::get(t_ref.at(name), i) - ModelBuilder::get(mb.tensors.at(name), i);
      double got = ModelBuilder::get(t.at(name), i) - ModelBuilder::get(mb.tensors.at(name), i);
      EXPECT_NEAR(got, want, 3e-2 * max_update) << name << "[" << i << "]";
    }
  }
  // A second run changes nothing.
  auto again = castMatmulsToBf16(*m->lookup("forward"));
  ASSERT_TRUE(again.isOk());
  EXPECT_FALSE(*again);
}

}  // namespace
}  // namespace kiln::passes
