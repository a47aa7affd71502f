// Pooled embedding lookup (TorchRec's EmbeddingBag, HugeCTR's sparse embedding).
//
//   kiln.embedding_bag(table[R, D], ids[B, H])                     fixed hotness H per sample
//   kiln.embedding_bag(table[R, D], ids[B, H], weights[B, H])      ... with per-id weights
//   kiln.embedding_bag(table[R, D], ids[N], lengths[B])            variable length: sample b owns
//                                                                  the next lengths[b] ids (the
//                                                                  layout of TorchRec's jagged tensors)
//   kiln.embedding_bag(table[R, D], ids[N], lengths[B], weights[N])
// Result: [B, D], the sum (or mean) of the selected rows, each scaled by its weight.
// Ids must lie in [0, R); an id out of range is a run-time error naming the table. With mode
// "mean" the (weighted) sum is divided by the number of ids in the bag; an empty bag gives zeros.
//
// Gradients: the table's gradient is NOT a dense [R, D] tensor built here. The autodiff pass
// owns it and applies the pooled-output gradient to the touched rows with a fused sparse update
// (kiln.embedding_bag_update), so this op's rule leaves the table's gradient empty. Per-id
// weights get theirs from
//   kiln.embedding_bag_weight_grad(table, ids[, lengths], grad_out) {mode}  -> shaped like ids:
//     d out[b] / d w_j = table[ids_j] (divided by the bag's count for mean), dotted with grad_out[b].
//
// A hybrid table's hot rows (passes/shard.cc) are all-reduced as a dense block, so their
// gradient is built densely:
//   kiln.embedding_bag_dense_grad(ids[, lengths], grad_out[B, D]) {rows, mode}  -> [rows, D]:
//     out[r] = sum over the ids j equal to r of grad_out[bag of j] (divided by the bag's count for
//     mean): the gradient of embedding_bag's table, rows no id touches zero. Without `rows`
//     the block has max(id) + 1 rows (bounded by the ids' count): the rows a de-duplicated
//     lookup (kiln.dedup_ids' inverse, which uses every row) brought in.
//
// Sequence features (`embeddings(..., pool = none)`, docs/language.md) pad jagged ids first:
//   kiln.jagged_to_padded(ids[N], lengths[B]) {length = L}  -> ids' dtype [B, L]
//     out[b, j] = ids[offset_b + j] for j < min(lengths[b], L), else 0 (fbgemm's
//     jagged_to_padded_dense: a bag longer than L keeps its first L ids). Integer: no gradient.
#include <cmath>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

Status inferEmbeddingBag(const Op& op, std::vector<TensorType>& out) {
  const TensorType& table = op.operand(0)->type();
  const TensorType& ids = op.operand(1)->type();
  if (table.rank() != 2) return Status::errorf("'kiln.embedding_bag' table must be [rows, dim], got {}", table.str());
  if (!isFloat(table.dtype())) return Status::errorf("'kiln.embedding_bag' table must be float, got {}", table.str());
  if (!isInteger(ids.dtype())) return Status::errorf("'kiln.embedding_bag' ids must be i32 or i64, got {}", ids.str());
  Dim batch;
  if (ids.rank() == 2) {
    if (op.numOperands() > 3)
      return Status::error("'kiln.embedding_bag' with [B, H] ids takes (table, ids[, weights])");
    if (op.numOperands() == 3) {
      const TensorType& w = op.operand(2)->type();
      if (w.shape() != ids.shape() || !isFloat(w.dtype()))
        return Status::errorf("'kiln.embedding_bag' weights {} must be float and shaped like ids {}", w.str(), ids.str());
    }
    batch = ids.dim(0);
  } else if (ids.rank() == 1) {
    if (op.numOperands() < 3)
      return Status::error("'kiln.embedding_bag' with flat ids needs lengths: (table, ids, lengths[, weights])");
    const TensorType& lengths = op.operand(2)->type();
    if (lengths.rank() != 1 || !isInteger(lengths.dtype()))
      return Status::errorf("'kiln.embedding_bag' lengths must be a 1-d integer tensor, got {}", lengths.str());
    if (op.numOperands() == 4) {
      const TensorType& w = op.operand(3)->type();
      if (w.shape() != ids.shape() || !isFloat(w.dtype()))
        return Status::errorf("'kiln.embedding_bag' weights {} must be float and shaped like ids {}", w.str(), ids.str());
    }
    batch = lengths.dim(0);
  } else {
    return Status::errorf("'kiln.embedding_bag' ids must be [B, H] or [N], got {}", ids.str());
  }
  out = {TensorType(table.dtype(), {batch, table.dim(1)})};
  return Status::ok();
}

