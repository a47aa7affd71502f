#include "codegen/emit/embedding_sort.h"

#include <fmt/format.h>

#include <algorithm>

#include "codegen/emit/optimizer.h"

namespace kiln::codegen::emit {

int64_t sortTiles(const SortedBackwardShape& s) { return std::max<int64_t>(1, (s.slots + kSortTile - 1) / kSortTile); }

int sortPasses(const SortedBackwardShape& s) { return std::max(1, (s.id_bits + s.table_bits + 7) / 8); }

int64_t histogramElements(const SortedBackwardShape& s) { return 256 * sortTiles(s) + 1; }

int64_t partialRows(const SortedBackwardShape& s) { return std::max<int64_t>(1, (s.slots + kPiece - 1) / kPiece); }

int64_t partialElements(const SortedBackwardShape& s) { return partialRows(s) * std::max<int64_t>(1, s.max_dim); }

namespace {

Kernel sourceKernel(std::string name, int64_t grid, int block, std::string body) {
  Kernel k;
  k.name = std::move(name);
  k.kind = KernelKind::Source;
  k.grid = std::max<int64_t>(1, grid);
  k.block = block;
  k.source = std::move(body);
  return k;
}

// The key shift of the slots without a valid id: (T << id_bits), as an unsigned literal.
std::string noneKey(const SortedBackwardShape& s) {
  return fmt::format("{}ull", static_cast<unsigned long long>(s.tables) << s.id_bits);
}

}  // namespace

Kernel sortKeysKernel(const SortedBackwardShape& s) {
  Kernel k = sourceKernel(
      "embedding_grad_keys", sortTiles(s), 256,
      fmt::format("  kiln_emb_keys<{}>(b0, b1, b2, b3, b4, b5, {}, {}LL, {}LL, {}, {}LL);\n", kSortTile, s.tables,
                  s.slots, s.batch, s.id_bits, sortTiles(s)));
  k.addBuffer("tables", DType::i64, (s.tables + 1) * kTableWords);
  k.addBuffer("sort_keys.0", DType::i64, s.slots, true);
  k.addBuffer("sort_positions.0", DType::i32, s.slots, true);
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s), true);
  k.addBuffer("distinct_counts", DType::i64, s.tables, true);
  k.addBuffer("embedding_errors", DType::i32, 2, true);
  return k;
}

Kernel sortHistogramKernel(const SortedBackwardShape& s, int pass) {
  Kernel k = sourceKernel(fmt::format("embedding_grad_histogram_{}", pass), sortTiles(s), 256,
                          fmt::format("  kiln_emb_histogram<{}>(b0, b1, {}LL, {}LL, {});\n", kSortTile, s.slots,
                                      sortTiles(s), 8 * pass));
  k.addBuffer("sort_keys", DType::i64, s.slots);
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s), true);
  return k;
}

Kernel sortScanKernel(const SortedBackwardShape& s, int64_t n) {
  Kernel k = sourceKernel("embedding_grad_scan", 1, 1024, fmt::format("  kiln_emb_exclusive_scan(b0, {}LL);\n", n));
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s), true);
  return k;
}

Kernel sortScatterKernel(const SortedBackwardShape& s, int pass) {
  Kernel k = sourceKernel(fmt::format("embedding_grad_scatter_{}", pass), sortTiles(s), 256,
                          fmt::format("  kiln_emb_scatter<{}>(b0, b1, b2, b3, b4, {}LL, {}LL, {});\n", kSortTile,
                                      s.slots, sortTiles(s), 8 * pass));
  k.addBuffer("sort_keys.in", DType::i64, s.slots);
  k.addBuffer("sort_positions.in", DType::i32, s.slots);
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s));
  k.addBuffer("sort_keys.out", DType::i64, s.slots, true);
  k.addBuffer("sort_positions.out", DType::i32, s.slots, true);
  return k;
}

