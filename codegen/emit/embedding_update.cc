// The embedding update emitter: sparse optimizer steps on the rows a batch touched
// (kiln.embedding_bag_update, one table or a fused `embedding_update` group of them) and the
// squared norm of a sparse gradient (kiln.embedding_bag_grad_sqnorm).
//
// Sort, then segment-reduce (embedding_sort.h): the (table, id) keys of every id occurrence of
// every table of the group are radix-sorted together with their positions, and one warp per
// distinct (table, id) sums its occurrences' gradient rows in position order and steps the
// optimizer on that row of the table, in place: no atomics, the same bits on every run, and
// neither the dense table gradient nor the summed rows ever reach memory. Per-table data comes
// from an address table in device memory, so the kernels' parameters do not grow with the table
// count, and the tables sharing an optimizer configuration (RowStep) are one launch.
#include <algorithm>
#include <optional>

#include "codegen/emit/embedding_sort.h"
#include "codegen/emit/emitter_registry.h"
#include "codegen/emit/optimizer.h"
#include "ir/optimizer.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// Where an update reads its pooled-output gradient: columns [offset, offset + dim) of rows of
// `stride` elements of `value` (the concatenated gradient, when a fused group drops the slice).
struct GradSource {
  const Value* value;
  int64_t stride, offset;
};

struct Accumulated {
  int64_t dim = 0;
  int64_t bound = 0;  // distinct ids at most: min(occurrences, rows)
  const Op* op = nullptr;
  ir::EmbeddingUpdateLayout layout;
  BagIds bag;
  int64_t rows = 0;  // -1: unchecked (a squared-norm probe has no table)
  std::optional<GradSource> source;
  // Set by sortAll: the table's number in the group, where its distinct ids start in
  // SortedRows::distinct_ids and its summed rows in SortedRows::accum.
  int64_t index = -1, keys_at = 0, accum_at = 0;
};

// What the sort leaves, shared by every table of the group (embedding_sort.h names the
// buffers): the address table, the sorted keys and positions, the segments.
struct Sorted {
  SortedBackwardShape shape;
  int table = -1, keys = -1, positions = -1, starts = -1, meta = -1;
  int counts = -1;    // i64 [T], cleared by the keys kernel: the accumulation's distinct-id counts
  int partials = -1;  // the hot ids' pieces' partial rows (segmentPartialsKernel)
};

// What the squared-norm probe's accumulation leaves: counts[t] distinct ids of table t, listed
// at distinct_ids[keys_at + o], the o-th one's summed gradient row at accum[accum_at + o * dim
// ...] (only the first counts[t] are written).
struct SortedRows {
  int distinct_ids = -1, accum = -1, counts = -1;
};

// One table's shape and where its gradient is read (sortAll lays the group out).
Expected<Accumulated> prepareAccumulate(GroupLowering& gl, const Op& op, const ir::EmbeddingUpdateLayout& l,
                                        int64_t rows, const GradSource* source) {
  const Value* ids = op.operand(static_cast<unsigned>(l.ids));
  const Value* grad = op.operand(static_cast<unsigned>(l.grad_out));
  if (op.hasAttr("column_offset"))
    return Status::errorf(
        "'{}' of a column shard (column_offset) has no CUDA lowering yet: the CPU backend runs it",
        op.name());
  KILN_ASSIGN_OR_RETURN(
      auto bag, gl.bagIds(op, ids, l.lengths >= 0 ? op.operand(static_cast<unsigned>(l.lengths)) : nullptr));
  auto is = gl.shapeOf(ids);
  auto gs = gl.shapeOf(grad);
  if (!is || !gs) return !is ? is.status() : gs.status();
  Accumulated a;
  a.op = &op;
  a.layout = l;
  a.bag = bag;
  a.rows = rows;
  if (source) a.source = *source;
  a.dim = (*gs)[1];
  int64_t n = product(*is);
  a.bound = std::min(n, rows > 0 ? rows : n);
  return a;
}

// Appends a Source kernel of embedding_sort.cc with its buffers bound, in order, to group
// buffers.
Status addSortKernel(GroupLowering& gl, Kernel k, const std::vector<int>& group_buffers) {
  return gl.addSourceKernel(std::move(k), group_buffers, "the embedding backward");
}

// Bits to write the values 0..v.
int bitsFor(uint64_t v) {
  int b = 0;
  while (b < 64 && (v >> b) != 0) ++b;
  return b;
}

