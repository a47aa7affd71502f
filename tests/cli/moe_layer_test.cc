// The moe(...) layer against an independent formulation: each token through its top-k experts
// by a plain loop in double (routing, capacity, SwiGLU experts, shared experts, balancing
// losses written out here from Megatron-Core's definitions), forward and backward. The
// gradient Kiln's training step applies (SGD with lr = 1: the change of each weight) is checked
// against central finite differences of the plain loop's loss.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>

#include "runtime/comm/local_group.h"
#include "tools/session_flags.h"

namespace kiln::cli {
namespace {

struct Case {
  const char* name;
  int64_t experts = 4, topk = 2, hidden = 3, shared = 0;
  std::string router = "softmax";
  bool pre_softmax = false;
  int64_t groups = 1, group_topk = 1;
  double capacity = 0;  // 0: dropless
  std::string drop_policy = "probs";
  bool pad = false;
  double aux = 0, seq_aux = 0, z = 0;
  double bias_rate = 0;  // expert_bias (aux-loss-free balancing); the bias starts at zero
  int64_t seq = 0;       // > 0: x is [B, seq, H / seq]
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int64_t kTokensPerBatch = 10, kWidth = 6;

// ---- the independent formulation -------------------------------------------------------------

struct Weights {
  std::vector<double> router;  // [E, H]
  std::vector<double> fc1;     // [E, H, 2F]
  std::vector<double> fc2;     // [E, F, H]
  std::vector<double> s1;      // [2 F2, H]
  std::vector<double> s2;      // [H, F2]
};

double silu(double v) { return v / (1 + std::exp(-v)); }

// The k largest of `v` (descending; ties to the lower index), among `allowed`.
std::vector<int> topIndices(const std::vector<double>& v, int64_t k, const std::vector<bool>& allowed) {
  std::vector<int> idx;
  for (int i = 0; i < static_cast<int>(v.size()); ++i)
    if (allowed[static_cast<size_t>(i)]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return v[static_cast<size_t>(a)] > v[static_cast<size_t>(b)]; });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

struct Reference {
  std::vector<double> y;  // [N, H]
  double loss = 0;
  std::vector<int64_t> counts;  // tokens each expert computed (kept by capacity)
  std::vector<int64_t> routed;  // slots that chose each expert (before capacity)
};

// With `global_f`, the aux loss's f_i is that fraction of the global batch's slots routed to
// expert i (on N ranks each rank's loss judges the whole batch's load), else this batch's own.
Reference reference(const Case& c, const Weights& w, const std::vector<double>& x,
                    const std::vector<double>& target, int64_t n,
                    const std::vector<double>* global_f = nullptr) {
  const int64_t e_count = c.experts, k = c.topk, f = c.hidden, h = kWidth, f2 = c.shared * c.hidden;
  Reference r;
  r.y.assign(static_cast<size_t>(n * h), 0.0);
  std::vector<std::vector<double>> logits(static_cast<size_t>(n),
                                          std::vector<double>(static_cast<size_t>(e_count)));
  std::vector<std::vector<int>> chosen(static_cast<size_t>(n));
  std::vector<std::vector<double>> probs(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    auto& l = logits[static_cast<size_t>(t)];
    for (int64_t e = 0; e < e_count; ++e)
      for (int64_t j = 0; j < h; ++j)
        l[static_cast<size_t>(e)] +=
            w.router[static_cast<size_t>(e * h + j)] * x[static_cast<size_t>(t * h + j)];
    std::vector<double> sel = l, score = l;
    if (c.router == "sigmoid") {
      for (auto& v : score) v = 1 / (1 + std::exp(-v));
      sel = score;
    } else if (c.pre_softmax) {
      double m = *std::max_element(l.begin(), l.end()), z = 0;
      for (auto& v : score) z += std::exp(v - m);
      for (auto& v : score) v = std::exp(v - m) / z;
      sel = score;
    }
    std::vector<bool> allowed(static_cast<size_t>(e_count), true);
    if (c.groups > 1) {
      const int64_t per = e_count / c.groups;
      std::vector<double> gscore(static_cast<size_t>(c.groups));
      for (int64_t g = 0; g < c.groups; ++g) {
        std::vector<double> members(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(members.rbegin(), members.rend());
        for (int64_t i = 0; i < k / c.group_topk; ++i)
          gscore[static_cast<size_t>(g)] += members[static_cast<size_t>(i)];
      }
      std::vector<int> best =
          topIndices(gscore, c.group_topk, std::vector<bool>(static_cast<size_t>(c.groups), true));
      std::fill(allowed.begin(), allowed.end(), false);
      for (int g : best)
        for (int64_t i = 0; i < per; ++i) allowed[static_cast<size_t>(g * per + i)] = true;
    }
    auto& ch = chosen[static_cast<size_t>(t)];
    ch = topIndices(sel, k, allowed);
    auto& p = probs[static_cast<size_t>(t)];
    for (int e : ch) p.push_back(score[static_cast<size_t>(e)]);
    if (c.router == "softmax" && !c.pre_softmax) {
      double m = *std::max_element(p.begin(), p.end()), z = 0;
      for (double v : p) z += std::exp(v - m);
      for (double& v : p) v = std::exp(v - m) / z;
    } else if (c.router == "sigmoid" && k > 1) {
      double s = std::accumulate(p.begin(), p.end(), 0.0) + 1e-20;
      for (double& v : p) v /= s;
    }
  }

  // Capacity: which slots each expert keeps.
  std::vector<bool> kept(static_cast<size_t>(n * k), true);
  if (c.capacity > 0) {
    const int64_t cap = static_cast<int64_t>(
        std::ceil(static_cast<double>(n * k) * c.capacity / static_cast<double>(e_count)));
    for (int64_t e = 0; e < e_count; ++e) {
      std::vector<int64_t> slots;
      for (int64_t s = 0; s < n * k; ++s)
        if (chosen[static_cast<size_t>(s / k)][static_cast<size_t>(s % k)] == e) slots.push_back(s);
      if (c.drop_policy == "probs")
        std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
          return probs[static_cast<size_t>(a / k)][static_cast<size_t>(a % k)] >
                 probs[static_cast<size_t>(b / k)][static_cast<size_t>(b % k)];
        });
      for (size_t i = static_cast<size_t>(cap); i < slots.size(); ++i)
        kept[static_cast<size_t>(slots[i])] = false;
    }
  }
  r.counts.assign(static_cast<size_t>(e_count), 0);