Kernel segmentCountKernel(const SortedBackwardShape& s) {
  Kernel k = sourceKernel("embedding_grad_segment_count", sortTiles(s), 256,
                          fmt::format("  kiln_emb_segment_count<{}>(b0, b1, {}LL, {});\n", kSortTile, s.slots,
                                      noneKey(s)));
  k.addBuffer("sort_keys", DType::i64, s.slots);
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s), true);
  return k;
}

Kernel segmentsKernel(const SortedBackwardShape& s) {
  Kernel k = sourceKernel("embedding_grad_segments", sortTiles(s), 256,
                          fmt::format("  kiln_emb_segments<{}>(b0, b1, b2, b3, {}LL, {}LL, {}, {});\n", kSortTile,
                                      s.slots, sortTiles(s), s.id_bits, noneKey(s)));
  k.addBuffer("sort_keys", DType::i64, s.slots);
  k.addBuffer("sort_histogram", DType::i32, histogramElements(s));
  k.addBuffer("segment_starts", DType::i32, s.max_segments + 1, true);
  k.addBuffer("segment_meta", DType::i64, s.tables + 2, true);
  return k;
}

namespace {

// Elements of a row each lane holds: ceil(max_dim / 32).
int perLane(const SortedBackwardShape& s) { return static_cast<int>(std::max<int64_t>(1, (s.max_dim + 31) / 32)); }

// The first six parameters of the kernels walking the segments (accumulate, update): the address
// table, the sorted keys and positions, the segments and the pieces' partial rows, all read.
void addSegmentBuffers(Kernel& k, const SortedBackwardShape& s) {
  k.addBuffer("tables", DType::i64, (s.tables + 1) * kTableWords);
  k.addBuffer("sort_keys", DType::i64, s.slots);
  k.addBuffer("sort_positions", DType::i32, s.slots);
  k.addBuffer("segment_starts", DType::i32, s.max_segments + 1);
  k.addBuffer("segment_meta", DType::i64, s.tables + 2);
  k.addBuffer("piece_partials", DType::f32, partialElements(s));
}

}  // namespace

Kernel segmentPartialsKernel(const SortedBackwardShape& s) {
  // One warp per multiple of kPiece from 1 on.
  const int64_t warps = std::max<int64_t>(1, partialRows(s) - 1);
  Kernel k = sourceKernel("embedding_grad_partials", (warps + 7) / 8, 256,
                          fmt::format("  kiln_emb_partials<{}, {}>(b0, b1, b2, b3, {}LL, {}LL, {}, {}LL, {}LL);\n",
                                      perLane(s), kPiece, s.slots, s.batch, s.id_bits, s.max_dim, s.tables));
  k.addBuffer("tables", DType::i64, (s.tables + 1) * kTableWords);
  k.addBuffer("sort_keys", DType::i64, s.slots);
  k.addBuffer("sort_positions", DType::i32, s.slots);
  k.addBuffer("piece_partials", DType::f32, partialElements(s), true);
  return k;
}

Kernel segmentAccumulateKernel(const SortedBackwardShape& s, int64_t distinct_ids, int64_t accum_elements) {
  const int per_lane = perLane(s);
  Kernel k = sourceKernel("embedding_grad_accumulate", (s.max_segments + 7) / 8, 256,
                          fmt::format("  kiln_emb_accumulate<{}, {}>(b0, b1, b2, b3, b4, b5, b6, b7, b8, {}LL, {}, "
                                      "{}LL);\n",
                                      per_lane, kPiece, s.batch, s.id_bits, s.max_dim));
  addSegmentBuffers(k, s);
  k.addBuffer("distinct_ids", DType::i64, distinct_ids, true);
  k.addBuffer("row_grads", DType::f32, accum_elements, true);
  k.addBuffer("distinct_counts", DType::i64, s.tables, true);
  return k;
}

