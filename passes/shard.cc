// The shard pass: rewrites one rank's @train_step and @forward for N ranks from a plan
// (passes/shard_plan.h). Each rank compiles its own program (options rank and ranks), so a
// table-wise table exists only on its rank and a row shard has its own rows; the collectives
// each program issues are the same, in the same order, on every rank.
//
// The batch symbol B is this rank's share of the global batch (N * B samples, rank r holding
// samples [r * B, (r + 1) * B)). Per table, by its sharding (k ranks hold it), as its kind
// (passes/sharding/) says: whether every rank holds it (the lookup stays local), whether its
// pieces are row blocks (ids by owner) or take every id, and how pools come back (PoolReturn):
//
//   forward, row_wise / table_wise / table_row_wise (shards own row blocks):
//     bucketize_ids(ids)          ids by owner, made local; per-owner lengths; counts
//     all_to_all(lengths)         each owner learns how many of its ids every global sample has
//     all_to_all_v(ids)           the ids reach their owners, in global sample order
//     embedding_bag(shard, ...)   on each owner: partial pools of all N * B samples
//     reduce_scatter(partials)    row_wise over all ranks: each rank sums its B samples
//     all_to_all_v(partials)      otherwise: each owner returns B rows to every rank, which
//                                 sums the k partials (table_wise: k = 1, nothing to sum)
//   forward, column_wise: bucketize_ids replicates every id to each of the k shard holders;
//     each returns its columns (all_to_all_v) and the rank puts the k pieces side by side.
//   forward, data_parallel: unchanged (the whole table on every rank).
//
//   backward: the pooled gradient goes where the pools came from (all_gather for row_wise over
//   all ranks, the reverse all_to_all_v otherwise), so each owner holds the gradient of every
//   global sample that touched its rows, and runs the fused sparse optimizer on the ids it
//   received: exactly the single-rank update of those rows. A data_parallel table gathers every
//   rank's ids and gradients, and every replica applies the same update.
//
//   dense parameters: every rank holds them; their gradients are all-reduced in buckets of
//   about `bucket_bytes` (DDP's 25 MB), each placed right after the last gradient it carries,
//   in the order the backward produces them.
//
//   hybrid tables (a plan entry's hot_rows): every rank holds a replica of the hot rows (and of
//   their optimizer state); split_hot_ids pools the hot ids there and sends only the cold ids by
//   the type's route; pools (and gradients) travel only for samples that sent an owner ids
//   (compact_rows / expand_rows around the all_to_all_v); the replica's gradient is a dense block
//   all-reduced in the dense buckets (embedding_bag_dense_grad) and its update visits every hot
//   row once, or, under lazy adam, is gathered as a data_parallel table's.
//
//   the pipelined step (ShardOptions::pipeline): each model-parallel lookup's route runs on the
//   next batch's ids (inputs "next.*") and is returned for the next step; this batch's routed
//   ids come in as inputs ("pipe.*"); @pipeline_prime routes the first batch.
//
//   MoE layers (passes/shard_experts.cc): with expert parallelism each rank holds E / ep experts
//   and the rows travel to their owners by all_to_all_v and back; in any case the balancing
//   losses and the per-expert counts (statistics, the expert-bias update) are the global batch's.
//
// The loss each rank computes is its local batch's. The global loss is the mean of the N local
// losses (unless a loss op sums over samples), so every gradient sent (pooled gradients, dense
// buckets) is scaled by 1/N first.
#include "passes/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "ir/builder.h"
#include "ir/checked.h"
#include "ir/collective.h"
#include "ir/op_def.h"
#include "ir/optimizer.h"
#include "passes/cost_model.h"
#include "passes/pass_registry.h"
#include "passes/shard_experts.h"

namespace kiln::passes {
namespace {

using ir::AttrDict;
using ir::Attribute;
using ir::Dim;
using ir::DType;
using ir::Op;
using ir::OpCode;
using ir::TensorType;
using ir::Value;

// What the lookup side of a table leaves for its update: where this rank's ids went and what
// came back.
struct Route {
  Value* ids = nullptr;            // the ids this rank holds rows for, of all N * B samples
  Value* lengths = nullptr;        // [N * B]: how many of them each global sample has
  Value* return_counts = nullptr;  // rows of pools this rank returns to each peer
  Value* back_counts = nullptr;    // rows each owner returned here (the gradients go back by them)
  // A hybrid table's hot ids of this rank's samples, as rows of the replica (split_hot_ids); the
  // fields above then route its cold ids.
  Value* hot_ids = nullptr;
  Value* hot_lengths = nullptr;
  // With `compact`, pools travel only for samples that sent ids (a hybrid table's: those with a
  // cold id), and `sent_lengths` ([N * B], per owner how many ids of each local sample went
  // there) says which.
  bool compact = false;
  Value* sent_lengths = nullptr;
  double pools_fill = 1;  // the share of samples expected to send ids (the cost model's)
  // De-duplicated (TablePlan::dedup): `ids` are the distinct ids peers sent here (one row back
  // for each), `return_counts` how many came from each peer; this rank's own ids are `inverse`
  // (each id's row among the rows brought back) pooled by `own_lengths`, and `send_counts` says
  // how many distinct ids went to each owner (their rows' gradients go back by them).
  bool dedup = false;
  Value* inverse = nullptr;
  Value* own_lengths = nullptr;
  Value* send_counts = nullptr;
  double rows_fill = 1;  // the share of the ids' bound expected to be distinct (the cost model's)
};

// A hybrid table's replica on this rank: the weight and each optimizer state, [hot rows, ...].
struct HotReplica {
  Value* weight = nullptr;
  std::map<const Value*, Value*> of;  // the table's parameter (weight or state) -> its replica
};

class Sharder {
 public:
  Sharder(const ShardOptions& o, const ShardPlan& plan, const std::vector<TableInfo>& tables)
      : o_(o), plan_(plan) {
    for (const TableInfo& t : tables) info_[t.name] = &t;
  }

  Status run(ir::Function& f);
  void setPipelined(bool p) { pipelined_ = p; }
  const ExpertShardResult& experts() const { return experts_; }
  // The pipelined step's carried values, each with the input of the next step that receives it.
  const std::vector<std::pair<std::string, Value*>>& carries() const { return carries_; }

 private:
  const TableShard* mine(const TablePlan& t) const {
    for (const TableShard& s : t.shards)
      if (s.rank == o_.rank) return &s;
    return nullptr;
  }
  // How t's pools come back to the ranks, and its gradients go out (its kind's choice).
  PoolReturn poolReturn(const TablePlan& t) const { return t.kind().poolReturn(t, o_.ranks); }
  // A hybrid table's pools travel only for the samples that sent ids (Route::compact): from row
  // blocks, to which a sample sends ids only where some lie in the block.
  static bool compacts(const TablePlan& t) { return !t.hot.ids.empty() && t.kind().rowBlocks() && !t.dedup; }
  int64_t holders(const TablePlan& t) const { return static_cast<int64_t>(t.shards.size()); }

  Status located(const Op& op, Status s) const { return std::move(s).withLocation(op.location()); }
  AttrDict group() const { return {{"ranks", Attribute(int64_t{o_.ranks})}, {"group", Attribute("world")}}; }
  TensorType countsType() const { return TensorType(DType::i64, {Dim::fixed(o_.ranks)}); }
  AttrDict groupAxis0() const {
    AttrDict a = group();
    a["axis"] = Attribute(int64_t{0});
    return a;
  }

