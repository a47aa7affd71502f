// `--data synthetic`: a seeded stream of samples with a learnable label.
//
// Ids of each table follow a power law (Zipf-like: rank r drawn with probability ~ (r+1)^-s,
// ranks scattered over the table's rows). A hidden model decides the label:
//   logit = bias + sum_j a_j (dense_j - c_j) + sum_f (1/n_f) sum_k w_k * h_f(id_k)
// with a_j and h_f(row) Gaussian values derived from the seed by hashing (no tables stored),
// and label ~ Bernoulli(sigmoid(logit)).
//
// A sequence task (docs/data.md, "Synthetic sequences"): a variable-length history and a
// single-id candidate read by one embedding table (a model's `embeddings(..., pool = none)`)
// get ids from hidden item categories instead: each sample has two interest categories, its
// history mostly holds items of them, and its candidate is of one of them half the time. The
// pair's term of the logit grows with how many history items share the candidate's category:
//   logit += kSequenceWeight * (min(matches, kSequenceCap) - kSequenceCenter)
// (no h_f term for the pair). The count, not the fraction, decides: target attention can
// weigh each history item by its match, mean pooling sees only the mix.
// A retrieval task (docs/data.md, "Synthetic retrieval"): the candidates' ids of an in-batch
// retrieval loss (in_batch_softmax) and the query, the first other single-id feature (the user).
// Users and items have hidden categories; a sample's candidate is an item of its user's
// category with probability kRetrievalInterest, else any item, drawn by popularity either way,
// so a model that learns the categories ranks the positive high among the batch's candidates.
// A schema with several labels has one hidden model each. Sample i of a stream is a pure function of
// (seed, stream, i): streams differ between training and evaluation (held out), the hidden
// model is shared, any batch size sees the same samples, and resuming needs only the index.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "runtime/data/batch.h"

namespace kiln::data {

struct SyntheticOptions {
  uint64_t seed = 1;
  uint64_t stream = 0;          // 0: training; 1: evaluation (held out); others: more streams
  double zipf_exponent = 1.1;   // s of the id power law
  double dense_strength = 1.2;  // std of the dense part of the hidden logit
  double sparse_strength = 2.4; // std of the sparse part (for one id per feature)
  double bias = -1.0;           // sets the base click rate
};

class SyntheticGenerator {
 public:
  SyntheticGenerator(const BatchSpec& spec, SyntheticOptions opts);

  // Fills `batch` with samples [first, first + n) of the stream. When `logits` is given it
  // receives the hidden model's logit of each sample (the best possible score).
  void generate(int64_t first, int64_t n, Batch& batch, std::vector<float>* logits = nullptr) const;

  const SyntheticOptions& options() const { return opts_; }

 private:
  struct Table {
    int input = -1;  // index of the sparse input in the spec
    int lengths = -1, weights = -1;
    int64_t rows = 0;
    int hotness = 0, max_hotness = 0;
    float zipf_a = 0, zipf_inv = 0;  // inverse CDF: x = (1 + u*a)^inv
    uint64_t mult = 1, shift = 0;     // rank -> row scatter, a bijection of [0, rows)
    float weight_scale = 0;
    uint64_t key = 0;                 // hashing key of h_f
  };

  // A history and its candidate (indices into tables_), read by one table.
  struct SequencePair {
    int history = -1, candidate = -1;
    int64_t categories = 0;
    uint64_t key = 0;  // hashing key of the hidden item categories
  };

  // The query and candidate (indices into tables_) of a retrieval task.
  struct RetrievalPair {
    int query = -1, candidate = -1;
    int64_t categories = 0;
    uint64_t query_key = 0, candidate_key = 0;  // hashing keys of the hidden categories
  };

  int64_t drawRow(const Table& t, uint64_t bits) const;
  // The hidden category of a row: its hash under `key`, in [0, categories).
  static int64_t category(uint64_t key, int64_t categories, int64_t row);
  // A row of category c, drawn from the table's power law until one has it (after 1024
  // misses, the last draw: a table of fewer rows than categories has categories with none).
  int64_t drawRowOf(uint64_t key, int64_t categories, const Table& t, int64_t c, uint64_t& state) const;
  void generateRetrieval(const RetrievalPair& p, int64_t n, const std::vector<uint64_t>& seeds,
                         Batch& batch) const;
  void generatePair(const SequencePair& p, int64_t n, const std::vector<uint64_t>& seeds, Batch& batch,
                    std::vector<float>& logit) const;
  // h_f(row) of label `label`'s hidden model.
  float hiddenWeight(const Table& t, int64_t row, int label) const;

  BatchSpec spec_;
  SyntheticOptions opts_;
  std::vector<Table> tables_;
  std::vector<SequencePair> pairs_;
  std::optional<RetrievalPair> retrieval_;
  // The Criteo layout has 13 dense features, log(1 + E * scale_j); a schema's dense columns are
  // standard normal (scale 0). a_j of label l is dense_weight_[l * dense + j].
  int dense_ = kNumDense;
  int labels_ = 1;
  std::vector<float> dense_weight_, dense_center_, dense_scale_;
};

}  // namespace kiln::data
