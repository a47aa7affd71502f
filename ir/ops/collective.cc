// Collectives over a group of `ranks` ranks: the communication the shard pass inserts.
//
//   kiln.all_reduce(x)             {ranks, group}        every rank gets the sum of every rank's x
//   kiln.reduce_scatter(x)         {ranks, group, axis}  x's `axis` splits into `ranks` equal
//                                                        segments; rank r gets the sum of every
//                                                        rank's r-th segment
//   kiln.all_gather(x)             {ranks, group, axis}  every rank's x, concatenated in rank
//                                                        order along `axis`
//   kiln.all_to_all(x)             {ranks, group}        dim 0 splits into `ranks` equal
//                                                        segments; segment p goes to rank p, and
//                                                        result segment p comes from rank p
//   kiln.all_to_all_v(x, send_counts: i64[N]) -> (rows, recv_counts: i64[N])   {ranks, group}
//                                  variable splits: the first send_counts[p] rows of x go to
//                                  rank p, the next to p + 1, ...; `rows` holds what arrives,
//                                  packed in peer order, recv_counts[p] of them from p. The
//                                  counts are known only at run time, so `rows` has a stated
//                                  type whose dim 0 is bounded (`?(cap)`: more arriving is a
//                                  run-time error) or exact. `expected_fill` (default 1) is the
//                                  share of the bound a step is expected to move, for the cost
//                                  model only.
//   kiln.bucketize_ids(ids[B, H]) or (ids[M], lengths[B])
//       -> (ids_out[M'], lengths_out[N*B], send_counts: i64[N], return_counts: i64[N])
//       {ranks, rank, table, rows, mode, owners, row_starts}
//                                  routes a rank's ids to the ranks that hold their rows, for
//                                  the all_to_all_v of a sharded table. mode "partition": shard
//                                  j on rank owners[j] holds rows [row_starts[j],
//                                  row_starts[j + 1]); each id goes to its shard's rank, made
//                                  local (minus row_starts[j]). mode "replicate": each id goes to
//                                  every rank of `owners` unchanged (column shards, replicas).
//                                  ids_out is packed by destination rank, in sample order within
//                                  each; lengths_out holds, per destination p, how many ids of
//                                  each local sample go to p (zeros for a rank that holds
//                                  nothing); send_counts[p] is ids_out's segment for p. The pools
//                                  come back by a second all_to_all_v: return_counts[p] is B for
//                                  every p on a rank in `owners` (it returns one pooled row per
//                                  sample of every peer), 0 elsewhere. An id outside [0, rows)
//                                  is a run-time error naming the table.
//   kiln.split_hot_ids(ids[B, H]) or (ids[M], lengths[B])
//       -> (hot[M'], hot_lengths[B], cold[M'], cold_lengths[B])   {table, rows, hot_rows}
//                                  splits a rank's ids by a table's hot rows (a hybrid table's
//                                  rows replicated on every rank; hot_rows ascending, distinct, in
//                                  [0, rows)): `hot` holds each hot id's position in hot_rows
//                                  (its row of the replica), `cold` the other ids unchanged, both
//                                  in sample order with how many of each sample's ids they hold.
//                                  M' is bounded by the ids' count. An id outside [0, rows) is a
//                                  run-time error naming the table.
//   kiln.dedup_ids(ids[B, H]) or (ids[M], lengths[B])
//       -> (unique[?(M)], inverse: i64 shaped like ids, send_counts: i64[N])
//       {ranks, rank, table, rows, owners, row_starts}
//                                  a de-duplicating route (TorchRec's input dedup, HugeCTR's
//                                  unique infrequent ids): each distinct id of the bags once,
//                                  to the rank of its shard (row_starts as bucketize_ids'
//                                  partition), made local. `unique` is packed by destination
//                                  rank, each shard's ids ascending; send_counts[p] is p's
//                                  segment; inverse[i] is the position in `unique` of id i (0
//                                  past the lengths' total), so every position of `unique` is
//                                  some id's. The owners send back one row per unique id and
//                                  the bags are pooled here, from those rows by `inverse`. An
//                                  id outside [0, rows) is a run-time error naming the table.
//   kiln.compact_rows(x[R, D], lengths[L]) -> (rows[?(L), D], counts: i64[N])   {ranks}
//                                  the rows of x whose sample has ids: lengths splits into N
//                                  equal blocks (one per rank), entry i standing for row i mod R
//                                  of x (R = L: each its own row; R = L / N: x again for each
//                                  block); `rows` packs, block after block, the rows with
//                                  lengths[i] > 0, and counts[p] is block p's share. The
//                                  all_to_all_v of a hybrid table's pools sends only these.
//   kiln.expand_rows(rows[M, D], lengths[L]) {blocks = K} -> [L / K, D]
//                                  the inverse, summed over K equal blocks of lengths: entry i
//                                  takes the next of `rows` where lengths[i] > 0 and adds it to
//                                  row i mod (L / K); rows no entry takes are zeros; every row of
//                                  `rows` must be used. K = 1 puts each row back in its place; K
//                                  = N sums a sample's partial pools from its N possible owners.
// `group` names the ranks; only "world" (all of them) runs today, sub-groups (a node's GPUs for
// table_row_wise) come with the plans that need them.
//
// Gradients, under the convention of data-parallel training: the loss is every rank's loss
// summed, L = sum_r L_r, and each rank holds the gradient of L with respect to its own values.
// Then all_reduce(sum) -> all_reduce(sum) of the gradient; all_gather <-> reduce_scatter (same
// axis); all_to_all -> all_to_all; all_to_all_v -> all_to_all_v of the rows' gradient with the
// send and receive counts swapped (the rows go back where they came from).
//
// Costs: bytes on the wire per rank for the ring algorithms NCCL and MPI use on large messages,
// with B the bytes of the full (unsplit) tensor: all_reduce 2(N-1)/N * B; reduce_scatter and
// all_gather (N-1)/N * B; all_to_all (N-1)/N * B. all_to_all_v counts its operand at its bound
// and assumes rows spread evenly over the peers.
#include "ir/collective.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/ops/grad_util.h"
#include "ir/ops/kernel_util.h"