  Status retypeParameters(ir::Function& f);
  Status addHotReplica(Op& param, const TablePlan& t);
  Expected<Route> route(const TablePlan& t, Value* ids, Value* lengths);
  // The ranks of t's shards in shard order and, for row blocks, where each block starts (then
  // where the last ends); column shards and replicas take every id: no starts.
  static void shardOwners(const TablePlan& t, std::vector<int64_t>& owners, std::vector<int64_t>& starts);
  // Ids to the ranks `owners`: by row blocks starting at `starts` (one more entry, the end), or
  // every id to every owner when `starts` is empty.
  Expected<Route> routeTo(const std::string& table, int64_t table_rows, const std::vector<int64_t>& owners,
                          const std::vector<int64_t>& starts, Value* ids, Value* lengths);
  // Each distinct id once to its owner (TablePlan::dedup).
  Expected<Route> routeUnique(const TablePlan& t, Value* ids, Value* lengths);
  // A de-duplicated lookup: the owners' rows of the distinct ids, pooled here.
  Expected<Value*> pooledFromUniqueRows(const TablePlan& t, const Route& r, Value* table, const TensorType& pooled);
  Expected<Value*> pooledByOwners(const TablePlan& t, Route& r, Value* table, const TensorType& pooled);
  // The route a pipelined step reads: each of `next`'s values handed over by the previous step.
  Expected<Route> carriedRoute(const TablePlan& t, const Route& next);
  static std::vector<Value*> updateOperands(const Op& update, const ir::EmbeddingUpdateLayout& l, Value* ids,
                                            Value* lengths, Value* grads);
  Status lowerUniqueUpdate(Op& update, const ir::EmbeddingUpdateLayout& l, const TablePlan& t, const Route& r,
                           Value* grad);
  Status lowerHotUpdate(Op& update, const ir::EmbeddingUpdateLayout& l, const TablePlan& t, const Route& r,
                        Value* scaled_grad, Value* gathered_grad);
  // The bound of a rank's (cold) ids of `ids`: [B, H] or flat.
  static Dim idsBound(const Value* ids) {
    return ids->type().rank() == 2 ? ids->type().dim(0).times(ids->type().dim(1).size())
                                   : ids->type().dim(0).upperBound();
  }
  Status lowerLookup(Op& bag, const TablePlan& t);
  Status lowerUpdate(Op& update, const TablePlan& t);
  Status reduceDenseGradients(ir::Function& f);
  Expected<Value*> scaled(Value* grad);
  Expected<Value*> zeros(TensorType t);
  // x viewed as `blocks` [a, b, c], its first two axes swapped, viewed as `result`: samples'
  // column pieces into holder order and back.
  Expected<Value*> swapBlocks(Value* x, const TensorType& blocks, const TensorType& result);

