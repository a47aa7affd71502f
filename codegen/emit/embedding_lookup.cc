// The embedding lookup emitter: every embedding_bag of a group as ONE EmbeddingForward kernel
// (after ONE BagOffsets scan for jagged bags; a few of each past GroupLowering::kMaxKernelParams,
// some 100 tables a launch), the fused `embedding` group (bags and their concat: the kernel
// writes each bag's rows at its columns of the concatenated output), and the gradient of the
// per-id weights (a Row kernel reading the table's rows at the ids).
#include "codegen/emit/emitter_registry.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// The lookup kernels of a group under construction: a table goes into the current one, which
// is finished and a new one begun when its parameters would pass kMaxKernelParams.
class LookupKernels {
 public:
  LookupKernels(GroupLowering& gl, std::string name, int64_t batch) : gl_(gl), name_(std::move(name)), batch_(batch) {
    begin();
  }
  // The kernel the next table goes into.
  Expected<KernelBuilder*> next() {
    // A table binds its weight, ids, per-id weights, offsets and output; the flag comes last.
    if (!kb_.k.tables.empty() && kb_.k.buffers.size() + 6 > GroupLowering::kMaxKernelParams)
      KILN_RETURN_IF_ERROR(flush());
    return &kb_;
  }
  Status finish() { return flush(); }
  bool empty() const { return kb_.k.tables.empty() && launches_ == 0; }

 private:
  void begin() {
    kb_ = KernelBuilder::ofKind(name_, KernelKind::EmbeddingForward);
    kb_.k.batch = batch_;
  }
  Status flush() {
    if (kb_.k.tables.empty()) return Status::ok();
    kb_.k.error_flag = gl_.bind(kb_, gl_.errorFlag(), true);
    Status s = gl_.finish(kb_);
    ++launches_;
    begin();
    return s;
  }

  GroupLowering& gl_;
  std::string name_;
  int64_t batch_;
  KernelBuilder kb_;
  int launches_ = 0;
};

// One bag's table in a lookup kernel, writing `out` at columns [offset, offset + dim) of rows of
// `stride` elements.
Status addLookupTable(GroupLowering& gl, KernelBuilder& kb, const Op& bag, const BagIds& ids, int out,
                      int64_t stride, int64_t offset) {
  const Value* table = bag.operand(0);
  KILN_ASSIGN_OR_RETURN(auto ts, gl.shapeOf(table));
  EmbeddingTable t;
  t.weight = gl.bindValue(kb, table, false);
  gl.bindIds(kb, t, ids);
  if (const Value* w = GroupLowering::bagWeights(bag)) t.weights = gl.bindValue(kb, w, false);
  t.rows = (ts)[0];
  t.dim = (ts)[1];
  t.mean = bag.strAttr("mode", "sum") == "mean";
  t.out = out < 0 ? gl.bindValue(kb, bag.result(), true) : gl.bind(kb, out, true);
  t.out_stride = stride < 0 ? t.dim : stride;
  t.out_offset = offset;
  t.flag_index = gl.errorSubject(valueName(table), t.rows);
  kb.k.tables.push_back(t);
  return Status::ok();
}

Status lowerEmbeddingForward(GroupLowering& gl, const std::vector<const Op*>& ops) {
  std::vector<BagIds> bags;
  for (const Op* op : ops) {
    KILN_ASSIGN_OR_RETURN(auto b, gl.bagIdsOf(*op));
    if (!bags.empty() && b.batch != bags.front().batch)
      return Status::errorf("{}: the bags of one kernel must share the batch", opLabel(*op));
    bags.push_back(b);
  }
  KILN_RETURN_IF_ERROR(gl.scanLengths(bags));
  LookupKernels kernels(gl, "embedding_bags", bags.empty() ? 0 : bags.front().batch);
  for (size_t i = 0; i < ops.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(KernelBuilder * kb, kernels.next());
    KILN_RETURN_IF_ERROR(addLookupTable(gl, *kb, *ops[i], bags[i], -1, -1, 0));
  }
  return kernels.finish();
}

