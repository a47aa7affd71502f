// The MoE kernels' checks (codegen/emit/moe.h), shared by the simt run on the host
// (tests/simt/simt_moe_test.cc) and the GPU run (tests/gpu/gpu_moe_test.cc): each builds the
// kernels of one op, runs them through a `Run` (add / poisoned / kernel / run / get) and
// compares with plain loops written here from docs/moe.md (f64, or f64 finite differences for
// the gradients): top-k, routing (softmax before and after, sigmoid, bias, group-limited), the
// balancing losses, dispatch (dropless, capacity dropping by probs and by position, padding, the
// bound's slack), permutation, row dots, the expert-bias update and the grouped GEMMs (empty
// experts, rows past R, f32 SIMT and bf16 tensor-core tiles, both layouts of w).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "codegen/emit/moe.h"

namespace kiln::testing::moe {

using codegen::DType;
using codegen::Kernel;
namespace emit = codegen::emit;

// Where the checks run their kernels: buffers (inputs copied in, outputs poisoned with all bits
// set: NaN floats, -1 ints, so an element a kernel should write and does not shows), the kernels
// in order, and the results read back. simt and the GPU implement the raw parts.
class MoeRun {
 public:
  virtual ~MoeRun() = default;
  template <typename T>
  int add(const std::vector<T>& v) {
    return addBytes(v.data(), v.size() * sizeof(T), sizeof(T));
  }
  template <typename T>
  int poisoned(size_t n) {
    std::vector<T> v(n);
    std::memset(static_cast<void*>(v.data()), 0xff, n * sizeof(T));
    return add(v);
  }
  template <typename T>
  std::vector<T> get(int buffer, size_t n) {
    std::vector<T> v(n);
    getBytes(buffer, v.data(), n * sizeof(T));
    return v;
  }
  void kernel(Kernel k, std::vector<int> args) {
    Status valid = codegen::validate(k);
    ASSERT_TRUE(valid.isOk()) << valid.message();
    ASSERT_EQ(args.size(), k.buffers.size()) << k.name;
    kernels_.push_back(std::move(k));
    args_.push_back(std::move(args));
  }
  // Overwrites an input (between runs).
  template <typename T>
  void set(int buffer, const std::vector<T>& v) {
    setBytes(buffer, v.data(), v.size() * sizeof(T));
  }
  // Compiles the kernels into one module and runs them in order (failures are test failures).
  virtual void run() = 0;