namespace kiln::ir {
namespace {

using namespace kernels;
using CpuOperands = std::vector<const TensorView*>;
using CpuResults = std::vector<TensorView*>;

int64_t ranksOf(const Op& op) { return op.intAttr("ranks", 1); }

bool hasAxis(const Op& op) { return op.isAnyOf(OpCode::ReduceScatter, OpCode::AllGather); }

// Sums need an arithmetic type the communicators add (comm::fromIrDType): not i1 or fp8.
bool summable(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16 || t == DType::f64 || isInteger(t);
}
bool movable(DType t) { return summable(t) || t == DType::i1; }

Status checkGroup(const Op& op) {
  if (ranksOf(op) < 1) return Status::errorf("'{}' needs ranks >= 1, got {}", op.name(), ranksOf(op));
  if (op.strAttr("group", "world").empty()) return Status::errorf("'{}' has an empty group name", op.name());
  return Status::ok();
}

// Equal splits need a size every rank agrees on at compile time.
Status checkNoBoundedDims(const Op& op, const TensorType& t) {
  if (t.hasBoundedDims())
    return Status::errorf(
        "'{}' splits or sums {} evenly across ranks, so it cannot have a data-dependent "
        "dimension (kiln.all_to_all_v takes one)",
        op.name(), t.str());
  return Status::ok();
}

// The dim `d` (axis `axis` of t) split into n equal parts.
Expected<Dim> dividedDim(const Op& op, const TensorType& t, int64_t axis, int64_t n) {
  const Dim& d = t.dim(axis);
  if (d.factor() % n != 0)
    return Status::errorf("'{}' splits dim {} of {} ({}) into {} equal parts, but {} does not divide by {}",
                          op.name(), axis, t.str(), d.str(), n, d.str(), n);
  return d.isStatic() ? Dim::fixed(d.size() / n) : Dim::symbol(d.sym(), d.factor() / n);
}

Expected<int64_t> axisOf(const Op& op, const TensorType& t) {
  if (t.rank() == 0) return Status::errorf("'{}' needs an operand of rank >= 1, got {}", op.name(), t.str());
  return normalizeAxis(op, hasAxis(op) ? op.intAttr("axis", 0) : 0, t.rank());
}

Status inferCollective(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(checkGroup(op));
  const TensorType& x = op.operand(0)->type();
  const int64_t n = ranksOf(op);
  const bool sums = op.isAnyOf(OpCode::AllReduce, OpCode::ReduceScatter);
  if (sums ? !summable(x.dtype()) : !movable(x.dtype()))
    return Status::errorf("'{}' has no {} for element type {}", op.name(), sums ? "sum" : "transfer",
                          dtypeName(x.dtype()));
  KILN_RETURN_IF_ERROR(checkNoBoundedDims(op, x));
  if (op.is(OpCode::AllReduce)) {
    out = {x.withSharding(std::nullopt)};
    return Status::ok();
  }
  KILN_ASSIGN_OR_RETURN(int64_t axis, axisOf(op, x));
  Shape shape = x.shape();
  if (op.is(OpCode::AllGather)) {
    shape[static_cast<size_t>(axis)] = x.dim(axis).times(n);
  } else {
    // reduce_scatter gets one segment; all_to_all swaps equal segments and keeps the shape.
    KILN_ASSIGN_OR_RETURN(Dim part, dividedDim(op, x, axis, n));
    if (op.is(OpCode::ReduceScatter)) shape[static_cast<size_t>(axis)] = part;
  }
  out = {TensorType(x.dtype(), std::move(shape))};
  return Status::ok();
}

// all_to_all_v states its result types: the rows (dim 0 bounded or exact, the rest as the
// operand's) and the counts received, i64[ranks].
Status verifyAllToAllV(const Op& op) {
  KILN_RETURN_IF_ERROR(checkGroup(op));
  const int64_t n = ranksOf(op);
  const TensorType& x = op.operand(0)->type();
  const TensorType& counts = op.operand(1)->type();
  if (x.rank() == 0) return Status::errorf("'{}' needs rows of rank >= 1, got {}", op.name(), x.str());
  if (!movable(x.dtype()))
    return Status::errorf("'{}' has no transfer for element type {}", op.name(), dtypeName(x.dtype()));
  if (counts.rank() != 1 || !isInteger(counts.dtype()) || !counts.dim(0).isStatic() ||
      counts.dim(0).size() != n)
    return Status::errorf("'{}' send counts must be an integer tensor of {} elements (one per rank), got {}",
                          op.name(), n, counts.str());
  const TensorType& rows = op.result(0)->type();
  const TensorType& recv = op.result(1)->type();
  bool same_row_shape = rows.dtype() == x.dtype() && rows.rank() == x.rank();
  for (int64_t i = 1; same_row_shape && i < x.rank(); ++i) same_row_shape = rows.dim(i) == x.dim(i);
  if (!same_row_shape)
    return Status::errorf("'{}' result rows {} must have the element type and row shape of the operand {}",
                          op.name(), rows.str(), x.str());
  for (int64_t i = 1; i < x.rank(); ++i)
    if (x.dim(i).isBounded())
      return Status::errorf("'{}' rows {} may have a data-dependent size in dim 0 only", op.name(), x.str());
  const TensorType want_recv(DType::i64, {Dim::fixed(n)});
  if (!(recv.withSharding(std::nullopt) == want_recv))
    return Status::errorf("'{}' receive counts must be {}, got {}", op.name(), want_recv.str(), recv.str());
  return Status::ok();
}

// The shard pass's routing and row moves: no arithmetic, their operands read and results written.
OpCost costRouting(const Op& op, const SymbolBindings& symbols) {
  return OpCost{0, operandAndResultBytes(op, symbols)};
}

// ---- bucketize_ids ---------------------------------------------------------------------------

// The bags of ids [B, H] (one operand) or of ids[M] with lengths[B]: batch and id count.
Status bagDims(const Op& op, Dim& batch, Dim& count) {
  const TensorType& ids = op.operand(0)->type();
  if (!isInteger(ids.dtype())) return Status::errorf("'{}' ids must be integers, got {}", op.name(), ids.str());
  if (ids.rank() == 2 && op.numOperands() == 1) {
    if (!ids.dim(1).isStatic()) return Status::errorf("'{}' ids {} need a static hotness", op.name(), ids.str());
    batch = ids.dim(0);
    count = ids.dim(0).times(ids.dim(1).size());
  } else if (ids.rank() == 1 && op.numOperands() == 2) {
    const TensorType& lengths = op.operand(1)->type();
    if (lengths.rank() != 1 || !isInteger(lengths.dtype()))
      return Status::errorf("'{}' lengths must be a 1-d integer tensor, got {}", op.name(), lengths.str());
    batch = lengths.dim(0);
    count = ids.dim(0);
  } else {
    return Status::errorf("'{}' takes ids[B, H], or ids[M] with lengths[B]", op.name());
  }
  return Status::ok();
}


bool replicates(const Op& op) { return op.strAttr("mode", "partition") == "replicate"; }

// The owners of a route (ranks of the group) and, partitioning, their row blocks' starts.
Status checkRouting(const Op& op, bool partition) {
  const int64_t n = ranksOf(op);
  const std::vector<int64_t> owners = op.intsAttr("owners");
  const std::vector<int64_t> starts = op.intsAttr("row_starts");
  if (n < 1 || owners.empty()) return Status::errorf("'{}' needs ranks >= 1 and at least one owner", op.name());
  for (int64_t o : owners)
    if (o < 0 || o >= n) return Status::errorf("'{}' owner {} is not a rank of {}", op.name(), o, n);
  if (!partition) return Status::ok();
  if (starts.size() != owners.size() + 1)
    return Status::errorf("'{}' has {} owners but {} row_starts (want one more than owners)", op.name(),
                          owners.size(), starts.size());
  for (size_t j = 0; j + 1 < starts.size(); ++j)
    if (starts[j] > starts[j + 1] || starts[j] < 0)
      return Status::errorf("'{}' row_starts {} must rise from 0", op.name(), shapeString(starts));
  return Status::ok();
}

Status inferBucketizeIds(const Op& op, std::vector<TensorType>& out) {
  const int64_t n = ranksOf(op);
  const std::vector<int64_t> owners = op.intsAttr("owners");
  KILN_RETURN_IF_ERROR(checkRouting(op, !replicates(op)));
  Dim batch, count;
  KILN_RETURN_IF_ERROR(bagDims(op, batch, count));
  if (batch.isBounded())
    return Status::errorf("'{}' needs a batch dim that is not data-dependent", op.name());
  if (replicates(op)) count = count.times(static_cast<int64_t>(owners.size()));
  // Partitioned ids arrive in full (each goes to exactly one rank); the types say how many.
  const TensorType counts(DType::i64, {Dim::fixed(n)});
  out = {TensorType(DType::i64, {count}), TensorType(DType::i64, {batch.times(n)}), counts, counts};
  return Status::ok();
}

Status cpuBucketizeIds(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const int64_t n = ranksOf(op);
  const std::vector<int64_t> owners = op.intsAttr("owners");
  const std::vector<int64_t> starts = op.intsAttr("row_starts");
  const int64_t rows = op.intAttr("rows", 0);
  const bool replicate = replicates(op);
  const TensorView& ids = *in[0];
  // Bag b holds ids [begin[b], begin[b + 1]).
  std::vector<int64_t> begin;
  if (in.size() == 1) {
    const int64_t h = ids.shape[1];
    for (int64_t b = 0; b <= ids.shape[0]; ++b) begin.push_back(b * h);
  } else {
    begin.push_back(0);
    for (int64_t b = 0; b < in[1]->shape[0]; ++b) {
      const int64_t len = loadIndex(*in[1], b);
      if (len < 0)
        return Status::errorf("'{}' of table '{}': sample {} has negative length {}", op.name(),
                              op.strAttr("table"), b, len);
      begin.push_back(begin.back() + len);
    }
    if (begin.back() > ids.numel())
      return Status::errorf("'{}' of table '{}': lengths add up to {} ids but the batch has {}", op.name(),
                            op.strAttr("table"), begin.back(), ids.numel());
  }
  const int64_t batch = static_cast<int64_t>(begin.size()) - 1;
  // The shard of each id, checked once: the owner's position j in `owners`.
  const int64_t total = begin.back();
  std::vector<int32_t> shard(static_cast<size_t>(total), 0);
  for (int64_t i = 0; i < total; ++i) {
    const int64_t id = loadIndex(ids, i);
    if (id < 0 || id >= rows)
      return Status::errorf("'{}': id {} at position {} is out of range for table '{}' of {} rows", op.name(),
                            id, i, op.strAttr("table"), rows);
    if (!replicate)
      shard[static_cast<size_t>(i)] =
          static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end() - 1, id) - starts.begin() - 1);
  }
  auto* out_ids = static_cast<int64_t*>(out[0]->data);
  auto* out_len = static_cast<int64_t*>(out[1]->data);
  auto* send = static_cast<int64_t*>(out[2]->data);
  auto* ret = static_cast<int64_t*>(out[3]->data);
  std::fill(out_len, out_len + n * batch, int64_t{0});
  int64_t w = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t start = w;
    for (size_t j = 0; j < owners.size(); ++j) {
      if (owners[j] != p) continue;
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = begin[static_cast<size_t>(b)]; i < begin[static_cast<size_t>(b) + 1]; ++i) {
          if (!replicate && shard[static_cast<size_t>(i)] != static_cast<int32_t>(j)) continue;
          out_ids[w++] = loadIndex(ids, i) - (replicate ? 0 : starts[j]);
          ++out_len[p * batch + b];
        }
    }
    send[p] = w - start;
  }
  const bool owner = std::find(owners.begin(), owners.end(), op.intAttr("rank", 0)) != owners.end();
  for (int64_t p = 0; p < n; ++p) ret[p] = owner ? batch : 0;
  std::vector<int64_t> shape = out[0]->shape;
  shape[0] = w;
  return setResultShape(op, *out[0], shape);
}