// Which ids each sample of a batch owns: bag b is ids [begin[b], begin[b + 1]).
struct Bags {
  std::vector<int64_t> begin;
  int64_t batch() const { return static_cast<int64_t>(begin.size()) - 1; }
};

std::string tableLabel(const Op& op) {
  std::string t = op.strAttr("table");
  return t.empty() ? fmt::format("'{}'", op.name()) : fmt::format("'{}' of table '{}'", op.name(), t);
}

Expected<Bags> bagsOf(const Op& op, const TensorView& ids, const TensorView* lengths) {
  Bags bags;
  if (!lengths) {
    const int64_t batch = ids.shape[0], hot = ids.shape[1];
    for (int64_t b = 0; b <= batch; ++b) bags.begin.push_back(b * hot);
    return bags;
  }
  bags.begin.push_back(0);
  for (int64_t b = 0, n = lengths->numel(); b < n; ++b) {
    const int64_t len = loadIndex(*lengths, b);
    if (len < 0) return Status::errorf("{}: length {} of sample {} is negative", tableLabel(op), len, b);
    bags.begin.push_back(bags.begin.back() + len);
  }
  if (bags.begin.back() != ids.numel())
    return Status::errorf("{}: the lengths add up to {} but there are {} ids", tableLabel(op),
                          bags.begin.back(), ids.numel());
  return bags;
}

Status checkIds(const Op& op, const TensorView& ids, int64_t rows) {
  for (int64_t j = 0, n = ids.numel(); j < n; ++j) {
    const int64_t id = loadIndex(ids, j);
    if (id < 0 || id >= rows)
      return Status::errorf("{}: id {} at position {} is out of range [0, {})", tableLabel(op), id,
                            indexString(ids.shape, j), rows);
  }
  return Status::ok();
}

// Operand positions: (table, ids[, weights]) for [B, H] ids, (table, ids, lengths[, weights]) for flat ids.
struct BagOperands {
  const TensorView* lengths = nullptr;
  const TensorView* weights = nullptr;
};
BagOperands bagOperands(const CpuOperands& in) {
  BagOperands o;
  if (in[1]->rank() == 1) {
    o.lengths = in[2];
    if (in.size() > 3) o.weights = in[3];
  } else if (in.size() > 2) {
    o.weights = in[2];
  }
  return o;
}

Status cpuEmbeddingBag(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& table = *in[0];
  const TensorView& ids = *in[1];
  const BagOperands extra = bagOperands(in);
  TensorView& r = *out[0];
  const int64_t rows = table.shape[0], dim = table.shape[1];
  KILN_RETURN_IF_ERROR(checkIds(op, ids, rows));
  KILN_ASSIGN_OR_RETURN(auto bags, bagsOf(op, ids, extra.lengths));
  KILN_RETURN_IF_ERROR(setResultShape(op, r, {bags.batch(), dim}));
  const bool mean = op.strAttr("mode") == "mean";
  return visitFloat(op, table.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pt = data<T>(table);
    auto* pr = data<T>(r);
    std::vector<double> acc(static_cast<size_t>(dim));
    for (int64_t b = 0; b < bags.batch(); ++b) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const int64_t lo = bags.begin[static_cast<size_t>(b)], hi = bags.begin[static_cast<size_t>(b) + 1];
      for (int64_t j = lo; j < hi; ++j) {
        const double w = extra.weights ? loadAsDouble(*extra.weights, j) : 1.0;
        const auto* row = pt + loadIndex(ids, j) * dim;
        for (int64_t d = 0; d < dim; ++d) acc[static_cast<size_t>(d)] += w * T::load(row[d]);
      }
      const double scale = mean && hi > lo ? 1.0 / static_cast<double>(hi - lo) : 1.0;
      for (int64_t d = 0; d < dim; ++d) pr[b * dim + d] = T::store(acc[static_cast<size_t>(d)] * scale);
    }
    return Status::ok();
  });
}

