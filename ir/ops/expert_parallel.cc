// Expert parallelism (docs/moe.md, "Expert parallelism"): the ops the shard pass puts around a
// MoE layer's experts when they are spread over ranks.
//
//   kiln.moe_route_counts(experts[N, k]) {experts = E}                      -> i32[E]
//     how many of the N*k slots chose each expert (before capacity): the global-batch
//     aux loss's f_i, once all-reduced
//   kiln.moe_ep_split(offsets[E + 1]) {ranks = N, ep, rank, experts = E}
//     -> (send_counts: i64[N], chunk_counts: i64[N * L])                    L = E / ep
//     the rows of each expert block to the rank owning it: rank r's EP group is ranks
//     [g*ep, (g+1)*ep) with g = r / ep, and its member g*ep + j owns experts [j*L, (j+1)*L).
//     send_counts[q] is the rows (in dispatch order) for rank q, 0 outside the group;
//     chunk_counts[q*L + e] the rows of q's e-th local expert, 0 outside the group
//   kiln.moe_sort_chunks(x[?R, ...], chunk_counts: i64[P * L]) {chunks = L, inverse = false}
//     -> x's type: rows arriving peer-major (peer p's chunk for local expert e is chunk p*L + e,
//     chunk_counts[p*L + e] rows, packed p-major) into expert-major order (e-major, then p);
//     inverse: back. A permutation: its gradient is the other direction
//   kiln.moe_chunk_offsets(chunk_counts: i64[P * L]) {chunks = L}         -> i32[L + 1]
//     the expert offsets of the expert-major order: offsets[e] = sum over e' < e and every p
//     of chunk_counts[p*L + e']
#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;

Status expectCounts(const Op& op, unsigned i, int64_t chunks) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 1 || t.dtype() != DType::i64 || !t.dim(0).isStatic() || t.dim(0).size() < 1 ||
      chunks < 1 || t.dim(0).size() % chunks != 0)
    return Status::errorf("'{}' needs chunk counts of type i64[P * {}] (P peers of {} chunks), got {}",
                          op.name(), chunks, chunks, t.str());
  return Status::ok();
}

Status inferRouteCounts(const Op& op, std::vector<TensorType>& out) {
  const TensorType& experts = op.operand(0)->type();
  if (experts.dtype() != DType::i32 || experts.rank() != 2)
    return Status::errorf("'{}' needs experts of type i32[N, k], got {}", op.name(), experts.str());
  const int64_t e = op.intAttr("experts");
  if (e < 1) return Status::errorf("'{}' needs experts >= 1, got {}", op.name(), e);
  out = {TensorType(DType::i32, {Dim::fixed(e)})};
  return Status::ok();
}

Status inferEpSplit(const Op& op, std::vector<TensorType>& out) {
  const TensorType& offsets = op.operand(0)->type();
  const int64_t e = op.intAttr("experts"), ranks = op.intAttr("ranks"), ep = op.intAttr("ep");
  if (offsets.rank() != 1 || offsets.dtype() != DType::i32 || !(offsets.dim(0) == Dim::fixed(e + 1)))
    return Status::errorf("'{}' needs offsets of type i32[{}] (experts + 1), got {}", op.name(), e + 1,
                          offsets.str());
  if (ep < 1 || e % ep != 0 || ranks % ep != 0)
    return Status::errorf("'{}' needs ep >= 1 dividing experts = {} and ranks = {}, got ep = {}", op.name(), e,
                          ranks, ep);
  out = {TensorType(DType::i64, {Dim::fixed(ranks)}), TensorType(DType::i64, {Dim::fixed(ranks * (e / ep))})};
  return Status::ok();
}

Status verifyEpSplit(const Op& op) {
  const int64_t rank = op.intAttr("rank"), ranks = op.intAttr("ranks");
  if (rank < 0 || rank >= ranks)
    return Status::errorf("'{}' needs 0 <= rank < ranks = {}, got rank = {}", op.name(), ranks, rank);
  return Status::ok();
}

Status inferSortChunks(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  if (x.rank() < 1) return Status::errorf("'{}' needs rows of rank >= 1, got {}", op.name(), x.str());
  KILN_RETURN_IF_ERROR(expectCounts(op, 1, op.intAttr("chunks")));
  out = {x.withSharding(std::nullopt)};
  return Status::ok();
}

Status inferChunkOffsets(const Op& op, std::vector<TensorType>& out) {
  const int64_t chunks = op.intAttr("chunks");
  KILN_RETURN_IF_ERROR(expectCounts(op, 0, chunks));
  out = {TensorType(DType::i32, {Dim::fixed(chunks + 1)})};
  return Status::ok();
}

// Counting and moving: bytes read plus written.
OpCost costMoving(const Op& op, const SymbolBindings& symbols) {
  double bytes = 0;
  for (const Value* v : op.operands()) bytes += typeBytes(v->type(), symbols);
  for (const Value* v : op.results()) bytes += typeBytes(v->type(), symbols);
  return {0, bytes};
}

// A permutation of rows: its adjoint is the inverse permutation.
Status gradSortChunks(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* g = ctx.result_grads[0];
  if (!g) return Status::ok();
  AttrDict a = op.attrs();
  a["inverse"] = Attribute(!op.boolAttr("inverse"));
  KILN_GRAD_VALUE(dx, ctx.builder.createValue(OpCode::MoeSortChunks, {g, op.operand(1)}, a));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

}  // namespace

void registerExpertParallelOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.moe_route_counts",
         .summary = "Per expert, how many slots chose it (before capacity)",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {{"experts", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferRouteCounts,
         .cost = costMoving});
  r.add({.name = "kiln.moe_ep_split",
         .summary = "Rows of each expert block to the rank that owns it: per-rank and per-expert counts",
         .min_operands = 1,
         .max_operands = 1,
         .num_results = 2,
         .attrs = {{"ranks", K::Int, true}, {"ep", K::Int, true}, {"rank", K::Int, true}, {"experts", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferEpSplit,
         .verify = verifyEpSplit,
         .cost = costMoving});
  r.add({.name = "kiln.moe_sort_chunks",
         .summary = "Rows arriving peer-major into expert-major order (inverse: back)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"chunks", K::Int, true}, {"inverse", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferSortChunks,
         .cost = costMoving,
         .grad = gradSortChunks});
  r.add({.name = "kiln.moe_chunk_offsets",
         .summary = "Expert offsets of the expert-major order of received chunks",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {{"chunks", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferChunkOffsets,
         .cost = costMoving});
}

}  // namespace kiln::ir