 protected:
  virtual int addBytes(const void* data, size_t bytes, size_t align) = 0;
  virtual void getBytes(int buffer, void* out, size_t bytes) = 0;
  virtual void setBytes(int buffer, const void* data, size_t bytes) = 0;
  std::vector<Kernel> kernels_;
  std::vector<std::vector<int>> args_;
};

inline uint16_t toBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float fromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::vector<float> normal(size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// ---- Top-k ----

// Indices of the k largest of v, descending, ties to the lower index.
inline std::vector<int> topIndices(const std::vector<double>& v, int64_t k,
                                   const std::vector<bool>& eligible = {}) {
  std::vector<int> idx;
  for (int i = 0; i < static_cast<int>(v.size()); ++i)
    if (eligible.empty() || eligible[static_cast<size_t>(i)]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

inline void checkTopkAlongAMiddleAxisWithTies(MoeRun& run) {
  const int64_t outer = 3, n = 45, inner = 2, k = 6;
  std::mt19937 rng(7);
  std::vector<float> x(static_cast<size_t>(outer * n * inner));
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 9)) - 4.0f;  // many ties
  const int xb = run.add(x), vb = run.poisoned<float>(static_cast<size_t>(outer * k * inner)),
            ib = run.poisoned<int>(static_cast<size_t>(outer * k * inner));
  run.kernel(emit::topkKernel(DType::f32, outer, n, inner, k), {xb, vb, ib});
  run.run();
  auto values = run.get<float>(vb, static_cast<size_t>(outer * k * inner));
  auto indices = run.get<int>(ib, static_cast<size_t>(outer * k * inner));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t in = 0; in < inner; ++in) {
      std::vector<double> row;
      for (int64_t i = 0; i < n; ++i) row.push_back(x[static_cast<size_t>((o * n + i) * inner + in)]);
      std::vector<int> want = topIndices(row, k);
      for (int64_t j = 0; j < k; ++j) {
        const size_t at = static_cast<size_t>((o * k + j) * inner + in);
        EXPECT_EQ(indices[at], want[static_cast<size_t>(j)]) << o << "," << j << "," << in;
        EXPECT_EQ(values[at], row[static_cast<size_t>(want[static_cast<size_t>(j)])]);
      }
    }
}

// ---- Routing ----

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// docs/moe.md's moe_router for one token, in f64: the chosen experts and their probs.
inline void routeToken(const emit::RouterShape& r, const double* logits, const float* bias,
                       std::vector<int>& experts, std::vector<double>& probs) {
  const int64_t E = r.experts;
  std::vector<double> scores(logits, logits + E);
  if (r.sigmoid) {
    for (double& s : scores) s = sigmoid(s);
  } else if (r.pre_softmax) {
    const double m = *std::max_element(scores.begin(), scores.end());
    double z = 0;
    for (double& s : scores) z += (s = std::exp(s - m));
    for (double& s : scores) s /= z;
  }
  std::vector<double> sel = scores;
  if (bias)
    for (int64_t e = 0; e < E; ++e) sel[static_cast<size_t>(e)] += bias[e];
  std::vector<bool> eligible(static_cast<size_t>(E), true);
  if (r.groups > 1) {
    const int64_t per_group = E / r.groups;
    std::vector<double> group_score;
    for (int64_t g = 0; g < r.groups; ++g) {
      std::vector<double> members(sel.begin() + g * per_group, sel.begin() + (g + 1) * per_group);
      double sum = 0;
      for (int i : topIndices(members, r.topk / r.group_topk)) sum += members[static_cast<size_t>(i)];
      group_score.push_back(sum);
    }
    std::vector<int> best = topIndices(group_score, r.group_topk);
    for (int64_t e = 0; e < E; ++e)
      eligible[static_cast<size_t>(e)] =
          std::count(best.begin(), best.end(), static_cast<int>(e / per_group)) > 0;
  }
  experts = topIndices(sel, r.topk, eligible);
  probs.clear();
  for (int e : experts)
    probs.push_back(r.sigmoid || r.pre_softmax ? scores[static_cast<size_t>(e)] : logits[e]);
  if (!r.sigmoid && !r.pre_softmax) {
    const double m = *std::max_element(probs.begin(), probs.end());
    double z = 0;
    for (double& p : probs) z += (p = std::exp(p - m));
    for (double& p : probs) p /= z;
  } else if (r.sigmoid && r.topk > 1) {
    const double z = std::accumulate(probs.begin(), probs.end(), 0.0) + 1e-20;
    for (double& p : probs) p /= z;
  }
  for (double& p : probs) p *= r.scale;
}

// The probs of a fixed selection as a function of the logits (the router's gradient path).
inline std::vector<double> probsOfSelection(const emit::RouterShape& r, const std::vector<double>& logits,
                                            const std::vector<int>& experts) {
  std::vector<double> probs;
  if (r.sigmoid) {
    for (int e : experts) probs.push_back(sigmoid(logits[static_cast<size_t>(e)]));
    if (r.topk > 1) {
      const double z = std::accumulate(probs.begin(), probs.end(), 0.0) + 1e-20;
      for (double& p : probs) p /= z;
    }
  } else if (r.pre_softmax) {
    const double m = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (double l : logits) z += std::exp(l - m);
    for (int e : experts) probs.push_back(std::exp(logits[static_cast<size_t>(e)] - m) / z);
  } else {
    double m = -INFINITY, z = 0;
    for (int e : experts) m = std::max(m, logits[static_cast<size_t>(e)]);
    for (int e : experts) z += std::exp(logits[static_cast<size_t>(e)] - m);
    for (int e : experts) probs.push_back(std::exp(logits[static_cast<size_t>(e)] - m) / z);
  }
  for (double& p : probs) p *= r.scale;
  return probs;
}

struct RouterCase {
  const char* name;
  emit::RouterShape shape;
};

inline void checkRouter(MoeRun& run, const RouterCase& param) {
  emit::RouterShape r = param.shape;
  const int64_t N = r.tokens, E = r.experts, K = r.topk;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 11, 2.0f);
  std::vector<float> bias = normal(static_cast<size_t>(E), 12, 0.05f);
  std::vector<float> dprobs = normal(static_cast<size_t>(N * K), 13);
  const int lb = run.add(logits), bb = run.add(bias);
  const int pb = run.poisoned<float>(static_cast<size_t>(N * K)),
            eb = run.poisoned<int>(static_cast<size_t>(N * K));
  std::vector<int> fwd{lb};
  if (r.bias) fwd.push_back(bb);
  fwd.insert(fwd.end(), {pb, eb});
  run.kernel(emit::routerKernel(r), fwd);
  const int db = run.add(dprobs), gb = run.poisoned<float>(static_cast<size_t>(N * E));
  run.kernel(emit::routerGradKernel(r), {lb, eb, db, gb});
  run.run();
  auto probs = run.get<float>(pb, static_cast<size_t>(N * K));
  auto experts = run.get<int>(eb, static_cast<size_t>(N * K));
  auto grad = run.get<float>(gb, static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> row(logits.begin() + n * E, logits.begin() + (n + 1) * E);
    std::vector<int> want_e;
    std::vector<double> want_p;
    routeToken(r, row.data(), r.bias ? bias.data() : nullptr, want_e, want_p);
    for (int64_t j = 0; j < K; ++j) {
      ASSERT_EQ(experts[static_cast<size_t>(n * K + j)], want_e[static_cast<size_t>(j)])
          << "token " << n << " choice " << j;
      EXPECT_NEAR(probs[static_cast<size_t>(n * K + j)], want_p[static_cast<size_t>(j)], 1e-5)
          << n << "," << j;
    }
    // d(dprobs . probs)/d logits by central differences, the selection held fixed.
    for (int64_t e = 0; e < E; ++e) {
      auto objective = [&](double delta) {
        std::vector<double> l = row;
        l[static_cast<size_t>(e)] += delta;
        std::vector<double> p = probsOfSelection(r, l, want_e);
        double sum = 0;
        for (int64_t j = 0; j < K; ++j)
          sum += dprobs[static_cast<size_t>(n * K + j)] * p[static_cast<size_t>(j)];
        return sum;
      };
      const double h = 1e-5, want = (objective(h) - objective(-h)) / (2 * h);
      EXPECT_NEAR(grad[static_cast<size_t>(n * E + e)], want, 2e-5) << "token " << n << " expert " << e;
    }
  }
}

