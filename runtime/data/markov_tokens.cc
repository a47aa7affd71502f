#include "runtime/data/markov_tokens.h"

#include <algorithm>
#include <cmath>

#include "runtime/data/sample.h"

namespace kiln::data {

namespace {

// Uniform in (0, 1) from the top 53 bits.
double unitInterval(uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Power iteration stops once an iteration moves pi by less than this (L1), or after the cap: the
// chain contracts by 1 - mix per iteration, so mix = 0.05 gets there in about 650.
constexpr double kStationaryTolerance = 1e-14;
constexpr int kMaxPowerIterations = 100000;

}  // namespace

MarkovChain::MarkovChain(int64_t vocab, uint64_t seed, MarkovOptions opts)
    : vocab_(vocab), k_(static_cast<int>(std::min<int64_t>(opts.successors, vocab))), mix_(opts.mix) {
  const uint64_t key = mix64(seed ^ 0x6b696c6e6d61726bull);
  const auto v = static_cast<size_t>(vocab_), k = static_cast<size_t>(k_);
  succ_.resize(v * k);
  weight_.resize(v * k);
  for (size_t s = 0; s < v; ++s) {
    double total = 0;
    for (size_t j = 0; j < k; ++j) {
      // Distinct successors: hash again until the token is new for this state (K <= V).
      uint64_t h = mix64(key + s * 0x9e3779b97f4a7c15ull + j);
      int32_t t;
      for (;;) {
        t = static_cast<int32_t>(h % static_cast<uint64_t>(vocab_));
        if (std::find(succ_.begin() + static_cast<ptrdiff_t>(s * k),
                      succ_.begin() + static_cast<ptrdiff_t>(s * k + j),
                      t) == succ_.begin() + static_cast<ptrdiff_t>(s * k + j))
          break;
        h = mix64(h);
      }
      succ_[s * k + j] = t;
      weight_[s * k + j] = (0.25 + unitInterval(mix64(h ^ 0x77))) / std::pow(static_cast<double>(j + 1), 1.5);
      total += weight_[s * k + j];
    }
    for (size_t j = 0; j < k; ++j) weight_[s * k + j] /= total;
  }

  // pi' = mix / V + (1 - mix) pi W, from the uniform distribution.
  pi_.assign(v, 1.0 / static_cast<double>(vocab_));
  std::vector<double> next(v);
  for (int it = 0; it < kMaxPowerIterations; ++it) {
    std::fill(next.begin(), next.end(), mix_ / static_cast<double>(vocab_));
    for (size_t s = 0; s < v; ++s)
      for (size_t j = 0; j < k; ++j)
        next[static_cast<size_t>(succ_[s * k + j])] += (1 - mix_) * pi_[s] * weight_[s * k + j];
    double moved = 0;
    for (size_t s = 0; s < v; ++s) moved += std::abs(next[s] - pi_[s]);
    pi_.swap(next);
    if (moved < kStationaryTolerance) break;
  }
  pi_cdf_.resize(v);
  double acc = 0;
  for (size_t s = 0; s < v; ++s) {
    acc += pi_[s];
    pi_cdf_[s] = acc;
    entropy_rate_ += pi_[s] * nextEntropy(static_cast<int64_t>(s));
  }
}

double MarkovChain::probability(int64_t from, int64_t to) const {
  double p = mix_ / static_cast<double>(vocab_);
  for (int j = 0; j < k_; ++j)
    if (succ_[static_cast<size_t>(from * k_ + j)] == to)
      p += (1 - mix_) * weight_[static_cast<size_t>(from * k_ + j)];
  return p;
}

// H(P(. | s)): the K successors, and the V - K tokens that only the uniform part reaches.
double MarkovChain::nextEntropy(int64_t s) const {
  const double floor_p = mix_ / static_cast<double>(vocab_);
  double h = 0;
  for (int j = 0; j < k_; ++j) {
    const double p = floor_p + (1 - mix_) * weight_[static_cast<size_t>(s * k_ + j)];
    if (p > 0) h -= p * std::log(p);
  }
  if (floor_p > 0) h -= static_cast<double>(vocab_ - k_) * floor_p * std::log(floor_p);
  return h;
}

int32_t MarkovChain::start(uint64_t bits) const {
  const double u = unitInterval(bits) * pi_cdf_.back();
  const auto it = std::lower_bound(pi_cdf_.begin(), pi_cdf_.end(), u);
  return static_cast<int32_t>(std::min<ptrdiff_t>(it - pi_cdf_.begin(), static_cast<ptrdiff_t>(vocab_ - 1)));
}

int32_t MarkovChain::next(int32_t from, uint64_t bits) const {
  double u = unitInterval(bits);
  if (u < mix_)
    return static_cast<int32_t>(
        std::min<int64_t>(static_cast<int64_t>(u / mix_ * static_cast<double>(vocab_)), vocab_ - 1));
  u = (u - mix_) / (1 - mix_);
  const size_t base = static_cast<size_t>(from) * static_cast<size_t>(k_);
  for (int j = 0; j + 1 < k_; ++j) {
    u -= weight_[base + static_cast<size_t>(j)];
    if (u < 0) return succ_[base + static_cast<size_t>(j)];
  }
  return succ_[base + static_cast<size_t>(k_ - 1)];
}

namespace {

class MarkovTokenSource final : public TokenSource {
 public:
  MarkovTokenSource(std::shared_ptr<const MarkovChain> chain, uint64_t seed, uint64_t stream, int64_t seq_len,
                    int64_t samples)
      : chain_(std::move(chain)),
        stream_key_(mix64(seed * 0xd1b54a32d192ed03ull + stream * 0x8cb92ba72f3d8dd7ull + 0x746f6b)),
        seq_len_(seq_len),
        samples_(samples) {}

