// `--data synthetic` for language models: token sequences of a seeded first-order Markov chain.
//
// State s moves to one of K = min(4, V) successors (distinct tokens hashed from the seed) with
// peaked weights, or with probability `mix` to a uniformly drawn token:
//   P(t | s) = mix / V + (1 - mix) w_s(t),   w_s = normalized (0.25 + u_k) / (k + 1)^1.5
// for the k-th successor (u_k uniform, hashed). The mix makes the chain irreducible and aperiodic,
// so it has one stationary distribution pi, found by power iteration over the sparse successor
// lists (it contracts by 1 - mix per step; nothing V x V is stored). The entropy rate
// sum_s pi_s H(P(. | s)) is the floor of any model's per-token cross entropy on this data.
// Each window starts from pi; window i of a stream is a pure function of (seed, stream, i).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/data/token_source.h"

namespace kiln::data {

// The chain keeps K successors, their weights and pi per token (about 56 bytes each): a larger
// vocabulary than this is refused rather than allocated.
inline constexpr int64_t kMaxSyntheticVocab = int64_t{1} << 24;

struct MarkovOptions {
  int successors = 4;  // K: the peaked part of each state's next-token distribution
  double mix = 0.05;   // the weight of the uniform part
};

class MarkovChain {
 public:
  MarkovChain(int64_t vocab, uint64_t seed, MarkovOptions opts = {});

  int64_t vocab() const { return vocab_; }
  // The exact P(to | from).
  double probability(int64_t from, int64_t to) const;
  // The stationary distribution (sums to 1).
  const std::vector<double>& stationary() const { return pi_; }
  // sum_s pi_s H(P(. | s)) in nats.
  double entropyRate() const { return entropy_rate_; }

  // A token drawn from pi, and the successor of `from`, each from 64 random bits.
  int32_t start(uint64_t bits) const;
  int32_t next(int32_t from, uint64_t bits) const;

 private:
  double nextEntropy(int64_t s) const;

  int64_t vocab_;
  int k_;
  double mix_;
  std::vector<int32_t> succ_;   // [V, K] successor tokens
  std::vector<double> weight_;  // [V, K] normalized w_s, summing to 1 per state
  std::vector<double> pi_, pi_cdf_;
  double entropy_rate_ = 0;
};

// Windows of T + 1 tokens of `chain`, `samples` per epoch, stream `stream` (0 trains, 1 is the
// held-out evaluation stream). Position: the window index (`sample`).
std::unique_ptr<TokenSource> openMarkovTokens(std::shared_ptr<const MarkovChain> chain, uint64_t seed,
                                              uint64_t stream, int64_t seq_len, int64_t samples);

// One walk of `chain` from its stationary start, token by token (what `kiln data tokens` writes).
class MarkovWalk {
 public:
  MarkovWalk(const MarkovChain& chain, uint64_t seed);
  int32_t next();

 private:
  const MarkovChain& chain_;
  uint64_t state_;
  int32_t last_ = -1;
};

}  // namespace kiln::data