// ---- split_hot_ids ----------------------------------------------------------------------------

Status inferSplitHotIds(const Op& op, std::vector<TensorType>& out) {
  const int64_t rows = op.intAttr("rows", 0);
  const std::vector<int64_t> hot = op.intsAttr("hot_rows");
  for (size_t i = 0; i < hot.size(); ++i)
    if (hot[i] < 0 || hot[i] >= rows || (i > 0 && hot[i] <= hot[i - 1]))
      return Status::errorf("'{}' of table '{}': hot_rows must be distinct rows in [0, {}), ascending; "
                            "entry {} is {}",
                            op.name(), op.strAttr("table"), rows, i, hot[i]);
  Dim batch, count;
  KILN_RETURN_IF_ERROR(bagDims(op, batch, count));
  const TensorType ids(DType::i64, {Dim::bounded(count.upperBound())}), lengths(DType::i64, {batch});
  out = {ids, lengths, ids, lengths};
  return Status::ok();
}

Status cpuSplitHotIds(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const std::vector<int64_t> hot = op.intsAttr("hot_rows");
  const int64_t rows = op.intAttr("rows", 0);
  const TensorView& ids = *in[0];
  const int64_t batch = in.size() == 1 ? ids.shape[0] : in[1]->shape[0];
  const int64_t per_sample = in.size() == 1 ? ids.shape[1] : 0;
  auto* hot_ids = static_cast<int64_t*>(out[0]->data);
  auto* hot_len = static_cast<int64_t*>(out[1]->data);
  auto* cold_ids = static_cast<int64_t*>(out[2]->data);
  auto* cold_len = static_cast<int64_t*>(out[3]->data);
  int64_t at = 0, h = 0, c = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = in.size() == 1 ? per_sample : loadIndex(*in[1], b);
    if (len < 0 || at + len > ids.numel())
      return Status::errorf("'{}' of table '{}': sample {} has length {} with {} of {} ids left", op.name(),
                            op.strAttr("table"), b, len, ids.numel() - at, ids.numel());
    hot_len[b] = cold_len[b] = 0;
    for (int64_t k = 0; k < len; ++k, ++at) {
      const int64_t id = loadIndex(ids, at);
      if (id < 0 || id >= rows)
        return Status::errorf("'{}': id {} at position {} is out of range for table '{}' of {} rows", op.name(),
                              id, at, op.strAttr("table"), rows);
      auto it = std::lower_bound(hot.begin(), hot.end(), id);
      if (it != hot.end() && *it == id) {
        hot_ids[h++] = it - hot.begin();
        ++hot_len[b];
      } else {
        cold_ids[c++] = id;
        ++cold_len[b];
      }
    }
  }
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], {h}));
  return setResultShape(op, *out[2], {c});
}

