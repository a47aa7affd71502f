// The optimizer ops' CPU kernels against independent formulas written out here: every dense
// optimizer over several steps, every sparse embedding optimizer with duplicate ids, mean
// pooling, per-id weights and variable lengths, and the rows a batch does not touch.
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/optimizer.h"

namespace kiln::ir {
namespace {

using Vec = std::vector<double>;

HostTensor tensor(DType t, std::vector<int64_t> shape, const Vec& values) {
  HostTensor h(t, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) {
    if (t == DType::f64) h.as<double>()[i] = values[i];
    else if (t == DType::f32) h.as<float>()[i] = static_cast<float>(values[i]);
    else if (t == DType::i64) h.as<int64_t>()[i] = static_cast<int64_t>(values[i]);
    else if (t == DType::i32) h.as<int32_t>()[i] = static_cast<int32_t>(values[i]);
  }
  return h;
}

Vec values(const HostTensor& h) {
  Vec out(static_cast<size_t>(h.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = h.view.dtype == DType::f64 ? h.as<double>()[i] : h.as<float>()[i];
  return out;
}

TensorType typeOf(const HostTensor& h) {
  Shape s;
  for (int64_t d : h.view.shape) s.push_back(Dim::fixed(d));
  return TensorType(h.view.dtype, s);
}

// A function holding one update op whose operands are parameters (written in place) or inputs;
// run() calls the op's CPU kernel on the given host tensors.
class UpdateHarness {
 public:
  UpdateHarness() : func_(module_.addFunction("t")), builder_(func_.entry()) {}

  Value* param(const std::string& name, const HostTensor& h) { return source("kiln.parameter", name, h); }
  Value* input(const std::string& name, const HostTensor& h) { return source("kiln.input", name, h); }

  Status build(const std::string& op_name, const std::vector<Value*>& operands, AttrDict attrs) {
    auto op = builder_.create(op_name, operands, std::move(attrs));
    if (!op) return op.status();
    op_ = *op;
    return Status::ok();
  }

  Status run(std::vector<TensorView*> results = {}) {
    std::vector<const TensorView*> views;
    for (Value* v : op_->operands()) views.push_back(&tensors_.at(v)->view);
    return op_->def()->cpu(*op_, views, results, CpuContext{});
  }

  HostTensor& at(Value* v) { return *tensors_.at(v); }

 private:
  Value* source(const char* kind, const std::string& name, const HostTensor& h) {
    auto op = builder_.createWithTypes(kind, {}, {typeOf(h)}, {{"name", name}});
    EXPECT_TRUE(op.isOk()) << op.status().str();
    storage_.push_back(std::make_unique<HostTensor>(h));
    tensors_[(*op)->result()] = storage_.back().get();
    return (*op)->result();
  }

  Module module_;
  Function& func_;
  Builder builder_;
  Op* op_ = nullptr;
  std::vector<std::unique_ptr<HostTensor>> storage_;
  std::map<Value*, HostTensor*> tensors_;
};

HostTensor scalar(double v) { return tensor(DType::f32, {}, {v}); }

void expectNear(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " [" << i << "]";
}

// ---- Dense --------------------------------------------------------------------------------------

struct DenseCase {
  std::string kind;
  AttrDict attrs;
};

// Runs three steps with changing gradients, lr factors and a clipping scale; checks param and
// state against a plain per-element reference after each.
void runDense(const DenseCase& c, DType dtype, double tol) {
  Vec p0{0.5, -1.25, 2.0, 0.0}, g_base{0.3, -0.7, 1.1, 0.05};
  double base_lr = c.attrs.at("lr").asDouble();
  double wd = c.attrs.count("weight_decay") ? c.attrs.at("weight_decay").asDouble() : 0;
  double mom = c.attrs.count("momentum") ? c.attrs.at("momentum").asDouble() : 0;
  bool nesterov = c.attrs.count("nesterov") && c.attrs.at("nesterov").asBool();
  double eps = c.attrs.count("eps") ? c.attrs.at("eps").asDouble() : 1e-8;
  double b1 = c.attrs.count("beta1") ? c.attrs.at("beta1").asDouble() : 0.9;
  double b2 = c.attrs.count("beta2") ? c.attrs.at("beta2").asDouble() : 0.999;
  double acc0 = c.attrs.count("initial_accumulator") ? c.attrs.at("initial_accumulator").asDouble() : 0;

  auto slots = denseOptimizerState(c.kind, c.attrs);
  UpdateHarness h;
  Value* p = h.param("w", tensor(dtype, {2, 2}, p0));
  Value* g = h.input("g", tensor(dtype, {2, 2}, g_base));
  std::vector<Value*> operands{p, g};
  for (auto& s : slots) operands.push_back(h.param("w." + s.suffix, tensor(dtype, {2, 2}, Vec(4, s.initial_value))));
  Value* lr = h.input("lr", scalar(1));
  Value* step = h.input("step", scalar(1));
  Value* scale = h.input("scale", scalar(1));
  operands.insert(operands.end(), {lr, step, scale});
  AttrDict attrs = c.attrs;
  attrs["kind"] = c.kind;
  attrs["scaled"] = true;
  ASSERT_TRUE(h.build("kiln.optimizer_update", operands, attrs).isOk());

  Vec w = p0, m(4, 0.0), v(4, 0.0), s(4, acc0);
  for (int t = 1; t <= 3; ++t) {
    // The lr input is f32, so the reference uses the factor as rounded to f32.
    double lr_factor = static_cast<float>(1.0 / t), clip = t == 2 ? 0.5 : 1.0;
    Vec grad(4);
    for (int i = 0; i < 4; ++i) grad[i] = g_base[i] * t - 0.1 * i;
    h.at(g) = tensor(dtype, {2, 2}, grad);
    h.at(lr) = scalar(lr_factor);
    h.at(step) = scalar(t);
    h.at(scale) = scalar(clip);
    ASSERT_TRUE(h.run().isOk());
    double a = base_lr * lr_factor;
    for (int i = 0; i < 4; ++i) {
      double gi = grad[i] * clip;
      if (c.kind == "sgd") {
        gi += wd * w[i];
        if (mom != 0) {
          m[i] = mom * m[i] + gi;
          w[i] -= a * (nesterov ? gi + mom * m[i] : m[i]);
        } else {
          w[i] -= a * gi;
        }
      } else if (c.kind == "adagrad") {
        gi += wd * w[i];
        s[i] += gi * gi;
        w[i] -= a * gi / (std::sqrt(s[i]) + eps);
      } else {
        if (c.kind == "adamw") w[i] *= 1 - a * wd;
        else gi += wd * w[i];
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
        w[i] -= a * mhat / (std::sqrt(vhat) + eps);
      }
    }
    expectNear(values(h.at(p)), w, tol, c.kind + " param, step " + std::to_string(t));
    if (c.kind == "sgd" && mom != 0) expectNear(values(h.at(operands[2])), m, tol, "momentum");
    if (c.kind == "adagrad") expectNear(values(h.at(operands[2])), s, tol, "adagrad_sum");
    if (c.kind == "adam" || c.kind == "adamw") {
      expectNear(values(h.at(operands[2])), m, tol, "adam_m");
      expectNear(values(h.at(operands[3])), v, tol, "adam_v");
    }
  }
}

TEST(OptimizerUpdate, Sgd) { runDense({"sgd", {{"lr", 0.1}}}, DType::f64, 1e-12); }
TEST(OptimizerUpdate, SgdWeightDecay) { runDense({"sgd", {{"lr", 0.1}, {"weight_decay", 0.01}}}, DType::f64, 1e-12); }
TEST(OptimizerUpdate, SgdMomentum) { runDense({"sgd", {{"lr", 0.1}, {"momentum", 0.9}}}, DType::f64, 1e-12); }
TEST(OptimizerUpdate, SgdNesterov) {
  runDense({"sgd", {{"lr", 0.1}, {"momentum", 0.9}, {"nesterov", true}, {"weight_decay", 0.001}}}, DType::f64, 1e-12);
}
TEST(OptimizerUpdate, Adagrad) {
  runDense({"adagrad", {{"lr", 0.05}, {"eps", 1e-10}, {"initial_accumulator", 0.1}}}, DType::f64, 1e-12);
}
TEST(OptimizerUpdate, Adam) { runDense({"adam", {{"lr", 0.01}, {"weight_decay", 0.1}}}, DType::f64, 1e-12); }
TEST(OptimizerUpdate, AdamW) {
  runDense({"adamw", {{"lr", 0.01}, {"weight_decay", 0.1}, {"beta1", 0.8}, {"beta2", 0.99}}}, DType::f64, 1e-12);
}
TEST(OptimizerUpdate, AdamF32) { runDense({"adam", {{"lr", 0.01}}}, DType::f32, 1e-6); }

// One step by hand: SGD with momentum 0.5, lr 0.1, two steps on a single weight.
TEST(OptimizerUpdate, SgdMomentumByHand) {
  UpdateHarness h;
  Value* p = h.param("w", tensor(DType::f64, {1}, {1.0}));
  Value* g = h.input("g", tensor(DType::f64, {1}, {2.0}));
  Value* m = h.param("w.momentum", tensor(DType::f64, {1}, {0.0}));
  Value* lr = h.input("lr", scalar(1));
  Value* step = h.input("step", scalar(1));
  ASSERT_TRUE(h.build("kiln.optimizer_update", {p, g, m, lr, step}, {{"kind", "sgd"}, {"lr", 0.1}, {"momentum", 0.5}}).isOk());
  ASSERT_TRUE(h.run().isOk());
  // m = 2, w = 1 - 0.2 = 0.8
  EXPECT_DOUBLE_EQ(h.at(p).as<double>()[0], 0.8);
  ASSERT_TRUE(h.run().isOk());
  // m = 0.5*2 + 2 = 3, w = 0.8 - 0.3 = 0.5
  EXPECT_DOUBLE_EQ(h.at(m).as<double>()[0], 3.0);
  EXPECT_DOUBLE_EQ(h.at(p).as<double>()[0], 0.5);
}

TEST(OptimizerUpdate, RejectsBadOperands) {
  UpdateHarness h;
  Value* p = h.param("w", tensor(DType::f32, {2}, {0, 0}));
  Value* g = h.input("g", tensor(DType::f32, {3}, {0, 0, 0}));
  Value* lr = h.input("lr", scalar(1));
  Value* step = h.input("step", scalar(1));
  Status s = h.build("kiln.optimizer_update", {p, g, lr, step}, {{"kind", "sgd"}, {"lr", 0.1}});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("expected the parameter's"), std::string::npos) << s.message();
  // Adagrad needs its accumulator.
  Value* g2 = h.input("g2", tensor(DType::f32, {2}, {0, 0}));
  s = h.build("kiln.optimizer_update", {p, g2, lr, step}, {{"kind", "adagrad"}, {"lr", 0.1}});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("expects 5 operands"), std::string::npos) << s.message();
  // The parameter must be named storage: an input cannot be updated in place.
  s = h.build("kiln.optimizer_update", {g2, g2, lr, step}, {{"kind", "sgd"}, {"lr", 0.1}});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("must be a kiln.parameter"), std::string::npos) << s.message();
}

// ---- Sparse -------------------------------------------------------------------------------------

struct Lookup {
  std::vector<int64_t> ids;      // flat
  std::vector<int64_t> lengths;  // per sample (fixed hotness: all equal)
  Vec weights;                   // empty: unweighted
  bool flat = false;             // ids [N] + lengths instead of [B, H]
  bool mean = false;
};

// The dense table gradient, written out naively, and the set of touched rows.
Vec naiveTableGrad(const Lookup& l, const Vec& grad_out, int64_t rows, int64_t dim, std::set<int64_t>& touched) {
  Vec G(static_cast<size_t>(rows * dim), 0.0);
  size_t pos = 0;
  for (size_t b = 0; b < l.lengths.size(); ++b) {
    for (int64_t j = 0; j < l.lengths[b]; ++j, ++pos) {
      double c = l.weights.empty() ? 1.0 : l.weights[pos];
      if (l.mean) c /= static_cast<double>(l.lengths[b]);
      int64_t r = l.ids[pos];
      touched.insert(r);
      for (int64_t d = 0; d < dim; ++d) G[r * dim + d] += c * grad_out[b * dim + d];
    }
  }
  return G;
}

void runSparse(const std::string& kind, const Lookup& l, AttrDict extra = {}) {
  const int64_t rows = 6, dim = 3, batch = static_cast<int64_t>(l.lengths.size());
  Vec table0(rows * dim);
  for (size_t i = 0; i < table0.size(); ++i) table0[i] = 0.1 * static_cast<double>(i) - 0.7;
  Vec grad_out(static_cast<size_t>(batch * dim));
  for (size_t i = 0; i < grad_out.size(); ++i) grad_out[i] = std::sin(1.0 + static_cast<double>(i));
  double base_lr = 0.2, wd = extra.count("weight_decay") ? extra.at("weight_decay").asDouble() : 0;
  double eps = extra.count("eps") ? extra.at("eps").asDouble() : 1e-8, b1 = 0.9, b2 = 0.999;

  UpdateHarness h;
  Value* table = h.param("t", tensor(DType::f64, {rows, dim}, table0));
  int64_t n = static_cast<int64_t>(l.ids.size());
  Vec ids(l.ids.begin(), l.ids.end());
  std::vector<Value*> operands{table};
  if (l.flat) {
    operands.push_back(h.input("ids", tensor(DType::i64, {n}, ids)));
    operands.push_back(h.input("len", tensor(DType::i32, {batch}, Vec(l.lengths.begin(), l.lengths.end()))));
  } else {
    operands.push_back(h.input("ids", tensor(DType::i32, {batch, n / batch}, ids)));
  }
  std::vector<int64_t> id_shape = l.flat ? std::vector<int64_t>{n} : std::vector<int64_t>{batch, n / batch};
  if (!l.weights.empty()) operands.push_back(h.input("w", tensor(DType::f64, id_shape, l.weights)));
  Value* gout = h.input("gout", tensor(DType::f64, {batch, dim}, grad_out));
  operands.push_back(gout);
  AttrDict attrs = extra;
  attrs["optimizer"] = kind;
  attrs["lr"] = base_lr;
  attrs["mode"] = l.mean ? "mean" : "sum";
  attrs["weighted"] = !l.weights.empty();
  attrs["table"] = "t";
  auto slots = sparseOptimizerState(kind, attrs);
  std::vector<Value*> state;
  for (auto& s : slots) {
    int64_t size = s.rowwise ? rows : rows * dim;
    Vec init(static_cast<size_t>(size));
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.01 * static_cast<double>(i % 5);  // non-zero, to see untouched rows keep it
    std::vector<int64_t> shape = s.rowwise ? std::vector<int64_t>{rows} : std::vector<int64_t>{rows, dim};
    state.push_back(h.param("t." + s.suffix, tensor(DType::f64, shape, init)));
    operands.push_back(state.back());
  }
  Value* lr = h.input("lr", scalar(0.5));
  Value* step = h.input("step", scalar(3));
  operands.push_back(lr);
  operands.push_back(step);
  Status built = h.build("kiln.embedding_bag_update", operands, attrs);
  ASSERT_TRUE(built.isOk()) << built.str();

  std::vector<Vec> state0;
  for (Value* s : state) state0.push_back(values(h.at(s)));
  ASSERT_TRUE(h.run().isOk());

  std::set<int64_t> touched;
  Vec G = naiveTableGrad(l, grad_out, rows, dim, touched);
  Vec w = table0;
  std::vector<Vec> st = state0;
  double a = base_lr * 0.5;
  for (int64_t r : touched) {
    Vec g(dim);
    for (int64_t d = 0; d < dim; ++d) g[d] = G[r * dim + d] + wd * w[r * dim + d];
    if (kind == "rowwise_adagrad") {
      double mean_sq = 0;
      for (double x : g) mean_sq += x * x / dim;
      st[0][r] += mean_sq;
    }
    for (int64_t d = 0; d < dim; ++d) {
      size_t i = static_cast<size_t>(r * dim + d);
      if (kind == "sgd") {
        w[i] -= a * g[d];
      } else if (kind == "adagrad") {
        st[0][i] += g[d] * g[d];
        w[i] -= a * g[d] / (std::sqrt(st[0][i]) + eps);
      } else if (kind == "rowwise_adagrad") {
        w[i] -= a * g[d] / (std::sqrt(st[0][r]) + eps);
      } else {
        st[0][i] = b1 * st[0][i] + (1 - b1) * g[d];
        st[1][i] = b2 * st[1][i] + (1 - b2) * g[d] * g[d];
        w[i] -= a * (st[0][i] / (1 - std::pow(b1, 3))) / (std::sqrt(st[1][i] / (1 - std::pow(b2, 3))) + eps);
      }
    }
  }
  Vec got = values(h.at(table));
  expectNear(got, w, 1e-12, kind + " table");
  for (size_t k = 0; k < state.size(); ++k) expectNear(values(h.at(state[k])), st[k], 1e-12, kind + " state");
  // Rows no id selected are bit-identical, and so is their state.
  for (int64_t r = 0; r < rows; ++r) {
    if (touched.count(r)) continue;
    for (int64_t d = 0; d < dim; ++d) EXPECT_EQ(got[r * dim + d], table0[r * dim + d]) << "untouched row " << r;
  }
}

// Row 2 appears three times (twice in one sample), row 4 twice; rows 1, 3, 5 are untouched
// (row 0 too, except in the flat case).
const Lookup kFixed{{2, 2, 4, 2, 4, 0}, {2, 2, 2}, {}, false, false};
const Lookup kFixedMeanWeighted{{2, 2, 4, 2, 4, 0}, {2, 2, 2}, {0.5, -1.0, 2.0, 1.5, 0.25, 3.0}, false, true};
const Lookup kFlat{{2, 4, 4, 2, 2}, {3, 0, 2}, {}, true, true};  // an empty bag in the middle

TEST(EmbeddingBagUpdate, SgdDuplicates) { runSparse("sgd", kFixed); }
TEST(EmbeddingBagUpdate, SgdWeightedMeanDecay) { runSparse("sgd", kFixedMeanWeighted, {{"weight_decay", 0.05}}); }
TEST(EmbeddingBagUpdate, AdagradFlatLengths) { runSparse("adagrad", kFlat, {{"eps", 1e-10}}); }
TEST(EmbeddingBagUpdate, Adagrad) { runSparse("adagrad", kFixedMeanWeighted); }
TEST(EmbeddingBagUpdate, RowwiseAdagrad) { runSparse("rowwise_adagrad", kFixed, {{"eps", 1e-10}}); }
TEST(EmbeddingBagUpdate, RowwiseAdagradFlat) { runSparse("rowwise_adagrad", kFlat); }
TEST(EmbeddingBagUpdate, LazyAdam) { runSparse("adam", kFixed); }
TEST(EmbeddingBagUpdate, LazyAdamWeighted) { runSparse("adam", kFixedMeanWeighted, {{"weight_decay", 0.01}}); }

// A row the batch selects twice with opposite weights has a zero combined gradient but is still
// touched: SGD leaves it, while Adam's moments decay (lazy Adam updates every touched row).
TEST(EmbeddingBagUpdate, CancellingDuplicatesStillTouch) {
  runSparse("adam", Lookup{{1, 1}, {2}, {1.0, -1.0}, false, false});
}

TEST(EmbeddingBagUpdate, IdOutOfRangeIsAnError) {
  UpdateHarness h;
  Value* table = h.param("tables.0", tensor(DType::f32, {4, 2}, Vec(8, 0.0)));
  Value* ids = h.input("ids", tensor(DType::i64, {2, 1}, {1, 7}));
  Value* gout = h.input("g", tensor(DType::f32, {2, 2}, Vec(4, 1.0)));
  Value* lr = h.input("lr", scalar(1));
  Value* step = h.input("step", scalar(1));
  ASSERT_TRUE(h.build("kiln.embedding_bag_update", {table, ids, gout, lr, step},
                      {{"optimizer", "sgd"}, {"lr", 0.1}, {"table", "tables.0"}}).isOk());
  Status s = h.run();
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("'tables.0': id 7 at position 1 is out of range [0, 4)"), std::string::npos) << s.message();
}