Status cpuEmbeddingBagWeightGrad(const Op& op, const CpuOperands& in, const CpuResults& out,
                                 const CpuContext&) {
  const TensorView& table = *in[0];
  const TensorView& ids = *in[1];
  const TensorView* lengths = ids.rank() == 1 ? in[2] : nullptr;
  const TensorView& g = *in.back();
  TensorView& r = *out[0];
  const int64_t rows = table.shape[0], dim = table.shape[1];
  KILN_RETURN_IF_ERROR(checkIds(op, ids, rows));
  KILN_ASSIGN_OR_RETURN(auto bags, bagsOf(op, ids, lengths));
  if (g.shape != std::vector<int64_t>{bags.batch(), dim})
    return Status::errorf("{}: grad_out {} does not match {} bags of dim {}", tableLabel(op),
                          shapeString(g.shape), bags.batch(), dim);
  KILN_RETURN_IF_ERROR(setResultShape(op, r, ids.shape));
  const bool mean = op.strAttr("mode") == "mean";
  return visitFloat(op, table.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pt = data<T>(table);
    const auto* pg = data<T>(g);
    auto* pr = data<T>(r);
    for (int64_t b = 0; b < bags.batch(); ++b) {
      const int64_t lo = bags.begin[static_cast<size_t>(b)], hi = bags.begin[static_cast<size_t>(b) + 1];
      const double scale = mean && hi > lo ? 1.0 / static_cast<double>(hi - lo) : 1.0;
      for (int64_t j = lo; j < hi; ++j) {
        const auto* row = pt + loadIndex(ids, j) * dim;
        double dot = 0;
        for (int64_t d = 0; d < dim; ++d)
          dot += static_cast<double>(T::load(row[d])) * T::load(pg[b * dim + d]);
        pr[j] = T::store(dot * scale);
      }
    }
    return Status::ok();
  });
}

// The table gets no gradient here (see the top of this file); weights get theirs.
Status gradEmbeddingBag(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  const bool flat = op.operand(1)->type().rank() == 1;
  const unsigned weights_at = flat ? 3 : 2;
  if (!g || op.numOperands() <= weights_at) return Status::ok();
  std::vector<Value*> operands = {op.operand(0), op.operand(1)};
  if (flat) operands.push_back(op.operand(2));
  operands.push_back(g);
  AttrDict attrs = {{"mode", Attribute(op.strAttr("mode", "sum"))}};
  if (op.hasAttr("table")) attrs["table"] = *op.attr("table");
  KILN_GRAD_VALUE(dw, ctx.builder.createValue("kiln.embedding_bag_weight_grad", operands, attrs));
  const DType wt = op.operand(weights_at)->type().dtype();
  if (dw->type().dtype() != wt) {
    KILN_GRAD_VALUE(
        c, ctx.builder.createValue("kiln.cast", {dw}, {{"to", Attribute(std::string(dtypeName(wt)))}}));
    dw = c;
  }
  ctx.operand_grads[weights_at] = dw;
  return Status::ok();
}

// The batch of a backward op reading (..., ids[B, H], grad_out) or (..., ids[N], lengths[B],
// grad_out), its ids at operand `ids_at`: checks the ids and the operand count.
Expected<Dim> bagGradBatch(const Op& op, unsigned ids_at) {
  const TensorType& ids = op.operand(ids_at)->type();
  if (!isInteger(ids.dtype()) || (ids.rank() != 1 && ids.rank() != 2))
    return Status::errorf("'{}' ids must be integer [B, H] or [N], got {}", op.name(), ids.str());
  const unsigned want = ids_at + (ids.rank() == 1 ? 3 : 2);
  if (op.numOperands() != want)
    return Status::errorf("'{}' takes ({}ids{}, grad_out)", op.name(), ids_at ? "table, " : "",
                          ids.rank() == 1 ? ", lengths" : "");
  return ids.rank() == 2 ? ids.dim(0) : op.operand(ids_at + 1)->type().dim(0);
}

Status inferEmbeddingBagWeightGrad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& table = op.operand(0)->type();
  const TensorType& ids = op.operand(1)->type();
  const TensorType& g = op.operand(op.numOperands() - 1)->type();
  if (table.rank() != 2 || !isFloat(table.dtype()))
    return Status::errorf("'kiln.embedding_bag_weight_grad' table must be float [rows, dim], got {}",
                          table.str());
  KILN_ASSIGN_OR_RETURN(const Dim batch, bagGradBatch(op, 1));
  if (g.dtype() != table.dtype() || g.rank() != 2 || !(g.dim(0) == batch) || !(g.dim(1) == table.dim(1)))
    return Status::errorf("'kiln.embedding_bag_weight_grad' grad_out must be {}, got {}",
                          TensorType(table.dtype(), {batch, table.dim(1)}).str(), g.str());
  out = {TensorType(table.dtype(), ids.shape())};
  return Status::ok();
}