// ---- dedup_ids --------------------------------------------------------------------------------

Status inferDedupIds(const Op& op, std::vector<TensorType>& out) {
  KILN_RETURN_IF_ERROR(checkRouting(op, /*partition=*/true));
  Dim batch, count;
  KILN_RETURN_IF_ERROR(bagDims(op, batch, count));
  out = {TensorType(DType::i64, {Dim::bounded(count.upperBound())}),
         TensorType(DType::i64, op.operand(0)->type().shape()), TensorType(DType::i64, {Dim::fixed(ranksOf(op))})};
  return Status::ok();
}

Status cpuDedupIds(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const int64_t n = ranksOf(op), rows = op.intAttr("rows", 0);
  const std::vector<int64_t> owners = op.intsAttr("owners");
  const std::vector<int64_t> starts = op.intsAttr("row_starts");
  const TensorView& ids = *in[0];
  int64_t total = ids.numel();
  if (in.size() == 2) {
    total = 0;
    for (int64_t b = 0; b < in[1]->numel(); ++b) {
      const int64_t len = loadIndex(*in[1], b);
      if (len < 0)
        return Status::errorf("'{}' of table '{}': sample {} has negative length {}", op.name(), op.strAttr("table"),
                              b, len);
      total += len;
    }
    if (total > ids.numel())
      return Status::errorf("'{}' of table '{}': lengths add up to {} ids but the batch has {}", op.name(),
                            op.strAttr("table"), total, ids.numel());
  }
  std::vector<int64_t> distinct(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    const int64_t id = loadIndex(ids, i);
    if (id < 0 || id >= rows)
      return Status::errorf("'{}': id {} at position {} is out of range for table '{}' of {} rows", op.name(), id, i,
                            op.strAttr("table"), rows);
    distinct[static_cast<size_t>(i)] = id;
  }
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  // Shard j's distinct ids are the run [starts[j], starts[j + 1]) of the sorted ids; the runs go
  // out in destination order.
  auto* unique = static_cast<int64_t*>(out[0]->data);
  auto* send = static_cast<int64_t*>(out[2]->data);
  std::vector<int64_t> position(distinct.size());
  int64_t w = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t start = w;
    for (size_t j = 0; j < owners.size(); ++j) {
      if (owners[j] != p) continue;
      const auto lo = std::lower_bound(distinct.begin(), distinct.end(), starts[j]);
      const auto hi = std::lower_bound(distinct.begin(), distinct.end(), starts[j + 1]);
      for (auto it = lo; it != hi; ++it) {
        position[static_cast<size_t>(it - distinct.begin())] = w;
        unique[w++] = *it - starts[j];
      }
    }
    send[p] = w - start;
  }
  if (w != static_cast<int64_t>(distinct.size()))
    return Status::errorf("'{}' of table '{}': row_starts {} do not cover its ids", op.name(), op.strAttr("table"),
                          shapeString(starts));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[1], ids.shape));
  auto* inverse = static_cast<int64_t*>(out[1]->data);
  std::fill(inverse, inverse + ids.numel(), int64_t{0});
  for (int64_t i = 0; i < total; ++i) {
    const int64_t id = loadIndex(ids, i);
    inverse[i] = position[static_cast<size_t>(std::lower_bound(distinct.begin(), distinct.end(), id) - distinct.begin())];
  }
  return setResultShape(op, *out[0], {w});
}

