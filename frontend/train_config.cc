// The train block: the loss (lowered into @forward and returned as the output "loss") and the
// training settings, written as the module attribute kiln.train (docs/model-ir.md).
#include <fmt/format.h>

#include <cmath>
#include <map>

#include "frontend/model_lowering.h"
#include "ir/precision.h"

namespace kiln::frontend {
namespace {

// Defaults of each optimizer's fields; the kind decides which fields exist.
const std::map<std::string, std::vector<std::pair<std::string, ir::Attribute>>>& optimizerDefaults() {
  static const std::map<std::string, std::vector<std::pair<std::string, ir::Attribute>>> k = {
      {"sgd", {{"lr", 0.01}, {"momentum", 0.0}, {"nesterov", false}, {"weight_decay", 0.0}}},
      {"adagrad", {{"lr", 0.01}, {"eps", 1e-8}, {"initial_accumulator", 0.0}, {"weight_decay", 0.0}}},
      {"rowwise_adagrad", {{"lr", 0.01}, {"eps", 1e-8}, {"initial_accumulator", 0.0}, {"weight_decay", 0.0}}},
      {"adam", {{"lr", 0.001}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.0}}},
      {"adamw", {{"lr", 0.001}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.01}}}};
  return k;
}

ir::Attribute optimizerAttr(ModelLowering& L, const Val& v, const Location& loc, bool embedding) {
  Val r = L.recordArg(v, loc, embedding ? "embedding_optimizer" : "optimizer");
  static const std::set<std::string> kDense = {"sgd", "adagrad", "adam", "adamw"};
  static const std::set<std::string> kSparse = {"sgd", "adagrad", "rowwise_adagrad", "adam"};
  const auto& allowed = embedding ? kSparse : kDense;
  if (!allowed.count(r.s))
    L.fail(loc, embedding ? fmt::format("'{}' is not an embedding optimizer (use sgd, adagrad, rowwise_adagrad or adam)", r.s)
                          : fmt::format("'{}' is not a dense optimizer (use sgd, adagrad, adam or adamw)", r.s));
  ir::AttrDict d{{"kind", r.s}};
  const auto& defaults = optimizerDefaults().at(r.s);
  for (const auto& [k, unused] : r.fields) {
    // Embedding rows are updated lazily, only when looked up, so a velocity would go stale
    // between visits: sparse sgd is plain sgd, and saying otherwise is an error, not a no-op.
    if (embedding && (k == "momentum" || k == "nesterov"))
      L.fail(loc, fmt::format("embedding optimizers take no {} (sparse rows are updated only when looked up)", k));
    bool known = false;
    for (const auto& kv : defaults) known |= kv.first == k;
    if (!known) L.fail(loc, fmt::format("optimizer '{}' has no setting '{}'", r.s, k));
  }
  for (const auto& [k, dflt] : defaults) {
    if (embedding && (k == "momentum" || k == "nesterov")) continue;
    const Val* f = r.field(k);
    if (!f) {
      d[k] = dflt;
    } else if (dflt.isBool()) {
      d[k] = L.boolArg(*f, loc, k.c_str());
    } else {
      double x = L.numberArg(*f, loc, k.c_str());
      if (x < 0 || (k == "lr" && x == 0)) L.fail(loc, fmt::format("{} must be {}, got {}", k, k == "lr" ? "positive" : "non-negative", x));
      if ((k == "beta1" || k == "beta2" || k == "momentum") && x >= 1) L.fail(loc, fmt::format("{} must be below 1, got {}", k, x));
      d[k] = x;
    }
  }
  return d;
}

ir::Attribute scheduleAttr(ModelLowering& L, const Val& v, const Location& loc) {
  Val r = L.recordArg(v, loc, "lr_schedule");
  ir::AttrDict d{{"kind", r.s}};
  auto num = [&](const char* k, double dflt) {
    const Val* f = r.field(k);
    double x = f ? L.numberArg(*f, loc, k) : dflt;
    if (x < 0) L.fail(loc, fmt::format("{} must be non-negative, got {}", k, x));
    d[k] = x;
  };
  auto steps = [&](const char* k) {
    const Val* f = r.field(k);
    int64_t x = f ? L.intArg(*f, loc, k) : 0;
    if (x < 0) L.fail(loc, fmt::format("{} must be non-negative, got {}", k, x));
    d[k] = x;
  };
  if (r.s == "constant") {
    if (r.field("value")) L.fail(loc, "the constant schedule takes no value (the optimizer's lr is the rate)");
  } else if (r.s == "warmup_decay") {
    steps("warmup_steps"), steps("decay_start"), steps("decay_steps");
    num("end_factor", 0.0), num("power", 1.0);
  } else if (r.s == "exponential") {
    num("decay_rate", 0.96), steps("decay_steps"), steps("warmup_steps");
    const Val* s = r.field("staircase");
    d["staircase"] = s ? L.boolArg(*s, loc, "staircase") : false;
    if (d["decay_steps"].asInt() == 0) d["decay_steps"] = int64_t{1};
  } else {
    L.fail(loc, fmt::format("'{}' is not a learning-rate schedule (use constant, warmup_decay or exponential)", r.s));
  }
  return d;
}

}  // namespace

