// Builds @train_step from @forward (see docs/autodiff.md):
//   1. clone @forward, add the scalar inputs `lr` and `step`;
//   2. walk the ops backwards from the loss, calling each op's gradient rule from the op table
//      and summing gradients of values used several times; ops that no trainable parameter
//      reaches, and kNonDifferentiable ops, are skipped;
//   3. an embedding table looked up by kiln.embedding_bag gets no dense gradient: its update is
//      one fused kiln.embedding_bag_update fed by the pooled-output gradient;
//   4. optionally clip every gradient by the global L2 norm;
//   5. emit one side-effecting update per parameter (with its state parameters) and return the
//      loss and the prediction.
#include "passes/autodiff.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/optimizer.h"
#include "ir/verifier.h"
#include "passes/lr_schedule.h"
#include "passes/pass_registry.h"

namespace kiln::passes {
namespace {

using ir::AttrDict;
using ir::Attribute;
using ir::Builder;
using ir::Op;
using ir::TensorType;
using ir::Value;

// Keys an optimizer dictionary may carry, so that a typo is an error rather than a silent default.
const std::set<std::string> kOptimizerKeys = {"kind", "lr", "momentum", "nesterov", "eps", "beta1", "beta2",
                                              "weight_decay", "initial_accumulator"};

Expected<AttrDict> dictField(const AttrDict& d, const char* key, const char* where) {
  auto it = d.find(key);
  if (it == d.end()) return AttrDict{};
  if (!it->second.isDict()) return Status::errorf("{}: '{}' must be a dictionary, got {}", where, key, it->second.str());
  return it->second.asDict();
}

std::string stringField(const AttrDict& d, const char* key, std::string dflt) {
  auto it = d.find(key);
  return it != d.end() && it->second.isString() ? it->second.asString() : dflt;
}

// Validates an optimizer dictionary and returns the attributes of its update op (hyperparameters
// with per-kind defaults filled in, so the printed IR shows every number that is used).
Expected<AttrDict> optimizerAttrs(const AttrDict& opt, bool sparse, const std::string& what) {
  std::string kind = stringField(opt, "kind", "");
  if (kind.empty()) return Status::errorf("{}: optimizer needs a 'kind'", what);
  if (sparse ? !ir::isSparseOptimizer(kind) : !ir::isDenseOptimizer(kind))
    return Status::errorf("{}: unknown optimizer '{}'; expected one of {}", what, kind,
                          sparse ? "sgd, adagrad, rowwise_adagrad, adam" : "sgd, adagrad, adam, adamw");
  for (const auto& [key, value] : opt) {
    if (!kOptimizerKeys.count(key)) return Status::errorf("{}: optimizer '{}' has no setting '{}'", what, kind, key);
    if (key == "kind") continue;
    if (key == "nesterov" ? !value.isBool() : !value.isNumber())
      return Status::errorf("{}: optimizer setting '{}' has the wrong kind: {}", what, key, value.str());
  }
  if (!opt.count("lr")) return Status::errorf("{}: optimizer '{}' needs 'lr'", what, kind);
  if (sparse && (opt.count("momentum") || opt.count("nesterov")))
    return Status::errorf("{}: embedding optimizers take no momentum", what);
  AttrDict a;
  a[sparse ? "optimizer" : "kind"] = kind;
  a["lr"] = opt.at("lr").asDouble();
  auto num = [&](const char* key, double dflt) {
    auto it = opt.find(key);
    return it != opt.end() ? it->second.asDouble() : dflt;
  };
  a["weight_decay"] = num("weight_decay", 0.0);
  if (kind == "sgd" && !sparse) {
    a["momentum"] = num("momentum", 0.0);
    auto it = opt.find("nesterov");
    a["nesterov"] = it != opt.end() && it->second.asBool();
    if (a["nesterov"].asBool() && a["momentum"].asDouble() == 0)
      return Status::errorf("{}: nesterov needs a non-zero momentum", what);
  }
  if (kind == "adagrad" || kind == "rowwise_adagrad") {
    a["eps"] = num("eps", 1e-10);  // PyTorch's and FBGEMM's default
    a["initial_accumulator"] = num("initial_accumulator", 0.0);
  }
  if (kind == "adam" || kind == "adamw") {
    a["eps"] = num("eps", 1e-8);
    a["beta1"] = num("beta1", 0.9);
    a["beta2"] = num("beta2", 0.999);
    if (a["beta1"].asDouble() < 0 || a["beta1"].asDouble() >= 1 || a["beta2"].asDouble() < 0 ||
        a["beta2"].asDouble() >= 1)
      return Status::errorf("{}: Adam's beta1 and beta2 must lie in [0, 1)", what);
  }
  if (a["lr"].asDouble() < 0) return Status::errorf("{}: 'lr' must be >= 0", what);
  return a;
}

// The training step under construction.
class TrainStepBuilder {
 public:
  explicit TrainStepBuilder(ir::Function& f) : func_(f), builder_(f.entry()) {}

