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
//
// The counts are known only at run time, so the references check what the types cannot: expert
// ids within [0, E), offsets rising from 0, chunk counts >= 0 that add up to x's run-time rows.
#include <cstring>

#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

Status expectCounts(const Op& op, unsigned i, int64_t chunks) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 1 || t.dtype() != DType::i64 || !t.dim(0).isStatic() || t.dim(0).size() < 1 || chunks < 1 ||
      t.dim(0).size() % chunks != 0)
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
    return Status::errorf("'{}' needs ep >= 1 dividing experts = {} and ranks = {}, got ep = {}", op.name(),
                          e, ranks, ep);
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

// ---- CPU reference ----------------------------------------------------------------------------

// Writes integer values into an i32 or i64 result.
void storeIndices(TensorView& r, const std::vector<int64_t>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (r.dtype == DType::i32)
      r.as<int32_t>()[i] = static_cast<int32_t>(v[i]);
    else
      r.as<int64_t>()[i] = v[i];
  }
}

Status cpuRouteCounts(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& experts = *in[0];
  const int64_t e = op.intAttr("experts");
  std::vector<int64_t> counts(static_cast<size_t>(e), 0);
  for (int64_t s = 0; s < experts.numel(); ++s) {
    const int64_t id = loadIndex(experts, s);
    if (id < 0 || id >= e)
      return Status::errorf("'{}': expert {} at {} is out of range [0, {})", op.name(), id,
                            indexString(experts.shape, s), e);
    ++counts[static_cast<size_t>(id)];
  }
  storeIndices(*out[0], counts);
  return Status::ok();
}

// Expert e's rows are [offsets[e], offsets[e + 1]): the offsets must rise from 0.
Status checkRisingOffsets(const Op& op, const TensorView& offsets) {
  if (loadIndex(offsets, 0) != 0)
    return Status::errorf("'{}': offsets[0] = {}, want 0", op.name(), loadIndex(offsets, 0));
  for (int64_t e = 0; e + 1 < offsets.numel(); ++e) {
    const int64_t lo = loadIndex(offsets, e), hi = loadIndex(offsets, e + 1);
    if (hi < lo) return Status::errorf("'{}': offsets decrease at expert {} ({} > {})", op.name(), e, lo, hi);
  }
  return Status::ok();
}

Status cpuEpSplit(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& offsets = *in[0];
  KILN_RETURN_IF_ERROR(checkRisingOffsets(op, offsets));
  const int64_t ranks = op.intAttr("ranks"), ep = op.intAttr("ep"), local = op.intAttr("experts") / ep;
  const int64_t first = op.intAttr("rank") / ep * ep;  // the EP group's first rank
  std::vector<int64_t> send(static_cast<size_t>(ranks), 0), chunks(static_cast<size_t>(ranks * local), 0);
  for (int64_t j = 0; j < ep; ++j) {
    const int64_t q = first + j;
    for (int64_t e = 0; e < local; ++e) {
      const int64_t expert = j * local + e;
      const int64_t rows = loadIndex(offsets, expert + 1) - loadIndex(offsets, expert);
      chunks[static_cast<size_t>(q * local + e)] = rows;
      send[static_cast<size_t>(q)] += rows;
    }
  }
  storeIndices(*out[0], send);
  storeIndices(*out[1], chunks);
  return Status::ok();
}

// The chunk counts, each >= 0.
Expected<std::vector<int64_t>> loadChunkCounts(const Op& op, const TensorView& counts) {
  std::vector<int64_t> v(static_cast<size_t>(counts.numel()));
  for (int64_t c = 0; c < counts.numel(); ++c) {
    v[static_cast<size_t>(c)] = loadIndex(counts, c);
    if (v[static_cast<size_t>(c)] < 0)
      return Status::errorf("'{}': chunk_counts[{}] = {} is negative", op.name(), c,
                            v[static_cast<size_t>(c)]);
  }
  return v;
}