TEST(EmbeddingBagUpdate, RejectsWrongStateShape) {
  UpdateHarness h;
  Value* table = h.param("t", tensor(DType::f32, {4, 2}, Vec(8, 0.0)));
  Value* ids = h.input("ids", tensor(DType::i64, {2, 1}, {1, 2}));
  Value* gout = h.input("g", tensor(DType::f32, {2, 2}, Vec(4, 1.0)));
  Value* acc = h.param("t.rowwise_adagrad_sum", tensor(DType::f32, {4, 2}, Vec(8, 0.0)));
  Value* lr = h.input("lr", scalar(1));
  Value* step = h.input("step", scalar(1));
  Status s = h.build("kiln.embedding_bag_update", {table, ids, gout, acc, lr, step},
                     {{"optimizer", "rowwise_adagrad"}, {"lr", 0.1}});
  ASSERT_FALSE(s.isOk());
  EXPECT_NE(s.message().find("expected !kiln.tensor<4xf32>"), std::string::npos) << s.message();
}

// Lengths that do not tile the ids are an error from ir::idSamples, which the reference hooks and
// the CPU kernel share.
TEST(EmbeddingBagGradSqnorm, LengthsMustTileTheIds) {
  struct Case {
    Vec lengths;
    std::string error;
  };
  for (const Case& c : {Case{{2, 2}, "lengths do not match the 3 ids (sample 1 has length 2)"},
                        Case{{1, -1}, "lengths do not match the 3 ids (sample 1 has length -1)"},
                        Case{{1, 1}, "lengths sum to 2 but there are 3 ids"}}) {
    UpdateHarness h;
    Value* ids = h.input("ids", tensor(DType::i64, {3}, {0, 1, 2}));
    Value* len = h.input("len", tensor(DType::i64, {2}, c.lengths));
    Value* g = h.input("g", tensor(DType::f64, {2, 2}, Vec(4, 1.0)));
    ASSERT_TRUE(h.build("kiln.embedding_bag_grad_sqnorm", {ids, len, g}, {{"mode", "mean"}}).isOk());
    HostTensor out(DType::f64, {});
    Status s = h.run({&out.view});
    ASSERT_FALSE(s.isOk());
    EXPECT_NE(s.message().find(c.error), std::string::npos) << s.message();
  }
}