inline emit::RouterShape router(int64_t E, int64_t K, bool sigmoid, bool pre, bool bias, int64_t G = 1,
                                int64_t GK = 1, double scale = 1.0) {
  emit::RouterShape r;
  r.tokens = 37;
  r.experts = E;
  r.topk = K;
  r.sigmoid = sigmoid;
  r.pre_softmax = pre;
  r.bias = bias;
  r.groups = G;
  r.group_topk = GK;
  r.scale = scale;
  return r;
}

inline std::vector<RouterCase> routerCases() {
  return {RouterCase{"softmax_after_topk", router(8, 2, false, false, false)},
          RouterCase{"softmax_after_topk_bias_40_experts", router(40, 4, false, false, true)},
          RouterCase{"softmax_before_topk", router(64, 6, false, true, false, 1, 1, 2.5)},
          RouterCase{"sigmoid_bias", router(72, 8, true, false, true)},
          RouterCase{"sigmoid_top1", router(16, 1, true, false, false)},
          RouterCase{"sigmoid_group_limited", router(64, 6, true, false, true, 8, 3, 2.5)},
          RouterCase{"softmax_group_limited", router(48, 4, false, true, false, 4, 2)}};
}

// ---- Balancing losses ----

// docs/moe.md's aux loss in f64, for fixed experts.
inline double auxLoss(const emit::AuxLossShape& a, const std::vector<double>& logits,
                      const std::vector<int>& experts) {
  const int64_t N = a.tokens, E = a.experts, K = a.topk, T = a.seq_len > 0 ? a.seq_len : N, S = N / T;
  double total = 0;
  for (int64_t s = 0; s < S; ++s) {
    std::vector<double> f(static_cast<size_t>(E)), P(static_cast<size_t>(E));
    for (int64_t t = s * T; t < (s + 1) * T; ++t) {
      for (int64_t j = 0; j < K; ++j)
        f[static_cast<size_t>(experts[static_cast<size_t>(t * K + j)])] += 1.0 / static_cast<double>(T * K);
      std::vector<double> sc(logits.begin() + t * E, logits.begin() + (t + 1) * E);
      double z = 0;
      if (a.sigmoid) {
        for (double& v : sc) z += (v = sigmoid(v));
        z += 1e-20;
      } else {
        const double m = *std::max_element(sc.begin(), sc.end());
        for (double& v : sc) z += (v = std::exp(v - m));
      }
      for (int64_t e = 0; e < E; ++e)
        P[static_cast<size_t>(e)] += sc[static_cast<size_t>(e)] / z / static_cast<double>(T);
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += f[static_cast<size_t>(e)] * P[static_cast<size_t>(e)];
    total += a.coeff * static_cast<double>(E) * sum;
  }
  return total / static_cast<double>(S);
}

inline void checkAuxLoss(MoeRun& run, bool sigmoid, int64_t seq_len) {
  emit::AuxLossShape a;
  a.tokens = 24;
  a.experts = 40;
  a.topk = 3;
  a.sigmoid = sigmoid;
  a.seq_len = seq_len;
  a.coeff = 0.01;
  const int64_t N = a.tokens, E = a.experts, K = a.topk, S = a.seq_len > 0 ? N / a.seq_len : 1;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 21, 1.5f);
  std::vector<int> experts(static_cast<size_t>(N * K));
  std::mt19937 rng(22);
  for (int64_t n = 0; n < N; ++n)  // distinct experts per token, skewed toward the low ones
    for (int64_t j = 0; j < K; ++j)
      experts[static_cast<size_t>(n * K + j)] = static_cast<int>((rng() % 10) * 3 + j);
  const float g = 1.7f;
  const int lb = run.add(logits), eb = run.add(experts), gb = run.add(std::vector<float>{g});
  const int stats = run.poisoned<float>(static_cast<size_t>(2 * N)),
            partial = run.poisoned<float>(static_cast<size_t>(S));
  const int loss = run.poisoned<float>(1);
  std::vector<Kernel> fwd = emit::auxLossKernels(a);
  run.kernel(fwd[0], {lb, stats});
  run.kernel(fwd[1], {lb, eb, stats, partial});
  run.kernel(fwd[2], {partial, loss});
  const int stats2 = run.poisoned<float>(static_cast<size_t>(2 * N)),
            counts = run.poisoned<int>(static_cast<size_t>(S * E));
  const int dl = run.poisoned<float>(static_cast<size_t>(N * E));
  std::vector<Kernel> bwd = emit::auxLossGradKernels(a);
  run.kernel(bwd[0], {lb, stats2});
  run.kernel(bwd[1], {eb, counts});
  run.kernel(bwd[2], {lb, stats2, counts, gb, dl});
  run.run();
  std::vector<double> l(logits.begin(), logits.end());
  const double want = auxLoss(a, l, experts);
  EXPECT_NEAR(run.get<float>(loss, 1)[0], want, 1e-6 + 1e-5 * std::abs(want));
  auto grad = run.get<float>(dl, static_cast<size_t>(N * E));
  for (int64_t i = 0; i < N * E; ++i) {
    const double h = 1e-4;
    std::vector<double> up = l, down = l;
    up[static_cast<size_t>(i)] += h;
    down[static_cast<size_t>(i)] -= h;
    const double fd = g * (auxLoss(a, up, experts) - auxLoss(a, down, experts)) / (2 * h);
    EXPECT_NEAR(grad[static_cast<size_t>(i)], fd, 1e-7 + 1e-4 * std::abs(fd)) << "element " << i;
  }
}