// Reads the ids (and lengths, weights), one table row per id, writes the pooled rows.
OpCost costEmbeddingBag(const Op& op, const SymbolBindings& symbols) {
  const TensorType& table = op.operand(0)->type();
  const double ids = typeElements(op.operand(1)->type(), symbols);
  auto dim = table.dim(1).evaluate(symbols);
  const double row_elems = ids * static_cast<double>(dim ? *dim : 0);
  const bool weighted = op.numOperands() > (op.operand(1)->type().rank() == 1 ? 3u : 2u);
  double bytes =
      typeBytes(op.result()->type(), symbols) + row_elems * static_cast<double>(dtypeBytes(table.dtype()));
  for (unsigned i = 1; i < op.numOperands(); ++i) bytes += typeBytes(op.operand(i)->type(), symbols);
  return {row_elems * (weighted ? 2 : 1), bytes};
}

// Reads a row per id plus grad_out, writes one value per id: a dot product each.
OpCost costEmbeddingBagWeightGrad(const Op& op, const SymbolBindings& symbols) {
  const TensorType& table = op.operand(0)->type();
  const double ids = typeElements(op.operand(1)->type(), symbols);
  auto dim = table.dim(1).evaluate(symbols);
  const double row_elems = ids * static_cast<double>(dim ? *dim : 0);
  double bytes =
      typeBytes(op.result()->type(), symbols) + row_elems * static_cast<double>(dtypeBytes(table.dtype()));
  for (unsigned i = 1; i < op.numOperands(); ++i) bytes += typeBytes(op.operand(i)->type(), symbols);
  return {2 * row_elems, bytes};
}

Status inferEmbeddingBagDenseGrad(const Op& op, std::vector<TensorType>& out) {
  const TensorType& ids = op.operand(0)->type();
  const TensorType& g = op.operand(op.numOperands() - 1)->type();
  const int64_t rows = op.intAttr("rows", -1);
  if (op.hasAttr("rows") && rows < 0)
    return Status::errorf("'kiln.embedding_bag_dense_grad' needs rows >= 0, got {}", rows);
  KILN_ASSIGN_OR_RETURN(const Dim batch, bagGradBatch(op, 0));
  if (!isFloat(g.dtype()) || g.rank() != 2 || !(g.dim(0) == batch))
    return Status::errorf("'kiln.embedding_bag_dense_grad' grad_out must be float [{}, D], got {}", batch.str(),
                          g.str());
  const Dim count = ids.rank() == 2 ? ids.dim(0).times(ids.dim(1).size()) : ids.dim(0);
  out = {TensorType(g.dtype(), {rows >= 0 ? Dim::fixed(rows) : Dim::bounded(count.upperBound()), g.dim(1)})};
  return Status::ok();
}

Status cpuEmbeddingBagDenseGrad(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& ids = *in[0];
  const TensorView* lengths = ids.rank() == 1 ? in[1] : nullptr;
  const TensorView& g = *in.back();
  TensorView& r = *out[0];
  const int64_t dim = g.shape[1];
  KILN_ASSIGN_OR_RETURN(auto bags, bagsOf(op, ids, lengths));
  int64_t rows = r.shape[0];
  if (!op.hasAttr("rows")) {
    // As many rows as the ids reach.
    rows = 0;
    for (int64_t j = 0; j < bags.begin.back(); ++j) rows = std::max(rows, loadIndex(ids, j) + 1);
    KILN_RETURN_IF_ERROR(setResultShape(op, r, {rows, dim}));
  }
  KILN_RETURN_IF_ERROR(checkIds(op, ids, rows));
  if (g.shape[0] != bags.batch())
    return Status::errorf("{}: grad_out {} does not match {} bags", tableLabel(op), shapeString(g.shape),
                          bags.batch());
  const bool mean = op.strAttr("mode") == "mean";
  return visitFloat(op, g.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* pg = data<T>(g);
    std::vector<double> acc(static_cast<size_t>(rows * dim), 0.0);
    for (int64_t b = 0; b < bags.batch(); ++b) {
      const int64_t lo = bags.begin[static_cast<size_t>(b)], hi = bags.begin[static_cast<size_t>(b) + 1];
      const double scale = mean && hi > lo ? 1.0 / static_cast<double>(hi - lo) : 1.0;
      for (int64_t j = lo; j < hi; ++j) {
        double* row = acc.data() + loadIndex(ids, j) * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] += scale * static_cast<double>(T::load(pg[b * dim + d]));
      }
    }
    auto* pr = data<T>(r);
    for (size_t i = 0; i < acc.size(); ++i) pr[i] = T::store(acc[i]);
    return Status::ok();
  });
}