  auto swigluMlp = [&](const double* in, auto w1, auto w2, int64_t ff, double* out, double scale) {
    std::vector<double> hid(static_cast<size_t>(2 * ff));
    for (int64_t o = 0; o < 2 * ff; ++o)
      for (int64_t j = 0; j < h; ++j) hid[static_cast<size_t>(o)] += w1(j, o) * in[j];
    for (int64_t o = 0; o < ff; ++o) {
      double a = silu(hid[static_cast<size_t>(o)]) * hid[static_cast<size_t>(ff + o)];
      for (int64_t j = 0; j < h; ++j) out[j] += scale * w2(o, j) * a;
    }
  };
  for (int64_t t = 0; t < n; ++t) {
    const double* xt = &x[static_cast<size_t>(t * h)];
    double* yt = &r.y[static_cast<size_t>(t * h)];
    for (int64_t j = 0; j < k; ++j) {
      if (!kept[static_cast<size_t>(t * k + j)]) continue;
      const int64_t e = chosen[static_cast<size_t>(t)][static_cast<size_t>(j)];
      ++r.counts[static_cast<size_t>(e)];
      swigluMlp(
          xt, [&](int64_t i, int64_t o) { return w.fc1[static_cast<size_t>((e * h + i) * 2 * f + o)]; },
          [&](int64_t o, int64_t i) { return w.fc2[static_cast<size_t>((e * f + o) * h + i)]; }, f, yt,
          probs[static_cast<size_t>(t)][static_cast<size_t>(j)]);
    }
    if (f2)
      swigluMlp(
          xt, [&](int64_t i, int64_t o) { return w.s1[static_cast<size_t>(o * h + i)]; },
          [&](int64_t o, int64_t i) { return w.s2[static_cast<size_t>(i * f2 + o)]; }, f2, yt, 1.0);
  }
  double sq = 0;
  for (size_t i = 0; i < r.y.size(); ++i) sq += (r.y[i] - target[i]) * (r.y[i] - target[i]);
  r.loss = sq / static_cast<double>(r.y.size());