  const ShardOptions& o_;
  const ShardPlan& plan_;
  std::map<std::string, const TableInfo*> info_;
  ir::Builder b_;
  double grad_scale_ = 1;
  // Per (table, ids value) of the forward: its route, for the update of the same lookup.
  std::map<std::pair<std::string, const Value*>, Route> routes_;
  std::vector<Op*> dropped_params_;
  std::map<std::string, HotReplica> hot_;  // per hybrid table
  double ids_fill_ = 1;                    // the expected_fill of the ids' all_to_all_v routeTo adds
  // The pipelined step: the next batch's input of each data input read, and what this step
  // hands the next (each carried value and the input that receives it).
  bool pipelined_ = false;
  std::map<const Value*, Value*> next_;
  std::vector<std::pair<std::string, Value*>> carries_;
  Expected<Value*> nextOf(Value* v, const Op& at);
  Expected<Op*> splitHot(const TablePlan& t, Value* ids, Value* lengths);
  Expected<Value*> carried(const std::string& name, Value* next_value);
  // Gradients all-reduced in the dense buckets besides the dense parameters': a hybrid table's
  // hot rows (operand `operand` of `user`).
  struct DenseGrad {
    Op* user;
    unsigned operand;
  };
  std::vector<DenseGrad> hot_grads_;
  ExpertShardResult experts_;
  int buckets_ = 0;
};

Expected<Value*> Sharder::zeros(TensorType t) {
  KILN_ASSIGN_OR_RETURN(
      Op * c, b_.createWithTypes(OpCode::Constant, {}, {std::move(t)}, {{"value", Attribute(0.0)}}));
  return c->result();
}

Expected<Value*> Sharder::swapBlocks(Value* x, const TensorType& blocks, const TensorType& result) {
  KILN_ASSIGN_OR_RETURN(Op * split, b_.createWithTypes(OpCode::Reshape, {x}, {blocks}));
  KILN_ASSIGN_OR_RETURN(Value * swapped,
                        b_.createValue(OpCode::Transpose, {split->result()}, {{"perm", Attribute::ints({1, 0, 2})}}));
  KILN_ASSIGN_OR_RETURN(Op * joined, b_.createWithTypes(OpCode::Reshape, {swapped}, {result}));
  return joined->result();
}

Expected<Value*> Sharder::scaled(Value* grad) { return scaledGradient(b_, grad, grad_scale_); }

// A held table and its optimizer state take their shard's shape, keeping the global name and
// recording where they lie (global_shape, offset: the checkpoint writer's and the initializer's
// view); those this rank does not hold go once their users are rewritten.
Status Sharder::retypeParameters(ir::Function& f) {
  for (Op* op : f.entry().opList()) {
    if (!op->is(OpCode::Parameter)) continue;
    std::string table = op->strAttr("state_of");
    if (table.empty() || !info_.count(table)) table = op->strAttr("name");
    const TablePlan* t = plan_.find(table);
    if (!t || !info_.count(table) || t->kind().replicated()) continue;
    if (!t->hot.ids.empty()) KILN_RETURN_IF_ERROR(addHotReplica(*op, *t));
    const TableShard* s = mine(*t);
    if (!s) {
      dropped_params_.push_back(op);
      continue;
    }
    const TensorType& old = op->result()->type();
    if (!old.isStatic())
      return located(*op, Status::errorf("sharded parameter {} needs a static shape", old.str()));
    std::vector<int64_t> global, offset{s->row_begin};
    ir::Shape shape{Dim::fixed(s->rows())};
    for (int64_t i = 0; i < old.rank(); ++i) global.push_back(old.dim(i).size());
    if (old.rank() >= 2) {
      shape.push_back(Dim::fixed(s->cols()));
      offset.push_back(s->col_begin);
    }
    op->result()->setType(TensorType(old.dtype(), std::move(shape)));
    op->setAttr("global_shape", Attribute::ints(global));
    op->setAttr("offset", Attribute::ints(offset));
    // A per-row state of column shards: every holder keeps the same copy of its rows'.
    if (old.rank() == 1 && poolReturn(*t) == PoolReturn::column_pieces && t->shards.size() > 1)
      op->setAttr("replicated", Attribute(true));
  }
  return Status::ok();
}

// A hybrid table's replica of `param` (the table or one of its optimizer states), on every rank:
// row i is row hot_rows[i] of the whole tensor. The initializer and the checkpoint read it through
// `hot_of` and `hot_rows` (runtime/parameter_store.cc, driver/session.cc); it is not a
// checkpoint tensor of its own.
Status Sharder::addHotReplica(Op& param, const TablePlan& t) {
  const TensorType& whole = param.result()->type();
  const std::string name = param.strAttr("name");
  ir::Shape shape{Dim::fixed(static_cast<int64_t>(t.hot.ids.size()))};
  std::vector<int64_t> global;
  for (int64_t i = 0; i < whole.rank(); ++i) {
    global.push_back(whole.dim(i).size());
    if (i > 0) shape.push_back(whole.dim(i));
  }
  AttrDict a = param.attrs();
  for (const char* key : {"embedding", "shard", "offset", "replicated"}) a.erase(key);
  a["name"] = Attribute(name + ".hot");
  a["hot_of"] = Attribute(name);
  a["hot_rows"] = Attribute::ints(t.hot.ids);
  a["global_shape"] = Attribute::ints(global);
  HotReplica& h = hot_[t.table];
  if (param.hasAttr("state_of")) a["state_of"] = Attribute(t.table + ".hot");
  // Right after the table's parameter (a terminator always follows).
  b_.setInsertionPoint(std::next(param.parentBlock()->find(&param))->get());
  b_.setLocation(param.location());
  KILN_ASSIGN_OR_RETURN(Op * replica, b_.createWithTypes(OpCode::Parameter, {}, {TensorType(whole.dtype(), shape)}, a));
  replica->result()->setNameHint(name + ".hot");
  h.of[param.result()] = replica->result();
  if (!param.hasAttr("state_of")) h.weight = replica->result();
  return Status::ok();
}

void Sharder::shardOwners(const TablePlan& t, std::vector<int64_t>& owners, std::vector<int64_t>& starts) {
  for (const TableShard& s : t.shards) {
    owners.push_back(s.rank);
    if (t.kind().rowBlocks()) starts.push_back(s.row_begin);
  }
  if (t.kind().rowBlocks()) starts.push_back(t.shards.back().row_end);
}

Expected<Route> Sharder::route(const TablePlan& t, Value* ids, Value* lengths) {
  std::vector<int64_t> owners, starts;
  shardOwners(t, owners, starts);
  return routeTo(t.table, info_.at(t.table)->rows, owners, starts, ids, lengths);
}

Expected<Route> Sharder::routeTo(const std::string& table, int64_t table_rows, const std::vector<int64_t>& owners,
                                 const std::vector<int64_t>& starts, Value* ids, Value* lengths) {
  const bool replicate = starts.empty();
  AttrDict a = group();
  a["rank"] = Attribute(int64_t{o_.rank});
  a["table"] = Attribute(table);
  a["rows"] = Attribute(table_rows);
  a["mode"] = Attribute(replicate ? "replicate" : "partition");
  a["owners"] = Attribute::ints(owners);
  if (!replicate) a["row_starts"] = Attribute::ints(starts);
  std::vector<Value*> in{ids};
  if (lengths) in.push_back(lengths);
  KILN_ASSIGN_OR_RETURN(Op * bucket, b_.create(OpCode::BucketizeIds, in, a));
  Route r;
  r.sent_lengths = bucket->result(1);
  KILN_ASSIGN_OR_RETURN(r.lengths, b_.createValue(OpCode::AllToAll, {bucket->result(1)}, group()));
  // Each peer sends at most all its ids (once to each holder): N times a rank's ids in all.
  const TensorType rows(DType::i64, {Dim::bounded(idsBound(ids).times(o_.ranks))});
  AttrDict moved_attrs = group();
  if (ids_fill_ < 1) moved_attrs["expected_fill"] = Attribute(ids_fill_);
  KILN_ASSIGN_OR_RETURN(Op * moved, b_.createWithTypes(OpCode::AllToAllV, {bucket->result(0), bucket->result(2)},
                                                       {rows, countsType()}, moved_attrs));
  r.ids = moved->result(0);
  r.return_counts = bucket->result(3);
  return r;
}

Expected<Route> Sharder::routeUnique(const TablePlan& t, Value* ids, Value* lengths) {
  AttrDict a = group();
  a["rank"] = Attribute(int64_t{o_.rank});
  a["table"] = Attribute(t.table);
  a["rows"] = Attribute(info_.at(t.table)->rows);
  std::vector<int64_t> owners, starts;
  shardOwners(t, owners, starts);
  a["owners"] = Attribute::ints(owners);
  a["row_starts"] = Attribute::ints(starts);
  std::vector<Value*> in{ids};
  if (lengths) in.push_back(lengths);
  KILN_ASSIGN_OR_RETURN(Op * dedup, b_.create(OpCode::DedupIds, in, a));
  AttrDict moved_attrs = group();
  if (ids_fill_ < 1) moved_attrs["expected_fill"] = Attribute(ids_fill_);
  const TensorType rows(DType::i64, {Dim::bounded(idsBound(ids).times(o_.ranks))});
  KILN_ASSIGN_OR_RETURN(Op * moved, b_.createWithTypes(OpCode::AllToAllV, {dedup->result(0), dedup->result(2)},
                                                       {rows, countsType()}, moved_attrs));
  Route r;
  r.dedup = true;
  r.rows_fill = ids_fill_;
  r.ids = moved->result(0);
  r.return_counts = moved->result(1);
  r.inverse = dedup->result(1);
  r.send_counts = dedup->result(2);
  return r;
}

Expected<Value*> Sharder::pooledFromUniqueRows(const TablePlan& t, const Route& r, Value* table,
                                              const TensorType& pooled) {
  const Dim cols = pooled.dim(1);
  Value* rows = nullptr;
  if (mine(t)) {
    KILN_ASSIGN_OR_RETURN(rows, b_.createValue(OpCode::Gather, {table, r.ids}, {{"axis", Attribute(int64_t{0})}}));
  } else {
    KILN_ASSIGN_OR_RETURN(rows, zeros(TensorType(pooled.dtype(), {Dim::fixed(0), cols})));
  }
  AttrDict back_attrs = group();
  if (r.rows_fill < 1) back_attrs["expected_fill"] = Attribute(r.rows_fill);
  const TensorType back_type(pooled.dtype(), {Dim::bounded(idsBound(r.inverse)), cols});
  KILN_ASSIGN_OR_RETURN(Op * back, b_.createWithTypes(OpCode::AllToAllV, {rows, r.return_counts},
                                                      {back_type, countsType()}, back_attrs));
  std::vector<Value*> in{back->result(0), r.inverse};
  if (r.own_lengths) in.push_back(r.own_lengths);
  return b_.createValue(OpCode::EmbeddingBag, in, {{"mode", Attribute("sum")}, {"table", Attribute(t.table)}});
}

// A hybrid table's split of (ids, lengths) into hot replica rows and cold ids.
Expected<Op*> Sharder::splitHot(const TablePlan& t, Value* ids, Value* lengths) {
  std::vector<Value*> in{ids};
  if (lengths) in.push_back(lengths);
  return b_.create(OpCode::SplitHotIds, in,
                   {{"table", Attribute(t.table)},
                    {"rows", Attribute(info_.at(t.table)->rows)},
                    {"hot_rows", Attribute::ints(t.hot.ids)}});
}

// The next batch's value of `v`, a data input: an input "next.<name>" beside it (made once).
Expected<Value*> Sharder::nextOf(Value* v, const Op& at) {
  if (auto it = next_.find(v); it != next_.end()) return it->second;
  Op* in = v->definingOp();
  if (!in || !in->is(OpCode::Input))
    return located(at, Status::error("the pipelined step routes the next batch's ids ahead, so a sharded table's "
                                     "ids must come straight from a data input"));
  AttrDict a = in->attrs();
  a["name"] = Attribute("next." + in->strAttr("name"));
  a["role"] = Attribute("pipeline");
  Op* before = b_.insertionPoint();
  b_.setInsertionPoint(std::next(in->parentBlock()->find(in))->get());
  KILN_ASSIGN_OR_RETURN(Op * next, b_.createWithTypes(OpCode::Input, {}, {v->type()}, a));
  b_.setInsertionPoint(before);
  next->result()->setNameHint("next." + in->strAttr("name"));
  next_[v] = next->result();
  return next->result();
}

// An input "pipe.<name>" of `next_value`'s type, which the step returns for the next step.
Expected<Value*> Sharder::carried(const std::string& name, Value* next_value) {
  KILN_ASSIGN_OR_RETURN(Op * in, b_.createWithTypes(OpCode::Input, {}, {next_value->type()},
                                                    {{"name", Attribute("pipe." + name)},
                                                     {"role", Attribute("pipeline")}}));
  in->result()->setNameHint("pipe." + name);
  carries_.push_back({"pipe." + name, next_value});
  return in->result();
}

Expected<Route> Sharder::carriedRoute(const TablePlan& t, const Route& next) {
  Route r;
  r.dedup = next.dedup;
  r.rows_fill = next.rows_fill;
  const std::pair<const char*, Value* Route::*> fields[] = {
      {"ids", &Route::ids},         {"lengths", &Route::lengths},          {"return_counts", &Route::return_counts},
      {"sent_lengths", &Route::sent_lengths}, {"inverse", &Route::inverse}, {"send_counts", &Route::send_counts}};
  for (const auto& [name, field] : fields) {
    if (!(next.*field)) continue;
    KILN_ASSIGN_OR_RETURN(r.*field, carried(t.table + "." + name, next.*field));
  }
  return r;
}

// The pools of this rank's samples from the owners of their ids: each owner pools the ids it
// received and sends the pools back (or reduce-scatters them), and the partials of row blocks
// are summed here.
Expected<Value*> Sharder::pooledByOwners(const TablePlan& t, Route& r, Value* table, const TensorType& pooled_type) {
  const Dim batch = pooled_type.dim(0);
  const int64_t dim = info_.at(t.table)->dim;
  const int64_t k = holders(t);
  const PoolReturn how = poolReturn(t);
  const int64_t cols = how == PoolReturn::column_pieces ? dim / k : dim;
  const bool reduce_scatter = how == PoolReturn::reduce_scatter;
  const TensorType partial_type(pooled_type.dtype(), {batch.times(o_.ranks), Dim::fixed(cols)});
  Value* partial = nullptr;
  if (mine(t)) {
    AttrDict a{{"mode", Attribute("sum")}, {"table", Attribute(t.table)}};
    KILN_ASSIGN_OR_RETURN(partial, b_.createValue(OpCode::EmbeddingBag, {table, r.ids, r.lengths}, a));
  } else {
    // Nothing to look up: an empty contribution (or zeros to the sum of a reduce_scatter).
    KILN_ASSIGN_OR_RETURN(
        partial, zeros(reduce_scatter ? partial_type
                                      : TensorType(pooled_type.dtype(), {Dim::fixed(0), Dim::fixed(cols)})));
  }
  if (reduce_scatter) return b_.createValue(OpCode::ReduceScatter, {partial}, groupAxis0());
  Value *send = partial, *send_counts = r.return_counts;
  if (r.compact && mine(t)) {
    // Only the pools of samples that sent ids here go back.
    KILN_ASSIGN_OR_RETURN(Op * c, b_.create(OpCode::CompactRows, {partial, r.lengths}, group()));
    send = c->result(0), send_counts = c->result(1);
  }
  const Dim back_rows = r.compact ? Dim::bounded(batch.times(k)) : batch.times(k);
  const TensorType back_type(pooled_type.dtype(), {back_rows, Dim::fixed(cols)});
  AttrDict back_attrs = group();
  if (r.compact && r.pools_fill < 1) back_attrs["expected_fill"] = Attribute(r.pools_fill);
  KILN_ASSIGN_OR_RETURN(Op * back, b_.createWithTypes(OpCode::AllToAllV, {send, send_counts},
                                                      {back_type, countsType()}, back_attrs));
  r.back_counts = back->result(1);
  Value* pooled = back->result(0);
  const TensorType pieces(pooled_type.dtype(), {Dim::fixed(k), batch, Dim::fixed(cols)});
  if (r.compact) {
    // Each sample's partials from the owners it sent ids to, summed in rank order.
    KILN_ASSIGN_OR_RETURN(pooled, b_.createValue(OpCode::ExpandRows, {pooled, r.sent_lengths},
                                                 {{"blocks", Attribute(int64_t{o_.ranks})}}));
  } else if (k > 1 && how == PoolReturn::column_pieces) {
    // Piece j holds columns [j * cols, (j + 1) * cols) of every sample: side by side.
    KILN_ASSIGN_OR_RETURN(pooled, swapBlocks(pooled, pieces, pooled_type));
  } else if (k > 1) {
    // Row blocks on k owners: each sample's pool is the sum of their partials, in rank order.
    KILN_ASSIGN_OR_RETURN(Op * split, b_.createWithTypes(OpCode::Reshape, {pooled}, {pieces}));
    KILN_ASSIGN_OR_RETURN(pooled, b_.createValue(OpCode::Reduce, {split->result()},
                                                 {{"kind", Attribute("sum")}, {"axes", Attribute::ints({0})}}));
  }
  return pooled;
}

Status Sharder::lowerLookup(Op& bag, const TablePlan& t) {
  if (bag.strAttr("mode", "sum") != "sum")
    return located(
        bag, Status::errorf("table '{}' is {}: sharding needs pool = sum (partial pools are summed across "
                            "ranks), got pool = {}",
                            t.table, shardingName(t.type), bag.strAttr("mode")));
  Value* ids = bag.operand(1);
  const bool flat = ids->type().rank() == 1;  // (ids, lengths) rather than ids[B, H]
  if (bag.numOperands() != (flat ? 3u : 2u))
    return located(
        bag, Status::errorf("table '{}': weighted lookups cannot be sharded yet (make it data_parallel)", t.table));
  Value* lengths = flat ? bag.operand(2) : nullptr;
  b_.setInsertionPoint(&bag);
  b_.setLocation(bag.location());
  // A hybrid table: the hot ids are looked up in this rank's replica, only the cold ones travel.
  Value* hot_pool = nullptr;
  Value *hot_ids = nullptr, *hot_lengths = nullptr;
  Value *cold_ids = ids, *cold_lengths = lengths;
  if (!t.hot.ids.empty()) {
    KILN_ASSIGN_OR_RETURN(Op * split, splitHot(t, ids, lengths));
    hot_ids = split->result(0), hot_lengths = split->result(1);
    cold_ids = split->result(2), cold_lengths = split->result(3);
    KILN_ASSIGN_OR_RETURN(hot_pool, b_.createValue(OpCode::EmbeddingBag, {hot_[t.table].weight, hot_ids, hot_lengths},
                                                   {{"mode", Attribute("sum")}, {"table", Attribute(t.table + ".hot")}}));
  }
  // The cost model's view of the cold exchanges: the shares the plan's data sample measured.
  ids_fill_ = (t.hot.ids.empty() ? 1.0 : 1 - t.hot.id_share) * (t.dedup ? t.unique_share : 1.0);
  Route r;
  if (!pipelined_) {
    KILN_ASSIGN_OR_RETURN(r, t.dedup ? routeUnique(t, cold_ids, cold_lengths) : route(t, cold_ids, cold_lengths));
  } else {
    // The next batch's (cold) ids take the route now; this batch's routed ids come in as the
    // previous step left them.
    KILN_ASSIGN_OR_RETURN(Value * next_ids, nextOf(ids, bag));
    Value* next_lengths = nullptr;
    if (lengths) {
      KILN_ASSIGN_OR_RETURN(next_lengths, nextOf(lengths, bag));
    }
    if (!t.hot.ids.empty()) {
      KILN_ASSIGN_OR_RETURN(Op * split, splitHot(t, next_ids, next_lengths));
      next_ids = split->result(2), next_lengths = split->result(3);
    }
    KILN_ASSIGN_OR_RETURN(Route next,
                          t.dedup ? routeUnique(t, next_ids, next_lengths) : route(t, next_ids, next_lengths));
    KILN_ASSIGN_OR_RETURN(r, carriedRoute(t, next));
  }
  r.hot_ids = hot_ids, r.hot_lengths = hot_lengths;
  r.compact = compacts(t);
  r.pools_fill = 1 - t.hot.sample_share;
  r.own_lengths = cold_lengths;
  Value* pooled = nullptr;
  if (r.dedup) {
    KILN_ASSIGN_OR_RETURN(pooled, pooledFromUniqueRows(t, r, bag.operand(0), bag.result()->type()));
  } else {
    KILN_ASSIGN_OR_RETURN(pooled, pooledByOwners(t, r, bag.operand(0), bag.result()->type()));
  }
  ids_fill_ = 1;
  if (hot_pool) {
    KILN_ASSIGN_OR_RETURN(pooled, b_.createValue(OpCode::Add, {hot_pool, pooled}));
  }
  bag.result()->replaceAllUsesWith(pooled);
  routes_[{t.table, ids}] = r;
  bag.parentBlock()->erase(&bag);
  return Status::ok();
}

Status Sharder::lowerUpdate(Op& update, const TablePlan& t) {
  auto layout = ir::embeddingUpdateLayout(update);
  if (!layout) return located(update, Status::errorf("table '{}': unknown sparse optimizer", t.table));
  const ir::EmbeddingUpdateLayout& l = *layout;
  if (l.weights >= 0)
    return located(update, Status::errorf("table '{}': weighted lookups cannot be sharded yet", t.table));
  if (l.grad_scale >= 0)
    return located(update,
                   Status::errorf("table '{}': grad_clip is not supported on several ranks yet", t.table));
  Value* ids = update.operand(static_cast<unsigned>(l.ids));
  Value* lengths = l.lengths >= 0 ? update.operand(static_cast<unsigned>(l.lengths)) : nullptr;
  b_.setInsertionPoint(&update);
  b_.setLocation(update.location());
  const PoolReturn how = poolReturn(t);
  Route r;
  if (how == PoolReturn::local) {
    // Nothing was routed for the lookup: the update gathers every rank's ids here.
    KILN_ASSIGN_OR_RETURN(r, route(t, ids, lengths));
  } else {
    auto it = routes_.find({t.table, ids});
    if (it == routes_.end())
      return located(
          update, Status::errorf("table '{}': its update has no lookup of the same ids before it", t.table));
    r = it->second;
  }
  // A column shard under rowwise_adagrad needs its rows' whole gradient: the row's statistic
  // spans every column.
  const bool whole_rows =
      how == PoolReturn::column_pieces && holders(t) > 1 && update.strAttr("optimizer") == "rowwise_adagrad";
  if (whole_rows && update.floatAttr("weight_decay") != 0)
    return located(update,
                   Status::errorf("table '{}': column_wise with rowwise_adagrad and weight_decay needs the "
                                  "other shards' weights; use row_wise or no weight decay",
                                  t.table));
  KILN_ASSIGN_OR_RETURN(Value * grad, scaled(update.operand(static_cast<unsigned>(l.grad_out))));
  const TensorType& gt = grad->type();
  const Dim batch = gt.dim(0);
  const int64_t k = holders(t);
  Value* grads = nullptr;  // the gradient of every global sample this rank's ids belong to
  if (r.dedup) {
    KILN_RETURN_IF_ERROR(lowerUniqueUpdate(update, l, t, r, grad));
  } else if (how == PoolReturn::local || how == PoolReturn::reduce_scatter) {
    KILN_ASSIGN_OR_RETURN(grads, b_.createValue(OpCode::AllGather, {grad}, groupAxis0()));
  } else if (r.compact) {
    // The gradients of the samples that sent ids, to the ranks they sent them to.
    KILN_ASSIGN_OR_RETURN(Op * c, b_.create(OpCode::CompactRows, {grad, r.sent_lengths}, group()));
    const Dim arrive = mine(t) ? Dim::bounded(batch.times(o_.ranks)) : Dim::fixed(0);
    AttrDict back_attrs = group();
    if (r.pools_fill < 1) back_attrs["expected_fill"] = Attribute(r.pools_fill);
    KILN_ASSIGN_OR_RETURN(Op * back, b_.createWithTypes(OpCode::AllToAllV, {c->result(0), c->result(1)},
                                                        {TensorType(gt.dtype(), {arrive, gt.dim(1)}), countsType()},
                                                        back_attrs));
    grads = back->result(0);
    if (mine(t)) {
      KILN_ASSIGN_OR_RETURN(grads, b_.createValue(OpCode::ExpandRows, {grads, r.lengths}));
    }
  } else {
    // Back the way the pools came: B rows to each owner (each its columns for column_wise, or
    // whole rows where rowwise_adagrad's statistic needs them).
    Value* send = grad;
    const int64_t dim = gt.dim(1).size();
    const bool own_columns = how == PoolReturn::column_pieces && !whole_rows;
    const int64_t cols = own_columns ? dim / k : dim;
    if (own_columns && k > 1) {
      // Each holder's columns of every sample, one holder after the other.
      KILN_ASSIGN_OR_RETURN(send, swapBlocks(grad, TensorType(gt.dtype(), {batch, Dim::fixed(k), Dim::fixed(cols)}),
                                             TensorType(gt.dtype(), {batch.times(k), Dim::fixed(cols)})));
    } else if (k > 1) {
      std::vector<Value*> copies(static_cast<size_t>(k), grad);
      KILN_ASSIGN_OR_RETURN(send, b_.createValue(OpCode::Concat, copies, {{"axis", Attribute(int64_t{0})}}));
    }
    const Dim arrive = mine(t) ? batch.times(o_.ranks) : Dim::fixed(0);
    KILN_ASSIGN_OR_RETURN(Op * back, b_.createWithTypes(OpCode::AllToAllV, {send, r.back_counts},
                                                        {TensorType(gt.dtype(), {arrive, Dim::fixed(cols)}), countsType()},
                                                        group()));
    grads = back->result(0);
  }
  if (!r.dedup && (how == PoolReturn::local || mine(t))) {
    // The same update over the ids this rank holds rows for, in the flat (ids, lengths) form.
    AttrDict attrs = update.attrs();
    if (whole_rows) attrs["column_offset"] = Attribute(mine(t)->col_begin);
    auto applied =
        b_.createWithTypes(OpCode::EmbeddingBagUpdate, updateOperands(update, l, r.ids, r.lengths, grads), {}, attrs);
    if (!applied) return applied.status();
  }
  if (r.hot_ids)
    KILN_RETURN_IF_ERROR(
        lowerHotUpdate(update, l, t, r, grad, how == PoolReturn::reduce_scatter ? grads : nullptr));
  update.parentBlock()->erase(&update);
  return Status::ok();
}

// `update`'s operands with its ids (and lengths, when given) and pooled gradient replaced.
std::vector<Value*> Sharder::updateOperands(const Op& update, const ir::EmbeddingUpdateLayout& l, Value* ids,
                                            Value* lengths, Value* grads) {
  std::vector<Value*> operands;
  for (unsigned i = 0; i < update.numOperands(); ++i) {
    const int idx = static_cast<int>(i);
    if (idx == l.ids) {
      operands.push_back(ids);
      if (lengths) operands.push_back(lengths);
    } else if (idx == l.grad_out) {
      operands.push_back(grads);
    } else if (idx != l.lengths) {
      operands.push_back(update.operand(i));
    }
  }
  return operands;
}

// The update of a de-duplicated table: each distinct id's gradient (its samples' pooled
// gradients summed, as embedding_bag's table gradient over the rows brought in) goes back to its
// owner, which updates the row once per peer that sent it.
Status Sharder::lowerUniqueUpdate(Op& update, const ir::EmbeddingUpdateLayout& l, const TablePlan& t,
                                  const Route& r, Value* grad) {
  std::vector<Value*> in{r.inverse};
  if (r.own_lengths) in.push_back(r.own_lengths);
  in.push_back(grad);
  KILN_ASSIGN_OR_RETURN(Value * rows_grad,
                        b_.createValue(OpCode::EmbeddingBagDenseGrad, in, {{"table", Attribute(t.table)}}));
  const TensorType& gt = rows_grad->type();
  const Dim arrive = mine(t) ? r.ids->type().dim(0) : Dim::fixed(0);
  AttrDict back_attrs = group();
  if (r.rows_fill < 1) back_attrs["expected_fill"] = Attribute(r.rows_fill);
  KILN_ASSIGN_OR_RETURN(Op * back, b_.createWithTypes(OpCode::AllToAllV, {rows_grad, r.send_counts},
                                                      {TensorType(gt.dtype(), {arrive, gt.dim(1)}), countsType()},
                                                      back_attrs));
  if (!mine(t)) return Status::ok();
  // Each distinct id a sample of its own: ids [rows, 1].
  KILN_ASSIGN_OR_RETURN(Op * ids, b_.createWithTypes(OpCode::Reshape, {r.ids},
                                                     {TensorType(DType::i64, {r.ids->type().dim(0), Dim::fixed(1)})}));
  auto applied = b_.createWithTypes(OpCode::EmbeddingBagUpdate,
                                    updateOperands(update, l, ids->result(), nullptr, back->result(0)), {},
                                    update.attrs());
  return applied ? Status::ok() : applied.status();
}

// The update of a hybrid table's replica, the same on every rank. Where the optimizer leaves a
// row without gradient alone (TableInfo::hot_dense_update), each rank's gradient of the hot rows
// is a dense [hot rows, dim] block, summed over the ranks in the dense gradient buckets, and the
// update visits every hot row once (row i as sample i, its ids the constant 0 .. hot rows - 1).
// Otherwise, as a data_parallel table: every rank's hot ids and pooled gradients reach every rank.
Status Sharder::lowerHotUpdate(Op& update, const ir::EmbeddingUpdateLayout& l, const TablePlan& t, const Route& r,
                               Value* scaled_grad, Value* gathered_grad) {
  const HotReplica& h = hot_.at(t.table);
  const int64_t rows = static_cast<int64_t>(t.hot.ids.size());
  const std::string name = t.table + ".hot";
  const bool dense = info_.at(t.table)->hot_dense_update;
  Value *ids = nullptr, *lengths = nullptr, *grads = nullptr;
  if (dense) {
    KILN_ASSIGN_OR_RETURN(
        grads, b_.createValue(OpCode::EmbeddingBagDenseGrad,
                              {r.hot_ids, r.hot_lengths, update.operand(static_cast<unsigned>(l.grad_out))},
                              {{"rows", Attribute(rows)}, {"table", Attribute(name)}}));
    std::vector<int64_t> each(static_cast<size_t>(rows));
    std::iota(each.begin(), each.end(), int64_t{0});
    KILN_ASSIGN_OR_RETURN(Op * c, b_.createWithTypes(OpCode::Constant, {},
                                                     {TensorType(DType::i64, {Dim::fixed(rows), Dim::fixed(1)})},
                                                     {{"value", Attribute::ints(each)}}));
    ids = c->result();
  } else {
    std::vector<int64_t> everyone(static_cast<size_t>(o_.ranks));
    std::iota(everyone.begin(), everyone.end(), int64_t{0});
    KILN_ASSIGN_OR_RETURN(Route hot, routeTo(name, rows, everyone, {}, r.hot_ids, r.hot_lengths));
    ids = hot.ids, lengths = hot.lengths;
    if (!gathered_grad) {
      KILN_ASSIGN_OR_RETURN(gathered_grad, b_.createValue(OpCode::AllGather, {scaled_grad}, groupAxis0()));
    }
    grads = gathered_grad;
  }
  std::vector<Value*> operands;
  unsigned grad_at = 0;
  for (unsigned i = 0; i < update.numOperands(); ++i) {
    const int idx = static_cast<int>(i);
    Value* v = update.operand(i);
    if (idx == l.table) {
      operands.push_back(h.weight);
    } else if (idx == l.ids) {
      operands.push_back(ids);
      if (lengths) operands.push_back(lengths);
    } else if (idx == l.lengths) {
      continue;
    } else if (idx == l.grad_out) {
      grad_at = static_cast<unsigned>(operands.size());
      operands.push_back(grads);
    } else if (idx >= l.state_begin && idx < l.state_begin + l.num_state) {
      auto it = h.of.find(v);
      if (it == h.of.end())
        return located(update, Status::errorf("table '{}': an optimizer state of its update is not a parameter, so "
                                              "its hot rows have no replica",
                                              t.table));
      operands.push_back(it->second);
    } else {
      operands.push_back(v);
    }
  }
  AttrDict attrs = update.attrs();
  attrs["table"] = Attribute(name);
  attrs.erase("column_offset");
  // The dense block's bucket is all-reduced after the last gradient it carries: the update goes
  // at the end of the step, after every bucket (and every lookup of the replica).
  Op* at = b_.insertionPoint();
  if (dense) b_.setInsertionPoint(update.parentBlock()->ops().back().get());
  KILN_ASSIGN_OR_RETURN(Op * applied, b_.createWithTypes(OpCode::EmbeddingBagUpdate, operands, {}, attrs));
  if (dense) hot_grads_.push_back({applied, grad_at});
  b_.setInsertionPoint(at);
  return Status::ok();
}

// Dense gradients, all-reduced in buckets in the order the backward produces them.
Status Sharder::reduceDenseGradients(ir::Function& f) {
  std::map<const Op*, size_t> pos;
  std::vector<Op*> ops = f.entry().opList();
  for (size_t i = 0; i < ops.size(); ++i) pos[ops[i]] = i;
  struct Grad {
    Op* update;
    unsigned operand;  // of `update`: the gradient
    Value* grad;
    size_t ready;
  };
  std::vector<Grad> grads;
  auto add = [&](Op* user, unsigned operand) {
    Value* g = user->operand(operand);
    const Op* def = g->definingOp();
    grads.push_back({user, operand, g, def && pos.count(def) ? pos[def] : 0});
  };
  for (Op* op : ops) {
    // Expert weights are reduced over the ranks that hold the same experts (shard_experts.cc).
    if (!op->is(OpCode::OptimizerUpdate) || experts_.expert_params.count(op->operand(0))) continue;
    if (op->boolAttr("scaled"))
      return located(*op, Status::error("grad_clip is not supported on several ranks yet"));
    add(op, 1);
  }
  for (const DenseGrad& g : hot_grads_) add(g.user, g.operand);
  std::stable_sort(grads.begin(), grads.end(),
                   [](const Grad& a, const Grad& b) { return a.ready < b.ready; });
  size_t i = 0;
  while (i < grads.size()) {
    // One bucket: gradients of one element type until it holds bucket_bytes.
    size_t j = i;
    int64_t bytes = 0;
    const DType dt = grads[i].grad->type().dtype();
    while (j < grads.size() && grads[j].grad->type().dtype() == dt && (j == i || bytes < o_.bucket_bytes)) {
      auto n = grads[j].grad->type().numElements({});
      if (!n)
        return located(*grads[j].update,
                       Status::error("a dense gradient needs a static shape on several ranks"));
      bytes += *n * static_cast<int64_t>(ir::dtypeBytes(dt));
      ++j;
    }
    // Right after the last of its gradients is computed.
    Op* last = grads[j - 1].grad->definingOp();
    auto it = last ? std::next(f.entry().find(last)) : f.entry().ops().begin();
    b_.setInsertionPoint(it->get());
    b_.setLocation(grads[i].update->location());
    if (j - i == 1) {
      KILN_ASSIGN_OR_RETURN(Value * sum, b_.createValue(OpCode::AllReduce, {grads[i].grad}, group()));
      KILN_ASSIGN_OR_RETURN(Value * mean, scaled(sum));
      grads[i].update->setOperand(grads[i].operand, mean);
    } else {
      std::vector<Value*> flat;
      std::vector<int64_t> sizes;
      for (size_t g = i; g < j; ++g) {
        const TensorType& t = grads[g].grad->type();
        const int64_t n = *t.numElements({});
        sizes.push_back(n);
        KILN_ASSIGN_OR_RETURN(Op * r, b_.createWithTypes(OpCode::Reshape, {grads[g].grad},
                                                         {TensorType(t.dtype(), {Dim::fixed(n)})}));
        flat.push_back(r->result());
      }
      KILN_ASSIGN_OR_RETURN(Value * bucket,
                            b_.createValue(OpCode::Concat, flat, {{"axis", Attribute(int64_t{0})}}));
      bucket->setNameHint(fmt::format("grad_bucket.{}", buckets_++));
      KILN_ASSIGN_OR_RETURN(Value * sum, b_.createValue(OpCode::AllReduce, {bucket}, group()));
      KILN_ASSIGN_OR_RETURN(Value * mean, scaled(sum));
      int64_t at = 0;
      for (size_t g = i; g < j; ++g) {
        const int64_t n = sizes[g - i];
        KILN_ASSIGN_OR_RETURN(Value * piece, b_.createValue(OpCode::Slice, {mean},
                                                            {{"axis", Attribute(int64_t{0})},
                                                             {"start", Attribute(at)},
                                                             {"limit", Attribute(at + n)}}));
        KILN_ASSIGN_OR_RETURN(
            Op * shaped,
            b_.createWithTypes(OpCode::Reshape, {piece}, {grads[g].grad->type().withSharding(std::nullopt)}));
        grads[g].update->setOperand(grads[g].operand, shaped->result());
        at += n;
      }
    }
    i = j;
  }
  return Status::ok();
}

Status Sharder::run(ir::Function& f) {
  routes_.clear();
  dropped_params_.clear();
  hot_.clear();
  hot_grads_.clear();
  next_.clear();
  carries_.clear();
  // The global batch's loss is the mean of the ranks' (a mean over samples, a reduce(mean) as
  // in mse, and whatever is added to it, such as MoE balancing losses); only a loss op that
  // sums over samples makes it their sum.
  grad_scale_ = 1.0 / o_.ranks;
  for (Op* op : f.entry().opList())
    if (op->isAnyOf(OpCode::BceWithLogits, OpCode::SoftmaxCrossEntropy) &&
        op->strAttr("reduction", "mean") == "sum")
      grad_scale_ = 1;
  KILN_RETURN_IF_ERROR(retypeParameters(f));
  // MoE layers: experts over ranks, global-batch balancing (passes/shard_experts.cc).
  KILN_ASSIGN_OR_RETURN(experts_, shardExperts(f, o_, grad_scale_));
  // A shared table's update reads the lookups of every feature side by side, which only a
  // replicated table can apply as it is (autodiff's combineSharedLookups).
  std::map<std::string, int> lookups;
  for (Op* op : f.entry().opList()) {
    if (!op->is(OpCode::EmbeddingBag)) continue;
    const TablePlan* t = plan_.find(op->strAttr("table"));
    if (t && !t->kind().replicated() && ++lookups[t->table] == 2)
      return located(*op,
                     Status::errorf("table '{}' is shared by several features and cannot be {} yet: a shared "
                                    "table trains on many ranks as data_parallel (shard = data_parallel)",
                                    t->table, shardingName(t->type)));
  }
  for (Op* op : f.entry().opList()) {
    if (!op->is(OpCode::EmbeddingBag)) continue;
    const TablePlan* t = plan_.find(op->strAttr("table"));
    if (t && !t->kind().replicated()) KILN_RETURN_IF_ERROR(lowerLookup(*op, *t));
  }
  for (Op* op : f.entry().opList()) {
    const TablePlan* t = plan_.find(op->strAttr("table"));
    if (op->is(OpCode::EmbeddingBagUpdate) && t) {
      KILN_RETURN_IF_ERROR(lowerUpdate(*op, *t));
    } else if (op->isAnyOf(OpCode::EmbeddingBagWeightGrad, OpCode::EmbeddingBagGradSqnorm) && t) {
      return located(
          *op, Status::errorf("table '{}': weighted lookups and grad_clip cannot be sharded yet", t->table));
    }
  }
  if (f.name() == "train_step") {
    KILN_RETURN_IF_ERROR(reduceDenseGradients(f));
  }
  for (Op* p : dropped_params_) {
    if (p->result()->hasUses())
      return located(*p, Status::errorf("parameter '{}' is not on rank {} but an op still uses it",
                                        p->strAttr("name"), o_.rank));
    f.entry().erase(p);
  }
  return Status::ok();
}

}  // namespace

Expected<Value*> scaledGradient(ir::Builder& b, Value* grad, double scale) {
  if (scale == 1) return grad;
  KILN_ASSIGN_OR_RETURN(Op * c,
                        b.createWithTypes(OpCode::Constant, {}, {TensorType(grad->type().dtype(), {})},
                                          {{"value", Attribute(scale)}}));
  return b.createValue(OpCode::Mul, {grad, c->result()});
}

Expected<ShardPlan> planFor(const std::vector<TableInfo>& tables, const ShardOptions& o) {
  ShardPlan plan;
  plan.ranks = o.ranks;
  plan.ranks_per_node = o.ranks_per_node;
  if (!o.sharding.empty()) {
    // Every table one way: the tests' and `kiln opt`'s plan, each table where its type puts it
    // (ShardingKind::uniformRanks; table_wise: round robin).
    auto type = parseShardingType(o.sharding);
    if (!type) return Status::errorf("shard: unknown sharding '{}' (use {})", o.sharding, shardingNames());
    UniformPlacement at;
    at.ranks = o.ranks;
    at.ranks_per_node = o.ranks_per_node > 0 ? o.ranks_per_node : o.ranks;
    for (size_t i = 0; i < tables.size(); ++i) {
      TablePlan t;
      t.table = tables[i].name;
      t.type = *type;
      at.index = i;
      t.ranks = shardingKind(*type).uniformRanks(tables[i], at);
      plan.tables.push_back(std::move(t));
    }
    KILN_RETURN_IF_ERROR(completePlan(plan, tables));
    return plan;
  }
  if (!o.plan_path.empty()) {
    std::ifstream in(o.plan_path, std::ios::binary);
    if (!in) return Status::errorf("cannot read plan file {}", o.plan_path);
    std::stringstream text;
    text << in.rdbuf();
    // Checked and laid out, its errors located in the file.
    return loadPlanJson(text.str(), o.plan_path, tables, o.ranks);
  }
  if (!o.proposed_plan.empty()) return loadPlanJson(o.proposed_plan, "the proposed plan (kiln.plan)", tables, o.ranks);
  KILN_ASSIGN_OR_RETURN(PlanRequest req, planRequestFor(o.target));
  req.ranks = o.ranks;
  req.ranks_per_node = o.ranks_per_node;
  req.memory_per_rank = o.memory_per_rank;
  req.global_batch = o.global_batch;
  return autoPlan(tables, req);
}

namespace {

// The pipelined step's hand-over: @train_step returns the carried values right after its loss
// and prediction (its statistics stay last), and @pipeline_prime, the part of the step that
// computes them from the "next.*" inputs alone, routes the first batch. kiln.pipeline names the
// carried inputs in the order both return them.
Status pipelineStep(ir::Module& m, ir::Function& step, const std::vector<std::pair<std::string, Value*>>& carries) {
  Op* ret = step.returnOp();
  if (!ret || ret->numOperands() < 2)
    return Status::error("the pipelined step needs @train_step to return its loss and prediction");
  std::vector<Value*> results = ret->operands();
  std::vector<TensorType> types = step.resultTypes();
  ir::AttrArray names;
  for (size_t i = 0; i < carries.size(); ++i) {
    results.insert(results.begin() + 2 + static_cast<long>(i), carries[i].second);
    types.insert(types.begin() + 2 + static_cast<long>(i), carries[i].second->type());
    names.push_back(Attribute(carries[i].first));
  }
  ret->setOperands(results);
  step.setResultTypes(types);
  m.mutableAttrs()["kiln.pipeline"] = Attribute(ir::AttrDict{{"carried", Attribute(std::move(names))}});

  // The prime: a copy of the step cut down to what the carried values need.
  const std::vector<Op*> from = step.entry().opList();
  std::map<const Op*, size_t> at;
  for (size_t i = 0; i < from.size(); ++i) at[from[i]] = i;
  m.eraseFunction("pipeline_prime");
  ir::Function& prime = ir::cloneFunction(step, m, "pipeline_prime");
  const std::vector<Op*> to = prime.entry().opList();
  std::vector<Value*> out;
  std::vector<TensorType> out_types;
  for (const auto& [name, v] : carries) {
    const Op* def = v->definingOp();
    out.push_back(to[at.at(def)]->result(v->index()));
    out_types.push_back(v->type());
  }
  Op* prime_ret = prime.returnOp();
  prime_ret->setOperands(out);
  prime.setResultTypes(out_types);
  std::set<const Op*> live{prime_ret};
  std::vector<const Op*> work{prime_ret};
  while (!work.empty()) {
    const Op* op = work.back();
    work.pop_back();
    for (Value* operand : op->operands())
      if (const Op* d = operand->definingOp(); d && live.insert(d).second) work.push_back(d);
  }
  for (auto it = to.rbegin(); it != to.rend(); ++it)
    if (!live.count(*it)) prime.entry().erase(*it);
  return Status::ok();
}

}  // namespace

Status shardModule(ir::Module& m, const ShardPlan& plan, const std::vector<TableInfo>& tables,
                   const ShardOptions& o) {
  std::map<std::string, int64_t> layer_ep;
  for (const char* name : {"forward", "train_step"}) {
    ir::Function* f = m.lookup(name);
    if (!f || f->body().empty()) continue;
    Sharder s(o, plan, tables);
    s.setPipelined(o.pipeline && f->name() == "train_step");
    KILN_RETURN_IF_ERROR(s.run(*f));
    layer_ep.insert(s.experts().layer_ep.begin(), s.experts().layer_ep.end());
    if (!s.carries().empty()) KILN_RETURN_IF_ERROR(pipelineStep(m, *f, s.carries()));
  }
  // Each expert-parallel layer's EP size, for its statistics (kiln.train's moe entries).
  auto train = m.attrs().find("kiln.train");
  if (layer_ep.empty() || train == m.attrs().end() || !train->second.isDict()) return Status::ok();
  ir::AttrDict t = train->second.asDict();
  auto moe = t.find("moe");
  if (moe == t.end() || !moe->second.isArray()) return Status::ok();
  ir::AttrArray layers;
  for (const Attribute& a : moe->second.asArray()) {
    if (!a.isDict()) {
      layers.push_back(a);
      continue;
    }
    ir::AttrDict layer = a.asDict();
    auto name = layer.find("name");
    if (name != layer.end() && name->second.isString() && layer_ep.count(name->second.asString()))
      layer["ep"] = Attribute(layer_ep.at(name->second.asString()));
    layers.push_back(Attribute(std::move(layer)));
  }
  t["moe"] = Attribute(std::move(layers));
  m.mutableAttrs()["kiln.train"] = Attribute(std::move(t));
  return Status::ok();
}

class ShardPass : public RegisteredPass<ShardPass> {
 public:
  KILN_PASS_INFO(ShardPass)
  explicit ShardPass(ShardOptions o) : o_(std::move(o)) {}