// Reads the ids and a grad_out row per id, writes the [rows, D] block once.
OpCost costEmbeddingBagDenseGrad(const Op& op, const SymbolBindings& symbols) {
  const TensorType& g = op.operand(op.numOperands() - 1)->type();
  const double ids = typeElements(op.operand(0)->type(), symbols);
  auto dim = g.dim(1).evaluate(symbols);
  const double row_elems = ids * static_cast<double>(dim ? *dim : 0);
  double bytes = typeBytes(op.result()->type(), symbols) + row_elems * static_cast<double>(dtypeBytes(g.dtype()));
  for (unsigned i = 0; i + 1 < op.numOperands(); ++i) bytes += typeBytes(op.operand(i)->type(), symbols);
  return {row_elems, bytes};
}

Status inferJaggedToPadded(const Op& op, std::vector<TensorType>& out) {
  const TensorType& ids = op.operand(0)->type();
  const TensorType& lengths = op.operand(1)->type();
  if (ids.rank() != 1 || !isInteger(ids.dtype()))
    return Status::errorf("'kiln.jagged_to_padded' ids must be flat integer [N], got {}", ids.str());
  if (lengths.rank() != 1 || !isInteger(lengths.dtype()))
    return Status::errorf("'kiln.jagged_to_padded' lengths must be a 1-d integer tensor, got {}",
                          lengths.str());
  const int64_t length = op.intAttr("length");
  if (length < 1) return Status::errorf("'kiln.jagged_to_padded' length must be positive, got {}", length);
  out = {TensorType(ids.dtype(), {lengths.dim(0), Dim::fixed(length)})};
  return Status::ok();
}

Status cpuJaggedToPadded(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& ids = *in[0];
  const TensorView& lengths = *in[1];
  TensorView& r = *out[0];
  const int64_t batch = lengths.numel(), length = op.intAttr("length");
  KILN_RETURN_IF_ERROR(setResultShape(op, r, {batch, length}));
  int64_t offset = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = loadIndex(lengths, b);
    if (len < 0) return Status::errorf("'{}': length {} of sample {} is negative", op.name(), len, b);
    if (offset + len > ids.numel())
      return Status::errorf("'{}': the lengths of samples 0..{} add up to {} but there are {} ids", op.name(),
                            b, offset + len, ids.numel());
    for (int64_t j = 0; j < length; ++j) {
      const int64_t id = j < len ? loadIndex(ids, offset + j) : 0;
      if (r.dtype == DType::i32)
        static_cast<int32_t*>(r.data)[b * length + j] = static_cast<int32_t>(id);
      else
        static_cast<int64_t*>(r.data)[b * length + j] = id;
    }
    offset += len;
  }
  return Status::ok();
}

// Reads the lengths and at most B*L ids, writes B*L ids.
OpCost costJaggedToPadded(const Op& op, const SymbolBindings& symbols) {
  const double written = typeBytes(op.result()->type(), symbols);
  return {0, 2 * written + typeBytes(op.operand(1)->type(), symbols)};
}

}  // namespace

void registerEmbeddingOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.embedding_bag",
         .summary = "Pooled lookup of table rows by multi-hot ids (sum or mean, optional weights)",
         .min_operands = 2, .max_operands = 4,
         .attrs = {{"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                   {"table", K::String}},
         .traits = kPure, .infer = inferEmbeddingBag,
         .cost = costEmbeddingBag, .grad = gradEmbeddingBag, .cpu = cpuEmbeddingBag});
  // Backward-only: autodiff emits it; no second-order gradients flow through it.
  r.add({.name = "kiln.embedding_bag_weight_grad",
         .summary = "Gradient of kiln.embedding_bag with respect to its per-id weights",
         .min_operands = 3, .max_operands = 4,
         .attrs = {{"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                   {"table", K::String}},
         .traits = kPure | kNonDifferentiable, .infer = inferEmbeddingBagWeightGrad,
         .cost = costEmbeddingBagWeightGrad, .cpu = cpuEmbeddingBagWeightGrad});
  r.add({.name = "kiln.embedding_bag_dense_grad",
         .summary = "Gradient of kiln.embedding_bag with respect to its table, as a dense [rows, D] block",
         .min_operands = 2, .max_operands = 3,
         .attrs = {{"rows", K::Int, false},
                   {"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                   {"table", K::String}},
         .traits = kPure | kNonDifferentiable, .infer = inferEmbeddingBagDenseGrad,
         .cost = costEmbeddingBagDenseGrad, .cpu = cpuEmbeddingBagDenseGrad});
  r.add({.name = "kiln.jagged_to_padded",
         .summary = "Jagged ids (flat ids and per-sample lengths) to a zero-padded [B, length] tensor",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"length", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferJaggedToPadded,
         .cost = costJaggedToPadded,
         .cpu = cpuJaggedToPadded});
}

}  // namespace kiln::ir