Kernel segmentUpdateKernel(const SortedBackwardShape& s, const RowStep& step, int64_t t0, int64_t t1,
                           int64_t segments) {
  const char* optimizer = step.optimizer == "adagrad"           ? "KILN_OPT_ADAGRAD"
                          : step.optimizer == "rowwise_adagrad" ? "KILN_EMB_ROWWISE_ADAGRAD"
                          : step.optimizer == "adam"            ? "KILN_OPT_ADAM"
                                                                : "KILN_OPT_SGD";
  // Doubles print exactly ({:.17g}); the kernel rounds them to its compute type as the Row
  // kernels' constants are.
  Kernel k = sourceKernel(
      "embedding_update_" + step.optimizer, (segments + 7) / 8, 256,
      fmt::format("  kiln_emb_update<{}, {}, {}, {}, {}, {}>(b0, b1, b2, b3, b4, b5, {}LL, {}, {}LL, {}, {}, {:.17g}, "
                  "{:.17g}, {:.17g}, {:.17g}, {:.17g});\n",
                  perLane(s), kPiece, optimizer, floatCType(step.table), floatCType(step.state),
                  step.table == DType::f64 ? "double" : "float", s.batch, s.id_bits, s.max_dim, t0, t1, step.lr,
                  step.eps, step.beta1, step.beta2, step.weight_decay));
  addSegmentBuffers(k, s);
  return k;
}

namespace {

// The address table's word numbers and flag bits, as the device code names them: printed from
// embedding_sort.h's enums, so the two cannot disagree.
std::string tableWordNames() {
  std::string out = "enum kiln_emb_word {\n";
  const std::pair<const char*, int64_t> words[] = {
      {"IDS", kIdsAddress},       {"WEIGHTS", kWeightsAddress}, {"OFFSETS", kOffsetsAddress},
      {"GRAD", kGradAddress},     {"FLAGS", kFlags},            {"HOTNESS", kHotness},
      {"ROWS", kRows},            {"DIM", kDim},                {"GRAD_STRIDE", kGradStride},
      {"GRAD_OFFSET", kGradOffset}, {"BEGIN", kBegin},          {"ACCUM_AT", kAccumAt},
      {"KEYS_AT", kKeysAt},       {"FLAG_INDEX", kFlagIndex},   {"TABLE", kTableAddress},
      {"STATE0", kState0Address}, {"STATE1", kState1Address},  {"LR", kLrAddress},
      {"STEP", kStepAddress},     {"SCALE", kScaleAddress},     {"SCALAR_TYPES", kScalarTypes},
      {"WORDS", kTableWords},     {"IDS_I64", kIdsI64},         {"GRAD_BF16", kGradBf16},
      {"MEAN", kMean},            {"WEIGHTS_BF16", kWeightsBf16}};
  for (const auto& [name, value] : words) out += fmt::format("  KILN_EMB_{} = {},\n", name, value);
  return out + "};\n";
}

}  // namespace