  // stats: the @forward outputs (name, index) the step also returns, after loss and prediction.
  Status run(const AttrDict& train, size_t loss_index, std::optional<size_t> prediction_index,
             const std::vector<std::pair<std::string, size_t>>& stats);

 private:
  Expected<Value*> constant(ir::DType dtype, double v) {
    KILN_ASSIGN_OR_RETURN(
        auto op, builder_.createWithTypes(ir::OpCode::Constant, {}, {TensorType(dtype, {})}, {{"value", v}}));
    return op->result();
  }
  Expected<Value*> scalarInput(const std::string& name);
  Status enterTrainingMode(const AttrDict& train);
  void markNeedsGrad();
  Status accumulate(Value* v, Value* g, const Op& from);
  Status backward(Value* loss);
  Expected<Value*> clipScale(double max_norm);
  Expected<std::vector<Value*>> stateFor(Op* param, const std::vector<ir::OptimizerStateSlot>& slots);
  Status emitUpdates(const AttrDict& train, Value* scale);
  Status emitExpertBiasUpdates(const std::map<std::string, Value*>& stats);
  Status emitRunningStateUpdates();

  // The lookups of one table as its update reads them: the operands after the table (ids,
  // lengths when variable-length, weights when weighted) and the pooled-output gradient.
  struct SparseUse {
    std::vector<Value*> inputs;
    Value* grad_out;
    std::string mode;
    bool weighted;
    Location loc;
  };
  Status combineSharedLookups();