  int64_t windowLength() const override { return seq_len_ + 1; }

  Expected<bool> next(int32_t* window) override {
    if (sample_ >= samples_) return false;
    // Window i: its own counter-based bits, so any window is drawn without the ones before it.
    uint64_t state = mix64(stream_key_ ^ (static_cast<uint64_t>(sample_) * 0xa0761d6478bd642full));
    auto bits = [&] { return mix64(state += 0x9e3779b97f4a7c15ull); };
    window[0] = chain_->start(bits());
    for (int64_t k = 1; k <= seq_len_; ++k) window[k] = chain_->next(window[k - 1], bits());
    ++sample_;
    return true;
  }

  Status seek(const StreamPosition& pos) override {
    if (pos.sample > samples_)
      return Status::errorf("data position sample {} is beyond the synthetic epoch of {}", pos.sample,
                            samples_);
    sample_ = pos.sample;
    return Status::ok();
  }

  StreamPosition position() const override { return StreamPosition{.sample = sample_}; }

 private:
  std::shared_ptr<const MarkovChain> chain_;
  uint64_t stream_key_;
  int64_t seq_len_, samples_;
  int64_t sample_ = 0;
};

}  // namespace

std::unique_ptr<TokenSource> openMarkovTokens(std::shared_ptr<const MarkovChain> chain, uint64_t seed,
                                              uint64_t stream, int64_t seq_len, int64_t samples) {
  return std::make_unique<MarkovTokenSource>(std::move(chain), seed, stream, seq_len, samples);
}

MarkovWalk::MarkovWalk(const MarkovChain& chain, uint64_t seed)
    : chain_(chain), state_(mix64(seed ^ 0x77616c6bull)) {}

int32_t MarkovWalk::next() {
  const uint64_t bits = mix64(state_ += 0x9e3779b97f4a7c15ull);
  last_ = last_ < 0 ? chain_.start(bits) : chain_.next(last_, bits);
  return last_;
}

}  // namespace kiln::data
