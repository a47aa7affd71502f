#include "runtime/data/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "runtime/data/sample.h"

namespace kiln::data {

namespace {

// The sequence task (synthetic.h): hidden categories, the share of history items drawn from
// the sample's interests, and the logit term's weight, cap and center.
constexpr int64_t kSequenceCategories = 16;
constexpr double kSequenceInterest = 0.8;
constexpr float kSequenceWeight = 0.9f;
constexpr int kSequenceCap = 5;
constexpr float kSequenceCenter = 2.0f;
// The retrieval task (synthetic.h): hidden categories and the share of candidates of the user's.
constexpr int64_t kRetrievalCategories = 16;
constexpr double kRetrievalInterest = 0.8;

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
  const bool criteo = spec_.layout == DataLayout::Criteo;
  int dense_count = 0;
  if (!criteo) {
    dense_ = labels_ = 0;
    for (const InputSpec& in : spec_.inputs) {
      dense_ += in.role == InputRole::Dense ? in.dense_count : 0;
      labels_ += in.role == InputRole::Label ? in.label_count : 0;
    }
    labels_ = std::max(labels_, 1);
    dense_count = dense_;
  } else {
    for (const InputSpec& in : spec_.inputs)
      if (in.role == InputRole::Dense) dense_count = std::max(dense_count, in.dense_count);
    dense_ = std::max(dense_, dense_count);  // wider than Criteo's 13: more of the same kind
  }
  dense_weight_.resize(static_cast<size_t>(dense_ * labels_));
  dense_center_.assign(static_cast<size_t>(dense_), 0.0f);
  dense_scale_.assign(static_cast<size_t>(dense_), 0.0f);
  for (int j = 0; j < dense_; ++j) {
    uint64_t h = mix64(model_key + 101 + static_cast<uint64_t>(j));
    double spread = 1.0;
    if (criteo) {
      // Dense value = log(1 + E * scale), E ~ Exp(1), scale log-uniform in [1, 1000] (Criteo-like
      // counts after the loader's log transform); c_j centers it near its mean.
      dense_scale_[j] = static_cast<float>(std::exp(uniform(h) * std::log(1000.0)));
      dense_center_[j] = static_cast<float>(std::log1p(dense_scale_[j]) - 0.5772);
      spread = 1.28;  // log(E) has std pi/sqrt(6) ~ 1.28
    }
    for (int l = 0; l < labels_; ++l) {
      const uint64_t hl = l == 0 ? mix64(h) : mix64(h + 0x51ed27u * static_cast<uint64_t>(l));
      dense_weight_[static_cast<size_t>(l * dense_ + j)] = static_cast<float>(
          gaussian(hl) * opts_.dense_strength / std::sqrt(std::max(dense_count, 1)) / spread);
    }
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
  // Sequence pairs: a variable-length input and a single-id input named with one table.
  for (size_t hi = 0; hi < tables_.size(); ++hi) {
    const InputSpec& h = spec_.inputs[static_cast<size_t>(tables_[hi].input)];
    if (h.table.empty() || !h.variableLength() || tables_[hi].weights >= 0) continue;
    for (size_t ci = 0; ci < tables_.size(); ++ci) {
      const InputSpec& c = spec_.inputs[static_cast<size_t>(tables_[ci].input)];
      if (c.table != h.table || c.variableLength() || c.hotness != 1 || tables_[ci].weights >= 0) continue;
      bool taken = false;
      for (const SequencePair& q : pairs_) taken |= q.candidate == static_cast<int>(ci);
      if (taken) continue;
      SequencePair p;
      p.history = static_cast<int>(hi);
      p.candidate = static_cast<int>(ci);
      p.categories = std::min<int64_t>(kSequenceCategories, h.rows);
      p.key = mix64(model_key ^ (0xca7e6012ull + static_cast<uint64_t>(h.feature)));
      pairs_.push_back(p);
      break;
    }
  }
  // A retrieval task: the candidates' feature and the first other single-id feature.
  for (size_t ci = 0; ci < tables_.size() && !retrieval_; ++ci) {
    const InputSpec& c = spec_.inputs[static_cast<size_t>(tables_[ci].input)];
    if (!c.retrieval_candidate || c.variableLength() || c.hotness != 1) continue;
    for (size_t qi = 0; qi < tables_.size(); ++qi) {
      const InputSpec& q = spec_.inputs[static_cast<size_t>(tables_[qi].input)];
      if (qi == ci || q.variableLength() || q.hotness != 1 || q.retrieval_candidate) continue;
      RetrievalPair p;
      p.query = static_cast<int>(qi);
      p.candidate = static_cast<int>(ci);
      p.categories = std::min<int64_t>(kRetrievalCategories, c.rows);
      p.query_key = mix64(model_key ^ (0x05e12ca7ull + static_cast<uint64_t>(q.feature)));
      p.candidate_key = mix64(model_key ^ (0x17e3ca7ull + static_cast<uint64_t>(c.feature)));
      retrieval_ = p;
      break;
    }
  }
}

int64_t SyntheticGenerator::category(uint64_t key, int64_t categories, int64_t row) {
  return static_cast<int64_t>(mix64(key + static_cast<uint64_t>(row)) % static_cast<uint64_t>(categories));
}

int64_t SyntheticGenerator::drawRowOf(uint64_t key, int64_t categories, const Table& t, int64_t c,
                                      uint64_t& state) const {
  int64_t row = 0;
  for (int tries = 0; tries < 1024; ++tries) {
    row = drawRow(t, mix64(state += 0x9e3779b97f4a7c15ull));
    if (category(key, categories, row) == c) return row;
  }
  return row;
}

void SyntheticGenerator::generateRetrieval(const RetrievalPair& p, int64_t n,
                                           const std::vector<uint64_t>& seeds, Batch& batch) const {
  const Table& qt = tables_[static_cast<size_t>(p.query)];
  const Table& ct = tables_[static_cast<size_t>(p.candidate)];
  const ir::HostTensor& query = batch.tensors[static_cast<size_t>(qt.input)];
  ir::HostTensor& cand = batch.tensors[static_cast<size_t>(ct.input)];
  for (int64_t i = 0; i < n; ++i) {
    uint64_t state = mix64(seeds[static_cast<size_t>(i)] ^ p.candidate_key);
    const int64_t user = query.view.dtype == ir::DType::i64 ? query.as<int64_t>()[i] : query.as<int32_t>()[i];
    const int64_t c = uniform(mix64(state += 0x9e3779b97f4a7c15ull)) < kRetrievalInterest
                          ? category(p.query_key, p.categories, user)
                          : static_cast<int64_t>(mix64(state += 0x9e3779b97f4a7c15ull) %
                                                 static_cast<uint64_t>(p.categories));
    const int64_t item = drawRowOf(p.candidate_key, p.categories, ct, c, state);
    if (cand.view.dtype == ir::DType::i64)
      cand.as<int64_t>()[i] = item;
    else
      cand.as<int32_t>()[i] = static_cast<int32_t>(item);
  }
}

void SyntheticGenerator::generatePair(const SequencePair& p, int64_t n, const std::vector<uint64_t>& seeds,
                                      Batch& batch, std::vector<float>& logit) const {
  const Table& ht = tables_[static_cast<size_t>(p.history)];
  const Table& ct = tables_[static_cast<size_t>(p.candidate)];
  const InputSpec& hin = spec_.inputs[static_cast<size_t>(ht.input)];
  ir::HostTensor& hist = batch.tensors[static_cast<size_t>(ht.input)];
  ir::HostTensor& cand = batch.tensors[static_cast<size_t>(ct.input)];
  ir::HostTensor& lt = batch.tensors[static_cast<size_t>(ht.lengths)];
  lt.reset(ir::DType::i32, {n});
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(n * hin.max_hotness));
  const auto L = static_cast<size_t>(labels_);
  auto store = [](ir::HostTensor& t, int64_t at, int64_t row) {
    if (t.view.dtype == ir::DType::i64)
      t.as<int64_t>()[at] = row;
    else
      t.as<int32_t>()[at] = static_cast<int32_t>(row);
  };
  for (int64_t i = 0; i < n; ++i) {
    uint64_t state = mix64(seeds[static_cast<size_t>(i)] ^ p.key);
    auto next = [&] { return mix64(state += 0x9e3779b97f4a7c15ull); };
    const int len = 1 + static_cast<int>(next() % static_cast<uint64_t>(hin.max_hotness));
    const int64_t interest[2] = {static_cast<int64_t>(next() % static_cast<uint64_t>(p.categories)),
                                 static_cast<int64_t>(next() % static_cast<uint64_t>(p.categories))};
    // The candidate: one of the interests half the time, else any category.
    const int64_t cc = uniform(next()) < 0.5
                           ? interest[next() & 1]
                           : static_cast<int64_t>(next() % static_cast<uint64_t>(p.categories));
    store(cand, i, drawRowOf(p.key, p.categories, ct, cc, state));
    int matches = 0;
    for (int k = 0; k < len; ++k) {
      const int64_t c = uniform(next()) < kSequenceInterest
                            ? interest[next() & 1]
                            : static_cast<int64_t>(next() % static_cast<uint64_t>(p.categories));
      ids.push_back(drawRowOf(p.key, p.categories, ht, c, state));
      matches += c == cc;
    }
    lt.as<int32_t>()[i] = len;
    const float term =
        kSequenceWeight * (static_cast<float>(std::min(matches, kSequenceCap)) - kSequenceCenter);
    for (size_t l = 0; l < L; ++l) logit[static_cast<size_t>(i) * L + l] += term;
  }
  hist.reset(hin.type.dtype(), {static_cast<int64_t>(ids.size())});
  for (size_t k = 0; k < ids.size(); ++k) store(hist, static_cast<int64_t>(k), ids[k]);
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

float SyntheticGenerator::hiddenWeight(const Table& t, int64_t row, int label) const {
  const uint64_t key = label == 0 ? t.key : mix64(t.key + 0x7a5e11ull * static_cast<uint64_t>(label));
  return gaussian(mix64(key + static_cast<uint64_t>(row))) * t.weight_scale;
}

void SyntheticGenerator::generate(int64_t first, int64_t n, Batch& batch, std::vector<float>* logits) const {
  allocateBatch(spec_, n, batch);
  // Variable-length ids: draw lengths first so the id tensors can be sized exactly.
  const uint64_t stream_key = mix64(opts_.seed * 0xd1b54a32d192ed03ull + opts_.stream * 0x8cb92ba72f3d8dd7ull + 7);
  // logit[i * labels_ + l]: label l of sample i.
  const auto L = static_cast<size_t>(labels_);
  std::vector<float> logit(static_cast<size_t>(n) * L, static_cast<float>(opts_.bias));
  std::vector<Bits> rng(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rng[i].state = mix64(stream_key ^ static_cast<uint64_t>(first + i) * 0xa0761d6478bd642full);

  // Dense features: every one feeds the hidden logits, whatever the model reads (the Criteo
  // layout's inputs each read the first of its 13; a schema's read their own columns).
  struct DenseOut {
    float* out;
    int count, first;
  };
  std::vector<DenseOut> dense_out;
  for (size_t k = 0; k < spec_.inputs.size(); ++k) {
    const InputSpec& in = spec_.inputs[k];
    if (in.role == InputRole::Dense)
      dense_out.push_back({batch.tensors[k].as<float>(), in.dense_count,
                           spec_.layout == DataLayout::Criteo ? 0 : in.first_column});
  }
  std::vector<float> v(static_cast<size_t>(dense_));
  for (int64_t i = 0; i < n; ++i) {
    Bits r{rng[i].state};
    for (int j = 0; j < dense_; ++j) {
      if (dense_scale_[j] > 0) {
        float e = -std::log(static_cast<float>(uniform(r.next())));
        v[j] = std::log1p(e * dense_scale_[j]);
      } else {
        v[j] = gaussian(r.next());
      }
    }
    for (size_t l = 0; l < L; ++l) {
      float acc = 0;
      for (int j = 0; j < dense_; ++j) acc += dense_weight_[l * dense_ + j] * (v[j] - dense_center_[j]);
      logit[static_cast<size_t>(i) * L + l] += acc;
    }
    for (const DenseOut& d : dense_out) std::copy_n(v.data() + d.first, d.count, d.out + i * d.count);
  }

  std::vector<bool> in_pair(tables_.size(), false);
  if (!pairs_.empty()) {
    std::vector<uint64_t> seeds(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) seeds[static_cast<size_t>(i)] = rng[static_cast<size_t>(i)].state;
    for (const SequencePair& p : pairs_) {
      generatePair(p, n, seeds, batch, logit);
      in_pair[static_cast<size_t>(p.history)] = in_pair[static_cast<size_t>(p.candidate)] = true;
    }
  }
  for (size_t ti = 0; ti < tables_.size(); ++ti) {
    if (in_pair[ti]) continue;
    const Table& t = tables_[ti];
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
    std::vector<float> acc(L);  // per label
    for (int64_t i = 0; i < n; ++i) {
      Bits r{rng[i].state ^ (0x100000000ull * static_cast<uint64_t>(in.feature + 1))};
      r.next();  // the length draw
      if (lengths) lengths[i] = len[i];
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < len[i]; ++k, ++pos) {
        int64_t row = drawRow(t, r.next());
        float wk = 1.0f;
        if (w) w[pos] = wk = 0.5f + static_cast<float>(uniform(r.next()));
        if (i64) ids.as<int64_t>()[pos] = row;
        else ids.as<int32_t>()[pos] = static_cast<int32_t>(row);
        for (size_t l = 0; l < L; ++l) acc[l] += wk * hiddenWeight(t, row, static_cast<int>(l));
      }
      for (size_t l = 0; l < L; ++l)
        logit[static_cast<size_t>(i) * L + l] += acc[l] / static_cast<float>(len[i]);
    }
  }

  // The candidates of a retrieval task follow the query ids drawn above.
  if (retrieval_) {
    std::vector<uint64_t> seeds(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) seeds[static_cast<size_t>(i)] = rng[static_cast<size_t>(i)].state;
    generateRetrieval(*retrieval_, n, seeds, batch);
  }

  // Each label input reads its labels (a Criteo-layout model has one, label 0).
  for (size_t k = 0; k < spec_.inputs.size(); ++k) {
    const InputSpec& in = spec_.inputs[k];
    if (in.role != InputRole::Label) continue;
    float* out = batch.tensors[k].as<float>();
    for (int64_t i = 0; i < n; ++i) {
      Bits r{rng[i].state ^ 0xfeedfacecafebeefull};
      for (size_t l = 0; l < L; ++l) {
        const float p = 1.0f / (1.0f + std::exp(-logit[static_cast<size_t>(i) * L + l]));
        const float y = uniform(r.next()) < p ? 1.0f : 0.0f;
        const auto j = static_cast<int64_t>(l) - in.first_column;
        if (j >= 0 && j < in.label_count) out[i * in.label_count + j] = y;
      }
    }
  }
  if (logits) {
    // The first label's logits.
    logits->resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) (*logits)[static_cast<size_t>(i)] = logit[static_cast<size_t>(i) * L];
  }
}

}  // namespace kiln::data