ir::Attribute denseOptimizerAttr(ModelLowering& L, const Val& v, const Location& loc) { return optimizerAttr(L, v, loc, false); }
ir::Attribute embeddingOptimizerAttr(ModelLowering& L, const Val& v, const Location& loc) { return optimizerAttr(L, v, loc, true); }

ir::Value* ModelLowering::scalarLoss(const Val& v, const Location& loc, const std::string& what) {
  ir::Value* loss = tensorArg(v, loc, what.c_str());
  if (loss->type().rank() != 0 || loss->type().dtype() != ir::DType::f32)
    fail(loc, fmt::format("{} must be a scalar f32[], got {}", what, typeStr(loss->type())));
  return loss;
}

// `prediction = [a, b, ...]`: each task's logits, [B] or [B, 1], side by side as [B, k] in the
// order listed, so that column j is scored against column j of a k-column label.
ir::Value* ModelLowering::taskPredictions(const ast::Expr& list) {
  if (list.items.empty()) fail(list.loc, "prediction = [...] needs at least one value");
  std::vector<ir::Value*> columns;
  for (const auto& item : list.items) {
    if (item->kind != ast::Expr::Kind::Name) fail(item->loc, "prediction = [A, B] lists the names of values");
    ir::Value* x = tensorArg(eval(*item), item->loc, "a task's prediction");
    const ir::TensorType& t = x->type();
    const bool column = t.rank() == 2 && t.dim(1) == ir::Dim::fixed(1);
    if (t.dtype() != ir::DType::f32 || !(t.rank() == 1 || column))
      fail(item->loc,
           fmt::format("a task's prediction is one f32 logit per sample, [B] or [B, 1]; '{}' is {}",
                       item->text, typeStr(t)));
    builder_.setLocation(item->loc);
    columns.push_back(column ? x : reshape(x, {t.dim(0), ir::Dim::fixed(1)}));
  }
  for (size_t i = 1; i < columns.size(); ++i)
    if (!(columns[i]->type().dim(0) == columns[0]->type().dim(0)))
      fail(list.items[i]->loc, fmt::format("the tasks' predictions have different batches: {} and {}",
                                           typeStr(columns[0]->type()), typeStr(columns[i]->type())));
  builder_.setLocation(list.loc);
  ir::Value* p = columns.size() == 1 ? columns[0] : emit(ir::OpCode::Concat, columns, {{"axis", int64_t{1}}});
  p->setNameHint("prediction");
  return p;
}

// The total loss of `loss = [l0, l1, ...]`: sum_i w_i l_i (weights default to 1); each task's
// own loss is a step statistic, task_loss.<i>, for the progress line and the metrics file.
void ModelLowering::weightTaskLosses(const std::vector<double>& weights, const Location& weights_loc,
                                     bool has_weights, const Location& loss_loc) {
  const std::vector<ir::Value*>& losses = train_.task_losses;
  if (losses.empty()) {
    if (has_weights)
      fail(weights_loc, "loss_weights weigh a list of losses: loss = [a, b] with loss_weights = [1, 0.5]");
    train_.loss->setNameHint("loss");
    return;
  }
  if (has_weights && weights.size() != losses.size())
    fail(weights_loc,
         fmt::format("{} loss weights for {} losses; give one per loss", weights.size(), losses.size()));
  builder_.setLocation(loss_loc);
  ir::Value* total = nullptr;
  for (size_t i = 0; i < losses.size(); ++i) {
    const double w = has_weights ? weights[i] : 1.0;
    ir::Value* term =
        w == 1.0 ? losses[i] : emit(ir::OpCode::Mul, {losses[i], scalarConstant(w, ir::DType::f32)});
    total = total ? emit(ir::OpCode::Add, {total, term}) : term;
    addStat(fmt::format("task_loss.{}", i), losses[i]);
  }
  if (losses.size() == 1 && total == losses[0])
    total = emit(ir::OpCode::Mul, {total, scalarConstant(1.0, ir::DType::f32)});
  total->setNameHint("loss");
  train_.loss = total;
}