  Expected<bool> run(ir::Module& m) override {
    if (o_.ranks <= 1) return false;
    KILN_ASSIGN_OR_RETURN(auto tables, tablesOf(m));
    ShardOptions o = o_;
    if (auto it = m.attrs().find("kiln.plan"); it != m.attrs().end()) {
      if (!it->second.isString()) return Status::error("shard: the module's kiln.plan must be a plan.json string");
      if (o.plan_path.empty() && o.sharding.empty()) o.proposed_plan = it->second.asString();
      m.mutableAttrs().erase("kiln.plan");
    }
    if (o.global_batch == 0)
      if (auto symbols = planningSymbols(m); symbols.count("B")) o.global_batch = symbols.at("B") * o.ranks;
    KILN_ASSIGN_OR_RETURN(ShardPlan plan, planFor(tables, o));
    KILN_RETURN_IF_ERROR(shardModule(m, plan, tables, o));
    AttrDict summary{{"ranks", Attribute(int64_t{o.ranks})}, {"rank", Attribute(int64_t{o.rank})}};
    for (const TablePlan& t : plan.tables) {
      std::vector<int64_t> ranks(t.ranks.begin(), t.ranks.end());
      std::string entry = fmt::format("{} {}", shardingName(t.type), fmt::join(ranks, ","));
      if (t.hot.rows > 0) entry += fmt::format(" hot {}", t.hot.rows);
      if (t.dedup) entry += " dedup";
      summary[t.table] = Attribute(std::move(entry));
    }
    summary["source"] = Attribute(!o.sharding.empty()        ? "sharding " + o.sharding
                                  : !o.plan_path.empty()     ? "plan file " + o.plan_path
                                  : !o.proposed_plan.empty() ? std::string("proposed")
                                                             : std::string("automatic"));
    m.mutableAttrs()["kiln.shard"] = Attribute(std::move(summary));
    return true;
  }

