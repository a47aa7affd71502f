// Workloads M1 and M2 (../shared/bench/WORKLOADS.md): one MoE layer (softmax top-k router,
// SwiGLU experts) forward + backward, the training step of models/moe_layer.kiln with plain SGD.
//
//   moe_bench [--workload m1|m2] [--tokens N] [--hidden H] [--device cpu|cuda] [--threads T]
//             [--rounds R] [--iters I] [--profile 1]
//
// On the CPU the workloads are scaled down (--tokens 1024 --hidden 512 by default; FFN size and
// expert count keep the workload's ratios) and Kiln runs interleaved with a baseline written
// here, as PyTorch's loop over experts runs it: router GEMM, top-k, a gather per expert, two
// GEMMs and SwiGLU per expert, a weighted scatter back, the same backward and SGD. Both use
// the same GEMMs (oneDNN, runtime/cpu/gemm.h) and thread count. Printed: ms per forward + backward (the median of
// R rounds of I steps each, alternating Kiln and the baseline), GFLOP/s, and the fraction of
// the SGEMM rate measured on this machine in the same run. On --device cuda Kiln runs
// alone in bf16 (the PyTorch peer, ../shared/bench/moe_torch.py, runs next to it in
// bench/device_run.sh).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/cpu/gemm.h"
#include "tools/session_flags.h"

using namespace kiln;

namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Shape {
  int64_t tokens, hidden, ffn, experts, topk;
  // Forward flops of the experts (the two GEMMs per routed token), as the peer counts them.
  double expertFlops() const {
    return static_cast<double>(tokens * topk) * (2.0 * hidden * 2 * ffn + 2.0 * ffn * hidden);
  }
};

runtime::ThreadPool* g_pool = nullptr;  // --threads

// C[m, n] = op(A) op(B) (+ C when accumulate), row-major, by the GEMMs Kiln's CPU backend uses.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c,
          bool accumulate = false) {
  auto d = runtime::cpu::GemmDesc::plain(ir::DType::f32, ta, tb, m, n, k);
  d.accumulate = accumulate;
  if (Status s = runtime::cpu::gemm(d, {a, b, c}, g_pool); !s.isOk()) {
    std::fprintf(stderr, "moe_bench: %s\n", s.message().c_str());
    std::exit(1);
  }
}

float silu(float v) { return v / (1.0f + std::exp(-v)); }

// The loop-over-experts baseline: one training step (forward, backward, SGD) of the same layer.
class LoopBaseline {
 public:
  explicit LoopBaseline(const Shape& s) : s_(s) {
    std::mt19937 rng(1);
    std::normal_distribution<float> n(0, 1);
    auto fill = [&](std::vector<float>& v, size_t size, float scale) {
      v.resize(size);
      for (float& x : v) x = scale * n(rng);
    };
    const auto h = static_cast<size_t>(s.hidden), f = static_cast<size_t>(s.ffn),
               e = static_cast<size_t>(s.experts);
    fill(wr_, e * h, 0.02f);
    fill(w1_, e * h * 2 * f, 0.02f);
    fill(w2_, e * f * h, 0.02f);
    fill(x_, static_cast<size_t>(s.tokens) * h, 1.0f);
    fill(target_, x_.size(), 1.0f);
  }

