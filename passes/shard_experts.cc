// Expert parallelism (docs/moe.md, "Expert parallelism"). The shard pass runs after autodiff, so
// a MoE layer arrives here with its forward and its backward; this file rewrites both.
//
// The layer's rows (kiln.moe_dispatch's permutation of the token slots, expert-major) live on the
// rank that routed them: that is the *source* order. With EP size ep, rank r's EP group is ranks
// [g*ep, (g+1)*ep), g = r / ep, and its member g*ep + j holds experts [j*L, (j+1)*L), L = E / ep.
// Every op that reads the experts' weights (kiln.grouped_matmul, grouped_matmul_wgrad) must run
// on the owner, in the *expert* order: the rows every group member sent, sorted by local expert.
// So, walking the step in order:
//   - a row operand of an expert op still in source order is *dispatched*:
//       all_to_all_v(rows, send_counts)    each owner gets its experts' rows, peer-major
//       moe_sort_chunks(...)               into expert-major order (offsets: moe_chunk_offsets)
//   - an op reading a value in expert order is on the expert side too (the SwiGLU, its gradient,
//     casts): its result is in expert order;
//   - a token op (moe_unpermute, moe_row_dot) reading a value in expert order gets it *combined*:
//       moe_sort_chunks(inverse)           back to peer-major
//       all_to_all_v(rows, recv_counts)    each row back to the rank that sent it
// Forward and backward fall out of the same rule: the backward's moe_permute(dout) is dispatched
// into the transposed GEMMs, and their result combined into the gradient's moe_unpermute. Each
// value moves at most once each way (the forward's combined output serves moe_row_dot too).
// The per-layer counts for the split come from moe_ep_split (rows per owner, rows per owner's
// expert) and one all_to_all of the latter, right after the dispatch.
//
// Expert weights and their optimizer state shrink to [L, ...] (global_shape and offset record the
// slice for checkpoints and the initializer). Their gradients hold the contributions of every
// token of the EP group; ranks holding the same experts (one per group, ranks / ep of them: the
// expert-data-parallel replicas) sum them with an all_to_all_v of the whole gradient among
// themselves, in rank order, so every replica applies the same update. Then the 1/N of the mean
// loss.
//
// Independent of ep: each layer's balancing loss judges the global batch (kiln.moe_aux_loss gets
// the all-reduced moe_route_counts: Megatron's global-batch load balancing), and the dispatch's
// per-expert counts (the step statistic, the expert-bias update) are all-reduced.
#include "passes/shard_experts.h"

#include <fmt/format.h>

#include "ir/builder.h"
#include "ir/collective.h"
#include "ir/op_def.h"
#include "passes/shape_inference.h"

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

// The parameter a GEMM's weight operand reads, through the casts mixed precision puts there.
Op* parameterBehindCasts(Value* v) {
  Op* d = v->definingOp();
  while (d && d->is(OpCode::Cast)) d = d->operand(0)->definingOp();
  return d && d->is(OpCode::Parameter) ? d : nullptr;
}

Op* nextOp(ir::Function& f, Op* op) { return std::next(f.entry().find(op))->get(); }

class ExpertSharder {
 public:
  ExpertSharder(ir::Function& f, const ShardOptions& o, double grad_scale)
      : f_(f), o_(o), grad_scale_(grad_scale) {}

  Expected<ExpertShardResult> run();

 private:
  // One MoE layer being spread over its EP group.
  struct Layer {
    Op* dispatch = nullptr;
    int64_t ep = 1;
    int64_t local = 0;         // L: experts per rank
    int64_t first_expert = 0;  // this rank's first: (rank % ep) * L
    Dim source_rows;           // the dispatch's row dim
    Value* send_counts = nullptr;
    Value* recv_chunks = nullptr;    // rows per (peer, local expert) arriving here
    Value* local_offsets = nullptr;  // of the expert order
    Value* recv_counts = nullptr;    // rows per peer arriving here: what the combine returns
    std::map<const Value*, Value*> dispatched, combined;
    std::set<const Value*> expert_order;
  };

  AttrDict world() const { return {{"ranks", Attribute(int64_t{o_.ranks})}, {"group", Attribute("world")}}; }
  TensorType countsType() const { return TensorType(DType::i64, {Dim::fixed(o_.ranks)}); }
  static Status located(const Op& op, Status s) { return std::move(s).withLocation(op.location()); }

  Status globalAuxLoss();
  Status globalCounts();
  Status lowerLayer(Layer& l);
  Status split(Layer& l);
  Expected<Value*> dispatch(Layer& l, Value* v, Op* before);
  Expected<Value*> combine(Layer& l, Value* v, Op* before);
  Status holdExperts(Layer& l, Op& param);
  Status reduceExpertGradients();