void ModelLowering::execTrain(const ast::Stmt& s) {
  if (frame().is_function) fail(s.loc, "'train' belongs in a model, not in a function");
  if (train_.present) fail(s.loc, "a model has one train block");
  train_.present = true;
  train_.loc = s.loc;
  ir::AttrDict& t = train_.attrs;
  bool has_optimizer = false, has_emb = false;
  std::map<std::string, Location> seen;
  std::vector<double> weights;
  Location weights_loc, loss_loc;
  for (const auto& st : s.body) {
    try {
      if (st->kind != ast::Stmt::Kind::Assign)
        fail(st->loc, "a train block holds settings: loss = ..., optimizer = ..., metrics = [...]");
      const std::string& key = st->names[0];
      const Location& kloc = st->name_locs[0];
      if (!seen.insert({key, kloc}).second) fail(kloc, fmt::format("'{}' is set twice", key));
      if (key == "label") {
        if (st->value->kind != ast::Expr::Kind::Name) fail(st->value->loc, "label names an input: label = NAME");
        Val v = eval(*st->value);
        tensorArg(v, st->value->loc, "the label");
        continue;
      }
      if (key == "prediction") {
        train_.prediction_loc = st->value->loc;
        if (st->value->kind == ast::Expr::Kind::List) {
          train_.prediction = "prediction";
          train_.prediction_value = taskPredictions(*st->value);
          continue;
        }
        if (st->value->kind != ast::Expr::Kind::Name)
          fail(st->value->loc, "prediction names a value or a list of them: prediction = NAME or [A, B]");
        Val v = eval(*st->value);
        tensorArg(v, st->value->loc, "the prediction");
        train_.prediction = st->value->text;
        continue;
      }
      Val v = eval(*st->value, key);
      checkNotError(v);
      const Location& vloc = st->value->loc;
      if (key == "loss") {
        if (v.kind == Val::Kind::List) {
          if (v.items.empty()) fail(vloc, "a list of losses needs at least one: loss = [a, b]");
          for (size_t i = 0; i < v.items.size(); ++i)
            train_.task_losses.push_back(scalarLoss(v.items[i], vloc, fmt::format("loss {} of the list", i)));
          loss_loc = vloc;
          train_.loss = train_.task_losses[0];  // replaced by the weighted sum below
        } else {
          train_.loss = scalarLoss(v, vloc, "the loss");
        }
      } else if (key == "loss_weights") {
        std::vector<Val> items = v.kind == Val::Kind::List ? v.items : std::vector<Val>{v};
        for (const Val& x : items) {
          const double w = numberArg(x, vloc, "a loss weight");
          if (!(w >= 0) || !std::isfinite(w))
            fail(vloc, fmt::format("loss weights must be finite and >= 0, got {}", w));
          weights.push_back(w);
        }
        weights_loc = vloc;
      } else if (key == "optimizer") {
        t["optimizer"] = denseOptimizerAttr(*this, v, vloc);
        has_optimizer = true;
      } else if (key == "embedding_optimizer") {
        t["embedding_optimizer"] = embeddingOptimizerAttr(*this, v, vloc);
        has_emb = true;
      } else if (key == "lr_schedule") {
        t["lr_schedule"] = scheduleAttr(*this, v, vloc);
      } else if (key == "grad_clip") {
        double c = numberArg(v, vloc, "grad_clip");
        if (c < 0) fail(vloc, "grad_clip must be non-negative (0 turns it off)");
        t["grad_clip"] = c;
      } else if (key == "precision") {
        std::string p = wordArg(v, vloc, "precision");
        if (!ir::isGemmPrecision(p))
          fail(vloc, fmt::format("precision must be one of {}, got '{}'", ir::gemmPrecisionNames(), p));
        t["precision"] = p;
      } else if (key == "metrics") {
        ir::AttrArray m;
        std::vector<Val> items = v.kind == Val::Kind::List ? v.items : std::vector<Val>{v};
        for (const Val& x : items) {
          std::string name = wordArg(x, vloc, "a metric");
          // loss and perplexity: the held-out cross entropy of a language model (and its exp).
          if (name != "auc" && name != "accuracy" && name != "loss" && name != "perplexity")
            fail(vloc, fmt::format("unknown metric '{}' (use auc, accuracy, loss, perplexity)", name));
          m.push_back(name);
        }
        t["metrics"] = m;
      } else {
        fail(kloc,
             fmt::format("unknown train setting '{}' (use loss, loss_weights, prediction, label, optimizer, "
                         "embedding_optimizer, lr_schedule, grad_clip, precision, metrics)",
                         key));
      }
    } catch (EvalError&) {
    }
  }
  if (!train_.loss && !seen.count("loss")) fail(s.loc, "the train block needs a loss: loss = bce_with_logits(logit, label)");
  if (!train_.loss) throw EvalError{};
  weightTaskLosses(weights, weights_loc, seen.count("loss_weights") > 0, loss_loc);
  if (!has_optimizer) t["optimizer"] = denseOptimizerAttr(*this, Val::builtin("sgd"), s.loc);
  if (!has_emb) {
    // Embeddings follow the dense optimizer unless told otherwise (adamw's decoupled decay has
    // no lazy sparse form, so its tables use adam).
    // Momentum has no sparse form either, so it stays with the dense weights.
    ir::AttrDict e = t["optimizer"].asDict();
    if (e["kind"].asString() == "adamw") e["kind"] = std::string("adam");
    e.erase("momentum");
    e.erase("nesterov");
    t["embedding_optimizer"] = e;
  }
  if (!t.count("lr_schedule")) t["lr_schedule"] = ir::AttrDict{{"kind", std::string("constant")}};
  if (!t.count("grad_clip")) t["grad_clip"] = 0.0;
  if (!t.count("precision")) t["precision"] = std::string("f32");
  if (!t.count("metrics")) t["metrics"] = ir::AttrArray{std::string("auc")};
}

}  // namespace kiln::frontend