// ---- compact_rows / expand_rows -------------------------------------------------------------

Status checkRowsAndLengths(const Op& op, const TensorType& x, const TensorType& lengths) {
  if (x.rank() != 2) return Status::errorf("'{}' rows must be [rows, D], got {}", op.name(), x.str());
  if (lengths.rank() != 1 || !isInteger(lengths.dtype()))
    return Status::errorf("'{}' lengths must be a 1-d integer tensor, got {}", op.name(), lengths.str());
  return Status::ok();
}

Status inferCompactRows(const Op& op, std::vector<TensorType>& out) {
  const TensorType& x = op.operand(0)->type();
  const TensorType& lengths = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(checkGroup(op));
  KILN_RETURN_IF_ERROR(checkRowsAndLengths(op, x, lengths));
  const int64_t n = ranksOf(op);
  if (lengths.dim(0).isStatic() && (lengths.dim(0).size() % n != 0))
    return Status::errorf("'{}' lengths {} do not split into {} blocks", op.name(), lengths.str(), n);
  out = {TensorType(x.dtype(), {Dim::bounded(lengths.dim(0).upperBound()), x.dim(1)}),
         TensorType(DType::i64, {Dim::fixed(n)})};
  return Status::ok();
}

Status cpuCompactRows(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& x = *in[0];
  const TensorView& lengths = *in[1];
  const int64_t n = ranksOf(op), total = lengths.numel(), rows = x.shape[0];
  if (total % n != 0 || rows == 0 || total % rows != 0)
    return Status::errorf("'{}': {} lengths do not split into {} blocks of rows of x's {}", op.name(), total, n, rows);
  const size_t row_bytes = static_cast<size_t>(x.shape[1]) * dtypeBytes(x.dtype);
  auto* dst = static_cast<char*>(out[0]->data);
  auto* counts = static_cast<int64_t*>(out[1]->data);
  const int64_t block = total / n;
  int64_t kept = 0;
  for (int64_t p = 0; p < n; ++p) {
    counts[p] = 0;
    for (int64_t i = p * block; i < (p + 1) * block; ++i) {
      if (loadIndex(lengths, i) <= 0) continue;
      std::memcpy(dst + static_cast<size_t>(kept++) * row_bytes,
                  static_cast<const char*>(x.data) + static_cast<size_t>(i % rows) * row_bytes, row_bytes);
      ++counts[p];
    }
  }
  return setResultShape(op, *out[0], {kept, x.shape[1]});
}

Status inferExpandRows(const Op& op, std::vector<TensorType>& out) {
  const TensorType& rows = op.operand(0)->type();
  const TensorType& lengths = op.operand(1)->type();
  KILN_RETURN_IF_ERROR(checkRowsAndLengths(op, rows, lengths));
  if (lengths.dim(0).isBounded())
    return Status::errorf("'{}' needs lengths whose size is not data-dependent, got {}", op.name(), lengths.str());
  if (!isFloat(rows.dtype())) return Status::errorf("'{}' sums float rows, got {}", op.name(), rows.str());
  const int64_t k = op.intAttr("blocks", 1);
  if (k < 1) return Status::errorf("'{}' needs blocks >= 1, got {}", op.name(), k);
  Dim per_block = lengths.dim(0);
  if (k > 1) {
    // lengths of N * B (the shard pass's), or a static size K divides.
    const Dim& l = lengths.dim(0);
    if (l.factor() % k != 0)
      return Status::errorf("'{}' lengths {} do not split into {} blocks", op.name(), lengths.str(), k);
    per_block = l.isStatic() ? Dim::fixed(l.size() / k) : Dim::symbol(l.sym(), l.factor() / k);
  }
  out = {TensorType(rows.dtype(), {per_block, rows.dim(1)})};
  return Status::ok();
}

Status cpuExpandRows(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext&) {
  const TensorView& rows = *in[0];
  const TensorView& lengths = *in[1];
  TensorView& r = *out[0];
  const int64_t d = rows.shape[1], per_block = r.shape[0];
  int64_t next = 0;
  return visitFloat(op, rows.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    const auto* src = data<T>(rows);
    std::vector<double> acc(static_cast<size_t>(per_block * d), 0.0);
    for (int64_t i = 0; i < lengths.numel(); ++i) {
      if (loadIndex(lengths, i) <= 0) continue;
      if (next == rows.shape[0])
        return Status::errorf("'{}': {} rows arrived but more samples have ids", op.name(), rows.shape[0]);
      double* dst = acc.data() + (i % per_block) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] += static_cast<double>(T::load(src[next * d + j]));
      ++next;
    }
    if (next != rows.shape[0])
      return Status::errorf("'{}': {} rows arrived but only {} samples have ids", op.name(), rows.shape[0], next);
    auto* pr = data<T>(r);
    for (size_t i = 0; i < acc.size(); ++i) pr[i] = T::store(acc[i]);
    return Status::ok();
  });
}