const std::string& embeddingSortDeviceFunctions() {
  static const std::string text = R"CUDA(
// The sorted embedding backward (codegen/emit/embedding_sort.cc). A table's row of the address
// table holds KILN_EMB_WORDS words (kiln_emb_word names them). Keys are (table << id_bits) | id;
// table T (none) marks a slot without a valid id and sorts last. Blocks of 256 threads take
// tiles of kTile slots, in chunks of 256 in slot order.

// The table owning occurrence slot q: the last t whose first slot is <= q (a table without
// slots shares its first slot with the next one, which wins).
__device__ __forceinline__ int kiln_emb_table_of(const long long* tab, int tables, long long q) {
  int lo = 0, hi = tables - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tab[mid * KILN_EMB_WORDS + KILN_EMB_BEGIN] <= q) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ unsigned long long kiln_emb_key(const long long* tab, int tables, long long batch,
                                                           int id_bits, long long q, int* err) {
  const unsigned long long none = (unsigned long long)tables << id_bits;
  const int t = kiln_emb_table_of(tab, tables, q);
  const long long* d = tab + t * KILN_EMB_WORDS;
  const long long p = q - d[KILN_EMB_BEGIN];
  // Padding past the last bag.
  if (d[KILN_EMB_OFFSETS] && p >= ((const long long*)d[KILN_EMB_OFFSETS])[batch]) return none;
  const long long id = (d[KILN_EMB_FLAGS] & KILN_EMB_IDS_I64) ? ((const long long*)d[KILN_EMB_IDS])[p]
                                                             : (long long)((const int*)d[KILN_EMB_IDS])[p];
  if (id < 0 || (d[KILN_EMB_ROWS] > 0 && id >= d[KILN_EMB_ROWS])) {
    kiln_set_error(err, (int)d[KILN_EMB_FLAG_INDEX]);
    return none;
  }
  return ((unsigned long long)t << id_bits) | (unsigned long long)id;
}

// The key of every slot of this block's tile, its position, and the tile's histogram of the
// keys' lowest byte (hist[digit * tiles + tile]); block 0 clears the distinct-id counts.
template <int kTile>
__device__ void kiln_emb_keys(const long long* tab, long long* keys, int* pos, int* hist, long long* counts,
                              int* err, int tables, long long n, long long batch, int id_bits, long long tiles) {
  __shared__ unsigned local[256];
  local[threadIdx.x] = 0;
  if (blockIdx.x == 0)
    for (int t = threadIdx.x; t < tables; t += blockDim.x) counts[t] = 0;
  __syncthreads();
  const long long lo = (long long)blockIdx.x * kTile, hi = lo + kTile < n ? lo + kTile : n;
  for (long long q = lo + threadIdx.x; q < hi; q += blockDim.x) {
    const unsigned long long key = kiln_emb_key(tab, tables, batch, id_bits, q, err);
    keys[q] = (long long)key;
    pos[q] = (int)q;
    atomicAdd(&local[key & 255u], 1u);
  }
  __syncthreads();
  hist[threadIdx.x * tiles + blockIdx.x] = (int)local[threadIdx.x];
}

// The tile's histogram of the keys' digit at `shift`.
template <int kTile>
__device__ void kiln_emb_histogram(const long long* keys, int* hist, long long n, long long tiles, int shift) {
  __shared__ unsigned local[256];
  local[threadIdx.x] = 0;
  __syncthreads();
  const long long lo = (long long)blockIdx.x * kTile, hi = lo + kTile < n ? lo + kTile : n;
  for (long long q = lo + threadIdx.x; q < hi; q += blockDim.x)
    atomicAdd(&local[((unsigned long long)keys[q] >> shift) & 255u], 1u);
  __syncthreads();
  hist[threadIdx.x * tiles + blockIdx.x] = (int)local[threadIdx.x];
}

// Exclusive scan of v[0, n) in place by one block, the total at v[n].
__device__ void kiln_emb_exclusive_scan(int* v, long long n) {
  __shared__ int warp_sums[32];
  __shared__ int carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = (int)(blockDim.x >> 5);
  if (tid == 0) carry = 0;
  __syncthreads();
  for (long long base = 0; base < n; base += blockDim.x) {
    const long long i = base + tid;
    const int own = i < n ? v[i] : 0;
    int x = own;
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += u;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int w = lane < warps ? warp_sums[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += u;
      }
      warp_sums[lane] = w;
    }
    __syncthreads();
    const int inclusive = carry + x + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (i < n) v[i] = inclusive - own;
    __syncthreads();  // every thread has read carry and warp_sums
    if (tid == (int)blockDim.x - 1) carry = inclusive;
    __syncthreads();
  }
  if (tid == 0) v[n] = carry;
}