  void step() {
    const int64_t n = s_.tokens, h = s_.hidden, f = s_.ffn, e_count = s_.experts, k = s_.topk;
    // Router: logits, top-k, softmax over the chosen.
    logits_.assign(static_cast<size_t>(n * e_count), 0);
    gemm(false, true, n, e_count, h, x_.data(), wr_.data(), logits_.data());
    probs_.resize(static_cast<size_t>(n * k));
    chosen_.resize(static_cast<size_t>(n * k));
    std::vector<int> order(static_cast<size_t>(e_count));
    for (int64_t t = 0; t < n; ++t) {
      const float* l = &logits_[static_cast<size_t>(t * e_count)];
      for (int i = 0; i < static_cast<int>(e_count); ++i) order[static_cast<size_t>(i)] = i;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int a, int b) { return l[a] > l[b]; });
      float m = l[order[0]], z = 0;
      for (int64_t j = 0; j < k; ++j) z += std::exp(l[order[static_cast<size_t>(j)]] - m);
      for (int64_t j = 0; j < k; ++j) {
        chosen_[static_cast<size_t>(t * k + j)] = order[static_cast<size_t>(j)];
        probs_[static_cast<size_t>(t * k + j)] = std::exp(l[order[static_cast<size_t>(j)]] - m) / z;
      }
    }
    // Tokens of each expert, in token order.
    std::vector<std::vector<int64_t>> slots(static_cast<size_t>(e_count));
    for (int64_t sl = 0; sl < n * k; ++sl)
      slots[static_cast<size_t>(chosen_[static_cast<size_t>(sl)])].push_back(sl);

    y_.assign(static_cast<size_t>(n * h), 0);
    std::vector<std::vector<float>> xs(static_cast<size_t>(e_count)), hid(xs.size()), act(xs.size()),
        out(xs.size());
    for (int64_t e = 0; e < e_count; ++e) {
      const auto& sl = slots[static_cast<size_t>(e)];
      const auto c = static_cast<int64_t>(sl.size());
      auto& xe = xs[static_cast<size_t>(e)];
      xe.resize(static_cast<size_t>(c * h));
      for (int64_t r = 0; r < c; ++r)
        std::memcpy(&xe[static_cast<size_t>(r * h)],
                    &x_[static_cast<size_t>(sl[static_cast<size_t>(r)] / k * h)],
                    sizeof(float) * static_cast<size_t>(h));
      hid[static_cast<size_t>(e)].resize(static_cast<size_t>(c * 2 * f));
      gemm(false, false, c, 2 * f, h, xe.data(), &w1_[static_cast<size_t>(e * h * 2 * f)],
           hid[static_cast<size_t>(e)].data());
      auto& a = act[static_cast<size_t>(e)];
      a.resize(static_cast<size_t>(c * f));
      for (int64_t r = 0; r < c; ++r)
        for (int64_t j = 0; j < f; ++j) {
          const float* hr = &hid[static_cast<size_t>(e)][static_cast<size_t>(r * 2 * f)];
          a[static_cast<size_t>(r * f + j)] = silu(hr[j]) * hr[f + j];
        }
      out[static_cast<size_t>(e)].resize(static_cast<size_t>(c * h));
      gemm(false, false, c, h, f, a.data(), &w2_[static_cast<size_t>(e * f * h)],
           out[static_cast<size_t>(e)].data());
      for (int64_t r = 0; r < c; ++r) {
        const int64_t sl_r = sl[static_cast<size_t>(r)];
        const float p = probs_[static_cast<size_t>(sl_r)];
        float* yt = &y_[static_cast<size_t>(sl_r / k * h)];
        const float* o = &out[static_cast<size_t>(e)][static_cast<size_t>(r * h)];
        for (int64_t j = 0; j < h; ++j) yt[j] += p * o[j];
      }
    }

    // Backward of mean((y - target)^2).
    dy_.resize(y_.size());
    const float scale = 2.0f / static_cast<float>(y_.size());
    for (size_t i = 0; i < y_.size(); ++i) dy_[i] = scale * (y_[i] - target_[i]);
    dx_.assign(x_.size(), 0);
    dprobs_.assign(probs_.size(), 0);
    dw1_.resize(w1_.size());
    dw2_.resize(w2_.size());
    for (int64_t e = 0; e < e_count; ++e) {
      const auto& sl = slots[static_cast<size_t>(e)];
      const auto c = static_cast<int64_t>(sl.size());
      std::vector<float> dye(static_cast<size_t>(c * h)), da(static_cast<size_t>(c * f)),
          dh(static_cast<size_t>(c * 2 * f)), dxe(static_cast<size_t>(c * h));
      for (int64_t r = 0; r < c; ++r) {
        const int64_t sl_r = sl[static_cast<size_t>(r)];
        const float* g = &dy_[static_cast<size_t>(sl_r / k * h)];
        const float* o = &out[static_cast<size_t>(e)][static_cast<size_t>(r * h)];
        const float p = probs_[static_cast<size_t>(sl_r)];
        float dot = 0;
        for (int64_t j = 0; j < h; ++j) {
          dye[static_cast<size_t>(r * h + j)] = p * g[j];
          dot += o[j] * g[j];
        }
        dprobs_[static_cast<size_t>(sl_r)] = dot;
      }
      gemm(true, false, f, h, c, act[static_cast<size_t>(e)].data(), dye.data(),
           &dw2_[static_cast<size_t>(e * f * h)]);
      gemm(false, true, c, f, h, dye.data(), &w2_[static_cast<size_t>(e * f * h)], da.data());
      for (int64_t r = 0; r < c; ++r)
        for (int64_t j = 0; j < f; ++j) {
          const float* hr = &hid[static_cast<size_t>(e)][static_cast<size_t>(r * 2 * f)];
          const float g = hr[j], u = hr[f + j], sg = 1.0f / (1.0f + std::exp(-g));
          const float d = da[static_cast<size_t>(r * f + j)];
          dh[static_cast<size_t>(r * 2 * f + j)] = d * u * sg * (1 + g * (1 - sg));
          dh[static_cast<size_t>(r * 2 * f + f + j)] = d * g * sg;
        }
      gemm(true, false, h, 2 * f, c, xs[static_cast<size_t>(e)].data(), dh.data(),
           &dw1_[static_cast<size_t>(e * h * 2 * f)]);
      gemm(false, true, c, h, 2 * f, dh.data(), &w1_[static_cast<size_t>(e * h * 2 * f)], dxe.data());
      for (int64_t r = 0; r < c; ++r) {
        float* dxt = &dx_[static_cast<size_t>(sl[static_cast<size_t>(r)] / k * h)];
        for (int64_t j = 0; j < h; ++j) dxt[j] += dxe[static_cast<size_t>(r * h + j)];
      }
    }
    // Router: softmax over the chosen logits.
    std::vector<float> dlogits(logits_.size(), 0);
    for (int64_t t = 0; t < n; ++t) {
      float sum = 0;
      for (int64_t j = 0; j < k; ++j)
        sum += probs_[static_cast<size_t>(t * k + j)] * dprobs_[static_cast<size_t>(t * k + j)];
      for (int64_t j = 0; j < k; ++j) {
        const size_t sl = static_cast<size_t>(t * k + j);
        dlogits[static_cast<size_t>(t * e_count + chosen_[sl])] = probs_[sl] * (dprobs_[sl] - sum);
      }
    }
    dwr_.resize(wr_.size());
    gemm(true, false, e_count, h, n, dlogits.data(), x_.data(), dwr_.data());
    gemm(false, false, n, h, e_count, dlogits.data(), wr_.data(), dx_.data(), /*accumulate=*/true);
    // SGD.
    auto sgd = [](std::vector<float>& w, const std::vector<float>& g) {
      for (size_t i = 0; i < w.size(); ++i) w[i] -= 0.01f * g[i];
    };
    sgd(wr_, dwr_);
    sgd(w1_, dw1_);
    sgd(w2_, dw2_);
  }

 private:
  Shape s_;
  std::vector<float> wr_, w1_, w2_, x_, target_, logits_, probs_, y_, dy_, dx_, dprobs_, dw1_, dw2_, dwr_;
  std::vector<int> chosen_;
};

