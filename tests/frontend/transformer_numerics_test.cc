// Numerics of the transformer builtins: models written in the language are lowered, run on the
// reference interpreter, and compared with plain loops in double written here. Attention (GQA,
// RoPE, causal mask) is checked forward for several head layouts, and a tiny decoder (embedding,
// attention, swiglu, sequence cross entropy) is checked backward: the gradients that one SGD
// step of @train_step applies equal central finite differences of the loops' loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
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

std::unique_ptr<ir::Module> compile(const std::string& src) {
  DiagnosticEngine d;
  auto m = compileModelSource("t.kiln", src, {}, d);
  EXPECT_TRUE(m) << d.str();
  return m ? m.take() : nullptr;
}

ir::HostTensor i32Tensor(std::vector<int64_t> shape, const std::vector<int>& values) {
  ir::HostTensor t(ir::DType::i32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.as<int32_t>()[i] = values[static_cast<size_t>(i)];
  return t;
}

void expectClose(const ir::HostTensor& got, const std::vector<int64_t>& shape,
                 const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.view.shape, shape);
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got.as<float>()[i], want[i], tol * (1 + std::abs(want[i]))) << "element " << i;
}

// ---- einsum and matmul against a loop over every label assignment ---------------------------

struct Operand {
  std::string labels;
  std::vector<int64_t> shape;
};

// out[o] = sum over all other labels of a[...] * b[...] (b absent for one operand).
std::vector<double> naiveEinsum(const std::vector<Operand>& ops, const std::vector<std::vector<double>>& vals,
                                const std::string& out, std::vector<int64_t>& out_shape) {
  std::map<char, int64_t> size;
  for (const Operand& o : ops)
    for (size_t i = 0; i < o.labels.size(); ++i) size[o.labels[i]] = o.shape[i];
  std::string all;
  for (const auto& [c, n] : size) all += c;
  out_shape.clear();
  int64_t out_n = 1;
  for (char c : out) out_shape.push_back(size[c]), out_n *= size[c];
  std::vector<double> r(static_cast<size_t>(out_n), 0.0);
  std::map<char, int64_t> at;
  for (char c : all) at[c] = 0;
  auto offset = [&](const std::string& labels) {
    int64_t off = 0;
    for (char c : labels) off = off * size[c] + at[c];
    return off;
  };
  while (true) {
    double p = 1;
    for (size_t k = 0; k < ops.size(); ++k) p *= vals[k][static_cast<size_t>(offset(ops[k].labels))];
    r[static_cast<size_t>(offset(out))] += p;
    size_t i = 0;
    for (; i < all.size(); ++i) {
      if (++at[all[i]] < size[all[i]]) break;
      at[all[i]] = 0;
    }
    if (i == all.size()) break;
  }
  return r;
}