// One stable pass of the LSD radix sort: the tile's slots go, in slot order, after every slot
// of a smaller digit and every earlier tile's slots of the same digit (the scanned histogram).
// A warp finds the lanes sharing its digit with 8 ballots; warps take their places in warp order.
template <int kTile>
__device__ void kiln_emb_scatter(const long long* keys_in, const int* pos_in, const int* hist, long long* keys_out,
                                 int* pos_out, long long n, long long tiles, int shift) {
  __shared__ unsigned next[256];          // where the tile's next slot of each digit goes
  __shared__ unsigned warp_at[8][256];    // per warp and digit: its count, then its first place
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  next[tid] = (unsigned)hist[tid * tiles + blockIdx.x];
  const long long lo = (long long)blockIdx.x * kTile, hi = lo + kTile < n ? lo + kTile : n;
  for (long long c = lo; c < hi; c += 256) {
    const long long i = c + tid;
    const bool valid = i < hi;
    const unsigned long long key = valid ? (unsigned long long)keys_in[i] : 0ull;
    const unsigned digit = (unsigned)(key >> shift) & 255u;
    for (int w = 0; w < 8; ++w) warp_at[w][tid] = 0;
    unsigned peers = __ballot_sync(0xffffffffu, valid);
    for (int b = 0; b < 8; ++b) {
      const bool bit = (digit >> b) & 1u;
      const unsigned set = __ballot_sync(0xffffffffu, bit);
      peers &= bit ? set : ~set;
    }
    const unsigned rank = (unsigned)__popc(peers & ((1u << lane) - 1u));
    __syncthreads();  // the counts are clear
    if (valid && rank == 0) warp_at[warp][digit] = (unsigned)__popc(peers);
    __syncthreads();
    unsigned run = next[tid];
    for (int w = 0; w < 8; ++w) {
      const unsigned count = warp_at[w][tid];
      warp_at[w][tid] = run;
      run += count;
    }
    next[tid] = run;
    __syncthreads();
    if (valid) {
      const unsigned at = warp_at[warp][digit] + rank;
      keys_out[at] = (long long)key;
      pos_out[at] = pos_in[i];
    }
    __syncthreads();  // every place is read before the next chunk clears the counts
  }
}

// Whether sorted slot i starts a segment: a valid key unlike its predecessor's.
__device__ __forceinline__ bool kiln_emb_starts(const long long* keys, long long i, unsigned long long none) {
  const unsigned long long key = (unsigned long long)keys[i];
  return key < none && (i == 0 || (unsigned long long)keys[i - 1] != key);
}

// The segment starts in each tile (hist[tile]).
template <int kTile>
__device__ void kiln_emb_segment_count(const long long* keys, int* hist, long long n, unsigned long long none) {
  __shared__ unsigned total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  const long long lo = (long long)blockIdx.x * kTile, hi = lo + kTile < n ? lo + kTile : n;
  unsigned mine = 0;
  for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine += kiln_emb_starts(keys, i, none) ? 1u : 0u;
  atomicAdd(&total, mine);
  __syncthreads();
  if (threadIdx.x == 0) hist[blockIdx.x] = (int)total;
}