inline void checkZLossAndGradient(MoeRun& run) {
  const int64_t N = 45, E = 40;
  const double coeff = 1e-3;
  std::vector<float> logits = normal(static_cast<size_t>(N * E), 31, 3.0f);
  auto zloss = [&](const std::vector<double>& l) {
    double sum = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double m = *std::max_element(l.begin() + n * E, l.begin() + (n + 1) * E);
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(l[static_cast<size_t>(n * E + e)] - m);
      sum += (m + std::log(z)) * (m + std::log(z));
    }
    return coeff * sum / static_cast<double>(N);
  };
  const float g = 0.5f;
  const int lb = run.add(logits), gb = run.add(std::vector<float>{g}), loss = run.poisoned<float>(1),
            dl = run.poisoned<float>(static_cast<size_t>(N * E));
  run.kernel(emit::zLossKernel(N, E, coeff), {lb, loss});
  run.kernel(emit::zLossGradKernel(N, E, coeff), {lb, gb, dl});
  run.run();
  std::vector<double> l(logits.begin(), logits.end());
  EXPECT_NEAR(run.get<float>(loss, 1)[0], zloss(l), 1e-5 * zloss(l));
  auto grad = run.get<float>(dl, static_cast<size_t>(N * E));
  for (int64_t i = 0; i < N * E; ++i) {
    std::vector<double> up = l, down = l;
    up[static_cast<size_t>(i)] += 1e-4;
    down[static_cast<size_t>(i)] -= 1e-4;
    const double fd = g * (zloss(up) - zloss(down)) / 2e-4;
    EXPECT_NEAR(grad[static_cast<size_t>(i)], fd, 1e-8 + 1e-4 * std::abs(fd)) << i;
  }
}

// ---- Dispatch ----

struct Dispatched {
  std::vector<int> rows, offsets, counts;
};

// docs/moe.md's moe_dispatch, plainly: per expert its slots in token order, the kept ones
// chosen by the policy, then padding.
inline Dispatched dispatchReference(const emit::DispatchShape& d, const std::vector<int>& experts,
                                    const std::vector<float>& probs) {
  Dispatched out;
  out.offsets.push_back(0);
  for (int64_t e = 0; e < d.experts; ++e) {
    std::vector<int> slots;
    for (int64_t s = 0; s < d.tokens * d.topk; ++s)
      if (experts[static_cast<size_t>(s)] == e) slots.push_back(static_cast<int>(s));
    if (d.capacity > 0 && static_cast<int64_t>(slots.size()) > d.capacity) {
      std::vector<int> order = slots;
      if (d.by_probs)
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
          return probs[static_cast<size_t>(a)] > probs[static_cast<size_t>(b)];
        });
      order.resize(static_cast<size_t>(d.capacity));
      std::sort(order.begin(), order.end());
      slots = order;
    }
    out.counts.push_back(static_cast<int>(slots.size()));
    out.rows.insert(out.rows.end(), slots.begin(), slots.end());
    if (d.pad)
      for (int64_t p = static_cast<int64_t>(slots.size()); p < d.capacity; ++p) out.rows.push_back(-1);
    out.offsets.push_back(static_cast<int>(out.rows.size()));
  }
  out.rows.resize(static_cast<size_t>(d.rows), -1);  // the bound's slack
  return out;
}