std::string typeText(const std::vector<int64_t>& shape) {
  std::string s = "f32[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

struct EinsumCase {
  std::string spec;
  std::vector<Operand> ops;
  std::string out;  // the output labels (for the implicit form, numpy's)
};

TEST(TransformerNumerics, EinsumMatchesLoops) {
  const std::vector<EinsumCase> cases = {
      {"ij,jk->ik", {{"ij", {3, 4}}, {"jk", {4, 5}}}, "ik"},
      {"bhqd,bhkd->bhqk", {{"bhqd", {2, 3, 4, 5}}, {"bhkd", {2, 3, 6, 5}}}, "bhqk"},
      {"bhqk,bhkd->bhqd", {{"bhqk", {2, 2, 3, 4}}, {"bhkd", {2, 2, 4, 5}}}, "bhqd"},
      {"ijk,jl->lik", {{"ijk", {2, 3, 4}}, {"jl", {3, 5}}}, "lik"},
      {"ijk,jkl->il", {{"ijk", {2, 3, 4}}, {"jkl", {3, 4, 5}}}, "il"},
      {"abc,cb->ab", {{"abc", {2, 3, 4}}, {"cb", {4, 3}}}, "ab"},
      {"ij,ij->i", {{"ij", {3, 4}}, {"ij", {3, 4}}}, "i"},
      {"i,j->ij", {{"i", {3}}, {"j", {4}}}, "ij"},
      {"ij,jk->k", {{"ij", {3, 4}}, {"jk", {4, 2}}}, "k"},
      {"ji,jk", {{"ji", {4, 3}}, {"jk", {4, 2}}}, "ik"},
      {"ijk->ki", {{"ijk", {2, 3, 4}}}, "ki"},
  };
  std::mt19937 rng(7);
  for (const EinsumCase& c : cases) {
    SCOPED_TRACE(c.spec);
    std::string src = "model m {\n";
    std::string args;
    Tensors in;
    std::vector<std::vector<double>> vals(c.ops.size());
    for (size_t k = 0; k < c.ops.size(); ++k) {
      std::string name = k ? "b" : "a";
      src += " input " + name + ": " + typeText(c.ops[k].shape) + "\n";
      args += ", " + name;
      in[name] = randomF32(c.ops[k].shape, rng, 1.0, vals[k]);
    }
    src += " y = einsum(\"" + c.spec + "\"" + args + ")\n output y\n}\n";
    auto m = compile(src);
    ASSERT_TRUE(m);
    auto r = ir::interpret(*m->lookup("forward"), in, {});
    ASSERT_TRUE(r) << r.status().str();
    std::vector<int64_t> shape;
    std::vector<double> want = naiveEinsum(c.ops, vals, c.out, shape);
    expectClose((*r)[0], shape, want, 1e-5);
  }
}

TEST(TransformerNumerics, MatmulBroadcastsLikeNumpy) {
  std::mt19937 rng(8);
  std::vector<double> a, b, v;
  Tensors in;
  in["a"] = randomF32({2, 1, 3, 4}, rng, 1.0, a);
  in["b"] = randomF32({5, 4, 2}, rng, 1.0, b);
  in["v"] = randomF32({4}, rng, 1.0, v);
  auto m = compile(
      "model m {\n input a: f32[2, 1, 3, 4]\n input b: f32[5, 4, 2]\n input v: f32[4]\n"
      " y = matmul(a, b)\n w = matmul(v, b)\n u = matmul(a, v)\n output y, w, u\n}\n");
  ASSERT_TRUE(m);
  auto r = ir::interpret(*m->lookup("forward"), in, {});
  ASSERT_TRUE(r) << r.status().str();
  std::vector<double> y(2 * 5 * 3 * 2, 0.0), w(5 * 2, 0.0), u(2 * 3, 0.0);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 5; ++j)
      for (int r0 = 0; r0 < 3; ++r0)
        for (int c = 0; c < 2; ++c)
          for (int k = 0; k < 4; ++k)
            y[((i * 5 + j) * 3 + r0) * 2 + c] += a[(i * 3 + r0) * 4 + k] * b[(j * 4 + k) * 2 + c];
  for (int j = 0; j < 5; ++j)
    for (int c = 0; c < 2; ++c)
      for (int k = 0; k < 4; ++k) w[j * 2 + c] += v[k] * b[(j * 4 + k) * 2 + c];
  for (int i = 0; i < 2; ++i)
    for (int r0 = 0; r0 < 3; ++r0)
      for (int k = 0; k < 4; ++k) u[i * 3 + r0] += a[(i * 3 + r0) * 4 + k] * v[k];
  expectClose((*r)[0], {2, 5, 3, 2}, y, 1e-5);
  expectClose((*r)[1], {5, 2}, w, 1e-5);
  expectClose((*r)[2], {2, 1, 3}, u, 1e-5);
}

TEST(TransformerNumerics, ComparisonsSelectElementwise) {
  std::mt19937 rng(9);
  std::vector<double> x, y;
  Tensors in;
  in["x"] = randomF32({2, 3}, rng, 1.0, x);
  in["y"] = randomF32({3}, rng, 1.0, y);
  auto m = compile(
      "model m {\n input x: f32[2, 3]\n input y: f32[3]\n"
      " a = where(x > y, x, y * 2)\n b = where(x <= 0, 0, x)\n c = where(x != x, 1, -1.5)\n output a, b, "
      "c\n}\n");
  ASSERT_TRUE(m);
  auto r = ir::interpret(*m->lookup("forward"), in, {});
  ASSERT_TRUE(r) << r.status().str();
  std::vector<double> a, b, c;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) {
      double xv = x[i * 3 + j];
      a.push_back(xv > y[j] ? xv : 2 * y[j]);
      b.push_back(xv <= 0 ? 0 : xv);
      c.push_back(-1.5);
    }
  expectClose((*r)[0], {2, 3}, a, 1e-6);
  expectClose((*r)[1], {2, 3}, b, 1e-6);
  expectClose((*r)[2], {2, 3}, c, 1e-6);
}