// The SGEMM rate on this machine at the experts' GEMM shape, GFLOP/s (best of 5).
double sgemmRate(const Shape& s) {
  const int64_t m = std::max<int64_t>(64, s.tokens * s.topk / s.experts), n = 2 * s.ffn, k = s.hidden;
  std::vector<float> a(static_cast<size_t>(m * k), 0.5f), b(static_cast<size_t>(k * n), 0.25f),
      c(static_cast<size_t>(m * n));
  double best = 1e30;
  gemm(false, false, m, n, k, a.data(), b.data(), c.data());
  for (int i = 0; i < 5; ++i) {
    auto t = Clock::now();
    gemm(false, false, m, n, k, a.data(), b.data(), c.data());
    best = std::min(best, msSince(t));
  }
  return 2.0 * static_cast<double>(m * n * k) / (best * 1e-3) / 1e9;
}

int fail(const std::string& what, const Status& st) {
  std::fprintf(stderr, "moe_bench: %s: %s\n", what.c_str(), st.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string workload = "m1", device = "cpu";
  int64_t tokens = 0, hidden = 0, rounds = 5, iters = 2;
  int threads = 2;
  bool profile = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--workload" && (v == "m1" || v == "m2"))
      workload = v;
    else if (k == "--tokens")
      tokens = std::stoll(v);
    else if (k == "--hidden")
      hidden = std::stoll(v);
    else if (k == "--device" && (v == "cpu" || v == "cuda"))
      device = v;
    else if (k == "--threads")
      threads = std::stoi(v);
    else if (k == "--rounds")
      rounds = std::stoll(v);
    else if (k == "--iters")
      iters = std::stoll(v);
    else if (k == "--profile")
      profile = v == "1";
    else {
      std::fprintf(stderr, "moe_bench: unknown flag or value: %s %s\n", k.c_str(), v.c_str());
      return 2;
    }
  }
  if ((argc - 1) % 2) {
    std::fprintf(stderr, "moe_bench: flag %s needs a value\n", argv[argc - 1]);
    return 2;
  }
  const bool gpu = device == "cuda";
  // The workload at full size, then scaled to --hidden keeping FFN/hidden.
  Shape s = workload == "m1" ? Shape{8192, 4096, 14336, 8, 2} : Shape{8192, 2048, 1408, 64, 6};
  const int64_t h = hidden ? hidden : gpu ? s.hidden : 512;
  s.ffn = s.ffn * h / s.hidden;
  s.hidden = h;
  s.tokens = tokens ? tokens : gpu ? s.tokens : 1024;
  runtime::ThreadPool pool(threads);
  g_pool = &pool;

  driver::SessionOptions o;
  o.model_path = std::string(KILN_SOURCE_DIR) + "/models/moe_layer.kiln";
  o.overrides = {{"hidden", std::to_string(s.hidden)},
                 {"ffn", std::to_string(s.ffn)},
                 {"experts", std::to_string(s.experts)},
                 {"topk", std::to_string(s.topk)}};
  o.batch = s.tokens;
  o.threads = threads;
  o.device = device;
  o.profile = profile;
  const ir::AttrDict sgd = {{"kind", ir::Attribute(std::string("sgd"))}, {"lr", ir::Attribute(0.01)}};
  o.train_overrides = {{"optimizer", ir::Attribute(sgd)}};
  if (gpu) o.train_overrides["precision"] = ir::Attribute(std::string("bf16"));
  std::ostringstream diag;
  auto session = driver::Session::create(o, diag);
  if (!session) return fail("compiling models/moe_layer.kiln", session.status());

  data::Batch batch;
  batch.size = s.tokens;
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0, 1);
  for (const char* name : {"x", "target"}) {
    ir::HostTensor t(ir::DType::f32, {s.tokens, s.hidden});
    for (int64_t i = 0; i < t.numel(); ++i) t.as<float>()[i] = normal(rng);
    batch.names.push_back(name);
    batch.tensors.push_back(std::move(t));
  }
  LoopBaseline baseline(s);
  int64_t step = 0;
  auto kilnSteps = [&]() -> Expected<double> {
    auto t = Clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      auto out = (*session)->trainStep(batch, 1.0, ++step);
      if (!out) return out.status();
    }
    return msSince(t) / static_cast<double>(iters);
  };
  auto baselineSteps = [&]() {
    auto t = Clock::now();
    for (int64_t i = 0; i < iters; ++i) baseline.step();
    return msSince(t) / static_cast<double>(iters);
  };
  // Warm up both (lowering, first touch), then alternate.
  if (auto w = kilnSteps(); !w) return fail("training step", w.status());
  if (!gpu) baselineSteps();
  std::vector<double> kiln_ms, base_ms;
  for (int64_t r = 0; r < rounds; ++r) {
    auto k = kilnSteps();
    if (!k) return fail("training step", k.status());
    kiln_ms.push_back(*k);
    if (!gpu) base_ms.push_back(baselineSteps());
  }
  const double flops = 3 * s.expertFlops();  // forward + backward (twice the forward's GEMMs)
  const double km = median(kiln_ms), bm = median(base_ms);
  const double rate = gpu ? 0 : sgemmRate(s);
  const double kiln_g = flops / (km * 1e-3) / 1e9;
  std::printf(
      "| %s (%s) tokens %lld hidden %lld ffn %lld experts %lld top-%lld | ms fwd+bwd | GFLOP/s | of SGEMM "
      "|\n",
      workload.c_str(), device.c_str(), static_cast<long long>(s.tokens), static_cast<long long>(s.hidden),
      static_cast<long long>(s.ffn), static_cast<long long>(s.experts), static_cast<long long>(s.topk));
  std::printf("| --- | --- | --- | --- |\n");
  std::printf("| Kiln | %.1f | %.1f | %s |\n", km, kiln_g,
              gpu ? "-" : fmt::format("{:.0f}%", 100 * kiln_g / rate).c_str());
  if (!gpu) {
    const double base_g = flops / (bm * 1e-3) / 1e9;
    std::printf("| loop over experts (oneDNN) | %.1f | %.1f | %.0f%% |\n", bm, base_g, 100 * base_g / rate);
    std::printf("| SGEMM, expert shape | - | %.1f | 100%% |\n", rate);
    std::printf("Kiln / loop: %.2fx faster (median of %lld interleaved rounds of %lld steps, %d threads)\n",
                bm / km, static_cast<long long>(rounds), static_cast<long long>(iters), threads);
  }
  if (profile) std::printf("%s\n", (*session)->profileTable("train_step").c_str());
  std::printf(
      "KILN {\"workload\": \"%s\", \"device\": \"%s\", \"ms\": %.3f, \"baseline_ms\": %.3f, \"gflops\": "
      "%.2f, "
      "\"sgemm_gflops\": %.2f}\n",
      workload.c_str(), device.c_str(), km, bm, kiln_g, rate);
  return 0;
}