// ---- Costs ------------------------------------------------------------------------------------

OpCost costCollective(const Op& op, const SymbolBindings& symbols) {
  OpCost c;
  c.bytes = operandAndResultBytes(op, symbols);
  const double n = static_cast<double>(ranksOf(op));
  const double share = (n - 1) / n;
  // The full tensor: the operand, except for all_gather whose result is the full one.
  const double full =
      typeBytes(op.is(OpCode::AllGather) ? op.result()->type() : op.operand(0)->type(), symbols);
  c.comm_bytes = (op.is(OpCode::AllReduce) ? 2 * share : share) * full;
  // An all_to_all_v's rows are a bound; the shard pass may say what share of it a step is
  // expected to fill (a hybrid table's cold ids and pools, from the plan's data sample).
  if (op.is(OpCode::AllToAllV)) {
    const double fill = std::clamp(op.floatAttr("expected_fill", 1.0), 0.0, 1.0);
    c.comm_bytes *= fill;
    c.bytes *= fill;
  }
  // A ring's reduce-scatter phase adds (N-1)/N of the elements on each rank.
  if (op.isAnyOf(OpCode::AllReduce, OpCode::ReduceScatter))
    c.flops = share * typeElements(op.operand(0)->type(), symbols);
  return c;
}

// ---- Gradients --------------------------------------------------------------------------------

AttrDict groupAttrs(const Op& op) {
  AttrDict a{{"ranks", Attribute(ranksOf(op))}, {"group", Attribute(op.strAttr("group", "world"))}};
  if (hasAxis(op)) a["axis"] = Attribute(op.intAttr("axis", 0));
  return a;
}

Status gradCollective(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* dy = ctx.result_grads.empty() ? nullptr : ctx.result_grads[0];
  if (!dy || !isFloat(op.operand(0)->type().dtype())) return Status::ok();
  OpCode adjoint = op.opcode();
  if (op.is(OpCode::AllGather)) adjoint = OpCode::ReduceScatter;
  if (op.is(OpCode::ReduceScatter)) adjoint = OpCode::AllGather;
  KILN_GRAD_VALUE(dx, ctx.builder.createValue(adjoint, {dy}, groupAttrs(op)));
  ctx.operand_grads[0] = dx;
  return Status::ok();
}

// The rows go back to the ranks they came from: each rank sends what it received from each peer
// (the forward's receive counts) and gets back what it sent (its send counts).
Status gradAllToAllV(GradContext& ctx, const Op& op) {
  grads::resetOperandGrads(ctx, op);
  Value* dy = ctx.result_grads.empty() ? nullptr : ctx.result_grads[0];
  if (!dy || !isFloat(op.operand(0)->type().dtype())) return Status::ok();
  const TensorType counts(DType::i64, {Dim::fixed(ranksOf(op))});
  auto back =
      ctx.builder.createWithTypes(OpCode::AllToAllV, {dy, op.result(1)},
                                  {op.operand(0)->type().withSharding(std::nullopt), counts}, groupAttrs(op));
  if (!back) return back.status();
  ctx.operand_grads[0] = (*back)->result(0);
  return Status::ok();
}

// ---- CPU reference ----------------------------------------------------------------------------

// The group the op runs over; null for a single rank without one (the identity).
Expected<RankGroup*> groupOf(const Op& op, const CpuContext& ctx) {
  const std::string group = op.strAttr("group", "world");
  if (group != "world")
    return Status::errorf("'{}' runs over rank group '{}', but only \"world\" runs yet", op.name(), group);
  const int64_t n = ranksOf(op);
  if (!ctx.ranks) {
    if (n == 1) return static_cast<RankGroup*>(nullptr);
    return Status::errorf("'{}' runs over {} ranks, but it was run without a rank group (a single rank)",
                          op.name(), n);
  }
  if (ctx.ranks->size() != n)
    return Status::errorf("'{}' runs over {} ranks, but its rank group has {}", op.name(), n,
                          ctx.ranks->size());
  return ctx.ranks;
}

// A tensor as [outer, d, inner] around `axis`, in elements.
struct AxisSplit {
  int64_t outer = 1, d = 1, inner = 1;
};
AxisSplit splitAt(const std::vector<int64_t>& shape, int64_t axis) {
  AxisSplit s;
  for (int64_t i = 0; i < static_cast<int64_t>(shape.size()); ++i) {
    const int64_t e = shape[static_cast<size_t>(i)];
    if (i < axis)
      s.outer *= e;
    else if (i == axis)
      s.d = e;
    else
      s.inner *= e;
  }
  return s;
}

Status cpuAllReduce(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext& ctx) {
  KILN_ASSIGN_OR_RETURN(RankGroup * g, groupOf(op, ctx));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], in[0]->shape));
  if (!g) {
    std::memcpy(out[0]->data, in[0]->data, static_cast<size_t>(in[0]->bytes()));
    return Status::ok();
  }
  return g->allReduceSum(in[0]->data, out[0]->data, in[0]->numel(), in[0]->dtype);
}

Status cpuAllToAll(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext& ctx) {
  KILN_ASSIGN_OR_RETURN(RankGroup * g, groupOf(op, ctx));
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], in[0]->shape));
  if (!g) {
    std::memcpy(out[0]->data, in[0]->data, static_cast<size_t>(in[0]->bytes()));
    return Status::ok();
  }
  // Dim 0 is outermost, so the segments are contiguous.
  return g->allToAll(in[0]->data, out[0]->data, in[0]->numel() / g->size(), in[0]->dtype);
}