TEST(TransformerNumerics, TopkArgmaxAndTakeAlongAxisMatchLoops) {
  // Rows with ties: the lower index wins, in descending order.
  const std::vector<double> x = {0.5, -1, 2, 0.5, 2, 3, 1, 1, 1, -2};
  ir::HostTensor t(ir::DType::f32, {2, 5});
  for (size_t i = 0; i < x.size(); ++i) t.as<float>()[i] = static_cast<float>(x[i]);
  auto m = compile(
      "model m {\n input x: f32[2, 5]\n vals, idx = topk(x, 3)\n a = argmax(x, axis = 0)\n"
      " picked = take_along_axis(x, idx, axis = 1)\n output vals, idx, a, picked\n}\n");
  ASSERT_TRUE(m);
  auto r = ir::interpret(*m->lookup("forward"), {{"x", t}}, {});
  ASSERT_TRUE(r) << r.status().str();
  std::vector<double> vals, idx, arg;
  for (int row = 0; row < 2; ++row) {
    std::vector<int> order = {0, 1, 2, 3, 4};
    std::stable_sort(order.begin(), order.end(),
                     [&](int p, int q) { return x[row * 5 + p] > x[row * 5 + q]; });
    for (int j = 0; j < 3; ++j) vals.push_back(x[row * 5 + order[j]]), idx.push_back(order[j]);
  }
  for (int c = 0; c < 5; ++c) arg.push_back(x[5 + c] > x[c] ? 1 : 0);
  expectClose((*r)[0], {2, 3}, vals, 0);
  ASSERT_EQ((*r)[1].view.dtype, ir::DType::i32);
  for (size_t i = 0; i < idx.size(); ++i) EXPECT_EQ((*r)[1].as<int32_t>()[i], idx[i]) << i;
  ASSERT_EQ((*r)[2].view.shape, (std::vector<int64_t>{5}));
  for (size_t i = 0; i < arg.size(); ++i) EXPECT_EQ((*r)[2].as<int32_t>()[i], arg[i]) << i;
  expectClose((*r)[3], {2, 3}, vals, 0);
}

// Gradients flow through topk's values and take_along_axis back to where they were read.
TEST(TransformerNumerics, SelectionGradientsMatchFiniteDifferences) {
  constexpr int64_t B = 3, In = 4, Out = 5;
  auto m = compile(R"(model m {
  dim B
  input x: f32[B, 4]
  input label: f32[B, 2]
  h = linear(x, 5, bias = false)
  vals, idx = topk(h, 2)
  best = take_along_axis(h, argmax(h, keepdims = true), 1)
  y = vals * best
  output y
  train {
    loss = mse(y, label)
    optimizer = sgd(lr = 1)
  }
})");
  ASSERT_TRUE(m);
  Status built = passes::buildTrainStep(*m);
  ASSERT_TRUE(built.isOk()) << built.str();
  std::mt19937 rng(13);
  Tensors in;
  std::vector<double> x, w, label;
  in["x"] = randomF32({B, In}, rng, 1.0, x);
  in["label"] = randomF32({B, 2}, rng, 1.0, label);
  in["h.weight"] = randomF32({Out, In}, rng, 0.5, w);
  for (const char* name : {"lr", "step"}) {
    in[name] = ir::HostTensor(ir::DType::f32, {});
    in[name].as<float>()[0] = 1;
  }
  auto loss = [&](const std::vector<double>& wt) {
    double sum = 0;
    for (int64_t b = 0; b < B; ++b) {
      std::vector<double> h(Out, 0.0);
      for (int64_t o = 0; o < Out; ++o)
        for (int64_t i = 0; i < In; ++i) h[o] += x[b * In + i] * wt[o * In + i];
      std::vector<double> sorted = h;
      std::sort(sorted.rbegin(), sorted.rend());
      for (int j = 0; j < 2; ++j) {
        double d = sorted[j] * sorted[0] - label[b * 2 + j];
        sum += d * d;
      }
    }
    return sum / (B * 2);
  };
  Tensors after = in;
  auto step = ir::interpretInPlace(*m->lookup("train_step"), after, {{"B", B}});
  ASSERT_TRUE(step) << step.status().str();
  EXPECT_NEAR((*step)[0].as<float>()[0], loss(w), 1e-5);
  for (int64_t e = 0; e < Out * In; ++e) {
    constexpr double kStep = 1e-6;
    std::vector<double> plus = w, minus = w;
    plus[e] += kStep;
    minus[e] -= kStep;
    const double fd = (loss(plus) - loss(minus)) / (2 * kStep);
    EXPECT_NEAR(in.at("h.weight").as<float>()[e] - after.at("h.weight").as<float>()[e], fd,
                1e-6 + 1e-4 * std::abs(fd))
        << "entry " << e;
  }
}