// The optimizer step of an update table (an embedding_bag_update; nullopt for the squared-norm
// probe, which has none).
std::optional<RowStep> rowStepOf(const Accumulated& a) {
  const Op& op = *a.op;
  if (a.layout.table < 0) return std::nullopt;
  RowStep r;
  r.optimizer = op.strAttr("optimizer");
  r.table = op.operand(static_cast<unsigned>(a.layout.table))->type().dtype();
  if (a.layout.num_state > 0) r.state = op.operand(static_cast<unsigned>(a.layout.state_begin))->type().dtype();
  r.lr = op.floatAttr("lr");
  r.eps = op.floatAttr("eps", 1e-8);
  r.beta1 = op.floatAttr("beta1", 0.9);
  r.beta2 = op.floatAttr("beta2", 0.999);
  r.weight_decay = op.floatAttr("weight_decay");
  return r;
}

// The jagged scan, then the sort of the backward (embedding_sort.h) over every table of
// `tables`: the address table, the keys, a stable radix sort of (table, id) keys with their
// positions, and the segments. Fills each table's place.
Expected<Sorted> sortAll(GroupLowering& gl, std::vector<Accumulated>& tables) {
  std::vector<BagIds> bags;
  for (const Accumulated& a : tables) {
    if (a.bag.batch != tables.front().bag.batch)
      return Status::errorf("{}: the updates of one kernel must share the batch", opLabel(*a.op));
    bags.push_back(a.bag);
  }
  KILN_RETURN_IF_ERROR(gl.scanLengths(bags));

  Sorted out;
  SortedBackwardShape& shape = out.shape;
  shape.tables = static_cast<int64_t>(tables.size());
  shape.batch = tables.front().bag.batch;
  std::vector<AddressWord> words;
  int64_t distinct_ids = 0, accum = 0;
  for (size_t i = 0; i < tables.size(); ++i) {
    Accumulated& a = tables[i];
    const Op& op = *a.op;
    const ir::EmbeddingUpdateLayout& l = a.layout;
    const Value* ids = op.operand(static_cast<unsigned>(l.ids));
    const Value* grad = a.source ? a.source->value : op.operand(static_cast<unsigned>(l.grad_out));
    const Value* weights = l.weights >= 0 ? op.operand(static_cast<unsigned>(l.weights)) : nullptr;
    const DType it = ids->type().dtype(), gt = grad->type().dtype();
    if ((it != DType::i32 && it != DType::i64) || (gt != DType::f32 && gt != DType::bf16) ||
        (weights && weights->type().dtype() != DType::f32 && weights->type().dtype() != DType::bf16))
      return Status::errorf("{}: the CUDA backward takes i32/i64 ids and f32/bf16 gradients and weights",
                            opLabel(op));
    a.index = static_cast<int64_t>(i);
    a.keys_at = distinct_ids;
    a.accum_at = accum;
    const int64_t occurrences = a.bag.lengths ? a.bag.num_ids : a.bag.batch * a.bag.hotness;
    int64_t flags = (it == DType::i64 ? kIdsI64 : 0) | (gt == DType::bf16 ? kGradBf16 : 0) |
                    (op.strAttr("mode", "sum") == "mean" ? kMean : 0) |
                    (weights && weights->type().dtype() == DType::bf16 ? kWeightsBf16 : 0);
    std::vector<AddressWord> row(kTableWords);
    row[kIdsAddress] = {gl.groupBuffer(ids, false), 0};
    if (weights) row[kWeightsAddress] = {gl.groupBuffer(weights, false), 0};
    if (a.bag.lengths) row[kOffsetsAddress] = {gl.offsetsOf(a.bag.lengths), 0};
    row[kGradAddress] = {gl.groupBuffer(grad, false), 0};
    row[kFlags].value = flags;
    row[kHotness].value = a.bag.hotness;
    row[kRows].value = a.rows;
    row[kDim].value = a.dim;
    row[kGradStride].value = a.source ? a.source->stride : a.dim;
    row[kGradOffset].value = a.source ? a.source->offset : 0;
    row[kBegin].value = shape.slots;
    row[kOccurrences].value = occurrences;
    row[kAccumAt].value = a.accum_at;
    row[kKeysAt].value = a.keys_at;
    if (l.table >= 0) {
      // The fused update writes the table and its state in place, and reads its scalars.
      auto operand = [&](int j) { return op.operand(static_cast<unsigned>(j)); };
      row[kTableAddress] = {gl.groupBuffer(operand(l.table), true), 0};
      if (l.num_state > 0) row[kState0Address] = {gl.groupBuffer(operand(l.state_begin), true), 0};
      if (l.num_state > 1) row[kState1Address] = {gl.groupBuffer(operand(l.state_begin + 1), true), 0};
      row[kLrAddress] = {gl.groupBuffer(operand(l.lr), false), 0};
      row[kStepAddress] = {gl.groupBuffer(operand(l.step), false), 0};
      int64_t types = scalarCode(operand(l.lr)->type().dtype()) | scalarCode(operand(l.step)->type().dtype()) << 4;
      if (l.grad_scale >= 0) {
        row[kScaleAddress] = {gl.groupBuffer(operand(l.grad_scale), false), 0};
        types |= scalarCode(operand(l.grad_scale)->type().dtype()) << 8;
      }
      row[kScalarTypes].value = types;
    }
    words.insert(words.end(), row.begin(), row.end());
    shape.slots += occurrences;
    shape.max_segments += a.bound;
    shape.max_dim = std::max(shape.max_dim, a.dim);
    shape.id_bits = std::max(shape.id_bits, a.rows > 0 ? bitsFor(static_cast<uint64_t>(a.rows - 1))
                                                       : (it == DType::i64 ? 63 : 31));
    distinct_ids += a.bound;
    accum += a.bound * a.dim;
  }
  shape.table_bits = bitsFor(static_cast<uint64_t>(shape.tables));
  if (shape.id_bits + shape.table_bits > 64 || shape.slots >= (int64_t{1} << 31))
    return Status::errorf("{}: {} tables of {}-bit ids and {} id occurrences do not fit the sorted backward's keys",
                          opLabel(*tables.front().op), shape.tables, shape.id_bits, shape.slots);
  std::vector<AddressWord> last(kTableWords);
  last[kBegin].value = shape.slots;
  words.insert(words.end(), last.begin(), last.end());

  // The keys kernel checks the ids: each table's error subject names it.
  for (size_t i = 0; i < tables.size(); ++i) {
    const ir::EmbeddingUpdateLayout& l = tables[i].layout;
    words[i * kTableWords + kFlagIndex].value = gl.errorSubject(
        valueName(tables[i].op->operand(static_cast<unsigned>(l.table >= 0 ? l.table : l.ids))), tables[i].rows);
  }
  out.table = gl.addressTable("embedding_backward.tables", std::move(words));
  const int keys[2] = {gl.tempBuffer("sort_keys.0", DType::i64, shape.slots),
                       gl.tempBuffer("sort_keys.1", DType::i64, shape.slots)};
  const int positions[2] = {gl.tempBuffer("sort_positions.0", DType::i32, shape.slots),
                            gl.tempBuffer("sort_positions.1", DType::i32, shape.slots)};
  const int hist = gl.tempBuffer("sort_histogram", DType::i32, histogramElements(shape));
  out.counts = gl.tempBuffer("distinct_counts", DType::i64, shape.tables);
  out.starts = gl.tempBuffer("segment_starts", DType::i32, shape.max_segments + 1);
  out.meta = gl.tempBuffer("segment_meta", DType::i64, shape.tables + 2);

  KILN_RETURN_IF_ERROR(
      addSortKernel(gl, sortKeysKernel(shape), {out.table, keys[0], positions[0], hist, out.counts, gl.errorFlag()}));
  const int passes = sortPasses(shape);
  for (int pass = 0; pass < passes; ++pass) {
    const int from = pass % 2, to = 1 - from;
    if (pass > 0) KILN_RETURN_IF_ERROR(addSortKernel(gl, sortHistogramKernel(shape, pass), {keys[from], hist}));
    KILN_RETURN_IF_ERROR(addSortKernel(gl, sortScanKernel(shape, 256 * sortTiles(shape)), {hist}));
    KILN_RETURN_IF_ERROR(addSortKernel(gl, sortScatterKernel(shape, pass),
                                       {keys[from], positions[from], hist, keys[to], positions[to]}));
  }
  out.keys = keys[passes % 2];
  out.positions = positions[passes % 2];
  KILN_RETURN_IF_ERROR(addSortKernel(gl, segmentCountKernel(shape), {out.keys, hist}));
  KILN_RETURN_IF_ERROR(addSortKernel(gl, sortScanKernel(shape, sortTiles(shape)), {hist}));
  KILN_RETURN_IF_ERROR(addSortKernel(gl, segmentsKernel(shape), {out.keys, hist, out.starts, out.meta}));
  out.partials = gl.tempBuffer("piece_partials", DType::f32, partialElements(shape));
  // With fewer slots than a piece no segment can be cut.
  if (shape.slots > kPiece)
    KILN_RETURN_IF_ERROR(
        addSortKernel(gl, segmentPartialsKernel(shape), {out.table, out.keys, out.positions, out.partials}));
  return out;
}