 private:
  ShardOptions o_;
};

Expected<std::unique_ptr<Pass>> createShardPass(const PassContext& context, const PassOptions& options) {
  ShardOptions o;
  o.target = context.target;
  auto integer = [&](const char* name, int64_t lo) -> Expected<int64_t> {
    const std::string& v = options.get(name);
    if (v.empty()) return lo;
    const std::optional<int64_t> x = parseInt64(v);
    if (!x || *x < lo) return Status::errorf("shard: option {} must be an integer >= {}, got '{}'", name, lo, v);
    return *x;
  };
  KILN_ASSIGN_OR_RETURN(int64_t ranks, integer("ranks", 1));
  KILN_ASSIGN_OR_RETURN(int64_t rank, integer("rank", 0));
  KILN_ASSIGN_OR_RETURN(int64_t per_node, integer("ranks_per_node", 0));
  KILN_ASSIGN_OR_RETURN(int64_t bucket, integer("bucket_bytes", 1));
  KILN_ASSIGN_OR_RETURN(int64_t memory, integer("memory_per_rank", 0));
  KILN_ASSIGN_OR_RETURN(int64_t ep, integer("ep", 1));
  if (rank >= ranks) return Status::errorf("shard: rank {} is not below ranks = {}", rank, ranks);
  if (per_node > 0 && ranks % per_node != 0)
    return Status::errorf("shard: ranks = {} does not divide into nodes of ranks_per_node = {}", ranks,
                          per_node);
  o.ranks = static_cast<int>(ranks);
  o.rank = static_cast<int>(rank);
  if (ranks % ep != 0)
    return Status::errorf(
        "shard: ep = {} does not divide ranks = {} (ranks / ep replicas of each expert group)", ep, ranks);
  o.ranks_per_node = static_cast<int>(per_node);
  o.ep = static_cast<int>(ep);
  o.bucket_bytes = bucket;
  o.memory_per_rank = memory;
  o.plan_path = options.get("plan");
  o.sharding = options.get("sharding");
  KILN_ASSIGN_OR_RETURN(int64_t pipeline, integer("pipeline", 0));
  o.pipeline = pipeline != 0;
  return makePass<ShardPass>(std::move(o));
}

}  // namespace kiln::passes