  ir::Function& f_;
  const ShardOptions& o_;
  double grad_scale_;
  ir::Builder b_;
  ExpertShardResult result_;
  std::map<const Op*, int64_t> expert_params_;  // the parameters (and states) held, by the first expert
  std::map<const Op*, int64_t> param_ep_;
};

// f_i of each per-batch aux loss from the routed counts summed over every rank.
Status ExpertSharder::globalAuxLoss() {
  std::map<const Value*, Value*> totals;  // by the router's experts value
  for (Op* op : f_.entry().opList()) {
    if (!op->isAnyOf(OpCode::MoeAuxLoss, OpCode::MoeAuxLossGrad) || op->intAttr("seq_len", 0) != 0) continue;
    const unsigned plain = op->is(OpCode::MoeAuxLoss) ? 2 : 3;
    if (op->numOperands() != plain) continue;
    Value* experts = op->operand(1);
    Value*& total = totals[experts];
    if (!total) {
      b_.setInsertionPoint(op);
      b_.setLocation(op->location());
      const int64_t e = op->operand(0)->type().dim(1).size();
      KILN_ASSIGN_OR_RETURN(Value * routed,
                            b_.createValue(OpCode::MoeRouteCounts, {experts}, {{"experts", Attribute(e)}}));
      KILN_ASSIGN_OR_RETURN(total, b_.createValue(OpCode::AllReduce, {routed}, world()));
    }
    op->addOperand(total);
  }
  return Status::ok();
}

// The dispatch's per-expert counts, every use of them: the global batch's.
Status ExpertSharder::globalCounts() {
  for (Op* d : f_.entry().opList()) {
    if (!d->is(OpCode::MoeDispatch) || !d->result(2)->hasUses()) continue;
    Value* counts = d->result(2);
    b_.setInsertionPoint(nextOp(f_, d));
    b_.setLocation(d->location());
    KILN_ASSIGN_OR_RETURN(Op * total, b_.create(OpCode::AllReduce, {counts}, world()));
    counts->replaceAllUsesWith(total->result());
    total->setOperand(0, counts);
  }
  return Status::ok();
}

Status ExpertSharder::split(Layer& l) {
  Op& d = *l.dispatch;
  b_.setInsertionPoint(nextOp(f_, &d));
  b_.setLocation(d.location());
  AttrDict a = world();
  a["ep"] = Attribute(l.ep);
  a["rank"] = Attribute(int64_t{o_.rank});
  a["experts"] = Attribute(d.intAttr("experts"));
  KILN_ASSIGN_OR_RETURN(Op * s, b_.create(OpCode::MoeEpSplit, {d.result(1)}, a));
  l.send_counts = s->result(0);
  KILN_ASSIGN_OR_RETURN(l.recv_chunks, b_.createValue(OpCode::AllToAll, {s->result(1)}, world()));
  KILN_ASSIGN_OR_RETURN(l.local_offsets, b_.createValue(OpCode::MoeChunkOffsets, {l.recv_chunks},
                                                        {{"chunks", Attribute(l.local)}}));
  return Status::ok();
}

Expected<Value*> ExpertSharder::dispatch(Layer& l, Value* v, Op* before) {
  if (auto it = l.dispatched.find(v); it != l.dispatched.end()) return it->second;
  b_.setInsertionPoint(before);
  b_.setLocation(before->location());
  const TensorType& t = v->type();
  // Every member of the group may send this rank all its rows.
  ir::Shape shape = t.shape();
  shape[0] = Dim::bounded(t.dim(0).upperBound().times(l.ep));
  KILN_ASSIGN_OR_RETURN(Op * moved,
                        b_.createWithTypes(OpCode::AllToAllV, {v, l.send_counts},
                                           {TensorType(t.dtype(), shape), countsType()}, world()));
  if (!l.recv_counts) l.recv_counts = moved->result(1);
  KILN_ASSIGN_OR_RETURN(Value * sorted,
                        b_.createValue(OpCode::MoeSortChunks, {moved->result(0), l.recv_chunks},
                                       {{"chunks", Attribute(l.local)}}));
  l.dispatched[v] = sorted;
  l.expert_order.insert(sorted);
  return sorted;
}

Expected<Value*> ExpertSharder::combine(Layer& l, Value* v, Op* before) {
  if (auto it = l.combined.find(v); it != l.combined.end()) return it->second;
  b_.setInsertionPoint(before);
  b_.setLocation(before->location());
  KILN_ASSIGN_OR_RETURN(Value * unsorted,
                        b_.createValue(OpCode::MoeSortChunks, {v, l.recv_chunks},
                                       {{"chunks", Attribute(l.local)}, {"inverse", Attribute(true)}}));
  ir::Shape shape = v->type().shape();
  shape[0] = l.source_rows;
  KILN_ASSIGN_OR_RETURN(Op * back,
                        b_.createWithTypes(OpCode::AllToAllV, {unsorted, l.recv_counts},
                                           {TensorType(v->type().dtype(), shape), countsType()}, world()));
  l.combined[v] = back->result(0);
  return back->result(0);
}