// One warp per segment summing its gradient rows into the tables' accumulated rows, which the
// squared-norm probe reads.
Expected<SortedRows> accumulateRows(GroupLowering& gl, const std::vector<Accumulated>& tables, const Sorted& sorted) {
  int64_t distinct_ids = 0, accum = 0;
  for (const Accumulated& a : tables) {
    distinct_ids += a.bound;
    accum += a.bound * a.dim;
  }
  SortedRows out;
  out.counts = sorted.counts;
  out.distinct_ids = gl.tempBuffer("distinct_ids", DType::i64, std::max<int64_t>(1, distinct_ids));
  out.accum = gl.tempBuffer("row_grads", DType::f32, std::max<int64_t>(1, accum));
  KILN_RETURN_IF_ERROR(addSortKernel(
      gl, segmentAccumulateKernel(sorted.shape, std::max<int64_t>(1, distinct_ids), std::max<int64_t>(1, accum)),
      {sorted.table, sorted.keys, sorted.positions, sorted.starts, sorted.meta, sorted.partials, out.distinct_ids,
       out.accum, out.counts}));
  return out;
}

// The optimizer on every distinct (table, id) row: one fused launch per run of consecutive
// tables sharing a RowStep (orderBySteps puts them next to each other).
Status updateAll(GroupLowering& gl, const std::vector<Accumulated>& tables, const Sorted& sorted) {
  for (size_t t0 = 0; t0 < tables.size();) {
    const std::optional<RowStep> step = rowStepOf(tables[t0]);
    if (!step) return Status::errorf("{} is not an embedding_bag_update", opLabel(*tables[t0].op));
    size_t t1 = t0;
    int64_t segments = 0;
    for (; t1 < tables.size() && rowStepOf(tables[t1]) == step; ++t1) segments += tables[t1].bound;
    KILN_RETURN_IF_ERROR(addSortKernel(
        gl, segmentUpdateKernel(sorted.shape, *step, static_cast<int64_t>(t0), static_cast<int64_t>(t1), segments),
        {sorted.table, sorted.keys, sorted.positions, sorted.starts, sorted.meta, sorted.partials}));
    t0 = t1;
  }
  return Status::ok();
}

