// The sorted embedding backward's Source kernels (embedding_sort.cc): for every table of an
// update group at once, the (table, id) key of each id occurrence, a stable LSD radix sort of the
// keys with their occurrence positions, the segments of equal keys, and one warp per segment
// summing its occurrences' gradient rows in position order, then stepping the optimizer on that
// row in the same warp (one launch for every table of an optimizer configuration). No
// floating-point atomics: the result is the same bits whatever order blocks and warps run in (as
// FBGEMM's split_embedding_backward with its fused optimizer, whose sort-then-segment-reduce this
// follows).
//
// Per-table data (the ids', weights', offsets' and gradient's addresses, dims, strides, where
// each table's occurrences begin and its rows are written) is read from an address table in
// device memory (GroupBuffer::words, kTableWords words per table), so the kernels take a fixed
// number of parameters whatever the table count.
#pragma once

#include <cstdint>
#include <string>

#include "codegen/kernel_ir.h"

namespace kiln::codegen::emit {

// The words of one table's row of the address table.
enum TableWord : int {
  kIdsAddress,       // i32 or i64 ids
  kWeightsAddress,   // f32 or bf16 per-id weights; 0: none
  kOffsetsAddress,   // i64 [batch + 1] bag offsets of jagged ids; 0: fixed hotness
  kGradAddress,      // f32 or bf16 gradient of the pooled output
  kFlags,            // kIdsI64 | kGradBf16 | kMean | kWeightsBf16
  kHotness,          // fixed hotness (0: jagged)
  kRows,             // ids must be in [0, rows); <= 0: unchecked (a squared-norm probe)
  kDim,              // row width
  kGradStride,       // the gradient of bag b is grad[b * stride + offset + d]
  kGradOffset,
  kBegin,            // the table's first occurrence slot among the group's
  kOccurrences,      // its slots (batch * hotness, or the ids buffer's size)
  kAccumAt,          // where its summed rows start in the accumulated rows (elements)
  kKeysAt,           // where its distinct ids start in the distinct-id list
  kFlagIndex,        // what the error flag names for it
  // The fused update's (segmentUpdateKernel): the table and its optimizer state, written in
  // place; the lr factor, step and gradient scale scalars (0: no scale) and their types.
  kTableAddress,
  kState0Address,    // 0: none
  kState1Address,
  kLrAddress,
  kStepAddress,
  kScaleAddress,
  kScalarTypes,      // ScalarCode (optimizer.h) of lr | step << 4 | scale << 8
  kTableWords = 24,  // words per table (two spare); a last row holds kBegin = the slot count
};
// kFlags bits.
constexpr int64_t kIdsI64 = 1, kGradBf16 = 2, kMean = 4, kWeightsBf16 = 8;

// The shape of one group's sorted backward, which its kernels are specialized to.
struct SortedBackwardShape {
  int64_t tables = 0;        // T
  int64_t slots = 0;         // N: occurrence slots of all tables (jagged padding included)
  int64_t batch = 0;         // B
  int id_bits = 0;           // the key is (table << id_bits) | id; table T marks a slot
  int table_bits = 0;        // without a valid id (padding, out of range), sorted last
  int64_t max_segments = 0;  // distinct (table, id) pairs at most: sum of min(occurrences, rows)
  int64_t max_dim = 0;
};

// Occurrences each block of the key, histogram, scatter and segment kernels takes.
constexpr int64_t kSortTile = 4096;
// A segment (one id's occurrences, sorted) is summed by one warp up to the first multiple of
// kPiece sorted slots after its start; each further piece of kPiece slots (a hot id's) is summed
// by its own warp into a partial row that the segment's warp then adds, in slot order.
constexpr int64_t kPiece = 256;
// The pieces' partial rows: one per multiple of kPiece below the slot count (row 0 unused), of
// max_dim f32 each.
int64_t partialRows(const SortedBackwardShape& s);
int64_t partialElements(const SortedBackwardShape& s);
int64_t sortTiles(const SortedBackwardShape& s);
// 8-bit radix passes: as many as the key's bits need.
int sortPasses(const SortedBackwardShape& s);
// Elements of the i32 histogram buffer: 256 digits x tiles, then one for the total.
int64_t histogramElements(const SortedBackwardShape& s);

// The optimizer step a fused update kernel applies, the same for each of its tables: what the
// kernel's text is specialized to (ir/ops/optimizer.cc states the math).
struct RowStep {
  std::string optimizer;  // sgd (plain: the sparse update keeps no momentum), adagrad, rowwise_adagrad, adam
  DType table = DType::f32, state = DType::f32;
  double lr = 0, eps = 1e-8, beta1 = 0.9, beta2 = 0.999, weight_decay = 0;
  bool operator==(const RowStep&) const = default;
};

// The kernels, each with its buffers declared (kernel parameters b0, b1, ... in order; the
// lowering binds them). `table` is the address table, `keys`/`positions` the sort's two ping-pong
// pairs, `hist` the histogram buffer, `counts` the i64 [T] distinct-id count of each table.
//   keys:        (table, keys0, pos0, hist, counts, error flag): keys and pass 0's histogram;
//                clears counts
//   histogram:   (keys, hist) of pass `pass`
//   scan:        (hist) exclusive scan of `n` counts in place, their total at [n]
//   scatter:     (keys_in, pos_in, hist, keys_out, pos_out) stable by pass `pass`'s digit
//   segment_count: (keys, hist) segment starts per tile
//   segments:    (keys, hist, seg_start, seg_meta): seg_start[s] = first sorted slot of
//                segment s, seg_start[S] = end of the valid keys; seg_meta[0] = S,
//                seg_meta[1 + t] = the first segment of a table >= t, seg_meta[1 + T] = S
//   partials:    (table, keys, positions, partials): one warp per multiple b of kPiece whose slot
//                continues a segment: the sum of slots [b kPiece, the piece's end) into
//                partials[b * max_dim ...]
//   accumulate:  (table, keys, positions, seg_start, seg_meta, partials, distinct_ids, accum,
//                counts): one warp per segment; table t's o-th distinct id goes to
//                distinct_ids[kKeysAt + o], its summed row to accum[kAccumAt + o * dim ...],
//                counts[t] = its distinct ids
//   update:      (table, keys, positions, seg_start, seg_meta, partials): one warp per segment of tables
//                [t0, t1), which share `step`: sums the segment's rows as accumulate does and
//                steps the table's row of that id and its state in place; `segments` bounds
//                the tables' segments (the grid)
Kernel sortKeysKernel(const SortedBackwardShape& s);
Kernel sortHistogramKernel(const SortedBackwardShape& s, int pass);
Kernel sortScanKernel(const SortedBackwardShape& s, int64_t n);
Kernel sortScatterKernel(const SortedBackwardShape& s, int pass);
Kernel segmentCountKernel(const SortedBackwardShape& s);
Kernel segmentsKernel(const SortedBackwardShape& s);
Kernel segmentPartialsKernel(const SortedBackwardShape& s);
Kernel segmentAccumulateKernel(const SortedBackwardShape& s, int64_t distinct_ids, int64_t accum_elements);
Kernel segmentUpdateKernel(const SortedBackwardShape& s, const RowStep& step, int64_t t0, int64_t t1,
                           int64_t segments);

// The device functions they call, part of every module's prelude.
const std::string& embeddingSortDeviceFunctions();

}  // namespace kiln::codegen::emit