Status cpuReduceScatter(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext& ctx) {
  KILN_ASSIGN_OR_RETURN(RankGroup * g, groupOf(op, ctx));
  const TensorView& x = *in[0];
  const int64_t axis = op.intAttr("axis", 0) < 0 ? op.intAttr("axis", 0) + x.rank() : op.intAttr("axis", 0);
  const int64_t n = ranksOf(op);
  const AxisSplit s = splitAt(x.shape, axis);
  std::vector<int64_t> shape = x.shape;
  shape[static_cast<size_t>(axis)] = s.d / n;
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], shape));
  if (!g) {
    std::memcpy(out[0]->data, x.data, static_cast<size_t>(x.bytes()));
    return Status::ok();
  }
  if (s.outer == 1) return g->reduceScatterSum(x.data, out[0]->data, out[0]->numel(), x.dtype);
  // Pack rank p's segment of every outer slice together: [n][outer][d / n][inner].
  const size_t chunk = static_cast<size_t>(s.d / n * s.inner * dtypeBytes(x.dtype));
  std::vector<unsigned char> packed(static_cast<size_t>(x.bytes()));
  const auto* src = static_cast<const unsigned char*>(x.data);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t o = 0; o < s.outer; ++o)
      std::memcpy(packed.data() + static_cast<size_t>(p * s.outer + o) * chunk,
                  src + static_cast<size_t>(o * n + p) * chunk, chunk);
  return g->reduceScatterSum(packed.data(), out[0]->data, out[0]->numel(), x.dtype);
}

Status cpuAllGather(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext& ctx) {
  KILN_ASSIGN_OR_RETURN(RankGroup * g, groupOf(op, ctx));
  const TensorView& x = *in[0];
  const int64_t axis = op.intAttr("axis", 0) < 0 ? op.intAttr("axis", 0) + x.rank() : op.intAttr("axis", 0);
  const int64_t n = ranksOf(op);
  const AxisSplit s = splitAt(x.shape, axis);
  std::vector<int64_t> shape = x.shape;
  shape[static_cast<size_t>(axis)] = s.d * n;
  KILN_RETURN_IF_ERROR(setResultShape(op, *out[0], shape));
  if (!g) {
    std::memcpy(out[0]->data, x.data, static_cast<size_t>(x.bytes()));
    return Status::ok();
  }
  if (s.outer == 1) return g->allGather(x.data, out[0]->data, x.numel(), x.dtype);
  // Received as [n][outer][d][inner]; the result is [outer][n * d][inner].
  std::vector<unsigned char> recv(static_cast<size_t>(x.bytes() * n));
  KILN_RETURN_IF_ERROR(g->allGather(x.data, recv.data(), x.numel(), x.dtype));
  const size_t chunk = static_cast<size_t>(s.d * s.inner * dtypeBytes(x.dtype));
  auto* dst = static_cast<unsigned char*>(out[0]->data);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t o = 0; o < s.outer; ++o)
      std::memcpy(dst + static_cast<size_t>(o * n + p) * chunk,
                  recv.data() + static_cast<size_t>(p * s.outer + o) * chunk, chunk);
  return Status::ok();
}

Status cpuAllToAllV(const Op& op, const CpuOperands& in, const CpuResults& out, const CpuContext& ctx) {
  KILN_ASSIGN_OR_RETURN(RankGroup * g, groupOf(op, ctx));
  const TensorView& x = *in[0];
  const int64_t n = ranksOf(op);
  const int64_t row_elems = splitAt(x.shape, 0).inner;
  std::vector<int64_t> send_rows;
  int64_t total_send = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t c = loadIndex(*in[1], p);
    if (c < 0) return Status::errorf("'{}' send count {} for rank {} is negative", op.name(), c, p);
    send_rows.push_back(c);
    total_send += c;
  }
  if (total_send != x.shape[0])
    return Status::errorf("'{}' send counts add up to {} rows but the operand has {}", op.name(), total_send,
                          x.shape[0]);
  std::vector<int64_t> recv_rows = send_rows;
  if (g) {
    KILN_ASSIGN_OR_RETURN(recv_rows, g->exchangeCounts(send_rows));
  }
  const int64_t total_recv = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  TensorView& rows = *out[0];
  const Dim& rows_dim = op.result(0)->type().dim(0);
  const int64_t capacity = rows.shape[0];
  if (rows_dim.isBounded() ? total_recv > capacity : total_recv != capacity) {
    const int me = g ? g->rank() : 0;
    return Status::errorf(
        "'{}' on rank {} receives {} rows ({} from each rank in order) but its result {} holds {}{}",
        op.name(), me, total_recv, shapeString(recv_rows), op.result(0)->type().str(),
        rows_dim.isBounded() ? "at most " : "exactly ", capacity);
  }
  std::vector<int64_t> shape = x.shape;
  shape[0] = total_recv;
  KILN_RETURN_IF_ERROR(setResultShape(op, rows, shape));
  auto* recv_counts = static_cast<int64_t*>(out[1]->data);
  for (int64_t p = 0; p < n; ++p) recv_counts[p] = recv_rows[static_cast<size_t>(p)];
  if (!g) {
    std::memcpy(rows.data, x.data, static_cast<size_t>(x.bytes()));
    return Status::ok();
  }
  std::vector<int64_t> send_elems, recv_elems;
  for (int64_t p = 0; p < n; ++p) {
    send_elems.push_back(send_rows[static_cast<size_t>(p)] * row_elems);
    recv_elems.push_back(recv_rows[static_cast<size_t>(p)] * row_elems);
  }
  return g->allToAllV(x.data, send_elems, rows.data, recv_elems, capacity * row_elems, x.dtype);
}

}  // namespace