// Token n picks k distinct experts skewed toward the low ones (so some overflow, some stay empty),
// with probs from a few values (ties under the probs policy).
inline void routing(int64_t N, int64_t K, int64_t E, unsigned seed, std::vector<int>& experts,
                    std::vector<float>& probs) {
  std::mt19937 rng(seed);
  experts.assign(static_cast<size_t>(N * K), 0);
  probs.assign(static_cast<size_t>(N * K), 0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int> pool(static_cast<size_t>(E));
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t j = 0; j < K; ++j) {
      // Square of a uniform: low experts are popular; the last quarter is never picked.
      size_t at = static_cast<size_t>(j) + static_cast<size_t>(std::pow((rng() % 1000) / 1000.0, 2) *
                                                               static_cast<double>(E * 3 / 4 - K));
      std::swap(pool[static_cast<size_t>(j)], pool[at]);
      experts[static_cast<size_t>(n * K + j)] = pool[static_cast<size_t>(j)];
      probs[static_cast<size_t>(n * K + j)] = static_cast<float>(rng() % 5) / 8.0f;
    }
  }
}

struct DispatchCase {
  const char* name;
  double capacity_factor;
  bool by_probs, pad;
};

inline void checkDispatch(MoeRun& run, const DispatchCase& c) {
  emit::DispatchShape d;
  d.tokens = 150;
  d.topk = 3;
  d.experts = 36;
  d.capacity = emit::expertCapacity(d.tokens, d.topk, d.experts, c.capacity_factor);
  d.by_probs = c.by_probs;
  d.pad = c.pad;
  // The bound of docs/moe.md: k*N without padding, f*N + E*u with it (u = 1 here), plus slack.
  d.rows = c.pad ? static_cast<int64_t>(std::ceil(d.topk * std::max(c.capacity_factor, 1.0))) * d.tokens +
                       d.experts
                 : d.tokens * d.topk;
  std::vector<int> experts;
  std::vector<float> probs;
  routing(d.tokens, d.topk, d.experts, 41, experts, probs);
  Dispatched want = dispatchReference(d, experts, probs);
  const int eb = run.add(experts), pb = run.add(probs), rb = run.poisoned<int>(static_cast<size_t>(d.rows)),
            ob = run.poisoned<int>(static_cast<size_t>(d.experts + 1)),
            cb = run.poisoned<int>(static_cast<size_t>(d.experts));
  const int plan = run.poisoned<int>(static_cast<size_t>(4 * d.experts));
  std::vector<Kernel> ks = emit::dispatchKernels(d);
  run.kernel(ks[0], {eb, pb, plan});
  run.kernel(ks[1], {plan, ob, cb, rb});
  run.kernel(ks[2], {eb, pb, plan, ob, rb});
  run.run();
  EXPECT_EQ(run.get<int>(ob, static_cast<size_t>(d.experts + 1)), want.offsets);
  EXPECT_EQ(run.get<int>(cb, static_cast<size_t>(d.experts)), want.counts);
  EXPECT_EQ(run.get<int>(rb, static_cast<size_t>(d.rows)), want.rows);
  if (c.capacity_factor > 0) {  // the case drops something and leaves an expert empty
    EXPECT_LT(std::accumulate(want.counts.begin(), want.counts.end(), 0), d.tokens * d.topk);
    EXPECT_EQ(want.counts.back(), 0);
  }
}

inline std::vector<DispatchCase> dispatchCases() {
  return {DispatchCase{"dropless", 0.0, true, false}, DispatchCase{"drop_by_probs", 1.0, true, false},
          DispatchCase{"drop_by_position", 1.0, false, false},
          DispatchCase{"drop_by_probs_padded", 1.25, true, true},
          DispatchCase{"drop_by_position_padded", 0.5, false, true}};
}

// ---- Permutation ----

