// The reduction emitter: folds of axes of a value (reduce, sum_to; both compute a pointwise
// producer chain of their group inline) and max's gradient.
//
// A fold takes one of three forms, chosen from the shapes (docs/cuda.md, "Reductions"):
//   - the folded dims lead and the kept ones trail ([B, N] -> [N], a whole tensor): ColumnReduce
//     kernels, threads on consecutive columns; long columns are cut into slabs whose partials a
//     second kernel folds in order;
//   - otherwise a Row kernel, a block per kept element folding its row;
//   - unless there are too few kept elements to fill the GPU and the rows are long: the rows are
//     cut into chunks, a Row kernel folding each chunk, a second one the chunks' partials.
// Every fold has a fixed order, so a step gives the same bits every run (no float atomics).
#include <algorithm>
#include <limits>
#include <set>

#include "codegen/emit/emitter_registry.h"
#include "codegen/emit/fold.h"

namespace kiln::codegen::emit {
namespace {

using ir::Op;
using ir::Value;

// A thread folds at least this many elements before a fold is cut into more blocks, and a fold
// is cut into at least kMinPieces or not at all: a second pass costs a launch, and a block of few
// elements is mostly its start and its tree.
constexpr int64_t kMinElementsPerThread = 32;
constexpr int64_t kMinPieces = 4;

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How many pieces to cut a fold of `rows` per output into, when `outputs` independent folds
// already occupy `outputs` blocks of `threads` threads each: enough for one full wave of
// 256-thread blocks on the group's GPU (waveBlocks, as launchConfig counts the first pass's
// waves), so the first pass's grid is that wave and the second pass reads that many partials.
int64_t piecesFor(const GroupLowering& gl, int64_t rows, int64_t outputs, int64_t threads) {
  const int64_t wanted = ceilDiv(waveBlocks(gl.sms(), 256), std::max<int64_t>(outputs, 1));
  const int64_t most = std::max<int64_t>(1, rows / (threads * kMinElementsPerThread));
  int64_t pieces = std::clamp<int64_t>(wanted, 1, most);
  if (pieces < kMinPieces) return 1;
  // No empty piece: as many as the rounded-up piece size needs.
  return ceilDiv(rows, ceilDiv(rows, pieces));
}

std::set<int64_t> axesOf(const Op& op, size_t rank) {
  std::set<int64_t> axes;
  for (int64_t a : op.intsAttr("axes")) axes.insert(a < 0 ? a + static_cast<int64_t>(rank) : a);
  return axes;
}

}  // namespace

std::vector<int64_t> Fold::keptDims(bool drop_ones) const {
  std::vector<int64_t> d;
  for (size_t i = 0; i < xs.size(); ++i)
    if (!folded[i] && !(drop_ones && xs[i] == 1)) d.push_back(xs[i]);
  return d;
}

std::vector<int64_t> Fold::foldedDims(bool drop_ones) const {
  std::vector<int64_t> d;
  for (size_t i = 0; i < xs.size(); ++i)
    if (folded[i] && !(drop_ones && xs[i] == 1)) d.push_back(xs[i]);
  return d;
}

bool Fold::foldsLeadingDims() const {
  bool seen_kept = false;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i] == 1) continue;
    if (!folded[i])
      seen_kept = true;
    else if (seen_kept)
      return false;
  }
  return true;
}