  // The balancing losses over tokens [first, first + len): E * sum_i f_i P_i.
  auto balance = [&](int64_t first, int64_t len) {
    std::vector<double> fsum(static_cast<size_t>(e_count)), psum(static_cast<size_t>(e_count));
    for (int64_t t = first; t < first + len; ++t) {
      const auto& l = logits[static_cast<size_t>(t)];
      std::vector<double> s(l.size());
      if (c.router == "sigmoid") {
        double tot = 0;
        for (size_t e = 0; e < l.size(); ++e) tot += s[e] = 1 / (1 + std::exp(-l[e]));
        for (auto& v : s) v /= tot + 1e-20;
      } else {
        double m = *std::max_element(l.begin(), l.end()), z = 0;
        for (double v : l) z += std::exp(v - m);
        for (size_t e = 0; e < l.size(); ++e) s[e] = std::exp(l[e] - m) / z;
      }
      for (size_t e = 0; e < s.size(); ++e) psum[e] += s[e] / static_cast<double>(len);
      for (int e : chosen[static_cast<size_t>(t)])
        fsum[static_cast<size_t>(e)] += 1.0 / static_cast<double>(len * k);
    }
    if (global_f && len == n) fsum = *global_f;
    double v = 0;
    for (int64_t e = 0; e < e_count; ++e) v += fsum[static_cast<size_t>(e)] * psum[static_cast<size_t>(e)];
    return static_cast<double>(e_count) * v;
  };
  r.routed.assign(static_cast<size_t>(e_count), 0);
  for (const auto& ch : chosen)
    for (int e : ch) ++r.routed[static_cast<size_t>(e)];
  if (c.aux > 0) r.loss += c.aux * balance(0, n);
  if (c.seq_aux > 0) {
    double sum = 0;
    for (int64_t s = 0; s < n / c.seq; ++s) sum += balance(s * c.seq, c.seq);
    r.loss += c.seq_aux * sum / static_cast<double>(n / c.seq);
  }
  if (c.z > 0) {
    double sum = 0;
    for (const auto& l : logits) {
      double m = *std::max_element(l.begin(), l.end()), z = 0;
      for (double v : l) z += std::exp(v - m);
      sum += (m + std::log(z)) * (m + std::log(z));
    }
    r.loss += c.z * sum / static_cast<double>(n);
  }
  return r;
}

// ---- the model under test ------------------------------------------------------------------

std::string modelSource(const Case& c) {
  std::string opts =
      fmt::format("experts = {}, topk = {}, hidden = {}, router = {}, pre_softmax = {}, name = \"y\"",
                  c.experts, c.topk, c.hidden, c.router, c.pre_softmax ? "true" : "false");
  if (c.groups > 1) opts += fmt::format(", groups = {}, group_topk = {}", c.groups, c.group_topk);
  if (c.capacity > 0)
    opts += fmt::format(", capacity_factor = {}, drop_policy = {}, pad_to_capacity = {}", c.capacity,
                        c.drop_policy, c.pad ? "true" : "false");
  if (c.shared) opts += fmt::format(", shared_experts = {}, shared_hidden = {}", c.shared, c.hidden);
  if (c.aux > 0) opts += fmt::format(", aux_loss = {}", c.aux);
  if (c.seq_aux > 0) opts += fmt::format(", seq_aux_loss = {}", c.seq_aux);
  if (c.z > 0) opts += fmt::format(", z_loss = {}", c.z);
  if (c.bias_rate > 0) opts += fmt::format(", expert_bias = {}", c.bias_rate);
  // With a sequence, each sample holds `seq` tokens of width kWidth.
  const int64_t per_sample = c.seq ? c.seq : 1;
  std::string body =
      c.seq ? fmt::format("  xs = reshape(x, [B, {}, {}])\n  y = reshape(moe(xs, {}), [B, {}])\n", c.seq,
                          kWidth, opts, c.seq * kWidth)
            : fmt::format("  y = moe(x, {})\n", opts);
  return fmt::format(
      "model moe_case {{\n  dim B\n  input x: f32[B, {0}]\n  input target: f32[B, {0}]\n{1}  output y\n"
      "  train {{\n    loss = mse(y, target)\n    optimizer = sgd(lr = 1)\n  }}\n}}\n",
      per_sample * kWidth, body);
}

// A compiled case with its weights set to seeded values of decisive routing (router entries of
// order 1), and a batch of `batch` samples; on every rank the same.
struct Prepared {
  std::unique_ptr<driver::Session> session;
  Weights w;
  data::Batch batch;
  std::vector<double> x, target;  // the batch, as doubles
};

std::string writeModel(const Case& c) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("kiln_moe_{}_{}", c.name, ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "m.kiln").string();
  std::ofstream(path) << modelSource(c);
  return path;
}

void prepare(const Case& c, const std::string& path, int64_t batch, comm::Communicator* comm, Prepared& p,
             int ep = 1) {
  const int64_t per_sample = c.seq ? c.seq : 1;
  driver::SessionOptions o;
  o.model_path = path;
  o.batch = batch;
  o.comm = comm;
  o.ep = ep;
  std::ostringstream diag;
  auto made = driver::Session::create(o, diag);
  ASSERT_TRUE(made) << made.status().str() << diag.str() << modelSource(c);
  p.session = made.take();
  driver::Session& s = *p.session;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0, 1);
  auto fill = [&](const std::string& name, std::vector<double>& dst, double scale) {
    ir::HostTensor* t = s.params().find(name);
    ASSERT_NE(t, nullptr) << name;
    dst.resize(static_cast<size_t>(t->numel()));
    for (size_t i = 0; i < dst.size(); ++i) {
      const float v = static_cast<float>(scale * normal(rng));
      t->as<float>()[i] = v;
      dst[i] = v;
    }
  };
  fill("y.router.weight", p.w.router, 1.0);
  fill("y.experts.fc1", p.w.fc1, 0.5);
  fill("y.experts.fc2", p.w.fc2, 0.5);
  if (c.shared) {
    fill("y.shared.fc1.weight", p.w.s1, 0.5);
    fill("y.shared.fc2.weight", p.w.s2, 0.5);
  }
  p.batch = {};
  p.batch.size = batch;
  p.x.assign(static_cast<size_t>(batch * per_sample * kWidth), 0);
  p.target.assign(p.x.size(), 0);
  for (const char* name : {"x", "target"}) {
    ir::HostTensor t(ir::DType::f32, {batch, per_sample * kWidth});
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = static_cast<float>(normal(rng));
      t.as<float>()[i] = v;
      (std::string(name) == "x" ? p.x : p.target)[static_cast<size_t>(i)] = v;
    }
    p.batch.names.push_back(name);
    p.batch.tensors.push_back(std::move(t));
  }
}