inline void checkPermutation(MoeRun& run, bool bf16) {
  emit::DispatchShape d;
  d.tokens = 40;
  d.topk = 2;
  d.experts = 8;
  d.capacity = emit::expertCapacity(d.tokens, d.topk, d.experts, 1.0);
  d.pad = true;
  d.rows = d.experts * d.capacity + 7;  // slack past R
  const int64_t N = d.tokens, K = d.topk, H = 37, R = d.rows;
  std::vector<int> experts;
  std::vector<float> probs;
  routing(N, K, d.experts, 51, experts, probs);
  const std::vector<int> rows = dispatchReference(d, experts, probs).rows;
  ASSERT_GT(std::count(rows.begin(), rows.end(), -1), 7);
  // Activations exactly representable in bf16 (a multiple of 1/16 below 4), so both dtypes
  // check against the same f64 sums.
  std::vector<float> x(static_cast<size_t>(N * H)), y(static_cast<size_t>(R * H));
  std::mt19937 rng(52);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 128) - 64) / 16.0f;
  for (float& v : y) v = static_cast<float>(static_cast<int>(rng() % 128) - 64) / 16.0f;
  const DType t = bf16 ? DType::bf16 : DType::f32;
  auto activations = [&](const std::vector<float>& v) {
    if (!bf16) return run.add(v);
    std::vector<uint16_t> h;
    for (float f : v) h.push_back(toBf16(f));
    return run.add(h);
  };
  auto read = [&](int b, size_t n) {
    if (!bf16) return run.get<float>(b, n);
    std::vector<float> out;
    for (uint16_t h : run.get<uint16_t>(b, n)) out.push_back(fromBf16(h));
    return out;
  };
  const size_t width = bf16 ? 2 : 4;
  auto poisoned = [&](size_t n) { return width == 2 ? run.poisoned<uint16_t>(n) : run.poisoned<float>(n); };
  const int xb = activations(x), yb = activations(y), rb = run.add(rows), pb = run.add(probs);
  const int permuted = poisoned(static_cast<size_t>(R * H)), plain = poisoned(static_cast<size_t>(R * H));
  const int combined = poisoned(static_cast<size_t>(N * H)), summed = poisoned(static_cast<size_t>(N * H));
  const int slot_row = run.poisoned<int>(static_cast<size_t>(N * K)),
            slot_row2 = run.poisoned<int>(static_cast<size_t>(N * K));
  const int dots = run.poisoned<float>(static_cast<size_t>(N * K));
  run.kernel(emit::permuteKernel(t, N, K, H, R, true), {xb, rb, pb, permuted});
  run.kernel(emit::permuteKernel(t, N, K, H, R, false), {xb, rb, pb, plain});
  std::vector<Kernel> un = emit::unpermuteKernels(t, N, K, H, R, true);
  run.kernel(un[0], {slot_row});
  run.kernel(un[1], {rb, slot_row});
  run.kernel(un[2], {yb, slot_row, pb, combined});
  std::vector<Kernel> sum = emit::unpermuteKernels(t, N, K, H, R, false);
  run.kernel(sum[0], {slot_row2});
  run.kernel(sum[1], {rb, slot_row2});
  run.kernel(sum[2], {yb, slot_row2, pb, summed});
  std::vector<Kernel> rd = emit::rowDotKernels(t, t, N, K, H, R);
  run.kernel(rd[0], {dots});
  run.kernel(rd[1], {yb, rb, xb, dots});
  run.run();
  const double tol = bf16 ? 2e-2 : 1e-5;
  auto got_p = read(permuted, static_cast<size_t>(R * H)),
       got_plain = read(plain, static_cast<size_t>(R * H));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const int s = rows[static_cast<size_t>(r)];
      const double v = s < 0 ? 0.0 : x[static_cast<size_t>((s / K) * H + h)];
      const double p = s < 0 ? 0.0 : probs[static_cast<size_t>(s)];
      ASSERT_NEAR(got_plain[static_cast<size_t>(r * H + h)], v, 0) << r << "," << h;
      ASSERT_NEAR(got_p[static_cast<size_t>(r * H + h)], v * p, tol) << r << "," << h;
    }
  std::vector<double> want_c(static_cast<size_t>(N * H)), want_s(static_cast<size_t>(N * H)),
      want_d(static_cast<size_t>(N * K));
  for (int64_t r = 0; r < R; ++r) {
    const int s = rows[static_cast<size_t>(r)];
    if (s < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const double v = y[static_cast<size_t>(r * H + h)];
      want_c[static_cast<size_t>((s / K) * H + h)] += probs[static_cast<size_t>(s)] * v;
      want_s[static_cast<size_t>((s / K) * H + h)] += v;
      want_d[static_cast<size_t>(s)] += v * x[static_cast<size_t>((s / K) * H + h)];
    }
  }
  auto got_c = read(combined, static_cast<size_t>(N * H)), got_s = read(summed, static_cast<size_t>(N * H));
  for (size_t i = 0; i < want_c.size(); ++i) {
    ASSERT_NEAR(got_c[i], want_c[i], tol * (1 + std::abs(want_c[i]))) << i;
    ASSERT_NEAR(got_s[i], want_s[i], tol * (1 + std::abs(want_s[i]))) << i;
  }
  auto got_d = run.get<float>(dots, static_cast<size_t>(N * K));
  for (size_t i = 0; i < want_d.size(); ++i) ASSERT_NEAR(got_d[i], want_d[i], 1e-4) << "slot " << i;
}

