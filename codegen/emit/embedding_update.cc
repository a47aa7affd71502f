// The embedding update emitter: sparse optimizer steps on the rows a batch touched
// (kiln.embedding_bag_update, one table or a fused `embedding_update` group of them) and the
// squared norm of a sparse gradient (kiln.embedding_bag_grad_sqnorm).
//
// Clear, insert, accumulate: duplicate ids of the batch are combined into a hash table of summed
// gradients, one table per update. The clear resets only the keys and the distinct count; the
// insert zeroes the rows it claims, so the gradient rows (capacity x dim floats, gigabytes at
// R1's scale) are never swept. ONE insert and ONE accumulate kernel serve every table of a
// group, as ONE lookup kernel serves every bag. Then one Row kernel per table applies the
// optimizer to the rows of its distinct ids.
#include <algorithm>
#include <optional>

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
  int keys = -1, accum = -1, distinct = -1;
  int64_t capacity = 0, dim = 0;
  int64_t bound = 0;  // distinct ids at most: min(occurrences, rows)
  // What the insert and accumulate kernels read.
  const Op* op = nullptr;
  ir::EmbeddingUpdateLayout layout;
  BagIds bag;
  int64_t rows = 0;  // -1: unchecked (a squared-norm probe has no table)
  std::optional<GradSource> source;
};

// One table's buffers and its clear kernel. The jagged lengths are scanned by accumulateAll.
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
  a.capacity = std::max<int64_t>(32, nextPow2(2 * a.bound));
  std::string stem = op.hasAttr("table") ? op.strAttr("table") : valueName(grad);
  a.keys = gl.tempBuffer(stem + ".unique_ids", DType::i64, a.capacity);
  a.accum = gl.tempBuffer(stem + ".row_grads", DType::f32, a.capacity * a.dim);
  a.distinct = gl.tempBuffer(stem + ".distinct_slots", DType::i64, 1 + a.capacity);
  KernelBuilder kb = KernelBuilder::pointwise("embedding_grad_clear", {a.capacity});
  ExprGraph& g = kb.g();
  int slot = g.coord(0);
  kb.k.stores.push_back({gl.bind(kb, a.keys, true), slot, g.intConstant(-1), -1});
  kb.k.stores.push_back({gl.bind(kb, a.distinct, true), g.intConstant(0), g.intConstant(0),
                         g.binary(ExprOp::Eq, slot, g.intConstant(0))});
  KILN_RETURN_IF_ERROR(gl.finish(kb));
  return a;
}

// The jagged scan, then ONE insert and ONE accumulate kernel over every table of `tables`.
Status accumulateAll(GroupLowering& gl, const std::vector<Accumulated>& tables) {
  std::vector<BagIds> bags;
  for (const Accumulated& a : tables) {
    if (a.bag.batch != tables.front().bag.batch)
      return Status::errorf("{}: the updates of one kernel must share the batch", opLabel(*a.op));
    bags.push_back(a.bag);
  }
  KILN_RETURN_IF_ERROR(gl.scanLengths(bags));
  // The insert checks the ids; the accumulate after it reports an id it cannot find there.
  std::vector<int> flag_index;
  for (const Accumulated& a : tables) {
    const ir::EmbeddingUpdateLayout& l = a.layout;
    flag_index.push_back(gl.errorSubject(
        valueName(a.op->operand(static_cast<unsigned>(l.table >= 0 ? l.table : l.ids))), a.rows));
  }
  for (KernelKind kind : {KernelKind::EmbeddingInsert, KernelKind::EmbeddingAccumulate}) {
    const bool insert = kind == KernelKind::EmbeddingInsert;
    KernelBuilder kb =
        KernelBuilder::ofKind(insert ? "embedding_grad_insert" : "embedding_grad_combine", kind);
    kb.k.batch = tables.front().bag.batch;
    for (size_t i = 0; i < tables.size(); ++i) {
      const Accumulated& a = tables[i];
      const Op& op = *a.op;
      EmbeddingTable t;
      gl.bindIds(kb, t, a.bag);
      t.rows = a.rows;
      t.dim = a.dim;
      t.keys = gl.bind(kb, a.keys, true);
      t.accum = gl.bind(kb, a.accum, true);
      t.capacity = a.capacity;
      t.flag_index = flag_index[i];
      if (insert) {
        t.distinct = gl.bind(kb, a.distinct, true);
      } else {
        if (a.layout.weights >= 0)
          t.weights = gl.bindValue(kb, op.operand(static_cast<unsigned>(a.layout.weights)), false);
        t.mean = op.strAttr("mode", "sum") == "mean";
        const Value* grad = op.operand(static_cast<unsigned>(a.layout.grad_out));
        t.out = gl.bindValue(kb, a.source ? a.source->value : grad, false);
        t.out_stride = a.source ? a.source->stride : a.dim;
        t.out_offset = a.source ? a.source->offset : 0;
      }
      kb.k.tables.push_back(t);
    }
    kb.k.error_flag = gl.bind(kb, gl.errorFlag(), true);
    KILN_RETURN_IF_ERROR(gl.finish(kb));
  }
  return Status::ok();
}

// The slot of the o-th distinct id of an accumulated table, and whether there is one:
// (o < distinct[0], distinct[1 + o]).
std::pair<int, int> distinctSlot(GroupLowering& gl, KernelBuilder& kb, const Accumulated& a, int o) {
  ExprGraph& g = kb.g();
  int list = gl.bind(kb, a.distinct, false);
  int present = g.binary(ExprOp::Lt, o, g.load(list, DType::i64, g.intConstant(0)));
  int slot = g.load(list, DType::i64, g.binary(ExprOp::Add, o, g.intConstant(1)));
  return {present, slot};
}