// ---- attention ------------------------------------------------------------------------------

struct AttentionConfig {
  int64_t heads, kv_heads, head_dim;
  bool causal, rope;
};

constexpr double kRopeBase = 100.0;

// y = attention(x) for x: [B, T, D] row-major; W*: [out, in] as the layers store them.
std::vector<double> naiveAttention(const std::vector<double>& x, int64_t B, int64_t T, int64_t D,
                                   const AttentionConfig& c, const std::vector<double>& wq,
                                   const std::vector<double>& wk, const std::vector<double>& wv,
                                   const std::vector<double>& wo) {
  const int64_t H = c.heads, G = c.kv_heads, hd = c.head_dim, half = hd / 2;
  auto project = [&](const std::vector<double>& w, int64_t b, int64_t t, int64_t head, int64_t d) {
    double s = 0;
    for (int64_t i = 0; i < D; ++i) s += x[(b * T + t) * D + i] * w[(head * hd + d) * D + i];
    return s;
  };
  // q/k at (b, head, t) after RoPE: pairs (d, d + hd/2) rotate by t * base^(-2d/hd).
  auto rotated = [&](const std::vector<double>& w, int64_t b, int64_t head, int64_t t) {
    std::vector<double> v(static_cast<size_t>(hd));
    for (int64_t d = 0; d < hd; ++d) v[d] = project(w, b, t, head, d);
    if (!c.rope) return v;
    std::vector<double> r = v;
    for (int64_t d = 0; d < half; ++d) {
      double angle = static_cast<double>(t) *
                     std::pow(kRopeBase, -2.0 * static_cast<double>(d) / static_cast<double>(hd));
      r[d] = v[d] * std::cos(angle) - v[d + half] * std::sin(angle);
      r[d + half] = v[d + half] * std::cos(angle) + v[d] * std::sin(angle);
    }
    return r;
  };
  std::vector<double> y(static_cast<size_t>(B * T * D), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> ctx(static_cast<size_t>(T * H * hd), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);  // the kv head of query head h
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> q = rotated(wq, b, h, t), score(static_cast<size_t>(T));
        double mx = -1e300;
        int64_t last = c.causal ? t : T - 1;
        for (int64_t s = 0; s <= last; ++s) {
          std::vector<double> k = rotated(wk, b, g, s);
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q[d] * k[d];
          score[s] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, score[s]);
        }
        double z = 0;
        for (int64_t s = 0; s <= last; ++s) z += std::exp(score[s] - mx);
        for (int64_t s = 0; s <= last; ++s)
          for (int64_t d = 0; d < hd; ++d)
            ctx[(t * H + h) * hd + d] += std::exp(score[s] - mx) / z * project(wv, b, s, g, d);
      }
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < D; ++j) {
        double s = 0;
        for (int64_t i = 0; i < H * hd; ++i) s += ctx[t * H * hd + i] * wo[j * H * hd + i];
        y[(b * T + t) * D + j] = s;
      }
  }
  return y;
}