inline void checkExpertBiasUpdate(MoeRun& run) {
  const std::vector<int> counts{5, 1, 3, 3, 0, 6};  // mean 3: two at the mean stay
  const std::vector<float> bias{0.5f, -0.25f, 0.0f, 1.0f, 0.125f, 0.0f};
  const int bb = run.add(bias), cb = run.add(counts);
  run.kernel(emit::expertBiasUpdateKernel(6, 0.125), {bb, cb});
  run.run();
  EXPECT_EQ(run.get<float>(bb, 6), (std::vector<float>{0.375f, -0.125f, 0.0f, 1.0f, 0.25f, -0.125f}));
}

// ---- Grouped GEMMs ----

struct GemmCase {
  const char* name;
  DType dtype;
  bool transpose;
  int64_t k, m;
};

inline void checkGroupedGemm(MoeRun& run, const GemmCase& c) {
  const bool bf16 = c.dtype == DType::bf16;
  // Expert 0 and 3 get no rows, expert 2 spans several row tiles, and the bound leaves rows past R.
  const std::vector<int> sizes{0, 70, 150, 0, 3};
  const int64_t E = static_cast<int64_t>(sizes.size()), K = c.k, M = c.m;
  std::vector<int> offsets{0};
  for (int s : sizes) offsets.push_back(offsets.back() + s);
  const int64_t R = offsets.back(), ROWS = R + 45;
  std::mt19937 rng(61);
  auto values = [&](size_t n) {  // multiples of 1/8 in [-2, 2): exact in bf16
    std::vector<float> v(n);
    for (float& f : v) f = static_cast<float>(static_cast<int>(rng() % 32) - 16) / 8.0f;
    return v;
  };
  std::vector<float> x = values(static_cast<size_t>(ROWS * K)), w = values(static_cast<size_t>(E * K * M)),
                     dy = values(static_cast<size_t>(ROWS * M));
  auto add = [&](const std::vector<float>& v) {
    if (!bf16) return run.add(v);
    std::vector<uint16_t> h;
    for (float f : v) h.push_back(toBf16(f));
    return run.add(h);
  };
  auto read = [&](int b, size_t n) {
    if (!bf16) return run.get<float>(b, n);
    std::vector<float> out;
    for (uint16_t h : run.get<uint16_t>(b, n)) out.push_back(fromBf16(h));
    return out;
  };
  const int xb = add(x), wb = add(w), ob = run.add(offsets), db = add(dy);
  const int yb = bf16 ? run.poisoned<uint16_t>(static_cast<size_t>(ROWS * M))
                      : run.poisoned<float>(static_cast<size_t>(ROWS * M));
  const int gb = bf16 ? run.poisoned<uint16_t>(static_cast<size_t>(E * K * M))
                      : run.poisoned<float>(static_cast<size_t>(E * K * M));
  emit::GroupedGemmShape s{c.dtype, ROWS, K, M, E, c.transpose};
  emit::WgradShape ws{c.dtype, ROWS, K, M, E, c.transpose};
  run.kernel(emit::groupedMatmulKernel(s), {xb, wb, ob, yb});
  run.kernel(emit::groupedWgradKernel(ws), {xb, db, ob, gb});
  run.run();
  auto y = read(yb, static_cast<size_t>(ROWS * M));
  auto wg = read(gb, static_cast<size_t>(E * K * M));
  // w[e] is [K, M], or [M, K] with the transpose.
  auto wAt = [&](int64_t e, int64_t k, int64_t m) {
    return static_cast<double>(w[static_cast<size_t>(e * K * M + (c.transpose ? m * K + k : k * M + m))]);
  };
  const double tol = bf16 ? 1.0 / 64 : 1e-4;  // bf16 rounds the f32 sums on the store
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e + 1)]; ++r)
      for (int64_t m = 0; m < M; ++m) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += x[static_cast<size_t>(r * K + k)] * wAt(e, k, m);
        ASSERT_NEAR(y[static_cast<size_t>(r * M + m)], want, tol * (1 + std::abs(want)))
            << "expert " << e << " row " << r << " col " << m;
      }
  for (int64_t r = R; r < ROWS; ++r)
    for (int64_t m = 0; m < M; ++m) ASSERT_EQ(y[static_cast<size_t>(r * M + m)], 0.0f) << "row past R " << r;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < M; ++m) {
        double want = 0;
        for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e + 1)]; ++r)
          want += x[static_cast<size_t>(r * K + k)] * dy[static_cast<size_t>(r * M + m)];
        const size_t at = static_cast<size_t>(e * K * M + (c.transpose ? m * K + k : k * M + m));
        ASSERT_NEAR(wg[at], want, tol * (1 + std::abs(want))) << "expert " << e << " k " << k << " m " << m;
      }
}