// The layer's expert weights `param` and its optimizer state: experts [first, first + L) here.
Status ExpertSharder::holdExperts(Layer& l, Op& param) {
  if (expert_params_.count(&param)) {
    if (param_ep_.at(&param) != l.ep)
      return located(param, Status::errorf("expert weights '{}' are used by layers of different ep",
                                           param.strAttr("name")));
    return Status::ok();
  }
  const std::string name = param.strAttr("name");
  for (Op* op : f_.entry().opList()) {
    if (!op->is(OpCode::Parameter) || (op != &param && op->strAttr("state_of") != name)) continue;
    const TensorType& old = op->result()->type();
    if (old.rank() < 1 || !old.isStatic() || old.dim(0).size() != l.dispatch->intAttr("experts"))
      return located(*op, Status::errorf("expert weights '{}' must be a static [E, ...] tensor, got {}",
                                         op->strAttr("name"), old.str()));
    std::vector<int64_t> global, offset(static_cast<size_t>(old.rank()), 0);
    for (int64_t i = 0; i < old.rank(); ++i) global.push_back(old.dim(i).size());
    offset[0] = l.first_expert;
    ir::Shape shape = old.shape();
    shape[0] = Dim::fixed(l.local);
    op->result()->setType(TensorType(old.dtype(), std::move(shape)));
    op->setAttr("global_shape", Attribute::ints(global));
    op->setAttr("offset", Attribute::ints(offset));
    if (o_.ranks > l.ep) op->setAttr("replicated", Attribute(true));
    expert_params_[op] = l.first_expert;
    param_ep_[op] = l.ep;
    result_.expert_params.insert(op->result());
  }
  // "moe.0.experts.fc1": the layer "moe.0".
  const size_t at = name.rfind(".experts.");
  result_.layer_ep[at == std::string::npos ? name : name.substr(0, at)] = l.ep;
  return Status::ok();
}

Status ExpertSharder::lowerLayer(Layer& l) {
  Op& d = *l.dispatch;
  const int64_t experts = d.intAttr("experts");
  if (l.ep > o_.ranks || o_.ranks % l.ep != 0 || experts % l.ep != 0)
    return located(d,
                   Status::errorf("a MoE layer of {} experts cannot spread over ep = {} of {} ranks: ep must "
                                  "divide both",
                                  experts, l.ep, o_.ranks));
  l.local = experts / l.ep;
  l.first_expert = (o_.rank % l.ep) * l.local;
  Value* rows = d.result(0);
  Value* offsets = d.result(1);
  l.source_rows = rows->type().dim(0);
  KILN_RETURN_IF_ERROR(split(l));
  auto rowsInSourceOrder = [&](const Value* v) {
    return v->type().rank() >= 1 && v->type().dim(0) == l.source_rows && !l.expert_order.count(v);
  };
  for (Op* op : f_.entry().opList()) {
    if (op->isAnyOf(OpCode::GroupedMatmul, OpCode::GroupedMatmulWgrad) && op->operand(2) == offsets) {
      const unsigned row_operands = op->is(OpCode::GroupedMatmul) ? 1 : 2;
      for (unsigned i = 0; i < row_operands; ++i) {
        if (l.expert_order.count(op->operand(i))) continue;
        KILN_ASSIGN_OR_RETURN(Value * moved, dispatch(l, op->operand(i), op));
        op->setOperand(i, moved);
      }
      op->setOperand(2, l.local_offsets);
      if (op->is(OpCode::GroupedMatmul)) {
        Op* param = parameterBehindCasts(op->operand(1));
        if (!param)
          return located(*op,
                         Status::error("expert parallelism needs the experts' weights to be parameters"));
        KILN_RETURN_IF_ERROR(holdExperts(l, *param));
        l.expert_order.insert(op->result());
      }
      continue;
    }
    if (op->isAnyOf(OpCode::MoePermute, OpCode::MoeUnpermute, OpCode::MoeRowDot) && op->operand(1) == rows) {
      // Token ops: their row operand back in source order.
      if (!op->is(OpCode::MoePermute) && l.expert_order.count(op->operand(0))) {
        KILN_ASSIGN_OR_RETURN(Value * back, combine(l, op->operand(0), op));
        op->setOperand(0, back);
      }
      continue;
    }
    bool expert_side = false;
    for (const Value* v : op->operands()) expert_side |= l.expert_order.count(v) > 0;
    if (!expert_side) continue;
    // On the expert side: every row operand in expert order, every result a row of it.
    for (unsigned i = 0; i < op->numOperands(); ++i) {
      if (!rowsInSourceOrder(op->operand(i))) continue;
      KILN_ASSIGN_OR_RETURN(Value * moved, dispatch(l, op->operand(i), op));
      op->setOperand(i, moved);
    }
    for (unsigned i = 0; i < op->numResults(); ++i) {
      Value* r = op->result(i);
      if (r->type().rank() < 1 || !(r->type().dim(0) == l.source_rows))
        return located(*op,
                       Status::errorf("'{}' combines the experts' rows into {}, which expert parallelism "
                                      "cannot split (ep = {})",
                                      op->name(), r->type().str(), l.ep));
      l.expert_order.insert(r);
    }
  }
  return Status::ok();
}