  ir::Function& func_;
  Builder builder_;
  std::vector<Op*> forward_ops_;
  std::unordered_set<const Value*> needs_grad_;
  std::unordered_map<const Value*, Value*> grads_;
  std::map<const Value*, std::vector<SparseUse>> sparse_;  // table value -> its lookups
  Value* lr_ = nullptr;
  Value* step_ = nullptr;
};

// Ops that act differently in training: kiln.dropout {training = false} of @forward (the
// identity) draws its mask here, from the run's seed (kiln.train's `seed`, set by the session
// from --seed; 0 without one) and the step input; kiln.running_stat takes the batch's statistic.
Status TrainStepBuilder::enterTrainingMode(const AttrDict& train) {
  int64_t seed = 0;
  if (auto it = train.find("seed"); it != train.end()) {
    if (!it->second.isInt() || it->second.asInt() < 0)
      return Status::errorf("kiln.train: seed must be an integer >= 0, got {}", it->second.str());
    seed = it->second.asInt();
  }
  for (Op* op : forward_ops_) {
    if (op->is(ir::OpCode::RunningStat)) op->setAttr("training", true);
    if (!op->is(ir::OpCode::Dropout) || op->boolAttr("training", false)) continue;
    op->setAttr("training", true);
    op->setAttr("seed", seed);
    op->addOperand(step_);
  }
  return Status::ok();
}

// Running state (ir/ops/running_state.cc) moves after the gradient's updates: each batch norm
// statistic toward the batch's, each log-Q estimator over the batch's ids at this step.
Status TrainStepBuilder::emitRunningStateUpdates() {
  for (Op* op : forward_ops_) {
    builder_.setLocation(op->location());
    if (op->is(ir::OpCode::RunningStat)) {
      KILN_RETURN_IF_ERROR(builder_.create(ir::OpCode::RunningStatUpdate, {op->operand(1), op->operand(0)},
                                           {{"momentum", op->floatAttr("momentum", 0.1)}}));
    } else if (op->is(ir::OpCode::LogFrequency)) {
      const Attribute* alpha = op->attr("alpha");
      KILN_RETURN_IF_ERROR(builder_.create(ir::OpCode::FrequencyUpdate,
                                           {op->operand(1), op->operand(0), step_},
                                           {{"alpha", alpha ? alpha->asDouble() : 0.01}}));
    }
  }
  builder_.setLocation({});
  return Status::ok();
}

Expected<Value*> TrainStepBuilder::scalarInput(const std::string& name) {
  for (Op* op : func_.entry().opList())
    if (op->is(ir::OpCode::Input) && op->strAttr("name") == name)
      return Status::error(fmt::format("@forward already has an input named '{}', which @train_step reserves", name),
                           op->location());
  KILN_ASSIGN_OR_RETURN(auto op,
                        builder_.createWithTypes(ir::OpCode::Input, {}, {TensorType(ir::DType::f32, {})},
                                                 {{"name", name}, {"role", name}}));
  op->result()->setNameHint(name);
  return op->result();
}

bool isTrainable(const Op& op) { return op.is(ir::OpCode::Parameter) && op.boolAttr("trainable", true); }

// (table, ids[B, H], weights) or (table, ids[N], lengths, weights).
bool isWeightedLookup(const Op& op) {
  return op.numOperands() == 4 || (op.numOperands() == 3 && op.operand(1)->type().rank() == 2);
}

bool isSparseLookup(const Op& op) {
  return op.is(ir::OpCode::EmbeddingBag) && op.operand(0)->definingOp() &&
         isTrainable(*op.operand(0)->definingOp());
}

// A value needs a gradient when a trainable parameter reaches it through differentiable ops.
void TrainStepBuilder::markNeedsGrad() {
  for (Op* op : forward_ops_) {
    bool needs = isTrainable(*op);
    if (!needs && !op->hasTrait(ir::kNonDifferentiable))
      for (Value* v : op->operands()) needs |= needs_grad_.count(v) > 0;
    if (needs)
      for (Value* r : op->results())
        if (ir::isFloat(r->type().dtype())) needs_grad_.insert(r);
  }
}

Status TrainStepBuilder::accumulate(Value* v, Value* g, const Op& from) {
  if (g->type().withSharding(std::nullopt) != v->type().withSharding(std::nullopt))
    return Status::error(fmt::format("gradient rule of '{}' gives {} for an operand of type {}", from.name(),
                                     g->type().str(), v->type().str()),
                         from.location());
  auto [it, inserted] = grads_.emplace(v, g);
  if (inserted) return Status::ok();
  KILN_ASSIGN_OR_RETURN(auto sum, builder_.createValue(ir::OpCode::Add, {it->second, g}));
  it->second = sum;
  return Status::ok();
}

Status TrainStepBuilder::backward(Value* loss) {
  KILN_ASSIGN_OR_RETURN(auto seed, constant(loss->type().dtype(), 1.0));
  grads_[loss] = seed;
  for (auto it = forward_ops_.rbegin(); it != forward_ops_.rend(); ++it) {
    Op* op = *it;
    std::vector<Value*> result_grads;
    bool any = false;
    for (Value* r : op->results()) {
      auto g = grads_.find(r);
      result_grads.push_back(g == grads_.end() ? nullptr : g->second);
      any |= g != grads_.end();
    }
    if (!any || op->hasTrait(ir::kNonDifferentiable) || op->hasTrait(ir::kSource)) continue;
    bool operand_needs = false;
    for (Value* v : op->operands()) operand_needs |= needs_grad_.count(v) > 0;
    if (!operand_needs) continue;
    builder_.setLocation(op->location());

    bool sparse = isSparseLookup(*op);
    if (op->is(ir::OpCode::EmbeddingBag) && !sparse && needs_grad_.count(op->operand(0)))
      return Status::error("the table of a kiln.embedding_bag that is trained must be a kiln.parameter itself "
                           "(its update is sparse, applied to the parameter in place)",
                           op->location());
    if (sparse)
      sparse_[op->operand(0)].push_back(
          {std::vector<Value*>(op->operands().begin() + 1, op->operands().end()), result_grads[0],
           op->strAttr("mode", "sum"), isWeightedLookup(*op), op->location()});
    // Only the per-id weights can still need a gradient from the generic rule.
    bool generic = !sparse;
    if (sparse)
      for (unsigned i = 1; i < op->numOperands(); ++i) generic |= needs_grad_.count(op->operand(i)) > 0;
    if (!generic) continue;

    const ir::OpDef* def = op->def();
    if (!def || !def->grad)
      return Status::error(fmt::format("'{}' has no gradient rule, but a trainable parameter reaches it", op->name()),
                           op->location());
    ir::GradContext ctx{builder_, result_grads, {}};
    KILN_RETURN_IF_ERROR(def->grad(ctx, *op));
    for (unsigned i = 0; i < op->numOperands() && i < ctx.operand_grads.size(); ++i) {
      Value* g = ctx.operand_grads[i];
      if (!g || !needs_grad_.count(op->operand(i))) continue;
      if (sparse && i == 0) continue;  // the table's dense gradient is never used (DCE drops it)
      KILN_RETURN_IF_ERROR(accumulate(op->operand(i), g, *op));
    }
  }
  builder_.setLocation({});
  return Status::ok();
}

// A table looked up by several features (a shared table) gets one sparse update: its lookups'
// ids, lengths, weights and pooled-output gradients side by side along the bag axis, as if one
// lookup read k * B bags. The update combines the gradients of rows hit more than once, whatever
// lookup they came from, so a row read by two features takes one optimizer step with the sum of
// their gradients (PyTorch's accumulated .grad); the gradient norm of grad_clip counts it so too.
Status TrainStepBuilder::combineSharedLookups() {
  for (auto& [table, uses] : sparse_) {
    if (uses.size() < 2) continue;
    // The backward walks the ops in reverse: put the lookups back in program order.
    std::reverse(uses.begin(), uses.end());
    const SparseUse& first = uses[0];
    for (const SparseUse& u : uses) {
      const bool same_form =
          u.inputs.size() == first.inputs.size() && u.weighted == first.weighted && u.mode == first.mode &&
          u.inputs[0]->type().rank() == first.inputs[0]->type().rank() &&
          std::equal(u.inputs.begin(), u.inputs.end(), first.inputs.begin(),
                     [](const Value* a, const Value* b) { return a->type().dtype() == b->type().dtype(); }) &&
          (u.inputs[0]->type().rank() == 1 || u.inputs[0]->type().dim(1) == first.inputs[0]->type().dim(1));
      if (!same_form)
        return Status::error(
            fmt::format(
                "embedding table '{}' is shared by lookups of different forms ({} and {}); a shared table's "
                "lookups need one hotness, weighting and id type",
                table->definingOp()->strAttr("name"), first.inputs[0]->type().str(),
                u.inputs[0]->type().str()),
            u.loc);
    }
    builder_.setLocation(first.loc);
    SparseUse combined{{}, nullptr, first.mode, first.weighted, first.loc};
    auto sideBySide = [&](auto pick) -> Expected<Value*> {
      std::vector<Value*> parts;
      for (const SparseUse& u : uses) parts.push_back(pick(u));
      return builder_.createValue(ir::OpCode::Concat, parts, {{"axis", Attribute(int64_t{0})}});
    };
    for (size_t i = 0; i < first.inputs.size(); ++i) {
      KILN_ASSIGN_OR_RETURN(Value * v, sideBySide([&](const SparseUse& u) { return u.inputs[i]; }));
      combined.inputs.push_back(v);
    }
    KILN_ASSIGN_OR_RETURN(combined.grad_out, sideBySide([](const SparseUse& u) { return u.grad_out; }));
    uses = {combined};
  }
  builder_.setLocation({});
  return Status::ok();
}

// scale = max_norm / max(norm, max_norm) = min(1, max_norm / norm), where norm is the L2 norm of
// every gradient: each dense parameter gradient and each embedding table's row gradients
// (duplicates combined, as the update applies them).
Expected<Value*> TrainStepBuilder::clipScale(double max_norm) {
  std::vector<Value*> squares;
  for (Op* op : forward_ops_) {
    if (!isTrainable(*op)) continue;
    auto g = grads_.find(op->result());
    if (g == grads_.end()) continue;
    Value* sq = nullptr;
    KILN_ASSIGN_OR_RETURN(auto prod, builder_.createValue(ir::OpCode::Mul, {g->second, g->second}));
    sq = prod;
    if (g->second->type().rank() > 0) {
      std::vector<int64_t> axes;
      for (int64_t i = 0; i < g->second->type().rank(); ++i) axes.push_back(i);
      KILN_ASSIGN_OR_RETURN(
          auto red,
          builder_.createValue(ir::OpCode::Reduce, {sq}, {{"kind", "sum"}, {"axes", Attribute::ints(axes)}}));
      sq = red;
    }
    squares.push_back(sq);
  }
  for (const auto& [table, uses] : sparse_) {
    for (const SparseUse& u : uses) {
      std::vector<Value*> operands = u.inputs;
      operands.push_back(u.grad_out);
      AttrDict attrs{{"mode", u.mode}, {"weighted", u.weighted}};
      KILN_ASSIGN_OR_RETURN(auto sq,
                            builder_.createValue(ir::OpCode::EmbeddingBagGradSqnorm, operands, attrs));
      squares.push_back(sq);
    }
  }
  if (squares.empty()) return Status::error("grad_clip is set but no parameter has a gradient");
  ir::DType dtype = squares[0]->type().dtype();
  Value* total = squares[0];
  for (size_t i = 1; i < squares.size(); ++i) {
    Value* s = squares[i];
    if (s->type().dtype() != dtype) {
      KILN_ASSIGN_OR_RETURN(
          auto c, builder_.createValue(ir::OpCode::Cast, {s}, {{"to", std::string(ir::dtypeName(dtype))}}));
      s = c;
    }
    KILN_ASSIGN_OR_RETURN(auto sum, builder_.createValue(ir::OpCode::Add, {total, s}));
    total = sum;
  }
  KILN_ASSIGN_OR_RETURN(auto norm, builder_.createValue(ir::OpCode::Sqrt, {total}));
  KILN_ASSIGN_OR_RETURN(auto limit, constant(dtype, max_norm));
  KILN_ASSIGN_OR_RETURN(auto denom, builder_.createValue(ir::OpCode::Max, {norm, limit}));
  KILN_ASSIGN_OR_RETURN(auto scale, builder_.createValue(ir::OpCode::Div, {limit, denom}));
  scale->setNameHint("grad_scale");
  return scale;
}

// Creates the state parameters of `param` right after it, named "<param>.<suffix>".
Expected<std::vector<Value*>> TrainStepBuilder::stateFor(Op* param, const std::vector<ir::OptimizerStateSlot>& slots) {
  std::vector<Value*> out;
  std::string name = param->strAttr("name");
  Builder b;
  auto pos = func_.entry().find(param);
  ++pos;
  b.setInsertionPoint(pos->get());
  b.setLocation(param->location());
  for (const auto& slot : slots) {
    const TensorType& t = param->result()->type();
    TensorType st = slot.rowwise ? TensorType(t.dtype(), {t.dim(0)}) : t.withSharding(std::nullopt);
    AttrDict attrs{{"name", name + "." + slot.suffix}, {"trainable", false}, {"state_of", name}};
    if (slot.initial_value != 0) {
      attrs["init"] = "constant";
      attrs["value"] = slot.initial_value;
    } else {
      attrs["init"] = "zeros";
    }
    KILN_ASSIGN_OR_RETURN(auto op, b.createWithTypes(ir::OpCode::Parameter, {}, {st}, attrs));
    op->result()->setNameHint(name + "." + slot.suffix);
    out.push_back(op->result());
  }
  return out;
}

Status TrainStepBuilder::emitUpdates(const AttrDict& train, Value* scale) {
  KILN_ASSIGN_OR_RETURN(auto dense_opt, dictField(train, "optimizer", "kiln.train"));
  KILN_ASSIGN_OR_RETURN(auto sparse_opt, dictField(train, "embedding_optimizer", "kiln.train"));
  if (dense_opt.empty()) return Status::error("kiln.train has no 'optimizer'");

  for (Op* param : forward_ops_) {
    if (!isTrainable(*param)) continue;
    Value* p = param->result();
    std::string name = param->strAttr("name");
    std::string where = fmt::format("parameter '{}'", name);
    auto dense = grads_.find(p);
    auto sparse = sparse_.find(p);
    if (dense == grads_.end() && sparse == sparse_.end()) continue;  // does not reach the loss
    if (sparse != sparse_.end()) {
      if (dense != grads_.end())
        return Status::error(fmt::format("embedding table '{}' is also used outside kiln.embedding_bag; its "
                                         "update must be sparse",
                                         name),
                             param->location());
      if (sparse->second.size() != 1)  // combineSharedLookups leaves one per table
        return Status::error(
            fmt::format("embedding table '{}': {} sparse updates", name, sparse->second.size()),
            param->location());
      // The table's own optimizer overrides the model's embedding optimizer.
      AttrDict opt = sparse_opt;
      if (const Attribute* own = param->attr("optimizer")) {
        if (!own->isDict()) return Status::error(fmt::format("{}: 'optimizer' must be a dictionary", where), param->location());
        opt = own->asDict();
      }
      if (opt.empty()) opt = dense_opt;  // no embedding optimizer: the dense one, if it has a sparse form
      auto attrs = optimizerAttrs(opt, /*sparse=*/true, where);
      if (!attrs) return Status(attrs.status()).withLocation(param->location());
      KILN_ASSIGN_OR_RETURN(
          auto state, stateFor(param, ir::sparseOptimizerState((*attrs)["optimizer"].asString(), *attrs)));
      const SparseUse& use = sparse->second[0];
      std::vector<Value*> operands{p};
      operands.insert(operands.end(), use.inputs.begin(), use.inputs.end());
      bool weighted = use.weighted;
      operands.push_back(use.grad_out);
      operands.insert(operands.end(), state.begin(), state.end());
      operands.push_back(lr_);
      operands.push_back(step_);
      if (scale) operands.push_back(scale);
      (*attrs)["mode"] = use.mode;
      (*attrs)["weighted"] = weighted;
      (*attrs)["scaled"] = scale != nullptr;
      (*attrs)["table"] = name;
      builder_.setLocation(use.loc);
      KILN_RETURN_IF_ERROR(builder_.create(ir::OpCode::EmbeddingBagUpdate, operands, *attrs));
      continue;
    }
    KILN_ASSIGN_OR_RETURN(auto attrs, optimizerAttrs(dense_opt, /*sparse=*/false, "kiln.train optimizer"));
    KILN_ASSIGN_OR_RETURN(auto state,
                          stateFor(param, ir::denseOptimizerState(attrs["kind"].asString(), attrs)));
    std::vector<Value*> operands{p, dense->second};
    operands.insert(operands.end(), state.begin(), state.end());
    operands.push_back(lr_);
    operands.push_back(step_);
    if (scale) operands.push_back(scale);
    attrs["scaled"] = scale != nullptr;
    attrs["param"] = name;
    builder_.setLocation(param->location());
    KILN_RETURN_IF_ERROR(builder_.create(ir::OpCode::OptimizerUpdate, operands, attrs));
  }
  builder_.setLocation({});
  return Status::ok();
}

// Aux-loss-free balancing (docs/moe.md): a parameter with `expert_bias_counts` is a MoE
// router's expert bias, moved outside the gradient by the counts that statistic names.
Status TrainStepBuilder::emitExpertBiasUpdates(const std::map<std::string, Value*>& stats) {
  for (Op* param : forward_ops_) {
    if (!param->is(ir::OpCode::Parameter) || !param->attr("expert_bias_counts")) continue;
    std::string counts_name = param->strAttr("expert_bias_counts");
    auto it = stats.find(counts_name);
    if (it == stats.end())
      return Status::error(
          fmt::format("expert bias '{}' names the counts '{}', which is no statistic of kiln.train",
                      param->strAttr("name"), counts_name),
          param->location());
    const Attribute* rate = param->attr("expert_bias_rate");
    builder_.setLocation(param->location());
    KILN_RETURN_IF_ERROR(builder_.create(ir::OpCode::MoeExpertBiasUpdate, {param->result(), it->second},
                                         {{"rate", rate && rate->isNumber() ? rate->asDouble() : 0.0}}));
  }
  builder_.setLocation({});
  return Status::ok();
}

Status TrainStepBuilder::run(const AttrDict& train, size_t loss_index, std::optional<size_t> prediction_index,
                             const std::vector<std::pair<std::string, size_t>>& stats) {
  ir::Block& body = func_.entry();
  Op* ret = func_.returnOp();
  if (!ret) return Status::error("@forward has no return", func_.loc);
  if (loss_index >= ret->numOperands())
    return Status::error(fmt::format("@forward returns {} values but the loss is output #{}", ret->numOperands(), loss_index),
                         ret->location());
  Value* loss = ret->operand(static_cast<unsigned>(loss_index));
  if (loss->type().rank() != 0 || !ir::isFloat(loss->type().dtype()))
    return Status::error(fmt::format("the loss must be a float scalar, got {}", loss->type().str()), ret->location());
  Value* prediction = prediction_index ? ret->operand(static_cast<unsigned>(*prediction_index)) : nullptr;
  std::map<std::string, Value*> stat_values;
  std::vector<Value*> stat_results;
  for (const auto& [name, index] : stats) {
    if (index >= ret->numOperands())
      return Status::error(
          fmt::format("the statistic '{}' is output #{} of {}", name, index, ret->numOperands()),
          ret->location());
    stat_values[name] = ret->operand(static_cast<unsigned>(index));
    stat_results.push_back(stat_values[name]);
  }
  body.erase(ret);
  forward_ops_ = body.opList();

  // lr and step come first, like the other sources.
  if (!body.empty()) builder_.setInsertionPoint(body.ops().front().get());
  KILN_ASSIGN_OR_RETURN(auto lr, scalarInput("lr"));
  KILN_ASSIGN_OR_RETURN(auto step, scalarInput("step"));
  lr_ = lr;
  step_ = step;
  builder_.setInsertionPointToEnd(body);
  KILN_RETURN_IF_ERROR(enterTrainingMode(train));

  markNeedsGrad();
  KILN_RETURN_IF_ERROR(backward(loss));
  KILN_RETURN_IF_ERROR(combineSharedLookups());

  Value* scale = nullptr;
  auto clip_it = train.find("grad_clip");
  double clip = clip_it != train.end() && clip_it->second.isNumber() ? clip_it->second.asDouble() : 0.0;
  if (clip < 0) return Status::errorf("kiln.train: grad_clip must be >= 0, got {}", clip);
  if (clip > 0) {
    KILN_ASSIGN_OR_RETURN(auto s, clipScale(clip));
    scale = s;
  }
  KILN_RETURN_IF_ERROR(emitUpdates(train, scale));
  KILN_RETURN_IF_ERROR(emitExpertBiasUpdates(stat_values));
  KILN_RETURN_IF_ERROR(emitRunningStateUpdates());

  std::vector<Value*> results{loss};
  if (prediction) results.push_back(prediction);
  results.insert(results.end(), stat_results.begin(), stat_results.end());
  std::vector<TensorType> types;
  for (Value* v : results) types.push_back(v->type());
  KILN_RETURN_IF_ERROR(builder_.createWithTypes(ir::OpCode::Return, results, {}));
  func_.setResultTypes(types);

  // Drop what the backward built but nothing uses (e.g. dense table gradients of a weighted
  // lookup's rule); one reverse sweep suffices since users come after their operands.
  std::vector<Op*> ops = body.opList();
  for (auto it = ops.rbegin(); it != ops.rend(); ++it) {
    Op* op = *it;
    if (!op->hasTrait(ir::kPure)) continue;
    bool used = false;
    for (Value* v : op->results()) used |= v->hasUses();
    if (!used) body.erase(op);
  }
  return Status::ok();
}

Expected<size_t> outputIndex(const ir::Module& m, const std::string& name, const char* role) {
  auto it = m.attrs().find("kiln.outputs");
  if (it == m.attrs().end() || !it->second.isArray())
    return Status::error("the module has no 'kiln.outputs' naming the results of @forward");
  const auto& outs = it->second.asArray();
  for (size_t i = 0; i < outs.size(); ++i)
    if (outs[i].isString() && outs[i].asString() == name) return i;
  return Status::errorf("kiln.train: the {} '{}' is not an output of @forward (kiln.outputs = {})", role, name,
                        it->second.str());
}

}  // namespace

Status buildTrainStep(ir::Module& module) {
  ir::Function* forward = module.lookup("forward");
  if (!forward) return Status::error("the module has no @forward function");
  auto train_it = module.attrs().find("kiln.train");
  if (train_it == module.attrs().end()) return Status::error("the model has no training block ('kiln.train')");
  if (!train_it->second.isDict()) return Status::error("'kiln.train' must be a dictionary");
  const AttrDict& train = train_it->second.asDict();

  KILN_ASSIGN_OR_RETURN(auto loss_index, outputIndex(module, stringField(train, "loss", "loss"), "loss"));
  std::optional<size_t> prediction_index;
  if (train.count("prediction")) {
    KILN_ASSIGN_OR_RETURN(auto p, outputIndex(module, stringField(train, "prediction", ""), "prediction"));
    prediction_index = p;
  }
  std::vector<std::pair<std::string, size_t>> stats;
  if (auto it = train.find("stats"); it != train.end()) {
    if (!it->second.isArray()) return Status::error("kiln.train: 'stats' must be an array of output names");
    for (const Attribute& a : it->second.asArray()) {
      if (!a.isString()) return Status::errorf("kiln.train: 'stats' holds {}, not an output name", a.str());
      KILN_ASSIGN_OR_RETURN(auto index, outputIndex(module, a.asString(), "statistic"));
      stats.push_back({a.asString(), index});
    }
  }
  KILN_ASSIGN_OR_RETURN(auto schedule, dictField(train, "lr_schedule", "kiln.train"));
  KILN_RETURN_IF_ERROR(checkLrSchedule(schedule));

  module.eraseFunction("train_step");
  ir::Function& step = ir::cloneFunction(*forward, module, "train_step");
  TrainStepBuilder builder(step);
  Status s = builder.run(train, loss_index, prediction_index, stats);
  if (s) s = ir::verify(step);
  if (!s) {
    module.eraseFunction("train_step");  // never leave a half-built function behind
    return s;
  }
  return Status::ok();
}

class AutodiffPass : public RegisteredPass<AutodiffPass> {
 public:
  KILN_PASS_INFO(AutodiffPass)
  Expected<bool> run(ir::Module& m) override {
    KILN_RETURN_IF_ERROR(buildTrainStep(m));
    return true;
  }
};

Expected<std::unique_ptr<Pass>> createAutodiffPass(const PassContext&, const PassOptions&) {
  return makePass<AutodiffPass>();
}

}  // namespace kiln::passes