// Numbers the segments in slot order (the tile's first number from the scanned counts):
// starts[s] = the first slot of segment s, starts[S] = the end of the valid keys; meta[0] = S
// and, when S > 0, meta[1 + t] = the first segment of a table >= t for t in [0, T] (S past the
// last), so the segments of tables [t0, t1) are [meta[1 + t0], meta[1 + t1]).
template <int kTile>
__device__ void kiln_emb_segments(const long long* keys, const int* hist, int* starts, long long* meta, long long n,
                                  long long tiles, int id_bits, unsigned long long none) {
  __shared__ unsigned warp_total[8];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned segments = (unsigned)hist[tiles];
  if (blockIdx.x == 0 && tid == 0) meta[0] = segments;
  unsigned base = (unsigned)hist[blockIdx.x];
  const long long lo = (long long)blockIdx.x * kTile, hi = lo + kTile < n ? lo + kTile : n;
  for (long long c = lo; c < hi; c += 256) {
    const long long i = c + tid;
    const bool start = i < hi && kiln_emb_starts(keys, i, none);
    const unsigned mask = __ballot_sync(0xffffffffu, start);
    if (lane == 0) warp_total[warp] = (unsigned)__popc(mask);
    __syncthreads();
    unsigned before = base, all = 0;
    for (int w = 0; w < 8; ++w) {
      if (w < warp) before += warp_total[w];
      all += warp_total[w];
    }
    if (start) {
      const unsigned s = before + (unsigned)__popc(mask & ((1u << lane) - 1u));
      starts[s] = (int)i;
      // The first segment of table t, and of the tables without keys just before it.
      const long long t = (long long)((unsigned long long)keys[i] >> id_bits);
      const long long before = i == 0 ? -1 : (long long)((unsigned long long)keys[i - 1] >> id_bits);
      for (long long u = before + 1; u <= t; ++u) meta[1 + u] = s;
    }
    if (i < hi && (unsigned long long)keys[i] < none && (i + 1 == n || (unsigned long long)keys[i + 1] >= none)) {
      starts[segments] = (int)(i + 1);
      // The tables after the last one with keys, and the end (t = T).
      const long long tables = (long long)(none >> id_bits);
      for (long long u = (long long)((unsigned long long)keys[i] >> id_bits) + 1; u <= tables; ++u)
        meta[1 + u] = segments;
    }
    base += all;
    __syncthreads();  // warp_total is read before the next chunk writes it
  }
}

// The warp's segment, sorted slots [lo, hi) of table row d: the gradient rows of its
// occurrences in position order (the sort is stable), each times its weight and 1/bag size for
// a mean, summed in f32; lane l holds elements l, l + 32, ... of the row.
template <int kPer>
__device__ __forceinline__ void kiln_emb_segment_sum(const long long* d, const int* pos, int lo, int hi,
                                                     long long batch, int lane, float (&acc)[kPer]) {
  const long long dim = d[KILN_EMB_DIM], hotness = d[KILN_EMB_HOTNESS];
  const bool mean = (d[KILN_EMB_FLAGS] & KILN_EMB_MEAN) != 0;
  const long long* offsets = (const long long*)d[KILN_EMB_OFFSETS];
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
  for (int j = lo; j < hi; ++j) {
    const long long p = (long long)pos[j] - d[KILN_EMB_BEGIN];
    long long b;
    float scale = 1.0f;
    if (offsets) {
      b = kiln_bag_of(offsets, batch, p);
      const long long size = offsets[b + 1] - offsets[b];
      if (mean && size > 0) scale = 1.0f / (float)size;
    } else {
      b = p / hotness;
      if (mean) scale = 1.0f / (float)hotness;
    }
    const float w = !d[KILN_EMB_WEIGHTS]                       ? 1.0f
                    : (d[KILN_EMB_FLAGS] & KILN_EMB_WEIGHTS_BF16) ? kiln_ld((const kiln_bf16*)d[KILN_EMB_WEIGHTS], p)
                                                              : kiln_ld((const float*)d[KILN_EMB_WEIGHTS], p);
    const float c = w * scale;
    const long long at = b * d[KILN_EMB_GRAD_STRIDE] + d[KILN_EMB_GRAD_OFFSET];
    const bool bf16 = (d[KILN_EMB_FLAGS] & KILN_EMB_GRAD_BF16) != 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const long long e = lane + 32 * k;
      if (e < dim)
        acc[k] += c * (bf16 ? kiln_ld((const kiln_bf16*)d[KILN_EMB_GRAD], at + e) : kiln_ld((const float*)d[KILN_EMB_GRAD], at + e));
    }
  }
}