bool isCollective(const Op& op) {
  return op.isAnyOf(OpCode::AllReduce, OpCode::ReduceScatter, OpCode::AllGather, OpCode::AllToAll,
                    OpCode::AllToAllV);
}

double collectiveSeconds(const Op& op, const SymbolBindings& symbols, const Target& target, LinkScope scope) {
  if (!isCollective(op) || !op.def() || !op.def()->cost) return 0;
  const int64_t n = ranksOf(op);
  if (n <= 1) return 0;
  const LinkRates& link = scope == LinkScope::intra_node ? target.intra_node : target.inter_node;
  // A ring pays a latency a step; an all_to_all posts its N-1 messages at once (NCCL's grouped
  // send/recv, MPI_Alltoallv) and pays one.
  const double steps = op.isAnyOf(OpCode::AllToAll, OpCode::AllToAllV) ? 1.0
                       : op.is(OpCode::AllReduce)                       ? 2.0 * static_cast<double>(n - 1)
                                                                        : static_cast<double>(n - 1);
  const double wire = op.def()->cost(op, symbols).comm_bytes;
  return steps * link.latency_s + (link.bytes_per_s > 0 ? wire / link.bytes_per_s : 0);
}

void registerCollectiveOps(OpRegistry& r) {
  using K = Attribute::Kind;
  const AttrSpec ranks{"ranks", K::Int, true};
  const AttrSpec group{"group", K::String, false, Attribute("world")};
  const AttrSpec axis{"axis", K::Int, false, Attribute(int64_t{0})};

  r.add({.name = "kiln.all_reduce",
         .summary = "Sum over the ranks of a group; every rank gets the sum",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {ranks, group},
         .infer = inferCollective,
         .cost = costCollective,
         .grad = gradCollective,
         .cpu = cpuAllReduce});

  r.add({.name = "kiln.reduce_scatter",
         .summary = "Sum over the ranks, each rank keeping its equal segment along `axis`",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {ranks, group, axis},
         .infer = inferCollective,
         .cost = costCollective,
         .grad = gradCollective,
         .cpu = cpuReduceScatter});

  r.add({.name = "kiln.all_gather",
         .summary = "Every rank's tensor, concatenated in rank order along `axis`",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {ranks, group, axis},
         .infer = inferCollective,
         .cost = costCollective,
         .grad = gradCollective,
         .cpu = cpuAllGather});

  r.add({.name = "kiln.all_to_all",
         .summary = "Equal splits of dim 0 exchanged: segment p goes to rank p",
         .min_operands = 1,
         .max_operands = 1,
         .attrs = {ranks, group},
         .infer = inferCollective,
         .cost = costCollective,
         .grad = gradCollective,
         .cpu = cpuAllToAll});

  r.add({.name = "kiln.bucketize_ids",
         .summary = "Routes ids to the ranks holding their rows (or to every holder), for all_to_all_v",
         .min_operands = 1,
         .max_operands = 2,
         .num_results = 4,
         .attrs = {ranks,
                   {"rank", K::Int, false, Attribute(int64_t{0})},
                   {"table", K::String, false, Attribute("")},
                   {"rows", K::Int, true},
                   {"mode", K::String, false, Attribute("partition"), {"partition", "replicate"}},
                   {"owners", K::Array, true},
                   {"row_starts", K::Array, false, Attribute(std::vector<Attribute>{})}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferBucketizeIds,
         .cost = costRouting,
         .cpu = cpuBucketizeIds});

  r.add({.name = "kiln.split_hot_ids",
         .summary = "Splits ids into a hybrid table's hot rows (as replica positions) and the cold rest",
         .min_operands = 1,
         .max_operands = 2,
         .num_results = 4,
         .attrs = {{"table", K::String, false, Attribute("")},
                   {"rows", K::Int, true},
                   {"hot_rows", K::Array, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferSplitHotIds,
         .cost = costRouting,
         .cpu = cpuSplitHotIds});

  r.add({.name = "kiln.dedup_ids",
         .summary = "Each distinct id once, to the rank of its shard, and every id's position among them",
         .min_operands = 1,
         .max_operands = 2,
         .num_results = 3,
         .attrs = {ranks,
                   {"rank", K::Int, false, Attribute(int64_t{0})},
                   {"table", K::String, false, Attribute("")},
                   {"rows", K::Int, true},
                   {"owners", K::Array, true},
                   {"row_starts", K::Array, true}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferDedupIds,
         .cost = costRouting,
         .cpu = cpuDedupIds});

  // Moves rows by lengths the shard pass's routing computed (it writes the backward itself, after
  // autodiff): no gradient of their own.
  r.add({.name = "kiln.compact_rows",
         .summary = "The rows of samples with ids, packed per rank block, and each block's count",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 2,
         .attrs = {ranks, group},
         .traits = kPure | kNonDifferentiable,
         .infer = inferCompactRows,
         .cost = costRouting,
         .cpu = cpuCompactRows});
  r.add({.name = "kiln.expand_rows",
         .summary = "Packed rows back to one row per sample, zeros for samples without ids",
         .min_operands = 2,
         .max_operands = 2,
         .attrs = {{"blocks", K::Int, false, Attribute(int64_t{1})}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferExpandRows,
         .cost = costRouting,
         .cpu = cpuExpandRows});

  r.add({.name = "kiln.all_to_all_v",
         .summary =
             "Rows exchanged by per-peer counts known at run time; gives the rows and the counts received",
         .min_operands = 2,
         .max_operands = 2,
         .num_results = 2,
         .attrs = {ranks, group, {"expected_fill", K::Float, false}},
         .traits = kTypeGiven,
         .verify = verifyAllToAllV,
         .cost = costCollective,
         .grad = gradAllToAllV,
         .cpu = cpuAllToAllV});
}

}  // namespace kiln::ir