// Bags of a collection and their concat: ONE lookup kernel writing each bag's pooled rows at
// its columns of the concatenated output; other concat operands (the dense features) are
// copied into their columns by a Pointwise kernel each.
Status lowerEmbeddingConcat(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& cat = *ops.back();
  if (!cat.is(ir::OpCode::Concat))
    return Status::errorf("an embedding group ends in {}, not kiln.concat", opLabel(cat));
  KILN_ASSIGN_OR_RETURN(auto cs, gl.shapeOf(cat.result()));
  int64_t axis = cat.intAttr("axis");
  if (axis < 0) axis += static_cast<int64_t>(cs.size());
  if (cs.size() != 2 || axis != 1)
    return Status::errorf("{}: the lookup kernel writes a [batch, width] concatenation along axis 1",
                          opLabel(cat));
  for (size_t i = 0; i + 1 < ops.size(); ++i)
    if (!ops[i]->is(ir::OpCode::EmbeddingBag))
      return Status::errorf("{} in an embedding group is not an embedding_bag", opLabel(*ops[i]));
  const int64_t width = (cs)[1];
  std::vector<BagIds> bags;
  for (size_t i = 0; i + 1 < ops.size(); ++i) {
    KILN_ASSIGN_OR_RETURN(auto b, gl.bagIdsOf(*ops[i]));
    if (b.batch != (cs)[0])
      return Status::errorf("{}: the bags of one kernel must share the batch", opLabel(*ops[i]));
    bags.push_back(b);
  }
  KILN_RETURN_IF_ERROR(gl.scanLengths(bags));
  int out = gl.groupBuffer(cat.result(), true);
  LookupKernels kernels(gl, "embedding_bags_concat", (cs)[0]);
  std::vector<std::pair<const Value*, int64_t>> copies;
  int64_t at = 0;
  for (const Value* x : cat.operands()) {
    KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
    const Op* bag = x->definingOp();
    if (bag && gl.inGroup(bag)) {
      KILN_ASSIGN_OR_RETURN(auto ids, gl.bagIdsOf(*bag));
      KILN_ASSIGN_OR_RETURN(KernelBuilder * kb, kernels.next());
      KILN_RETURN_IF_ERROR(addLookupTable(gl, *kb, *bag, ids, out, width, at));
    } else {
      copies.push_back({x, at});
    }
    at += (xs)[1];
  }
  if (kernels.empty()) return Status::errorf("{}: the embedding group has no bag", opLabel(cat));
  KILN_RETURN_IF_ERROR(kernels.finish());
  for (const auto& [x, offset] : copies) {
    auto xs = gl.shapeOf(x);
    KernelBuilder cb = KernelBuilder::pointwise("concat_columns", *xs);
    ExprGraph& g = cb.g();
    int b = g.coord(0), c = g.coord(1);
    KILN_ASSIGN_OR_RETURN(auto v, gl.valueAt(cb, x, {b, c}));
    int dst = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, b, g.intConstant(width)),
                       g.binary(ExprOp::Add, c, g.intConstant(offset)));
    cb.k.stores.push_back({gl.bind(cb, out, true), dst, g.cast(v, cat.result()->type().dtype()), -1});
    KILN_RETURN_IF_ERROR(gl.finish(cb));
  }
  return Status::ok();
}