// Tables of one RowStep next to each other, in their first table's order (stable otherwise),
// so each step is one launch over a contiguous range of tables.
void orderBySteps(std::vector<Accumulated>& tables) {
  std::vector<std::optional<RowStep>> seen;
  auto rank = [&](const Accumulated& a) {
    const std::optional<RowStep> s = rowStepOf(a);
    auto it = std::find(seen.begin(), seen.end(), s);
    if (it == seen.end()) it = seen.insert(seen.end(), s);
    return it - seen.begin();
  };
  for (const Accumulated& a : tables) rank(a);
  std::stable_sort(tables.begin(), tables.end(),
                   [&](const Accumulated& x, const Accumulated& y) { return rank(x) < rank(y); });
}

// Whether an accumulated table has an o-th distinct id (o < counts[t]).
int hasDistinct(GroupLowering& gl, KernelBuilder& kb, const Accumulated& a, const SortedRows& rows, int o) {
  ExprGraph& g = kb.g();
  return g.binary(ExprOp::Lt, o, g.load(gl.bind(kb, rows.counts, false), DType::i64, g.intConstant(a.index)));
}
// The summed gradient of the o-th distinct id's element d.
int accumulated(GroupLowering& gl, KernelBuilder& kb, const Accumulated& a, const SortedRows& rows, int o, int d) {
  ExprGraph& g = kb.g();
  int at = g.binary(ExprOp::Add, g.intConstant(a.accum_at), rowMajorOffset(g, {o, d}, {a.bound, a.dim}));
  return g.load(gl.bind(kb, rows.accum, false), DType::f32, at);
}