// d loss / d w[i] of the plain loop, by central differences.
double finiteDifference(const Case& c, Weights& w, std::vector<double>& wv, size_t i,
                        const std::vector<double>& x, const std::vector<double>& target, int64_t n,
                        const std::vector<double>* global_f = nullptr) {
  const double keep = wv[i], eps = 1e-5;
  wv[i] = keep + eps;
  const double up = reference(c, w, x, target, n, global_f).loss;
  wv[i] = keep - eps;
  const double down = reference(c, w, x, target, n, global_f).loss;
  wv[i] = keep;
  return (up - down) / (2 * eps);
}

std::vector<double>& weightsNamed(Weights& w, const std::string& name) {
  return name == "y.router.weight" ? w.router : name == "y.experts.fc1" ? w.fc1 : w.fc2;
}

class MoeLayer : public ::testing::TestWithParam<Case> {};

TEST_P(MoeLayer, MatchesEachTokenThroughItsExpertsForwardAndBackward) {
  const Case& c = GetParam();
  const int64_t per_sample = c.seq ? c.seq : 1;
  const int64_t batch = c.seq ? 4 : kTokensPerBatch;
  const int64_t n = batch * per_sample;
  const std::string path = writeModel(c);
  Prepared p;
  prepare(c, path, batch, nullptr, p);
  if (HasFatalFailure()) return;
  driver::Session& s = *p.session;
  Weights& w = p.w;
  const data::Batch& b = p.batch;
  const std::vector<double>&x = p.x, &target = p.target;

  const Reference want = reference(c, w, x, target, n);
  auto fwd = s.forward(b);
  ASSERT_TRUE(fwd) << fwd.status().str();
  EXPECT_NEAR(fwd->loss, want.loss, 1e-4 * (1 + want.loss));
  ASSERT_EQ(fwd->prediction.size(), want.y.size());
  for (size_t i = 0; i < want.y.size(); ++i)
    EXPECT_NEAR(fwd->prediction[i], want.y[i], 1e-4 * (1 + std::fabs(want.y[i]))) << i;
  // Per-expert counts: kept tokens only (dropped slots and padding rows do not count).
  std::vector<int64_t> counts;
  for (const auto& [name, values] : fwd->stats)
    if (name == "y.counts") counts.assign(values.begin(), values.end());
  EXPECT_EQ(counts, want.counts);

  // Backward: one SGD step with lr = 1 moves each weight by minus its gradient.
  std::map<std::string, std::vector<double>> before;
  for (const char* name : {"y.router.weight", "y.experts.fc1", "y.experts.fc2"}) {
    const ir::HostTensor* t = s.params().find(name);
    before[name].assign(t->as<float>(), t->as<float>() + t->numel());
  }
  auto step = s.trainStep(b, 1.0, 1);
  ASSERT_TRUE(step) << step.status().str();
  EXPECT_NEAR(step->loss, want.loss, 1e-4 * (1 + want.loss));
  std::mt19937 pick(3);
  for (auto& [name, old] : before) {
    std::vector<double>& wv = weightsNamed(w, name);
    const ir::HostTensor* t = s.params().find(name);
    for (int trial = 0; trial < 12; ++trial) {
      const size_t i = pick() % wv.size();
      const double got = old[i] - t->as<float>()[i];
      const double fd = finiteDifference(c, w, wv, i, x, target, n);
      EXPECT_NEAR(got, fd, 2e-4 + 2e-3 * std::fabs(fd)) << name << "[" << i << "]";
    }
  }
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

// One training step of `whole`'s batch on `ranks` in-process ranks, each on its share, with the
// same weights (the experts over `ep` of them); `done` sees each rank's session and loss after its
// step (under a lock).
Status stepOnRanks(const Case& c, const std::string& path, const Prepared& whole, int ranks,
                   const std::function<Status(int rank, driver::Session& s, const driver::StepOutputs& out)>& done,
                   int ep = 1) {
  std::mutex mu;
  comm::LocalGroup group(ranks);
  const int64_t share = whole.batch.size / ranks;
  return group.run([&](comm::Communicator& comm) -> Status {
    Prepared p;
    prepare(c, path, share, &comm, p, ep);
    if (!p.session) return Status::error("no session");
    // The whole batch's weights; under expert parallelism each rank holds the slice of experts
    // [r E / ep, (r + 1) E / ep) of the expert weights.
    for (auto [name, values] :
         {std::pair{"y.router.weight", &whole.w.router}, std::pair{"y.experts.fc1", &whole.w.fc1},
          std::pair{"y.experts.fc2", &whole.w.fc2}, std::pair{"y.shared.fc1.weight", &whole.w.s1},
          std::pair{"y.shared.fc2.weight", &whole.w.s2}}) {
      ir::HostTensor* t = p.session->params().find(name);
      if (!t) continue;
      const auto n = static_cast<size_t>(t->numel());
      const size_t first = n < values->size() ? static_cast<size_t>(comm.rank() % ep) * n : 0;
      for (size_t i = 0; i < n; ++i) t->as<float>()[i] = static_cast<float>((*values)[first + i]);
    }
    auto part = data::sliceBatch(whole.batch, p.session->trainSpec(), comm.rank() * share, share);
    if (!part) return part.status();
    KILN_ASSIGN_OR_RETURN(auto out, p.session->trainStep(*part, 1.0, 1));
    std::lock_guard<std::mutex> lock(mu);
    return done(comm.rank(), *p.session, out);
  });
}

// The fraction of the whole batch's slots routed to each expert: the global batch's f_i.
std::vector<double> globalFraction(const Case& c, const Prepared& whole, int64_t n) {
  const std::vector<int64_t> routed = reference(c, whole.w, whole.x, whole.target, n).routed;
  std::vector<double> f;
  for (int64_t v : routed) f.push_back(static_cast<double>(v) / static_cast<double>(n * c.topk));
  return f;
}

// Rank r's share of a batch's values (samples in order).
std::vector<double> shareOf(const std::vector<double>& v, int r, int ranks) {
  const auto n = static_cast<std::ptrdiff_t>(v.size()) / ranks;
  return std::vector<double>(v.begin() + r * n, v.begin() + (r + 1) * n);
}

// The balancing losses' coefficients apply once per step whatever the batch is split into: on
// two ranks (two micro-batches of one global batch) each rank's loss is its own half's
// `mse + aux_coeff * aux + z_coeff * z`, the global loss their mean, and the weights move by the
// mean of the halves' gradients, neither doubled nor halved. The aux loss judges the global
// batch's load (Megatron's global-batch balancing): each half's f_i is the whole batch's routed
// fraction, its P_i its own mean score.
TEST(MoeLayerAccounting, BalancingLossesApplyOncePerMicroBatch) {
  Case c;
  c.name = "accounting";
  c.aux = 0.5;
  c.z = 0.05;
  const std::string path = writeModel(c);
  constexpr int kRanks = 2;
  // The global batch: both halves, from one rank-independent draw.
  Prepared whole;
  prepare(c, path, kTokensPerBatch * kRanks, nullptr, whole);
  if (HasFatalFailure()) return;
  std::vector<std::vector<double>> after(kRanks);
  std::vector<double> losses(kRanks);
  Status st =
      stepOnRanks(c, path, whole, kRanks, [&](int rank, driver::Session& s, const driver::StepOutputs& out) -> Status {
        const ir::HostTensor* t = s.params().find("y.router.weight");
        losses[static_cast<size_t>(rank)] = out.loss;
        after[static_cast<size_t>(rank)].assign(t->as<float>(), t->as<float>() + t->numel());
        return Status::ok();
      });
  ASSERT_TRUE(st) << st.str();

  const std::vector<double> f = globalFraction(c, whole, 2 * kTokensPerBatch);
  std::vector<double> grad(whole.w.router.size(), 0.0);
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<double> x = shareOf(whole.x, r, kRanks), t = shareOf(whole.target, r, kRanks);
    const double want = reference(c, whole.w, x, t, kTokensPerBatch, &f).loss;
    EXPECT_NEAR(losses[static_cast<size_t>(r)], want, 1e-4 * (1 + want)) << "rank " << r;
    for (size_t i = 0; i < grad.size(); ++i)
      grad[i] += finiteDifference(c, whole.w, whole.w.router, i, x, t, kTokensPerBatch, &f) / kRanks;
  }
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < grad.size(); ++i)
      EXPECT_NEAR(whole.w.router[i] - after[static_cast<size_t>(r)][i], grad[i],
                  2e-4 + 2e-3 * std::fabs(grad[i]))
          << "rank " << r << " router[" << i << "]";
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