// dw[p] = <table[ids[p]], g[b]> for id position p of bag b (/ the bag's size for a mean): one
// row reduction per id position. Fixed hotness: p = (b, h). Jagged: p runs over the ids
// buffer, b = the bag owning p (a BagOf search over the scanned offsets); positions past the
// batch's last id (a bounded buffer's padding) get 0. An out-of-range id contributes 0 and
// sets the group's error flag, as the CPU reference rejects it.
Status lowerEmbeddingWeightGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* table = op.operand(0);
  const Value* ids = op.operand(1);
  const bool jagged = ids->type().rank() == 1;
  KILN_ASSIGN_OR_RETURN(auto bag, gl.bagIds(op, ids, jagged ? op.operand(2) : nullptr));
  if (jagged && bag.batch < 1) return Status::errorf("{}: jagged ids need at least one bag", opLabel(op));
  const Value* gval = op.operand(op.numOperands() - 1);
  auto ts = gl.shapeOf(table);
  auto is = gl.shapeOf(ids);
  if (!ts || !is) return !ts ? ts.status() : is.status();
  const int64_t rows = (*ts)[0], dim = (*ts)[1];
  if (jagged) KILN_RETURN_IF_ERROR(gl.scanLengths({bag}));
  KernelBuilder kb =
      KernelBuilder::row(jagged ? "embedding_weight_grad_jagged" : "embedding_weight_grad", *is, {dim});
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  const int d = g.coord(static_cast<int>(is->size()));
  int b, live = -1, size = -1;  // size: a jagged bag's id count
  Expected<int> id = 0;
  if (jagged) {
    const int p = g.coord(0);
    const int offsets = gl.bind(kb, gl.offsetsOf(bag.lengths), false);
    auto offset = [&](int i) { return g.load(offsets, DType::i64, i); };
    live = g.binary(ExprOp::Lt, p, offset(g.intConstant(bag.batch)));
    b = g.bagOf(offsets, bag.batch, p);
    size = g.binary(ExprOp::Sub, offset(g.binary(ExprOp::Add, b, g.intConstant(1))), offset(b));
    id = gl.valueAt(kb, ids, {p});
  } else {
    b = g.coord(0);
    id = gl.valueAt(kb, ids, {b, g.coord(1)});
  }
  if (!id) return id.status();
  const int id64 = g.cast(*id, DType::i64);
  int ok = g.binary(ExprOp::And, g.binary(ExprOp::Ge, id64, g.intConstant(0)),
                    g.binary(ExprOp::Lt, id64, g.intConstant(rows)));
  int bad = g.unary(ExprOp::Not, ok);
  if (live >= 0) {
    ok = g.binary(ExprOp::And, live, ok);
    bad = g.binary(ExprOp::And, live, bad);  // padding is never checked
  }
  auto w = gl.valueAt(kb, table, {id64, d});
  auto gv = gl.valueAt(kb, gval, {b, d});
  if (!w || !gv) return !w ? w.status() : gv.status();
  const DType ct = g.typeOf(*w);
  k.phases.push_back({Phase::Kind::Reduce,
                      Combiner::Sum,
                      g.select(ok, g.binary(ExprOp::Mul, *w, g.cast(*gv, ct)), g.constant(0, ct)),
                      {}});
  int acc = g.rowValue(0, ct);
  if (op.strAttr("mode", "sum") == "mean") {
    // A live position's bag holds at least that id, so size > 0.
    acc = jagged ? g.binary(ExprOp::Div, acc, g.cast(size, ct))
                 : g.binary(ExprOp::Mul, acc, g.constant(1.0 / static_cast<double>(bag.hotness), ct));
  }
  if (live >= 0) acc = g.select(live, acc, g.constant(0, ct));
  const DType rt = op.result()->type().dtype();
  k.stores.push_back(
      {gl.bindValue(kb, op.result(), true), rowMajorOffset(g, kb.spaceCoords(), *is), g.cast(acc, rt), -1});
  // {1, table} for a bad id, unless an earlier error holds the flag.
  k.error_flag = gl.bind(kb, gl.errorFlag(), true);
  const int table_index = gl.errorSubject(valueName(table), rows);
  const int clear =
      g.binary(ExprOp::Eq, g.load(k.error_flag, DType::i32, g.intConstant(0)), g.intConstant(0, DType::i32));
  const int report = g.binary(ExprOp::And, bad, clear);
  k.stores.push_back({k.error_flag, g.intConstant(1), g.intConstant(table_index, DType::i32), report});
  k.stores.push_back({k.error_flag, g.intConstant(0), g.intConstant(1, DType::i32), report});
  return gl.finish(kb);
}

// kiln.jagged_to_padded: the BagOffsets scan, then one Pointwise kernel over [B, L]: out[b, j] =
// ids[offsets[b] + j] while j < lengths[b], else 0 (a bag longer than L keeps its first L ids,
// as the CPU reference does).
Status lowerJaggedToPadded(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* ids = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto bag, gl.bagIds(op, ids, op.operand(1)));
  KILN_ASSIGN_OR_RETURN(auto rs, gl.shapeOf(op.result()));
  KILN_RETURN_IF_ERROR(gl.scanLengths({bag}));
  KernelBuilder kb = KernelBuilder::pointwise("jagged_to_padded", rs);
  ExprGraph& g = kb.g();
  const int b = g.coord(0), j = g.coord(1);
  const int offsets = gl.bind(kb, gl.offsetsOf(bag.lengths), false);
  const int begin = g.load(offsets, DType::i64, b);
  const int end = g.load(offsets, DType::i64, g.binary(ExprOp::Add, b, g.intConstant(1)));
  const int pos = g.binary(ExprOp::Add, begin, g.cast(j, DType::i64));
  const int live = g.binary(ExprOp::Lt, pos, end);
  KILN_ASSIGN_OR_RETURN(auto id, gl.valueAt(kb, ids, {g.select(live, pos, g.intConstant(0))}));
  const DType rt = op.result()->type().dtype();
  const int v = g.select(live, g.cast(id, rt), g.intConstant(0, rt));
  kb.k.stores.push_back(
      {gl.bindValue(kb, op.result(), true), rowMajorOffset(g, kb.spaceCoords(), rs), v, -1});
  return gl.finish(kb);
}

}  // namespace

void registerEmbeddingLookupEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::EmbeddingBag,
                 {"embedding_lookup", lowerEmbeddingForward, GroupForm::kManyOfTheOp});
  r.addOpEmitter(ir::OpCode::EmbeddingBagWeightGrad, {"embedding_lookup", lowerEmbeddingWeightGrad});
  r.addFusedEmitter("embedding", lowerEmbeddingConcat);
  r.addOpEmitter(ir::OpCode::JaggedToPadded, {"embedding_lookup", lowerJaggedToPadded});
}

}  // namespace kiln::codegen::emit