// A hot id's segment is cut at the multiples of kPiece sorted slots: one warp per multiple b
// that continues a segment (its slot's key equals the one before) sums slots [b kPiece, the
// piece's end: the segment's end or the next multiple) into partial row b, so no warp sums more
// than kPiece rows however skewed the ids are.
template <int kPer, int kPiece>
__device__ void kiln_emb_partials(const long long* tab, const long long* keys, const int* pos, float* partials,
                                  long long n, long long batch, int id_bits, long long max_dim, long long tables) {
  const long long b = 1 + (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  const long long q = b * kPiece;
  if (q >= n) return;  // the whole warp
  const unsigned long long key = (unsigned long long)keys[q];
  const long long t = (long long)(key >> id_bits);
  // A segment starts here, or the key is no table's (padding, a bad id: they sort last).
  if (key != (unsigned long long)keys[q - 1] || t >= tables) return;
  long long hi = q + kPiece < n ? q + kPiece : n;
  for (long long c = q + 1; c < hi; c += 32) {
    const unsigned other = __ballot_sync(0xffffffffu, c + lane < hi && (unsigned long long)keys[c + lane] != key);
    if (other) {
      hi = c + __popc((other & (0u - other)) - 1u);  // the first lane with another key
      break;
    }
  }
  const long long* d = tab + t * KILN_EMB_WORDS;
  float acc[kPer];
  kiln_emb_segment_sum<kPer>(d, pos, (int)q, (int)hi, batch, lane, acc);
  float* row = partials + b * max_dim;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const long long e = lane + 32 * k;
    if (e < d[KILN_EMB_DIM]) row[e] = acc[k];
  }
}

// Segment [lo, hi)'s summed gradient row: its slots up to the first multiple of kPiece past lo
// directly, then the partial row of each multiple of kPiece below hi (kiln_emb_partials), in
// slot order.
template <int kPer, int kPiece>
__device__ __forceinline__ void kiln_emb_segment_total(const long long* d, const int* pos, const float* partials,
                                                       int lo, int hi, long long batch, long long max_dim, int lane,
                                                       float (&acc)[kPer]) {
  const int first = (lo / kPiece + 1) * kPiece;
  kiln_emb_segment_sum<kPer>(d, pos, lo, hi < first ? hi : first, batch, lane, acc);
  for (int b = first; b < hi; b += kPiece) {
    const float* row = partials + (long long)(b / kPiece) * max_dim;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const long long e = lane + 32 * k;
      if (e < d[KILN_EMB_DIM]) acc[k] += row[e];
    }
  }
}

// One warp per segment: its summed gradient row into the table's o-th accumulated row; lane 0
// lists the id and, for the table's last segment, its count (the squared-norm probe reads them).
template <int kPer, int kPiece>
__device__ void kiln_emb_accumulate(const long long* tab, const long long* keys, const int* pos, const int* starts,
                                    const long long* meta, const float* partials, long long* distinct_ids, float* accum,
                                    long long* counts, long long batch, int id_bits, long long max_dim) {
  const long long s = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (s >= meta[0]) return;  // the whole warp
  const int lo = starts[s], hi = starts[s + 1];
  const unsigned long long key = (unsigned long long)keys[lo];
  const int t = (int)(key >> id_bits);
  const long long* d = tab + t * KILN_EMB_WORDS;
  const long long o = s - meta[1 + t], dim = d[KILN_EMB_DIM];
  float acc[kPer];
  kiln_emb_segment_total<kPer, kPiece>(d, pos, partials, lo, hi, batch, max_dim, lane, acc);
  float* row = accum + d[KILN_EMB_ACCUM_AT] + o * dim;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const long long e = lane + 32 * k;
    if (e < dim) row[e] = acc[k];
  }
  if (lane == 0) {
    distinct_ids[d[KILN_EMB_KEYS_AT] + o] = (long long)(key & ((1ull << id_bits) - 1ull));
    if (s + 1 == meta[0] || ((unsigned long long)keys[hi] >> id_bits) != (unsigned long long)t) counts[t] = o + 1;
  }
}

// rowwise_adagrad, the one optimizer the dense step (kiln_opt_element) does not have.
constexpr int KILN_EMB_ROWWISE_ADAGRAD = -1;