// An embedding_bag_update's table: its buffers and clear kernel (accumulateAll follows).
Expected<Accumulated> prepareUpdate(GroupLowering& gl, const Op& op, const GradSource* source = nullptr) {
  auto l = ir::embeddingUpdateLayout(op);
  if (!l) return Status::errorf("{} has an unknown optimizer", opLabel(op));
  KILN_ASSIGN_OR_RETURN(auto ts, gl.shapeOf(op.operand(static_cast<unsigned>(l->table))));
  return prepareAccumulate(gl, op, *l, (ts)[0], source);
}

// The sparse optimizer applied to the rows of an accumulated table's distinct ids.
Status updateRows(GroupLowering& gl, const Accumulated& a) {
  const Op& op = *a.op;
  const ir::EmbeddingUpdateLayout& l = a.layout;
  const Value* table = op.operand(static_cast<unsigned>(l.table));
  std::string kind = op.strAttr("optimizer");
  // One row per distinct id, walking the insert's list (not the whole hash table).
  KernelBuilder kb = KernelBuilder::row("embedding_update_" + kind, {a.bound}, {a.dim});
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  DType ct = computeType(table->type().dtype());
  Hyper h = hyper(gl, kb, op, l.lr, l.step, l.grad_scale, ct);
  int d = g.coord(1);
  auto [present, slot] = distinctSlot(gl, kb, a, g.coord(0));
  k.guard = present;
  int key = g.load(gl.bind(kb, a.keys, false), DType::i64, slot);
  int elem = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, key, g.intConstant(a.dim)), d);
  int tw = gl.bindValue(kb, table, true);
  int w = g.load(tw, table->type().dtype(), elem);
  int grad = g.cast(
      g.load(gl.bind(kb, a.accum, false), DType::f32, rowMajorOffset(g, {slot, d}, {a.capacity, a.dim})), ct);
  auto state = [&](int j) { return op.operand(static_cast<unsigned>(l.state_begin + j)); };
  Phase map;
  if (kind == "rowwise_adagrad") {
    auto c = [&](double v) { return g.constant(v, ct); };
    int gr = h.scale >= 0 ? g.binary(ExprOp::Mul, grad, h.scale) : grad;
    if (h.weight_decay != 0) gr = g.binary(ExprOp::Add, gr, g.binary(ExprOp::Mul, c(h.weight_decay), w));
    k.phases.push_back({Phase::Kind::Reduce, Combiner::Sum, g.binary(ExprOp::Mul, gr, gr), {}});
    int sb = gl.bindValue(kb, state(0), true);
    int s = g.binary(ExprOp::Add, g.load(sb, state(0)->type().dtype(), key),
                     g.binary(ExprOp::Mul, g.rowValue(0, ct), c(1.0 / static_cast<double>(a.dim))));
    int step = g.binary(ExprOp::Div, h.lr, g.binary(ExprOp::Add, g.unary(ExprOp::Sqrt, s), c(h.eps)));
    map.stores.push_back(
        {tw, elem, g.cast(g.binary(ExprOp::Sub, w, g.binary(ExprOp::Mul, step, gr)), table->type().dtype()),
         -1});
    k.phases.push_back(map);
    // After every thread has read the old accumulator (phases end with a barrier).
    k.stores.push_back({sb, key, g.cast(s, state(0)->type().dtype()), -1});
  } else {
    auto st = [&](int j) { return g.load(gl.bindValue(kb, state(j), true), state(j)->type().dtype(), elem); };
    auto store_st = [&](int j, int v) {
      map.stores.push_back({gl.bindValue(kb, state(j), true), elem, g.cast(v, state(j)->type().dtype()), -1});
    };
    int nw = elementUpdate(g, kind, h, w, grad, ct, st, store_st);
    map.stores.push_back({tw, elem, g.cast(nw, table->type().dtype()), -1});
    k.phases.push_back(map);
  }
  return gl.finish(kb);
}

Status lowerEmbeddingUpdate(GroupLowering& gl, const std::vector<const Op*>& ops) {
  KILN_ASSIGN_OR_RETURN(auto a, prepareUpdate(gl, *ops.back()));
  KILN_RETURN_IF_ERROR(accumulateAll(gl, {a}));
  return updateRows(gl, a);
}

Status lowerGradSqnorm(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  auto l = ir::embeddingUpdateLayout(op);
  KILN_ASSIGN_OR_RETURN(auto a, prepareAccumulate(gl, op, *l, -1, nullptr));
  KILN_RETURN_IF_ERROR(accumulateAll(gl, {a}));
  KernelBuilder kb = KernelBuilder::row("embedding_grad_sqnorm", {1}, {a.bound, a.dim});
  ExprGraph& g = kb.g();
  // The rows of the distinct ids; the rest of the table is never written.
  auto [present, slot] = distinctSlot(gl, kb, a, g.coord(1));
  int v = g.load(gl.bind(kb, a.accum, false), DType::f32,
                 rowMajorOffset(g, {slot, g.coord(2)}, {a.capacity, a.dim}));
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
  KILN_RETURN_IF_ERROR(accumulateAll(gl, tables));
  for (const Accumulated& a : tables) KILN_RETURN_IF_ERROR(updateRows(gl, a));
  return Status::ok();
}

}  // namespace

void registerEmbeddingUpdateEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::EmbeddingBagUpdate, {"embedding_update", lowerEmbeddingUpdate});
  r.addOpEmitter(ir::OpCode::EmbeddingBagGradSqnorm, {"embedding_update", lowerGradSqnorm});
  r.addFusedEmitter("embedding_update", lowerEmbeddingUpdates);
}

}  // namespace kiln::codegen::emit