namespace {

// The coordinates of x's dims: kept dims numbered from `kept_first`, folded ones from
// `folded_first` (each in x's order); size-1 dims are 0 when `drop_ones`.
std::vector<int> foldCoords(ExprGraph& g, const Fold& f, int kept_first, int folded_first, bool drop_ones) {
  std::vector<int> coords(f.xs.size());
  for (size_t i = 0; i < f.xs.size(); ++i) {
    if (drop_ones && f.xs[i] == 1)
      coords[i] = g.intConstant(0);
    else
      coords[i] = f.folded[i] ? g.coord(folded_first++) : g.coord(kept_first++);
  }
  return coords;
}

// The value stored in `out` from the folded accumulator.
int finishFold(ExprGraph& g, const Fold& f, int acc) {
  DType ct = g.typeOf(acc);
  if (f.scale != 1) acc = g.binary(ExprOp::Mul, acc, g.constant(f.scale, ct));
  return g.cast(acc, f.out->type().dtype());
}

// Folded dims leading: ColumnReduce kernels over [rows, columns].
Status lowerColumnFold(GroupLowering& gl, const Fold& f) {
  const std::vector<int64_t> kept = f.keptDims(true);
  std::vector<int64_t> rows = f.foldedDims(true);
  if (rows.empty()) rows = {1};
  const int64_t row_count = product(rows), columns = product(kept);
  int64_t lanes = 1;
  while (lanes < 32 && lanes < columns) lanes *= 2;
  const int64_t strips = ceilDiv(columns, lanes);
  const int64_t slabs = piecesFor(gl, row_count, strips, ColumnTile::kThreads / lanes);

  auto columnKernel = [&](std::string name, int64_t kernel_slabs, std::vector<int64_t> row_space) {
    KernelBuilder kb = KernelBuilder::ofKind(std::move(name), KernelKind::ColumnReduce);
    kb.k.space = {kernel_slabs};
    kb.k.space.insert(kb.k.space.end(), kept.begin(), kept.end());
    kb.k.row_space = std::move(row_space);
    return kb;
  };
  // The kept coordinates of a column kernel: 1.. (0 is the slab).
  auto keptCoords = [&](ExprGraph& g) {
    std::vector<int> c;
    for (size_t i = 0; i < kept.size(); ++i) c.push_back(g.coord(static_cast<int>(1 + i)));
    return c;
  };

  KernelBuilder first = columnKernel(slabs > 1 ? f.name + "_slabs" : f.name, slabs, rows);
  ExprGraph& g = first.g();
  const int row_first = static_cast<int>(first.k.space.size());
  std::vector<int> coords = foldCoords(g, f, 1, row_first, true);
  KILN_ASSIGN_OR_RETURN(int v, f.element(first, coords));
  first.k.phases.push_back({Phase::Kind::Reduce, f.combiner, v, {}});
  const DType ct = g.typeOf(v);
  const int acc = g.rowValue(0, ct);
  if (slabs == 1) {
    first.k.stores.push_back({gl.bindValue(first, f.out, true), rowMajorOffset(g, keptCoords(g), kept),
                              finishFold(g, f, acc), -1});
    return gl.finish(first);
  }
  // The partials [slabs, columns], then a fold of the slabs in order.
  const int partials = gl.tempBuffer(valueName(f.out) + ".partials", ct, slabs * columns);
  first.k.stores.push_back(
      {gl.bind(first, partials, true), rowMajorOffset(g, first.spaceCoords(), first.k.space), acc, -1});
  KILN_RETURN_IF_ERROR(gl.finish(first));

  KernelBuilder second = columnKernel(f.name, 1, {slabs});
  ExprGraph& g2 = second.g();
  std::vector<int> at = {g2.coord(static_cast<int>(second.k.space.size()))};
  for (int c : keptCoords(g2)) at.push_back(c);
  std::vector<int64_t> partial_shape = {slabs};
  partial_shape.insert(partial_shape.end(), kept.begin(), kept.end());
  const int partial = g2.load(gl.bind(second, partials, false), ct, rowMajorOffset(g2, at, partial_shape));
  second.k.phases.push_back({Phase::Kind::Reduce, f.combiner, partial, {}});
  second.k.stores.push_back({gl.bindValue(second, f.out, true), rowMajorOffset(g2, keptCoords(g2), kept),
                             finishFold(g2, f, g2.rowValue(0, ct)), -1});
  return gl.finish(second);
}

// A Row kernel per kept element; with few kept elements and long rows, each row cut into
// `chunks` folded by a Row kernel of [kept, chunks] outer elements, then their partials.
Status lowerRowFold(GroupLowering& gl, const Fold& f) {
  const std::vector<int64_t> kept = f.keptDims(false), rows = f.foldedDims(false);
  const int64_t outputs = product(kept), row_count = product(rows);
  // A Row kernel of few outer elements runs 1024-thread blocks (launchConfig); the chunks' kernel
  // takes a wave of them, 256-thread blocks.
  const int64_t chunks = piecesFor(gl, row_count, outputs, 256);
  const std::vector<int64_t> row_space = rows.empty() ? std::vector<int64_t>{1} : rows;
  if (chunks == 1) {
    KernelBuilder kb = KernelBuilder::row(f.name, kept, row_space);
    ExprGraph& g = kb.g();
    std::vector<int> coords = foldCoords(g, f, 0, static_cast<int>(kb.k.space.size()), false);
    KILN_ASSIGN_OR_RETURN(int v, f.element(kb, coords));
    kb.k.phases.push_back({Phase::Kind::Reduce, f.combiner, v, {}});
    kb.k.stores.push_back({gl.bindValue(kb, f.out, true), rowMajorOffset(g, kb.spaceCoords(), kb.k.space),
                           finishFold(g, f, g.rowValue(0, g.typeOf(v))), -1});
    return gl.finish(kb);
  }
  const int64_t chunk = ceilDiv(row_count, chunks);
  std::vector<int64_t> outer = kept;
  outer.push_back(chunks);
  KernelBuilder first = KernelBuilder::row(f.name + "_chunks", outer, {chunk});
  ExprGraph& g = first.g();
  const int k_outer = static_cast<int>(kept.size());
  // Row position p * chunk + r of the whole row, split into the folded dims (last fastest).
  int at = g.binary(ExprOp::Add, g.binary(ExprOp::Mul, g.coord(k_outer), g.intConstant(chunk)),
                    g.coord(k_outer + 1));
  const int inside = g.binary(ExprOp::Lt, at, g.intConstant(row_count));
  std::vector<int> folded_coords(rows.size());
  int rest = at;
  for (size_t j = rows.size(); j-- > 0;) {
    folded_coords[j] = j == 0 ? rest : g.binary(ExprOp::Rem, rest, g.intConstant(rows[j]));
    if (j > 0) rest = g.binary(ExprOp::Div, rest, g.intConstant(rows[j]));
  }
  std::vector<int> coords(f.xs.size());
  for (size_t i = 0, ki = 0, fi = 0; i < f.xs.size(); ++i)
    coords[i] = f.folded[i] ? folded_coords[fi++] : g.coord(static_cast<int>(ki++));
  KILN_ASSIGN_OR_RETURN(int v, f.element(first, coords));
  const DType ct = g.typeOf(v);
  // The last chunk's tail past the row reads nothing: the combiner's identity instead.
  const double identity = f.combiner == Combiner::Max ? -std::numeric_limits<double>::infinity() : 0.0;
  first.k.phases.push_back(
      {Phase::Kind::Reduce, f.combiner, g.select(inside, v, g.constant(identity, ct)), {}});
  const int partials = gl.tempBuffer(valueName(f.out) + ".partials", ct, outputs * chunks);
  first.k.stores.push_back({gl.bind(first, partials, true),
                            rowMajorOffset(g, first.spaceCoords(), first.k.space), g.rowValue(0, ct), -1});
  KILN_RETURN_IF_ERROR(gl.finish(first));

  KernelBuilder second = KernelBuilder::row(f.name, kept, {chunks});
  ExprGraph& g2 = second.g();
  std::vector<int> partial_at = second.spaceCoords();
  if (kept.empty()) partial_at.clear();  // the {1} outer space of no kept dims
  partial_at.push_back(g2.coord(static_cast<int>(second.k.space.size())));
  const int partial = g2.load(gl.bind(second, partials, false), ct, rowMajorOffset(g2, partial_at, outer));
  second.k.phases.push_back({Phase::Kind::Reduce, f.combiner, partial, {}});
  second.k.stores.push_back({gl.bindValue(second, f.out, true),
                             rowMajorOffset(g2, second.spaceCoords(), second.k.space),
                             finishFold(g2, f, g2.rowValue(0, ct)), -1});
  return gl.finish(second);
}

}  // namespace