std::string attentionModel(const AttentionConfig& c) {
  return "model m {\n dim B\n input x: f32[B, 5, 8]\n attn = attention(x, heads = " +
         std::to_string(c.heads) + ", kv_heads = " + std::to_string(c.kv_heads) +
         ", head_dim = " + std::to_string(c.head_dim) + ", causal = " + (c.causal ? "true" : "false") +
         ", rope = " + (c.rope ? "true" : "false") + ", rope_base = 100)\n output attn\n}\n";
}

class AttentionForward : public ::testing::TestWithParam<AttentionConfig> {};

TEST_P(AttentionForward, MatchesNaiveAttention) {
  const AttentionConfig c = GetParam();
  constexpr int64_t B = 2, T = 5, D = 8;
  auto m = compile(attentionModel(c));
  ASSERT_TRUE(m);
  std::mt19937 rng(11);
  Tensors in;
  std::vector<double> x, wq, wk, wv, wo;
  in["x"] = randomF32({B, T, D}, rng, 1.0, x);
  in["attn.q.weight"] = randomF32({c.heads * c.head_dim, D}, rng, 0.5, wq);
  in["attn.k.weight"] = randomF32({c.kv_heads * c.head_dim, D}, rng, 0.5, wk);
  in["attn.v.weight"] = randomF32({c.kv_heads * c.head_dim, D}, rng, 0.5, wv);
  in["attn.o.weight"] = randomF32({D, c.heads * c.head_dim}, rng, 0.5, wo);
  auto r = ir::interpret(*m->lookup("forward"), in, {{"B", B}});
  ASSERT_TRUE(r) << r.status().str();
  expectClose((*r)[0], {B, T, D}, naiveAttention(x, B, T, D, c, wq, wk, wv, wo), 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AttentionForward,
                         ::testing::Values(AttentionConfig{4, 2, 2, true, true},   // GQA
                                           AttentionConfig{2, 2, 4, true, true},   // MHA
                                           AttentionConfig{4, 1, 4, true, true},   // MQA, head_dim given
                                           AttentionConfig{2, 1, 4, false, true},  // no mask
                                           AttentionConfig{2, 2, 3, true, false}   // no rope, odd head_dim
                                           ));

// ---- a tiny decoder, backward --------------------------------------------------------------

constexpr int64_t kVocab = 7, kDim = 8, kHidden = 12;
const AttentionConfig kDecoderAttention{2, 1, 4, true, true};

const char* kDecoder = R"(model m {
  dim B
  param T = 5
  input tokens: i32[B, T] vocab(7)
  input label: i32[B, T]
  h = embedding(tokens, 7, 8)
  h = h + attention(h, heads = 2, kv_heads = 1, rope_base = 100)
  logits = linear(swiglu(linear(h, 12, bias = false)), 7, bias = false)
  output logits
  train {
    loss = softmax_cross_entropy(logits, label)
    optimizer = sgd(lr = 1)
  }
})";

using Weights = std::map<std::string, std::vector<double>>;

// The decoder's mean token cross entropy, in double.
double naiveDecoderLoss(const Weights& w, const std::vector<int>& tokens, const std::vector<int>& labels,
                        int64_t B, int64_t T) {
  std::vector<double> h(static_cast<size_t>(B * T * kDim));
  for (int64_t n = 0; n < B * T; ++n)
    for (int64_t d = 0; d < kDim; ++d) h[n * kDim + d] = w.at("h.weight")[tokens[n] * kDim + d];
  std::vector<double> a = naiveAttention(h, B, T, kDim, kDecoderAttention, w.at("attention.0.q.weight"),
                                         w.at("attention.0.k.weight"), w.at("attention.0.v.weight"),
                                         w.at("attention.0.o.weight"));
  double loss = 0;
  for (int64_t n = 0; n < B * T; ++n) {
    std::vector<double> up(kHidden, 0.0), logits(kVocab, 0.0);
    for (int64_t j = 0; j < kHidden; ++j)
      for (int64_t d = 0; d < kDim; ++d)
        up[j] += (h[n * kDim + d] + a[n * kDim + d]) * w.at("linear.0.weight")[j * kDim + d];
    const int64_t half = kHidden / 2;
    for (int64_t v = 0; v < kVocab; ++v)
      for (int64_t j = 0; j < half; ++j) {
        double gate = up[j] / (1 + std::exp(-up[j]));  // silu
        logits[v] += gate * up[j + half] * w.at("logits.weight")[v * half + j];
      }
    double mx = *std::max_element(logits.begin(), logits.end()), z = 0;
    for (double l : logits) z += std::exp(l - mx);
    loss += std::log(z) + mx - logits[labels[n]];
  }
  return loss / static_cast<double>(B * T);
}

