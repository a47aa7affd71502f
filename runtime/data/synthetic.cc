#include "runtime/data/synthetic.h"

#include <cmath>
#include <numeric>

#include "runtime/data/sample.h"

namespace kiln::data {

namespace {

// A small counter-based stream of random bits: each call mixes the next counter value.
struct Bits {
  uint64_t state;
  uint64_t next() { return mix64(state += 0x9e3779b97f4a7c15ull); }
};

// Uniform in (0, 1) from the top 53 bits.
inline double uniform(uint64_t b) { return (static_cast<double>(b >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

// An approximately standard normal value from one hash: the sum of four 16-bit uniforms
// (Irwin-Hall), which is plenty for hidden weights and far cheaper than Box-Muller.
inline float gaussian(uint64_t h) {
  float s = 0;
  for (int i = 0; i < 4; ++i) s += static_cast<float>((h >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;  // Irwin-Hall(4) has variance 1/3
}

}  // namespace

SyntheticGenerator::SyntheticGenerator(const BatchSpec& spec, SyntheticOptions opts) : spec_(spec), opts_(opts) {
  const uint64_t model_key = mix64(opts_.seed ^ 0x6b696c6e5f68696dull);  // the hidden model: seed only
  int dense_count = 0;
  for (const InputSpec& in : spec_.inputs)
    if (in.role == InputRole::Dense) dense_count = std::max(dense_count, in.dense_count);
  for (int j = 0; j < kNumDense; ++j) {
    uint64_t h = mix64(model_key + 101 + static_cast<uint64_t>(j));
    // Dense value = log(1 + E * scale), E ~ Exp(1), scale log-uniform in [1, 1000] (Criteo-like
    // counts after the loader's log transform); c_j centers it near its mean.
    dense_scale_[j] = static_cast<float>(std::exp(uniform(h) * std::log(1000.0)));
    dense_center_[j] = static_cast<float>(std::log1p(dense_scale_[j]) - 0.5772);
    dense_weight_[j] = static_cast<float>(gaussian(mix64(h)) * opts_.dense_strength / std::sqrt(std::max(dense_count, 1)) /
                                          1.28);  // log(E) has std pi/sqrt(6) ~ 1.28
  }
  int num_tables = 0;
  for (const InputSpec& in : spec_.inputs) num_tables += in.role == InputRole::Sparse;
  for (size_t i = 0; i < spec_.inputs.size(); ++i) {
    const InputSpec& in = spec_.inputs[i];
    if (in.role != InputRole::Sparse) continue;
    Table t;
    t.input = static_cast<int>(i);
    t.lengths = in.lengths_input;
    t.weights = in.weights_input;
    t.rows = in.rows;
    t.hotness = in.hotness;
    t.max_hotness = in.max_hotness;
    const double s = opts_.zipf_exponent;
    t.zipf_inv = static_cast<float>(1.0 / (1.0 - s));
    t.zipf_a = static_cast<float>(std::pow(static_cast<double>(in.rows) + 1.0, 1.0 - s) - 1.0);
    uint64_t h = mix64(model_key + 1000 + static_cast<uint64_t>(in.feature));
    // A multiplier coprime with rows makes rank -> (rank * mult + shift) mod rows a bijection.
    t.mult = (h | 1) % static_cast<uint64_t>(in.rows);
    while (std::gcd(t.mult, static_cast<uint64_t>(in.rows)) != 1) ++t.mult;
    t.shift = mix64(h) % static_cast<uint64_t>(in.rows);
    t.weight_scale = static_cast<float>(opts_.sparse_strength / std::sqrt(std::max(num_tables, 1)));
    t.key = mix64(h ^ 0x5eed);
    tables_.push_back(t);
  }
}

int64_t SyntheticGenerator::drawRow(const Table& t, uint64_t bits) const {
  // Single precision is plenty here and twice as fast; it blurs only the far tail's ranks.
  float x = std::pow(1.0f + static_cast<float>(uniform(bits)) * t.zipf_a, t.zipf_inv);  // in [1, rows + 1)
  uint64_t rank = x < 2.0f ? 0 : static_cast<uint64_t>(x) - 1;
  if (rank >= static_cast<uint64_t>(t.rows)) rank = static_cast<uint64_t>(t.rows) - 1;
  const auto rows = static_cast<uint64_t>(t.rows);
  if (rows <= (1ull << 31))  // rank * mult + shift < 2^63: 64-bit arithmetic (128-bit division is slow)
    return static_cast<int64_t>((rank * t.mult + t.shift) % rows);
  return static_cast<int64_t>((static_cast<unsigned __int128>(rank) * t.mult + t.shift) % rows);
}

float SyntheticGenerator::hiddenWeight(const Table& t, int64_t row) const {
  return gaussian(mix64(t.key + static_cast<uint64_t>(row))) * t.weight_scale;
}

void SyntheticGenerator::generate(int64_t first, int64_t n, Batch& batch, std::vector<float>* logits) const {
  allocateBatch(spec_, n, batch);
  // Variable-length ids: draw lengths first so the id tensors can be sized exactly.
  const uint64_t stream_key = mix64(opts_.seed * 0xd1b54a32d192ed03ull + opts_.stream * 0x8cb92ba72f3d8dd7ull + 7);
  std::vector<float> logit(static_cast<size_t>(n), static_cast<float>(opts_.bias));
  std::vector<Bits> rng(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rng[i].state = mix64(stream_key ^ static_cast<uint64_t>(first + i) * 0xa0761d6478bd642full);

  // Dense features: all 13 feed the hidden logit, whatever the model reads.
  std::vector<std::pair<float*, int>> dense_out;
  for (size_t k = 0; k < spec_.inputs.size(); ++k)
    if (spec_.inputs[k].role == InputRole::Dense) dense_out.emplace_back(batch.tensors[k].as<float>(), spec_.inputs[k].dense_count);
  for (int64_t i = 0; i < n; ++i) {
    Bits r{rng[i].state};
    float v[kNumDense];
    float acc = 0;
    for (int j = 0; j < kNumDense; ++j) {
      float e = -std::log(static_cast<float>(uniform(r.next())));
      v[j] = std::log1p(e * dense_scale_[j]);
      acc += dense_weight_[j] * (v[j] - dense_center_[j]);
    }
    logit[static_cast<size_t>(i)] += acc;
    for (auto [out, count] : dense_out) std::copy(v, v + count, out + i * count);
  }

  for (const Table& t : tables_) {
    const InputSpec& in = spec_.inputs[static_cast<size_t>(t.input)];
    ir::HostTensor& ids = batch.tensors[static_cast<size_t>(t.input)];
    const bool i64 = in.type.dtype() == ir::DType::i64;
    int32_t* lengths = nullptr;
    int64_t total = 0;
    std::vector<int> len(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      Bits r{rng[i].state ^ (0x100000000ull * static_cast<uint64_t>(in.feature + 1))};
      len[i] = t.max_hotness > 0 ? 1 + static_cast<int>(r.next() % static_cast<uint64_t>(t.max_hotness)) : t.hotness;
      total += len[i];
    }
    if (t.max_hotness > 0) {
      ir::HostTensor& lt = batch.tensors[static_cast<size_t>(t.lengths)];
      lt.reset(ir::DType::i32, {n});
      lengths = lt.as<int32_t>();
      ids.reset(in.type.dtype(), {total});
    }
    float* w = nullptr;
    if (t.weights >= 0) {
      ir::HostTensor& wt = batch.tensors[static_cast<size_t>(t.weights)];
      wt.reset(ir::DType::f32, ids.view.shape);
      w = wt.as<float>();
    }
    int64_t pos = 0;
    for (int64_t i = 0; i < n; ++i) {
      Bits r{rng[i].state ^ (0x100000000ull * static_cast<uint64_t>(in.feature + 1))};
      r.next();  // the length draw
      if (lengths) lengths[i] = len[i];
      float acc = 0;
      for (int k = 0; k < len[i]; ++k, ++pos) {
        int64_t row = drawRow(t, r.next());
        float wk = 1.0f;
        if (w) w[pos] = wk = 0.5f + static_cast<float>(uniform(r.next()));
        if (i64) ids.as<int64_t>()[pos] = row;
        else ids.as<int32_t>()[pos] = static_cast<int32_t>(row);
        acc += wk * hiddenWeight(t, row);
      }
      logit[static_cast<size_t>(i)] += acc / static_cast<float>(len[i]);
    }
  }

  int li = spec_.labelIndex();
  for (int64_t i = 0; i < n; ++i) {
    Bits r{rng[i].state ^ 0xfeedfacecafebeefull};
    float p = 1.0f / (1.0f + std::exp(-logit[static_cast<size_t>(i)]));
    if (li >= 0) batch.tensors[static_cast<size_t>(li)].as<float>()[i] = uniform(r.next()) < p ? 1.0f : 0.0f;
  }
  if (logits) *logits = std::move(logit);
}

}  // namespace kiln::data