// An embedding_bag_update's table (sortAll follows).
Expected<Accumulated> prepareUpdate(GroupLowering& gl, const Op& op, const GradSource* source = nullptr) {
  auto l = ir::embeddingUpdateLayout(op);
  if (!l) return Status::errorf("{} has an unknown optimizer", opLabel(op));
  KILN_ASSIGN_OR_RETURN(auto ts, gl.shapeOf(op.operand(static_cast<unsigned>(l->table))));
  return prepareAccumulate(gl, op, *l, (ts)[0], source);
}

Status lowerEmbeddingUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  KILN_ASSIGN_OR_RETURN(auto a, prepareUpdate(gl, *ops.back()));
  std::vector<Accumulated> tables = {a};
  KILN_ASSIGN_OR_RETURN(auto sorted, sortAll(gl, tables));
  return updateAll(gl, tables, sorted);
}

Status lowerGradSqnorm(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  auto l = ir::embeddingUpdateLayout(op);
  KILN_ASSIGN_OR_RETURN(auto a, prepareAccumulate(gl, op, *l, -1, nullptr));
  std::vector<Accumulated> tables = {a};
  KILN_ASSIGN_OR_RETURN(auto sorted, sortAll(gl, tables));
  KILN_ASSIGN_OR_RETURN(auto rows, accumulateRows(gl, tables, sorted));
  KernelBuilder kb = KernelBuilder::row("embedding_grad_sqnorm", {1}, {a.bound, a.dim});
  ExprGraph& g = kb.g();
  // The rows of the distinct ids; the rest of the table is never written.
  int present = hasDistinct(gl, kb, tables.front(), rows, g.coord(1));
  int v = accumulated(gl, kb, tables.front(), rows, g.coord(1), g.coord(2));
  int sq = g.select(present, g.binary(ExprOp::Mul, v, v), g.constant(0, DType::f32));
  kb.k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, sq, {}});
  kb.k.stores.push_back({gl.bindValue(kb, op.result(), true), g.intConstant(0),
                         g.cast(g.rowValue(0, DType::f32), op.result()->type().dtype()), -1});
  return gl.finish(kb);
}

// Slices of one concatenated gradient and the sparse updates they feed: each update reads its
// columns of the concatenated gradient directly (no slice is materialized).
Status lowerEmbeddingUpdates(GroupLowering& gl, const std::vector<const Op*>& ops) {
  std::vector<Accumulated> tables;
  for (const Op* op : ops) {
    if (op->is(ir::OpCode::Slice)) continue;
    if (!op->is(ir::OpCode::EmbeddingBagUpdate))
      return Status::errorf("{} in an embedding_update group is not a slice or embedding_bag_update",
                            opLabel(*op));
    auto l = ir::embeddingUpdateLayout(*op);
    if (!l) return Status::errorf("{} has an unknown optimizer", opLabel(*op));
    const Value* grad = op->operand(static_cast<unsigned>(l->grad_out));
    const Op* slice = grad->definingOp();
    if (!slice || !gl.inGroup(slice) || !slice->is(ir::OpCode::Slice))
      return Status::errorf("{}: its gradient is not a slice of the group", opLabel(*op));
    const Value* src = slice->operand(0);
    KILN_ASSIGN_OR_RETURN(auto ss, gl.shapeOf(src));
    int64_t axis = slice->intAttr("axis");
    if (axis < 0) axis += static_cast<int64_t>(ss.size());
    if (ss.size() != 2 || axis != 1)
      return Status::errorf(
          "{}: the update reads columns of a [batch, width] gradient; this slices axis {} of {}",
          opLabel(*slice), axis, src->type().str());
    for (const ir::Use& u : slice->result()->uses())
      if (u.user != op) return Status::errorf("{}: the gradient slice has other users", opLabel(*slice));
    GradSource source{src, (ss)[1], slice->intAttr("start")};
    KILN_ASSIGN_OR_RETURN(auto a, prepareUpdate(gl, *op, &source));
    tables.push_back(a);
  }
  orderBySteps(tables);
  KILN_ASSIGN_OR_RETURN(auto sorted, sortAll(gl, tables));
  return updateAll(gl, tables, sorted);
}

}  // namespace

void registerEmbeddingUpdateEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::EmbeddingBagUpdate, {"embedding_update", lowerEmbeddingUpdate});
  r.addOpEmitter(ir::OpCode::EmbeddingBagGradSqnorm, {"embedding_update", lowerGradSqnorm});
  r.addFusedEmitter("embedding_update", lowerEmbeddingUpdates);
}

}  // namespace kiln::codegen::emit