// The squared norm of the (never materialized) table gradient equals that of the naive one.
TEST(EmbeddingBagGradSqnorm, MatchesDenseGradient) {
  for (const Lookup* l : {&kFixed, &kFixedMeanWeighted, &kFlat}) {
    const int64_t dim = 3, batch = static_cast<int64_t>(l->lengths.size()), n = static_cast<int64_t>(l->ids.size());
    Vec grad_out(static_cast<size_t>(batch * dim));
    for (size_t i = 0; i < grad_out.size(); ++i) grad_out[i] = std::cos(0.3 * static_cast<double>(i));
    UpdateHarness h;
    Vec ids(l->ids.begin(), l->ids.end());
    std::vector<Value*> operands;
    std::vector<int64_t> id_shape = l->flat ? std::vector<int64_t>{n} : std::vector<int64_t>{batch, n / batch};
    operands.push_back(h.input("ids", tensor(DType::i64, id_shape, ids)));
    if (l->flat) operands.push_back(h.input("len", tensor(DType::i64, {batch}, Vec(l->lengths.begin(), l->lengths.end()))));
    if (!l->weights.empty()) operands.push_back(h.input("w", tensor(DType::f64, id_shape, l->weights)));
    operands.push_back(h.input("g", tensor(DType::f64, {batch, dim}, grad_out)));
    ASSERT_TRUE(h.build("kiln.embedding_bag_grad_sqnorm", operands,
                        {{"mode", l->mean ? "mean" : "sum"}, {"weighted", !l->weights.empty()}}).isOk());
    HostTensor out(DType::f64, {});
    ASSERT_TRUE(h.run({&out.view}).isOk());
    std::set<int64_t> touched;
    Vec G = naiveTableGrad(*l, grad_out, 6, dim, touched);
    double want = 0;
    for (double x : G) want += x * x;
    EXPECT_NEAR(out.as<double>()[0], want, 1e-12);
  }
}

}  // namespace
}  // namespace kiln::ir
