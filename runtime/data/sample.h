// One raw Criteo sample as every file loader yields it, and the assembly of raw samples into a
// model's Batch: raw categorical values become table rows by each input's id_map, and a feature
// with hotness H > 1 expands its one value into H ids.
#pragma once

#include <cstdint>

#include "runtime/data/batch.h"

namespace kiln::data {

struct RawSample {
  float label = 0;
  uint32_t missing = 0;            // bit f set: categorical feature f was empty
  float dense[kNumDense] = {};     // already log(1 + max(x, 0))
  uint64_t cats[kNumSparse] = {};  // the hex values as read
};

// A strong 64-bit mix (the splitmix64 finalizer): a bijection, so distinct values stay distinct.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The k-th value of a multi-hot expansion of `raw`: k = 0 is raw itself, k > 0 a hash of (raw, k)
// (as MLPerf's multi-hot preprocessing derives extra ids from the one Criteo id).
inline uint64_t expandValue(uint64_t raw, int k) {
  return k == 0 ? raw : mix64(raw + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(k));
}

// Maps a raw value into [0, rows): modulo, or a 64-bit hash then modulo.
inline int64_t mapId(uint64_t raw, IdMap m, int64_t rows) {
  uint64_t v = m == IdMap::Hash ? mix64(raw) : raw;
  return static_cast<int64_t>(v % static_cast<uint64_t>(rows));
}

// A missing categorical value gets this row in every table (reserved: present values may still
// hash onto it, as any two values may collide).
inline constexpr int64_t kMissingRow = 0;

// Allocates every tensor of `spec` for `n` samples (variable-length ids at their bound; callers
// shrink them once the lengths are known).
void allocateBatch(const BatchSpec& spec, int64_t n, Batch& batch);

// Fills `batch` with `n` raw samples: dense features, labels, ids (mapped and expanded), lengths
// of variable-length features (one id each: a Criteo sample has one value per feature), and
// per-id weights of 1.
void assembleBatch(const BatchSpec& spec, const RawSample* samples, int64_t n, Batch& batch);

// Sets the weights of every weighted feature to 1, shaped like its ids (once they are sized).
void fillUnitWeights(const BatchSpec& spec, Batch& batch);

}  // namespace kiln::data