// The fused row update: one warp per segment of tables [t0, t1) sums the segment's gradient
// rows (kiln_emb_segment_sum), then steps that id's row of its table and the row's optimizer
// state in place (kOptimizer: a kiln_opt_kind, or KILN_EMB_ROWWISE_ADAGRAD), computing in C
// (f32, or f64 for f64 tables) in the order the reference does.
// Each (table, id) is one segment, so no two warps touch one row: no atomics, and the summed
// rows never go through memory. The hyperparameters are the tables' shared attributes; lr,
// step and the gradient scale are read through the address table.
template <int kPer, int kPiece, int kOptimizer, typename W, typename S, typename C>
__device__ void kiln_emb_update(const long long* tab, const long long* keys, const int* pos, const int* starts,
                                const long long* meta, const float* partials, long long batch, int id_bits,
                                long long max_dim, int t0, int t1, double lr_attr, double eps, double beta1,
                                double beta2, double weight_decay) {
  if (meta[0] == 0) return;  // no segments: meta[1 + t] was never written
  const long long s = meta[1 + t0] + (((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int lane = threadIdx.x & 31;
  if (s >= meta[1 + t1]) return;  // the whole warp
  const int lo = starts[s], hi = starts[s + 1];
  const unsigned long long key = (unsigned long long)keys[lo];
  const long long* d = tab + (long long)(key >> id_bits) * KILN_EMB_WORDS;
  float acc[kPer];
  kiln_emb_segment_total<kPer, kPiece>(d, pos, partials, lo, hi, batch, max_dim, lane, acc);

  const long long id = (long long)(key & ((1ull << id_bits) - 1ull)), dim = d[KILN_EMB_DIM], row = id * dim;
  W* w = (W*)d[KILN_EMB_TABLE];
  S* s0 = (S*)d[KILN_EMB_STATE0];
  S* s1 = (S*)d[KILN_EMB_STATE1];
  const long long types = d[KILN_EMB_SCALAR_TYPES];
  const C lr = (C)lr_attr * kiln_opt_scalar<C>(d[KILN_EMB_LR], types & 15);
  const C scale = d[KILN_EMB_SCALE] ? kiln_opt_scalar<C>(d[KILN_EMB_SCALE], (types >> 8) & 15) : (C)1;
  if (kOptimizer == KILN_EMB_ROWWISE_ADAGRAD) {
    const C wd = (C)weight_decay;
    // One accumulator per row, grown by the mean of g^2 over the row (a warp-wide sum).
    C g[kPer];
    C sq = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const long long e = lane + 32 * k;
      g[k] = 0;
      if (e < dim) {
        g[k] = (C)acc[k] * scale;
        if (weight_decay != 0) g[k] = g[k] + wd * (C)kiln_ld(w, row + e);
        sq += g[k] * g[k];
      }
    }
    // Every lane reads the accumulator before the shuffles, which lane 0's store follows.
    const C old = (C)kiln_ld(s0, id);
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const C sum = old + sq * (C)(1.0 / (double)dim);
    const C step_size = lr / (kiln_fn::sqrt(sum) + (C)eps);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const long long e = lane + 32 * k;
      if (e < dim) kiln_st(w, row + e, (C)kiln_ld(w, row + e) - step_size * g[k]);
    }
    if (lane == 0) kiln_st(s0, id, sum);
    return;
  }
  const kiln_opt_hyper<C> h = kiln_opt_make_hyper<kOptimizer, C>(
      lr, kiln_opt_scalar<C>(d[KILN_EMB_STEP], (types >> 4) & 15), eps, beta1, beta2, weight_decay, 0.0);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const long long e = lane + 32 * k;
    if (e < dim)
      kiln_st(w, row + e,
              kiln_opt_element<kOptimizer, C, S>((C)kiln_ld(w, row + e), (C)acc[k] * scale, s0, s1, row + e, h));
  }
}
)CUDA";
  static const std::string all = tableWordNames() + text;
  return all;
}

}  // namespace kiln::codegen::emit