// Each expert gradient summed over the ranks that hold the same experts (r % ep equal), in rank
// order, then scaled: every replica applies the same update.
Status ExpertSharder::reduceExpertGradients() {
  for (Op* op : f_.entry().opList()) {
    if (!op->is(OpCode::OptimizerUpdate)) continue;
    auto held = param_ep_.find(op->operand(0)->definingOp());
    if (held == param_ep_.end()) continue;
    if (op->boolAttr("scaled"))
      return located(*op, Status::error("grad_clip is not supported on several ranks yet"));
    const int64_t ep = held->second;
    Value* grad = op->operand(1);
    Op* def = grad->definingOp();
    b_.setInsertionPoint(def ? nextOp(f_, def) : op);
    b_.setLocation(op->location());
    Value* sum = grad;
    const int64_t replicas = o_.ranks / ep;
    if (replicas > 1) {
      const TensorType& t = grad->type();
      const int64_t local = t.dim(0).size();
      std::vector<int64_t> counts(static_cast<size_t>(o_.ranks), 0);
      for (int64_t r = o_.rank % ep; r < o_.ranks; r += ep) counts[static_cast<size_t>(r)] = local;
      KILN_ASSIGN_OR_RETURN(Op * send_counts, b_.createWithTypes(OpCode::Constant, {}, {countsType()},
                                                                 {{"value", Attribute::ints(counts)}}));
      std::vector<Value*> copies(static_cast<size_t>(replicas), grad);
      KILN_ASSIGN_OR_RETURN(Value * send,
                            b_.createValue(OpCode::Concat, copies, {{"axis", Attribute(int64_t{0})}}));
      KILN_ASSIGN_OR_RETURN(Op * moved, b_.createWithTypes(OpCode::AllToAllV, {send, send_counts->result()},
                                                           {send->type(), countsType()}, world()));
      ir::Shape split = t.shape();
      split.insert(split.begin(), Dim::fixed(replicas));
      KILN_ASSIGN_OR_RETURN(Op * pieces, b_.createWithTypes(OpCode::Reshape, {moved->result(0)},
                                                            {TensorType(t.dtype(), split)}));
      KILN_ASSIGN_OR_RETURN(sum,
                            b_.createValue(OpCode::Reduce, {pieces->result()},
                                           {{"kind", Attribute("sum")}, {"axes", Attribute::ints({0})}}));
    }
    KILN_ASSIGN_OR_RETURN(Value * mean, scaledGradient(b_, sum, grad_scale_));
    op->setOperand(1, mean);
  }
  return Status::ok();
}

Expected<ExpertShardResult> ExpertSharder::run() {
  KILN_RETURN_IF_ERROR(globalAuxLoss());
  KILN_RETURN_IF_ERROR(globalCounts());
  std::vector<Layer> layers;
  for (Op* op : f_.entry().opList()) {
    if (!op->is(OpCode::MoeDispatch)) continue;
    const int64_t pin = op->intAttr("ep", 0);
    Layer l;
    l.dispatch = op;
    l.ep = pin > 0 ? pin : o_.ep;
    if (l.ep > 1) layers.push_back(l);
  }
  for (Layer& l : layers) KILN_RETURN_IF_ERROR(lowerLayer(l));
  if (layers.empty()) return result_;
  // Every inferred type again: the expert side's rows now have the bound of what arrives, and
  // its weights and gradients L experts.
  KILN_RETURN_IF_ERROR(statusOf(inferShapes(f_)));
  KILN_RETURN_IF_ERROR(reduceExpertGradients());
  return result_;
}

}  // namespace

Expected<ExpertShardResult> shardExperts(ir::Function& f, const ShardOptions& o, double grad_scale) {
  ExpertSharder s(f, o, grad_scale);
  return s.run();
}

}  // namespace kiln::passes