Status lowerFold(GroupLowering& gl, const Fold& f) {
  return f.foldsLeadingDims() ? lowerColumnFold(gl, f) : lowerRowFold(gl, f);
}

namespace {

// The fold of a value of the group.
Fold::Element valueElement(GroupLowering& gl, const Value* x) {
  return [&gl, x](KernelBuilder& kb, const std::vector<int>& coords) { return gl.valueAt(kb, x, coords); };
}

Status lowerReduce(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  if (!ir::isFloat(x->type().dtype()))
    return Status::errorf("{} on the CUDA backend needs a float operand", opLabel(op));
  const std::set<int64_t> axes = axesOf(op, xs.size());
  const std::string kind = op.strAttr("kind");
  Fold f{"reduce_" + kind, xs, std::vector<bool>(xs.size()), kind == "max" ? Combiner::Max : Combiner::Sum, 1,
         op.result(), valueElement(gl, x)};
  int64_t folded = 1;
  for (size_t i = 0; i < xs.size(); ++i)
    if ((f.folded[i] = axes.count(static_cast<int64_t>(i)) > 0)) folded *= xs[i];
  if (kind == "mean") f.scale = 1.0 / static_cast<double>(folded);
  return lowerFold(gl, f);
}

// sum_to: sums x over the dims along which the result type broadcasts to it (the leading dims x
// has beyond the result's, and the result's size-1 dims where x's are not).
Status lowerSumTo(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  if (!ir::isFloat(op.numResults() ? op.result()->type().dtype() : DType::f32))
    return Status::errorf("{} on the CUDA backend needs float values", opLabel(op));
  const Value* x = op.operand(0);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  KILN_ASSIGN_OR_RETURN(auto os, gl.shapeOf(op.result()));
  const size_t lead = xs.size() - os.size();
  Fold f{"sum_to", xs, std::vector<bool>(xs.size()), Combiner::Sum, 1, op.result(), valueElement(gl, x)};
  for (size_t i = 0; i < xs.size(); ++i) f.folded[i] = i < lead || (os[i - lead] == 1 && xs[i] != 1);
  return lowerFold(gl, f);
}

// max: the gradient goes to the maxima of each reduced slice, split evenly among ties.
Status lowerReduceMaxGrad(GroupLowering& gl, const std::vector<const Op*>& ops) {
  const Op& op = *ops.back();
  const Value* gval = op.operand(0);
  const Value* x = op.operand(1);
  const Value* y = op.operand(2);
  KILN_ASSIGN_OR_RETURN(auto xs, gl.shapeOf(x));
  const std::set<int64_t> axes = axesOf(op, xs.size());
  bool keep = op.boolAttr("keepdims");
  std::vector<int64_t> outer, row;
  for (size_t i = 0; i < xs.size(); ++i) (axes.count(static_cast<int64_t>(i)) ? row : outer).push_back(xs[i]);
  KernelBuilder kb = KernelBuilder::row("reduce_max_grad", outer, row);
  Kernel& k = kb.k;
  ExprGraph& g = k.exprs;
  std::vector<int> coords(xs.size()), kept;
  int oi = 0, ri = static_cast<int>(k.space.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    bool red = axes.count(static_cast<int64_t>(i));
    coords[i] = red ? g.coord(ri++) : g.coord(oi++);
    if (!red)
      kept.push_back(coords[i]);
    else if (keep)
      kept.push_back(g.intConstant(0));
  }
  auto xv = gl.valueAt(kb, x, coords);
  auto yv = gl.valueAt(kb, y, kept);
  auto gv = gl.valueAt(kb, gval, kept);
  if (!xv || !yv || !gv) return !xv ? xv.status() : !yv ? yv.status() : gv.status();
  DType ct = g.typeOf(*xv);
  int hit = g.binary(ExprOp::Eq, *xv, *yv);
  k.phases.push_back(
      {Phase::Kind::Reduce, Combiner::Sum, g.select(hit, g.constant(1, ct), g.constant(0, ct)), {}});
  Phase map;
  map.stores.push_back(
      {gl.bindValue(kb, op.result(), true), rowMajorOffset(g, coords, xs),
       g.cast(g.select(hit, g.binary(ExprOp::Div, *gv, g.rowValue(0, ct)), g.constant(0, ct)),
              op.result()->type().dtype()),
       -1});
  k.phases.push_back(map);
  return gl.finish(kb);
}

}  // namespace

void registerReductionEmitters(EmitterRegistry& r) {
  r.addOpEmitter(ir::OpCode::Reduce, {"reduction", lowerReduce, GroupForm::kPointwiseInputs});
  r.addOpEmitter(ir::OpCode::SumTo, {"reduction", lowerSumTo, GroupForm::kPointwiseInputs});
  // sum and mean gradients are expressions (pointwise.cc).
  r.addOpEmitter(ir::OpCode::ReduceGrad, {"reduction", lowerReduceMaxGrad, GroupForm::kAlone,
                                          [](const Op& op) { return op.strAttr("kind") == "max"; }});
  // A fused reduction region: the fold's kernels computing its pointwise producers inline.
  r.addFusedEmitter("reduction",
                    [](GroupLowering& gl, const std::vector<const Op*>&) { return lowerOps(gl); });
}

}  // namespace kiln::codegen::emit
