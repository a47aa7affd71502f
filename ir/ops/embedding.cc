// Pooled embedding lookup (TorchRec's EmbeddingBag, HugeCTR's sparse embedding).
//
//   kiln.embedding_bag(table[R, D], ids[B, H])                     fixed hotness H per sample
//   kiln.embedding_bag(table[R, D], ids[B, H], weights[B, H])      ... with per-id weights
//   kiln.embedding_bag(table[R, D], ids[N], lengths[B])            variable length: sample b owns
//                                                                  the next lengths[b] ids (the
//                                                                  layout of TorchRec's jagged tensors)
//   kiln.embedding_bag(table[R, D], ids[N], lengths[B], weights[N])
// Result: [B, D], the sum (or mean) of the selected rows, each scaled by its weight.
// Ids must lie in [0, R); an id out of range is a run-time error naming the table.
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

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

}  // namespace

void registerEmbeddingOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.embedding_bag",
         .summary = "Pooled lookup of table rows by multi-hot ids (sum or mean, optional weights)",
         .min_operands = 2, .max_operands = 4,
         .attrs = {{"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                   {"table", K::String}},
         .traits = kPure, .infer = inferEmbeddingBag});
}

}  // namespace kiln::ir