inline std::vector<GemmCase> gemmCases() {
  return {GemmCase{"f32", DType::f32, false, 40, 72}, GemmCase{"f32_transposed", DType::f32, true, 33, 65},
          GemmCase{"bf16_tensor_cores", DType::bf16, false, 48, 136},
          GemmCase{"bf16_tensor_cores_transposed", DType::bf16, true, 40, 24},
          GemmCase{"bf16_tensor_cores_deep", DType::bf16, false, 100, 40},
          // Rows of 37 and 45 elements: no operand may be copied 16 bytes at a time.
          GemmCase{"bf16_tensor_cores_unaligned", DType::bf16, false, 37, 45},
          // Seven steps of 32 around the three-stage ring, both operands k-contiguous.
          GemmCase{"bf16_tensor_cores_transposed_deep", DType::bf16, true, 200, 72}};
}

// A routed expert layer: dispatch -> permute -> grouped GEMM (bf16, tensor cores) -> unpermute,
// executed (`execute(replays)`: the GPU replays one captured graph) before and after new
// routing is uploaded into the same buffers: the kernels follow the new offsets.
inline void checkRoutedLayer(MoeRun& run, const std::function<void(int replays)>& execute) {
  const int64_t N = 512, K = 2, E = 16, H = 64, M = 96;
  emit::DispatchShape d{N, E, K, 0, true, false, N * K};
  std::vector<int> experts;
  std::vector<float> probs;
  routing(N, K, E, 71, experts, probs);
  std::mt19937 rng(72);
  auto bf16Values = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& h : v) h = toBf16(static_cast<float>(static_cast<int>(rng() % 16) - 8) / 8.0f);
    return v;
  };
  const std::vector<uint16_t> x = bf16Values(static_cast<size_t>(N * H)),
                              w = bf16Values(static_cast<size_t>(E * H * M));
  const int eb = run.add(experts), pb = run.add(probs), xb = run.add(x), wb = run.add(w);
  const int rows = run.poisoned<int>(static_cast<size_t>(N * K)),
            offsets = run.poisoned<int>(static_cast<size_t>(E + 1)),
            counts = run.poisoned<int>(static_cast<size_t>(E));
  const int permuted = run.poisoned<uint16_t>(static_cast<size_t>(N * K * H)),
            y = run.poisoned<uint16_t>(static_cast<size_t>(N * K * M)),
            slot_row = run.poisoned<int>(static_cast<size_t>(N * K)),
            out = run.poisoned<uint16_t>(static_cast<size_t>(N * M));
  const int plan = run.poisoned<int>(static_cast<size_t>(4 * E));
  std::vector<Kernel> dispatch = emit::dispatchKernels(d);
  run.kernel(dispatch[0], {eb, pb, plan});
  run.kernel(dispatch[1], {plan, offsets, counts, rows});
  run.kernel(dispatch[2], {eb, pb, plan, offsets, rows});
  run.kernel(emit::permuteKernel(DType::bf16, N, K, H, N * K, false), {xb, rows, pb, permuted});
  run.kernel(emit::groupedMatmulKernel({DType::bf16, N * K, H, M, E, false}), {permuted, wb, offsets, y});
  std::vector<Kernel> un = emit::unpermuteKernels(DType::bf16, N, K, M, N * K, true);
  run.kernel(un[0], {slot_row});
  run.kernel(un[1], {rows, slot_row});
  run.kernel(un[2], {y, slot_row, pb, out});
  auto check = [&](const std::vector<int>& ex, const std::vector<float>& pr) {
    const std::vector<uint16_t> got = run.get<uint16_t>(out, static_cast<size_t>(N * M));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) {
        double want = 0;
        for (int64_t j = 0; j < K; ++j) {
          // y rows are rounded to bf16 before the combine, as the kernels store them.
          const int e = ex[static_cast<size_t>(n * K + j)];
          double dot = 0;
          for (int64_t h = 0; h < H; ++h)
            dot += fromBf16(x[static_cast<size_t>(n * H + h)]) *
                   fromBf16(w[static_cast<size_t>((e * H + h) * M + m)]);
          want += pr[static_cast<size_t>(n * K + j)] * fromBf16(toBf16(static_cast<float>(dot)));
        }
        ASSERT_NEAR(fromBf16(got[static_cast<size_t>(n * M + m)]), want, 1.0 / 64 * (1 + std::abs(want)))
            << n << "," << m;
      }
  };
  execute(1);
  check(experts, probs);
  routing(N, K, E, 73, experts, probs);  // new routing, same graph
  run.set(eb, experts);
  run.set(pb, probs);
  execute(2);
  check(experts, probs);
}

}  // namespace kiln::testing::moe