TEST(TransformerNumerics, DecoderGradientsMatchFiniteDifferences) {
  constexpr int64_t B = 2, T = 5;
  auto m = compile(kDecoder);
  ASSERT_TRUE(m);
  Status built = passes::buildTrainStep(*m);
  ASSERT_TRUE(built.isOk()) << built.str();
  const std::map<std::string, std::vector<int64_t>> shapes = {{"h.weight", {kVocab, kDim}},
                                                              {"attention.0.q.weight", {8, kDim}},
                                                              {"attention.0.k.weight", {4, kDim}},
                                                              {"attention.0.v.weight", {4, kDim}},
                                                              {"attention.0.o.weight", {kDim, 8}},
                                                              {"linear.0.weight", {kHidden, kDim}},
                                                              {"logits.weight", {kVocab, kHidden / 2}}};
  std::mt19937 rng(12);
  Tensors in;
  Weights w;
  for (const auto& [name, shape] : shapes) in[name] = randomF32(shape, rng, 0.5, w[name]);
  // Token 6 never occurs: its embedding row must get no gradient; tokens 1 and 3 repeat.
  const std::vector<int> tokens = {1, 3, 0, 1, 5, 3, 3, 2, 4, 1};
  const std::vector<int> labels = {3, 0, 1, 5, 2, 6, 4, 1, 0, 2};
  in["tokens"] = i32Tensor({B, T}, tokens);
  in["label"] = i32Tensor({B, T}, labels);
  in["lr"] = ir::HostTensor(ir::DType::f32, {});
  in["lr"].as<float>()[0] = 1;
  in["step"] = ir::HostTensor(ir::DType::f32, {});
  in["step"].as<float>()[0] = 1;

  // One SGD step with lr = 1 moves each parameter by -grad.
  Tensors after = in;
  auto step = ir::interpretInPlace(*m->lookup("train_step"), after, {{"B", B}});
  ASSERT_TRUE(step) << step.status().str();
  const double loss = naiveDecoderLoss(w, tokens, labels, B, T);
  EXPECT_NEAR((*step)[0].as<float>()[0], loss, 1e-5 * (1 + loss));

  std::uniform_int_distribution<int64_t> pick(0, 1 << 20);
  for (const auto& [name, shape] : shapes) {
    SCOPED_TRACE(name);
    const int64_t n = shape[0] * shape[1];
    std::vector<int64_t> entries = {pick(rng) % n, pick(rng) % n, pick(rng) % n, n - 1};
    if (name == "h.weight") entries = {1 * kDim + 2, 3 * kDim + 5, 0, 6 * kDim + 1};
    for (int64_t e : entries) {
      const double grad = in.at(name).as<float>()[e] - after.at(name).as<float>()[e];
      constexpr double kStep = 1e-6;
      Weights plus = w, minus = w;
      plus[name][static_cast<size_t>(e)] += kStep;
      minus[name][static_cast<size_t>(e)] -= kStep;
      const double fd =
          (naiveDecoderLoss(plus, tokens, labels, B, T) - naiveDecoderLoss(minus, tokens, labels, B, T)) /
          (2 * kStep);
      EXPECT_NEAR(grad, fd, 1e-6 + 1e-4 * std::abs(fd)) << "entry " << e;
    }
  }
  // The unused token's row: no gradient at all.
  for (int64_t d = 0; d < kDim; ++d)
    EXPECT_EQ(in.at("h.weight").as<float>()[6 * kDim + d], after.at("h.weight").as<float>()[6 * kDim + d]);
}

}  // namespace
}  // namespace kiln::frontend
