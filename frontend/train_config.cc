// The train block: the loss (lowered into @forward and returned as the output "loss") and the
// training settings, written as the module attribute kiln.train (docs/model-ir.md).
#include <map>

#include <fmt/format.h>

#include "frontend/model_lowering.h"

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

void ModelLowering::execTrain(const ast::Stmt& s) {
  if (frame().is_function) fail(s.loc, "'train' belongs in a model, not in a function");
  if (train_.present) fail(s.loc, "a model has one train block");
  train_.present = true;
  train_.loc = s.loc;
  ir::AttrDict& t = train_.attrs;
  bool has_optimizer = false, has_emb = false;
  std::map<std::string, Location> seen;
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
        if (st->value->kind != ast::Expr::Kind::Name) fail(st->value->loc, "prediction names a value: prediction = NAME");
        Val v = eval(*st->value);
        tensorArg(v, st->value->loc, "the prediction");
        train_.prediction = st->value->text;
        train_.prediction_loc = st->value->loc;
        continue;
      }
      Val v = eval(*st->value, key);
      checkNotError(v);
      const Location& vloc = st->value->loc;
      if (key == "loss") {
        ir::Value* loss = tensorArg(v, vloc, "the loss");
        if (loss->type().rank() != 0 || loss->type().dtype() != ir::DType::f32)
          fail(vloc, fmt::format("the loss must be a scalar f32[], got {}", typeStr(loss->type())));
        loss->setNameHint("loss");
        train_.loss = loss;
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
        if (p != "f32" && p != "bf16") fail(vloc, fmt::format("precision must be f32 or bf16, got '{}'", p));
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
        fail(kloc, fmt::format("unknown train setting '{}' (use loss, prediction, label, optimizer, "
                               "embedding_optimizer, lr_schedule, grad_clip, precision, metrics)", key));
      }
    } catch (EvalError&) {
    }
  }
  if (!train_.loss && !seen.count("loss")) fail(s.loc, "the train block needs a loss: loss = bce_with_logits(logit, label)");
  if (!train_.loss) throw EvalError{};
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