Case make(const char* name, std::function<void(Case&)> f) {
  Case c;
  c.name = name;
  f(c);
  return c;
}

INSTANTIATE_TEST_SUITE_P(Routing, MoeLayer,
                         ::testing::Values(make("dropless_softmax", [](Case&) {}),
                                           make("pre_softmax", [](Case& c) { c.pre_softmax = true; }),
                                           make("sigmoid", [](Case& c) { c.router = "sigmoid"; }),
                                           make("top1", [](Case& c) { c.topk = 1; }),
                                           make("groups",
                                                [](Case& c) {
                                                  c.experts = 8;
                                                  c.groups = 4;
                                                  c.group_topk = 2;
                                                }),
                                           make("capacity_probs", [](Case& c) { c.capacity = 0.5; }),
                                           make("capacity_position",
                                                [](Case& c) {
                                                  c.capacity = 0.5;
                                                  c.drop_policy = "position";
                                                }),
                                           make("capacity_padded",
                                                [](Case& c) {
                                                  c.capacity = 1.0;
                                                  c.pad = true;
                                                }),
                                           make("shared_expert", [](Case& c) { c.shared = 2; }),
                                           make("aux_and_z",
                                                [](Case& c) {
                                                  c.aux = 0.1;
                                                  c.z = 0.01;
                                                }),
                                           make("seq_aux",
                                                [](Case& c) {
                                                  c.seq = 2;
                                                  c.seq_aux = 0.1;
                                                })),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// Aux-loss-free balancing: after one step the expert bias is rate * sign(mean(c) - c_i) for the
// step's per-expert counts c; on two ranks c is the global batch's (the sum of both halves'), so
// both replicas of the bias move alike.
TEST(MoeLayerAccounting, ExpertBiasMovesByTheGlobalBatchsCounts) {
  Case c;
  c.name = "expert_bias";
  c.router = "sigmoid";
  c.bias_rate = 0.25;
  const std::string path = writeModel(c);
  constexpr int kRanks = 2;
  Prepared whole;
  prepare(c, path, kTokensPerBatch * kRanks, nullptr, whole);
  if (HasFatalFailure()) return;
  auto expected = [&](const std::vector<int64_t>& counts) {
    double mean = 0;
    for (int64_t n : counts) mean += static_cast<double>(n) / static_cast<double>(counts.size());
    std::vector<double> b;
    for (int64_t n : counts) b.push_back(c.bias_rate * (mean > n ? 1.0 : mean < n ? -1.0 : 0.0));
    return b;
  };
  const char* kBias = "y.router.expert_bias";
  // One rank on the whole batch.
  {
    auto out = whole.session->trainStep(whole.batch, 1.0, 1);
    ASSERT_TRUE(out) << out.status().str();
    const std::vector<double> want =
        expected(reference(c, whole.w, whole.x, whole.target, 2 * kTokensPerBatch).counts);
    const ir::HostTensor* b = whole.session->params().find(kBias);
    ASSERT_NE(b, nullptr);
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_FLOAT_EQ(b->as<float>()[i], static_cast<float>(want[i])) << i;
  }
  // Two ranks, each on its half: the counts summed over the ranks decide.
  std::vector<int64_t> global(static_cast<size_t>(c.experts), 0);
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<double> x = shareOf(whole.x, r, kRanks), t = shareOf(whole.target, r, kRanks);
    const std::vector<int64_t> counts = reference(c, whole.w, x, t, kTokensPerBatch).counts;
    for (size_t e = 0; e < counts.size(); ++e) global[e] += counts[e];
  }
  const std::vector<double> want = expected(global);
  std::vector<std::vector<float>> bias(kRanks);
  Status st =
      stepOnRanks(c, path, whole, kRanks, [&](int rank, driver::Session& s, const driver::StepOutputs&) -> Status {
        const ir::HostTensor* b = s.params().find(kBias);
        if (!b) return Status::error("no expert bias");
        bias[static_cast<size_t>(rank)].assign(b->as<float>(), b->as<float>() + b->numel());
        return Status::ok();
      });
  ASSERT_TRUE(st) << st.str();
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_FLOAT_EQ(bias[static_cast<size_t>(r)][i], static_cast<float>(want[i]))
          << "rank " << r << " expert " << i;
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

}  // namespace
}  // namespace kiln::cli

