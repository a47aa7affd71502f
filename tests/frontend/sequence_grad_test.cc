// Gradients of the sequence builtins (frontend/sequence.cc, docs/language.md "Sequences"):
// sequence_pool (mean, sum, max), din_attention (unnormalized and softmax) and attention with
// lengths. Tiny models written in the language are lowered, one SGD step of @train_step runs on
// the reference interpreter (lr = 1, so old - new is the gradient), and every entry of every
// parameter is compared with central finite differences of the same loss written here as plain
// loops in double, which read only the valid rows of each sequence. The frontend has no f64
// dtype, so the model runs in f32 and the tolerances are f32's. The sequences come from a
// `pool = none` table, so the table's gradient is the gradient of the builtin's input; row 0,
// which only padding reads, must get none. A second group changes the padding rows of dense
// sequences and requires the outputs and the whole step to stay bit for bit the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "frontend/frontend.h"
#include "ir/interpreter.h"
#include "passes/autodiff.h"
#include "tests/frontend/numerics_util.h"

namespace kiln::frontend {
namespace {

using testing::randomF32;

using Tensors = std::map<std::string, ir::HostTensor>;
using Weights = std::map<std::string, std::vector<double>>;
using Shapes = std::map<std::string, std::vector<int64_t>>;
using Row = std::vector<double>;

constexpr int64_t kBatch = 3, kLen = 4, kRows = 8;

std::unique_ptr<ir::Module> compile(const std::string& src) {
  DiagnosticEngine d;
  auto m = compileModelSource("t.kiln", src, {}, d);
  EXPECT_TRUE(m) << d.str();
  return m ? m.take() : nullptr;
}

template <typename T>
ir::HostTensor intTensor(ir::DType dt, const std::vector<int64_t>& shape,
                         const std::vector<int64_t>& values) {
  ir::HostTensor t(dt, shape);
  EXPECT_EQ(t.numel(), static_cast<int64_t>(values.size()));
  for (int64_t i = 0; i < t.numel(); ++i) t.as<T>()[i] = static_cast<T>(values[static_cast<size_t>(i)]);
  return t;
}

ir::HostTensor f32Tensor(const std::vector<int64_t>& shape, const std::vector<double>& values) {
  ir::HostTensor t(ir::DType::f32, shape);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.as<float>()[i] = static_cast<float>(values[static_cast<size_t>(i)]);
  return t;
}

// ---- the loops ----------------------------------------------------------------------------

// The history of the gradient models: a variable-length feature of max_hotness kLen. Sample 0
// reads row 1 twice, sample 1 is empty, sample 2 is full; row 0 (the padding id) and row 6 are
// read by no valid position. The candidate of each sample is one more id.
const std::vector<int64_t> kLengths = {3, 0, 4};
const std::vector<int64_t> kIds = {1, 4, 1, 2, 5, 3, 7};
const std::vector<int64_t> kCandidates = {2, 7, 4};
const std::vector<double> kLabels = {1, 0, 1};

// The valid rows of sample b: table rows by id.
std::vector<Row> history(const std::vector<double>& table, int64_t dim, int64_t b) {
  int64_t start = 0;
  for (int64_t i = 0; i < b; ++i) start += kLengths[static_cast<size_t>(i)];
  std::vector<Row> rows;
  for (int64_t t = 0; t < kLengths[static_cast<size_t>(b)]; ++t) {
    const int64_t id = kIds[static_cast<size_t>(start + t)];
    rows.emplace_back(table.begin() + id * dim, table.begin() + (id + 1) * dim);
  }
  return rows;
}

Row tableRow(const std::vector<double>& table, int64_t dim, int64_t id) {
  return Row(table.begin() + id * dim, table.begin() + (id + 1) * dim);
}

// y = W x + b for W [out, in] as linear layers store it (bias optional).
Row affine(const std::vector<double>& w, const std::vector<double>* bias, const Row& x) {
  const size_t in = x.size(), out = w.size() / in;
  Row y(out, 0.0);
  for (size_t o = 0; o < out; ++o) {
    y[o] = bias ? (*bias)[o] : 0.0;
    for (size_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

// sequence_pool over the valid rows: zeros for an empty sequence.
Row pool(const std::vector<Row>& rows, int64_t dim, const std::string& mode) {
  Row r(static_cast<size_t>(dim), mode == "max" ? -INFINITY : 0.0);
  if (rows.empty()) return Row(static_cast<size_t>(dim), 0.0);
  for (const Row& row : rows)
    for (int64_t d = 0; d < dim; ++d) r[d] = mode == "max" ? std::max(r[d], row[d]) : r[d] + row[d];
  if (mode == "mean")
    for (double& v : r) v /= static_cast<double>(rows.size());
  return r;
}

// The mean of bce_with_logits over the batch, for logit = logit.weight * tanh(features) + bias.
double headLoss(const Weights& w, const std::vector<Row>& features) {
  double loss = 0;
  for (size_t b = 0; b < features.size(); ++b) {
    Row h = features[b];
    for (double& v : h) v = std::tanh(v);
    const double z = affine(w.at("logit.weight"), &w.at("logit.bias"), h)[0];
    loss += std::max(z, 0.0) - z * kLabels[b] + std::log1p(std::exp(-std::abs(z)));
  }
  return loss / static_cast<double>(features.size());
}

// DIN's activation unit with act = tanh: score each valid key by an MLP over (q, k, q - k, q * k),
// weight it by the raw score (or a softmax over the valid keys), sum the weighted keys.
Row din(const Weights& w, const std::string& name, const std::vector<size_t>& hidden, const Row& q,
        const std::vector<Row>& keys, bool softmax) {
  std::vector<double> score;
  for (const Row& k : keys) {
    Row h;
    for (const Row* part : {&q, &k}) h.insert(h.end(), part->begin(), part->end());
    for (size_t d = 0; d < q.size(); ++d) h.push_back(q[d] - k[d]);
    for (size_t d = 0; d < q.size(); ++d) h.push_back(q[d] * k[d]);
    for (size_t i = 0; i < hidden.size(); ++i) {
      const std::string layer = name + "." + std::to_string(i);
      h = affine(w.at(layer + ".weight"), &w.at(layer + ".bias"), h);
      for (double& v : h) v = std::tanh(v);
    }
    const std::string last = name + "." + std::to_string(hidden.size());
    score.push_back(affine(w.at(last + ".weight"), &w.at(last + ".bias"), h)[0]);
  }
  if (softmax && !score.empty()) {
    const double mx = *std::max_element(score.begin(), score.end());
    double z = 0;
    for (double& s : score) z += (s = std::exp(s - mx));
    for (double& s : score) s /= z;
  }
  Row r(q.size(), 0.0);
  for (size_t j = 0; j < keys.size(); ++j)
    for (size_t d = 0; d < q.size(); ++d) r[d] += score[j] * keys[j][d];
  return r;
}

// attention(x, heads, causal = false, rope = false) over the valid rows only (the keys past the
// length are masked, the padded rows of the result are zero and never read here).
std::vector<Row> maskedAttention(const Weights& w, const std::string& name, int64_t heads,
                                 const std::vector<Row>& x) {
  std::vector<Row> q, k, v, out;
  for (const Row& row : x) {
    q.push_back(affine(w.at(name + ".q.weight"), nullptr, row));
    k.push_back(affine(w.at(name + ".k.weight"), nullptr, row));
    v.push_back(affine(w.at(name + ".v.weight"), nullptr, row));
  }
  const size_t n = x.size(), hd = n ? q[0].size() / static_cast<size_t>(heads) : 0;
  for (size_t t = 0; t < n; ++t) {
    Row ctx(q[0].size(), 0.0);
    for (size_t h = 0; h < static_cast<size_t>(heads); ++h) {
      std::vector<double> score(n);
      for (size_t s = 0; s < n; ++s) {
        double dot = 0;
        for (size_t d = 0; d < hd; ++d) dot += q[t][h * hd + d] * k[s][h * hd + d];
        score[s] = dot / std::sqrt(static_cast<double>(hd));
      }
      const double mx = *std::max_element(score.begin(), score.end());
      double z = 0;
      for (double& s : score) z += (s = std::exp(s - mx));
      for (size_t s = 0; s < n; ++s)
        for (size_t d = 0; d < hd; ++d) ctx[h * hd + d] += score[s] / z * v[s][h * hd + d];
    }
    out.push_back(affine(w.at(name + ".o.weight"), nullptr, ctx));
  }
  return out;
}

// ---- the check ----------------------------------------------------------------------------

// The trainable parameters of @forward.
std::set<std::string> parameterNames(const ir::Module& m) {
  std::set<std::string> names;
  for (const auto& op : m.lookup("forward")->entry().ops())
    if (op->name() == "kiln.parameter" && op->boolAttr("trainable", true)) names.insert(op->strAttr("name"));
  return names;
}

struct GradientCase {
  std::string source;
  Shapes params;  // every trainable parameter, by name
  int64_t dim;    // the table's row width
  std::function<double(const Weights&)> loss;
};

// The history's inputs for a table of width `dim`.
Tensors historyInputs() {
  Tensors in;
  in["hist"] = intTensor<int64_t>(ir::DType::i64, {static_cast<int64_t>(kIds.size())}, kIds);
  in["hist.lengths"] = intTensor<int32_t>(ir::DType::i32, {kBatch}, kLengths);
  in["cand"] = intTensor<int64_t>(ir::DType::i64, {kBatch, 1}, kCandidates);
  in["label"] = f32Tensor({kBatch}, kLabels);
  return in;
}

void checkGradients(const GradientCase& c, uint32_t seed) {
  auto m = compile(c.source);
  ASSERT_TRUE(m);
  std::set<std::string> expected;
  for (const auto& [name, shape] : c.params) expected.insert(name);
  ASSERT_EQ(parameterNames(*m), expected);
  Status built = passes::buildTrainStep(*m);
  ASSERT_TRUE(built.isOk()) << built.str();

  std::mt19937 rng(seed);
  Tensors in = historyInputs();
  Weights w;
  for (const auto& [name, shape] : c.params) in[name] = randomF32(shape, rng, 0.5, w[name]);
  for (const char* name : {"lr", "step"}) in[name] = f32Tensor({}, {1.0});

  Tensors after = in;
  auto step = ir::interpretInPlace(*m->lookup("train_step"), after, {{"B", kBatch}});
  ASSERT_TRUE(step) << step.status().str();
  const double loss = c.loss(w);
  EXPECT_NEAR((*step)[0].as<float>()[0], loss, 1e-5 * (1 + loss)) << "the step's loss is the loops' loss";

  double largest = 0;
  for (const auto& [name, shape] : c.params) {
    SCOPED_TRACE(name);
    for (size_t e = 0; e < w[name].size(); ++e) {
      constexpr double kStep = 1e-6;
      Weights plus = w, minus = w;
      plus[name][e] += kStep;
      minus[name][e] -= kStep;
      const double fd = (c.loss(plus) - c.loss(minus)) / (2 * kStep);
      const auto i = static_cast<int64_t>(e);
      const double grad = static_cast<double>(in.at(name).as<float>()[i]) - after.at(name).as<float>()[i];
      EXPECT_NEAR(grad, fd, 2e-6 + 1e-4 * std::abs(fd)) << "entry " << e;
      largest = std::max(largest, std::abs(fd));
    }
  }
  EXPECT_GT(largest, 1e-2) << "the check needs gradients that are not all zero";
  // Row 0 is read only by padding (jagged_to_padded's fill) and row 6 by nothing: both keep
  // their values exactly.
  for (int64_t row : {0, 6})
    for (int64_t d = 0; d < c.dim; ++d)
      EXPECT_EQ(in.at("emb.0").as<float>()[row * c.dim + d], after.at("emb.0").as<float>()[row * c.dim + d])
          << "row " << row << " of the table";
}

class SequencePoolGradient : public ::testing::TestWithParam<std::string> {};

TEST_P(SequencePoolGradient, MatchesFiniteDifferencesOfLoops) {
  const std::string mode = GetParam();
  constexpr int64_t kDim = 3;
  GradientCase c;
  c.source = R"(model m {
  dim B
  input hist: ids[B] max_hotness(4)
  input label: f32[B]
  emb = embeddings(rows = 8, dim = 3, pool = none)
  user = sequence_pool(emb(hist), mode = )" +
             mode + R"()
  logit = linear(tanh(user), 1)
  output logit
  train {
    loss = bce_with_logits(logit, label)
    optimizer = sgd(lr = 1)
  }
})";
  c.params = {{"emb.0", {kRows, kDim}}, {"logit.weight", {1, kDim}}, {"logit.bias", {1}}};
  c.dim = kDim;
  c.loss = [mode](const Weights& w) {
    std::vector<Row> pooled;
    for (int64_t b = 0; b < kBatch; ++b) pooled.push_back(pool(history(w.at("emb.0"), kDim, b), kDim, mode));
    return headLoss(w, pooled);
  };
  checkGradients(c, 21);
}

INSTANTIATE_TEST_SUITE_P(Modes, SequencePoolGradient, ::testing::Values("mean", "sum", "max"));

class DinAttentionGradient : public ::testing::TestWithParam<bool> {};

TEST_P(DinAttentionGradient, MatchesFiniteDifferencesOfLoops) {
  const bool softmax = GetParam();
  constexpr int64_t kDim = 3, kHidden = 4;
  GradientCase c;
  c.source = std::string(R"(model m {
  dim B
  input hist: ids[B] max_hotness(4)
  input cand: ids[B]
  input label: f32[B]
  emb = embeddings(rows = 8, dim = 3, pool = none)
  keys = emb(hist)
  query = reshape(emb(cand), [B, 3])
  user = din_attention(query, keys, hidden = [4], act = tanh, softmax = )") +
             (softmax ? "true" : "false") + R"()
  logit = linear(tanh(user), 1)
  output logit
  train {
    loss = bce_with_logits(logit, label)
    optimizer = sgd(lr = 1)
  }
})";
  c.params = {{"emb.0", {kRows, kDim}},   {"user.0.weight", {kHidden, 4 * kDim}},
              {"user.0.bias", {kHidden}}, {"user.1.weight", {1, kHidden}},
              {"user.1.bias", {1}},       {"logit.weight", {1, kDim}},
              {"logit.bias", {1}}};
  c.dim = kDim;
  c.loss = [softmax](const Weights& w) {
    std::vector<Row> user;
    for (int64_t b = 0; b < kBatch; ++b)
      user.push_back(din(w, "user", {kHidden},
                         tableRow(w.at("emb.0"), kDim, kCandidates[static_cast<size_t>(b)]),
                         history(w.at("emb.0"), kDim, b), softmax));
    return headLoss(w, user);
  };
  checkGradients(c, 22);
}

INSTANTIATE_TEST_SUITE_P(Scores, DinAttentionGradient, ::testing::Values(false, true), [](const auto& info) {
  return std::string(info.param ? "Softmax" : "Unnormalized");
});

// attention over the history with its carried lengths, then mean pooling of its result (which
// carries them too).
TEST(SequenceGradient, MaskedAttentionMatchesFiniteDifferencesOfLoops) {
  constexpr int64_t kDim = 4, kHeads = 2;
  GradientCase c;
  c.source = R"(model m {
  dim B
  input hist: ids[B] max_hotness(4)
  input label: f32[B]
  emb = embeddings(rows = 8, dim = 4, pool = none)
  mixed = attention(emb(hist), heads = 2, causal = false, rope = false)
  user = sequence_pool(mixed, mode = mean)
  logit = linear(tanh(user), 1)
  output logit
  train {
    loss = bce_with_logits(logit, label)
    optimizer = sgd(lr = 1)
  }
})";
  c.params = {{"emb.0", {kRows, kDim}},
              {"mixed.q.weight", {kDim, kDim}},
              {"mixed.k.weight", {kDim, kDim}},
              {"mixed.v.weight", {kDim, kDim}},
              {"mixed.o.weight", {kDim, kDim}},
              {"logit.weight", {1, kDim}},
              {"logit.bias", {1}}};
  c.dim = kDim;
  c.loss = [](const Weights& w) {
    std::vector<Row> user;
    for (int64_t b = 0; b < kBatch; ++b)
      user.push_back(
          pool(maskedAttention(w, "mixed", kHeads, history(w.at("emb.0"), kDim, b)), kDim, "mean"));
    return headLoss(w, user);
  };
  checkGradients(c, 23);
}