// The first row of each chunk p*L + e when the chunks are packed p-major (the order they arrive
// in) or e-major (the local experts' order).
std::vector<int64_t> chunkStarts(const std::vector<int64_t>& counts, int64_t local, bool expert_major) {
  const int64_t peers = static_cast<int64_t>(counts.size()) / local;
  std::vector<int64_t> start(counts.size());
  int64_t row = 0;
  for (int64_t outer = 0; outer < (expert_major ? local : peers); ++outer)
    for (int64_t inner = 0; inner < (expert_major ? peers : local); ++inner) {
      const size_t c = static_cast<size_t>(expert_major ? inner * local + outer : outer * local + inner);
      start[c] = row;
      row += counts[c];
    }
  return start;
}

// Any element type and trailing shape: each chunk is one block of whole rows, moved by one memcpy.
Status cpuSortChunks(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> counts, loadChunkCounts(op, *in[1]));
  const int64_t rows = x.shape[0];
  int64_t total = 0;
  for (int64_t c : counts) {
    if (c > rows - total)
      return Status::errorf("'{}': chunk_counts add up to more than the {} rows of x", op.name(), rows);
    total += c;
  }
  if (total != rows)
    return Status::errorf("'{}': x has {} rows but chunk_counts add up to {}", op.name(), rows, total);
  if (rows > out[0]->shape[0])
    return Status::errorf("'{}': {} rows do not fit the result's bound of {} rows", op.name(), rows,
                          out[0]->shape[0]);
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], x.shape));
  const int64_t row_bytes = rows ? x.bytes() / rows : 0;
  const int64_t local = op.intAttr("chunks");
  const bool inverse = op.boolAttr("inverse");
  const std::vector<int64_t> from = chunkStarts(counts, local, inverse);
  const std::vector<int64_t> to = chunkStarts(counts, local, !inverse);
  const auto* src = static_cast<const unsigned char*>(x.data);
  auto* dst = static_cast<unsigned char*>(out[0]->data);
  for (size_t c = 0; c < counts.size(); ++c)
    if (counts[c] > 0) std::memcpy(dst + to[c] * row_bytes, src + from[c] * row_bytes, counts[c] * row_bytes);
  return Status::ok();
}

Status cpuChunkOffsets(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  KILN_ASSIGN_OR_RETURN(std::vector<int64_t> counts, loadChunkCounts(op, *in[0]));
  const int64_t local = op.intAttr("chunks");
  const int64_t peers = static_cast<int64_t>(counts.size()) / local;
  // The result is i32, like moe_dispatch's offsets that grouped_matmul reads.
  const int64_t max_rows = std::numeric_limits<int32_t>::max();
  std::vector<int64_t> offsets(static_cast<size_t>(local + 1), 0);
  int64_t row = 0;
  for (int64_t e = 0; e < local; ++e) {
    for (int64_t p = 0; p < peers; ++p) {
      const int64_t c = counts[static_cast<size_t>(p * local + e)];
      if (c > max_rows - row)
        return Status::errorf("'{}': the rows up to local expert {} do not fit the i32 offsets", op.name(),
                              e);
      row += c;
    }
    offsets[static_cast<size_t>(e + 1)] = row;
  }
  storeIndices(*out[0], offsets);
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
         .cost = costMoving,
         .cpu = cpuRouteCounts});
  r.add({.name = "kiln.moe_ep_split",
         .summary = "Rows of each expert block to the rank that owns it: per-rank and per-expert counts",
         .min_operands = 1,
         .max_operands = 1,
         .num_results = 2,
         .attrs = {{"ranks", K::Int, true},
                   {"ep", K::Int, true},
                   {"rank", K::Int, true},
                   {"experts", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferEpSplit,
         .verify = verifyEpSplit,
         .cost = costMoving,
         .cpu = cpuEpSplit});
  r.add({.name = "kiln.moe_sort_chunks",
         .summary = "Rows arriving peer-major into expert-major order (inverse: back)",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"chunks", K::Int, true}, {"inverse", K::Bool, false, Attribute(false)}},
         .traits = kPure,
         .infer = inferSortChunks,
         .cost = costMoving,
         .grad = gradSortChunks,
         .cpu = cpuSortChunks});
  r.add({.name = "kiln.moe_chunk_offsets",
         .summary = "Expert offsets of the expert-major order of received chunks",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {{"chunks", K::Int, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferChunkOffsets,
         .cost = costMoving,
         .cpu = cpuChunkOffsets});
}

}  // namespace kiln::ir