namespace kiln::cli {
namespace {

// Expert parallelism on two ranks (ep = 2: rank r holds experts [r E/2, (r+1) E/2)): each rank
// routes its own share, applies capacity to it before the dispatch (as Megatron does), and its
// experts compute the rows both ranks send them. So each rank's loss is the plain loop's on its
// share (with the global batch's f_i in the aux loss), the counts are the sum of the shares', the
// router moves by the mean of the shares' gradients on both ranks, and each expert slice by the
// same mean for its own experts.
class MoeLayerExpertParallel : public ::testing::TestWithParam<Case> {};

TEST_P(MoeLayerExpertParallel, EachShareThroughItsExpertsOnTheirOwners) {
  const Case& c = GetParam();
  constexpr int kRanks = 2;
  const std::string path = writeModel(c);
  Prepared whole;
  prepare(c, path, kTokensPerBatch * kRanks, nullptr, whole);
  if (HasFatalFailure()) return;
  const std::vector<double> f = globalFraction(c, whole, kRanks * kTokensPerBatch);
  std::vector<double> loss(kRanks);
  std::vector<int64_t> counts(static_cast<size_t>(c.experts), 0);
  for (int r = 0; r < kRanks; ++r) {
    const Reference share = reference(c, whole.w, shareOf(whole.x, r, kRanks),
                                      shareOf(whole.target, r, kRanks), kTokensPerBatch, &f);
    loss[static_cast<size_t>(r)] = share.loss;
    for (size_t e = 0; e < counts.size(); ++e) counts[e] += share.counts[e];
  }
  // d loss / d w[i] of the global batch: the mean over the shares.
  auto gradient = [&](std::vector<double>& wv, size_t i) {
    double g = 0;
    for (int r = 0; r < kRanks; ++r)
      g += finiteDifference(c, whole.w, wv, i, shareOf(whole.x, r, kRanks), shareOf(whole.target, r, kRanks),
                            kTokensPerBatch, &f) /
           kRanks;
    return g;
  };
  std::mutex checks;
  Status st = stepOnRanks(
      c, path, whole, kRanks,
      [&](int rank, driver::Session& s, const driver::StepOutputs& out) -> Status {
        EXPECT_NEAR(out.loss, loss[static_cast<size_t>(rank)], 1e-4 * (1 + loss[static_cast<size_t>(rank)]))
            << "rank " << rank;
        for (const auto& [name, values] : out.stats)
          if (name == "y.counts") EXPECT_EQ(std::vector<int64_t>(values.begin(), values.end()), counts);
        std::mt19937 pick(static_cast<unsigned>(5 + rank));
        for (const char* name : {"y.router.weight", "y.experts.fc1", "y.experts.fc2"}) {
          std::vector<double>& wv = weightsNamed(whole.w, name);
          const ir::HostTensor* t = s.params().find(name);
          if (!t) return Status::errorf("rank {} holds no {}", rank, name);
          // The expert weights: this rank's slice, which starts at expert rank * E / 2.
          const bool sliced = std::string(name) != "y.router.weight";
          const size_t first = sliced ? static_cast<size_t>(rank) * static_cast<size_t>(t->numel()) : 0;
          if (sliced) EXPECT_EQ(static_cast<size_t>(t->numel()) * kRanks, wv.size()) << name;
          for (int trial = 0; trial < 10; ++trial) {
            const size_t local = pick() % static_cast<size_t>(t->numel());
            const double moved = wv[first + local] - t->as<float>()[local];
            const double fd = gradient(wv, first + local);
            EXPECT_NEAR(moved, fd, 2e-4 + 2e-3 * std::fabs(fd))
                << name << "[" << first + local << "] on rank " << rank;
          }
        }
        return Status::ok();
      },
      /*ep=*/2);
  ASSERT_TRUE(st) << st.str();
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

INSTANTIATE_TEST_SUITE_P(Routing, MoeLayerExpertParallel,
                         ::testing::Values(make("ep_dropless", [](Case& c) { c.aux = 0.1; }),
                                           make("ep_capacity_probs", [](Case& c) { c.capacity = 0.5; }),
                                           make("ep_capacity_position",
                                                [](Case& c) {
                                                  c.capacity = 0.5;
                                                  c.drop_policy = "position";
                                                }),
                                           make("ep_capacity_padded",
                                                [](Case& c) {
                                                  c.capacity = 1.0;
                                                  c.pad = true;
                                                }),
                                           make("ep_groups",
                                                [](Case& c) {
                                                  c.experts = 8;
                                                  c.groups = 4;
                                                  c.group_topk = 2;
                                                }),
                                           make("ep_shared_expert", [](Case& c) { c.shared = 2; })),
                         [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace kiln::cli