// ---- padding is masked --------------------------------------------------------------------

// Dense padded sequences x: [B, 4, 3] with explicit lengths (0, a part, and one above L, which
// counts as L) feed each builtin through a linear layer, so the parameters see every row. Two
// fillings of the padding rows must give the same outputs and the same step, bit for bit, and
// the outputs equal the loops, which never read padding.
const std::vector<int64_t> kDenseLengths = {2, 0, 5};

const char* kPaddingModel = R"(model m {
  dim B
  input x: f32[B, 4, 3]
  input len: i32[B]
  input q: f32[B, 3]
  input label: f32[B]
  h = linear(x, 3)
  mean = sequence_pool(h, len, mode = mean)
  total = sequence_pool(h, len, mode = sum)
  top = sequence_pool(h, len, mode = max)
  interest = din_attention(q, h, len, hidden = [4], act = tanh)
  mixed = attention(h, heads = 1, causal = false, rope = false, lengths = len)
  logit = linear(concat(mean, total, top, interest, sequence_pool(mixed, len, mode = sum)), 1)
  output logit, mean, total, top, interest, mixed
  train {
    loss = bce_with_logits(logit, label)
    optimizer = sgd(lr = 1)
  }
})";

TEST(SequencePadding, ChangingPaddingRowsChangesNothing) {
  constexpr int64_t kDim = 3;
  auto m = compile(kPaddingModel);
  ASSERT_TRUE(m);
  Status built = passes::buildTrainStep(*m);
  ASSERT_TRUE(built.isOk()) << built.str();
  const Shapes params = {{"h.weight", {kDim, kDim}},           {"h.bias", {kDim}},
                         {"interest.0.weight", {4, 4 * kDim}}, {"interest.0.bias", {4}},
                         {"interest.1.weight", {1, 4}},        {"interest.1.bias", {1}},
                         {"mixed.q.weight", {kDim, kDim}},     {"mixed.k.weight", {kDim, kDim}},
                         {"mixed.v.weight", {kDim, kDim}},     {"mixed.o.weight", {kDim, kDim}},
                         {"logit.weight", {1, 5 * kDim}},      {"logit.bias", {1}}};
  std::set<std::string> expected;
  for (const auto& [name, shape] : params) expected.insert(name);
  ASSERT_EQ(parameterNames(*m), expected);

  std::mt19937 rng(31);
  Tensors in;
  Weights w;
  std::vector<double> x, q;
  for (const auto& [name, shape] : params) in[name] = randomF32(shape, rng, 0.5, w[name]);
  in["x"] = randomF32({kBatch, kLen, kDim}, rng, 1.0, x);
  in["q"] = randomF32({kBatch, kDim}, rng, 1.0, q);
  in["len"] = intTensor<int32_t>(ir::DType::i32, {kBatch}, kDenseLengths);
  in["label"] = f32Tensor({kBatch}, kLabels);
  for (const char* name : {"lr", "step"}) in[name] = f32Tensor({}, {1.0});

  // Other padding: large values of both signs, so a leak into max, a sum or a softmax shows.
  Tensors padded = in;
  std::uniform_real_distribution<double> garbage(-50.0, 50.0);
  int padding_rows = 0;
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t t = std::min(kDenseLengths[static_cast<size_t>(b)], kLen); t < kLen; ++t, ++padding_rows)
      for (int64_t d = 0; d < kDim; ++d)
        padded["x"].as<float>()[(b * kLen + t) * kDim + d] = static_cast<float>(garbage(rng));
  ASSERT_EQ(padding_rows, 6);

  auto fwd = ir::interpret(*m->lookup("forward"), in, {{"B", kBatch}});
  auto fwd_padded = ir::interpret(*m->lookup("forward"), padded, {{"B", kBatch}});
  ASSERT_TRUE(fwd) << fwd.status().str();
  ASSERT_TRUE(fwd_padded) << fwd_padded.status().str();
  ASSERT_EQ(fwd->size(), fwd_padded->size());
  for (size_t o = 0; o < fwd->size(); ++o) {
    ASSERT_EQ((*fwd)[o].numel(), (*fwd_padded)[o].numel());
    for (int64_t i = 0; i < (*fwd)[o].numel(); ++i)
      EXPECT_EQ((*fwd)[o].as<float>()[i], (*fwd_padded)[o].as<float>()[i])
          << "output " << o << " entry " << i;
  }

  // The outputs against the loops over the valid rows of h = linear(x).
  for (int64_t b = 0; b < kBatch; ++b) {
    SCOPED_TRACE("sample " + std::to_string(b));
    std::vector<Row> rows;
    for (int64_t t = 0; t < std::min(kDenseLengths[static_cast<size_t>(b)], kLen); ++t)
      rows.push_back(affine(w.at("h.weight"), &w.at("h.bias"),
                            Row(x.begin() + (b * kLen + t) * kDim, x.begin() + (b * kLen + t + 1) * kDim)));
    const Row qb(q.begin() + b * kDim, q.begin() + (b + 1) * kDim);
    const std::vector<Row> want = {pool(rows, kDim, "mean"), pool(rows, kDim, "sum"), pool(rows, kDim, "max"),
                                   din(w, "interest", {4}, qb, rows, false)};
    for (size_t o = 0; o < want.size(); ++o)
      for (int64_t d = 0; d < kDim; ++d)
        EXPECT_NEAR((*fwd)[o + 1].as<float>()[b * kDim + d], want[o][d], 1e-5 * (1 + std::abs(want[o][d])))
            << "output " << o + 1 << " dim " << d;
    const std::vector<Row> mixed = maskedAttention(w, "mixed", 1, rows);
    for (int64_t t = 0; t < kLen; ++t)
      for (int64_t d = 0; d < kDim; ++d) {
        const double v = t < static_cast<int64_t>(mixed.size()) ? mixed[t][d] : 0.0;  // padded rows: zero
        EXPECT_NEAR((*fwd)[5].as<float>()[(b * kLen + t) * kDim + d], v, 1e-5 * (1 + std::abs(v)))
            << "attention row " << t << " dim " << d;
      }
  }

  // The step: the same loss and the same update of every parameter.
  Tensors after = in, after_padded = padded;
  auto step = ir::interpretInPlace(*m->lookup("train_step"), after, {{"B", kBatch}});
  auto step_padded = ir::interpretInPlace(*m->lookup("train_step"), after_padded, {{"B", kBatch}});
  ASSERT_TRUE(step) << step.status().str();
  ASSERT_TRUE(step_padded) << step_padded.status().str();
  EXPECT_EQ((*step)[0].as<float>()[0], (*step_padded)[0].as<float>()[0]);
  int moved = 0;
  for (const auto& [name, shape] : params) {
    SCOPED_TRACE(name);
    for (int64_t i = 0; i < after.at(name).numel(); ++i) {
      EXPECT_EQ(after.at(name).as<float>()[i], after_padded.at(name).as<float>()[i]) << "entry " << i;
      moved += after.at(name).as<float>()[i] != in.at(name).as<float>()[i];
    }
  }
  EXPECT_GT(moved, 40) << "the step must move the parameters for the comparison to mean something";
}

}  // namespace
}  // namespace kiln::frontend
