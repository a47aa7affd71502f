// Recommendation builtins (docs/language.md): hashed id crosses (Wide & Deep's crossed
// columns), batch normalization with running statistics, and the two-tower retrieval loss with
// in-batch negatives and the log-Q correction (Yi et al. 2019) with its recall@k.
#include <fmt/format.h>

#include <limits>

#include "frontend/model_lowering.h"

namespace kiln::frontend {

using CallArgs = ModelLowering::CallArgs;

// The mean and biased variance of x [B, ..., C] over every axis but the last, each [C]: the
// batch's in training, running averages (`name.running_mean`, `name.running_var`, moved by
// `momentum` each train step and saved in checkpoints) in eval and predict.
NormStatistics normStatistics(ModelLowering& L, ir::Value* x, const std::string& name, double momentum,
                              const Location& loc) {
  const int64_t c = staticLastDim(L, x, loc, "a normalized input");
  const ir::TensorType stat(x->type().dtype(), {ir::Dim::fixed(c)});
  const ir::AttrDict state{{"trainable", false}};
  ir::Value* running_mean = L.makeParam(name + ".running_mean", stat, Val::builtin("zeros"), loc, state);
  ir::Value* running_var = L.makeParam(name + ".running_var", stat, Val::builtin("ones"), loc, state);
  L.builder().setLocation(loc);
  std::vector<int64_t> axes;
  for (int64_t i = 0; i + 1 < x->type().rank(); ++i) axes.push_back(i);
  ir::Value* mean = reduce(L, x, "mean", axes, false);
  ir::Value* centered = L.emit(ir::OpCode::Sub, {x, mean});
  ir::Value* var = reduce(L, L.emit(ir::OpCode::Mul, {centered, centered}), "mean", axes, false);
  const ir::AttrDict attrs{{"momentum", momentum}};
  NormStatistics s;
  s.mean = L.emit(ir::OpCode::RunningStat, {mean, running_mean}, attrs);
  s.var = L.emit(ir::OpCode::RunningStat, {var, running_var}, attrs);
  s.mean->setNameHint(name + ".mean");
  s.var->setNameHint(name + ".var");
  return s;
}

namespace {

// cross_ids(a, b, ..., buckets = N): the hashed cross of two or more single-id features, a new
// sparse feature with ids in [0, N) (kiln.hash_cross) for a table of N rows. A feature no table
// reads keeps its raw ids for the hash.
Val fnCrossIds(ModelLowering& L, CallArgs& a) {
  std::vector<SparseFeature> parts;
  std::vector<Location> locs;
  for (size_t i = 0; i < a.positional.size(); ++i) {
    const Val& v = a.positional[i];
    const Location& loc = a.positional_locs[i];
    L.checkNotError(v);
    if (v.kind != Val::Kind::Sparse)
      L.fail(loc, fmt::format("cross_ids crosses sparse features, got {}", describe(v)));
    for (const SparseFeature& f : v.sparse) {
      if (f.lengths || f.weights || f.ids->type().rank() != 2 || f.ids->type().dim(1).size() != 1)
        L.fail(loc, fmt::format("cross_ids crosses single-id features; '{}' is {}{}", f.name,
                                typeStr(f.ids->type()), f.weights ? " weighted" : ""));
      parts.push_back(f);
      locs.push_back(loc);
    }
  }
  if (parts.size() < 2)
    L.fail(a.loc, fmt::format("cross_ids needs two or more features, got {}", parts.size()));
  int64_t buckets = 0;
  for (size_t k = 0; k < a.named.size(); ++k) {
    if (a.named[k].first != "buckets")
      L.fail(a.named_locs[k],
             fmt::format("cross_ids takes features and 'buckets', not '{}'", a.named[k].first));
    buckets = positiveInt(L, a.named[k].second, a.named_locs[k], "buckets");
  }
  if (buckets == 0)
    L.fail(a.loc, "cross_ids needs 'buckets = N', the rows of the table that reads the cross");
  std::vector<ir::Value*> ids;
  std::string name = "cross(";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].ids_op->attr("rows")) parts[i].ids_op->setAttr("rows", kRawIdRows);
    ids.push_back(parts[i].ids);
    name += (i ? "," : "") + parts[i].name;
  }
  name += ")";
  uint64_t salt = 0xcbf29ce484222325ull;  // FNV-1a of the name: another cross, another hash
  for (unsigned char c : name) salt = (salt ^ c) * 0x100000001b3ull;
  L.builder().setLocation(a.loc);
  SparseFeature cross;
  cross.name = name;
  cross.feature = -1;
  cross.ids = L.emit(ir::OpCode::HashCross, ids,
                     {{"buckets", buckets}, {"salt", static_cast<int64_t>(salt & 0x7fffffffffffffffull)}});
  cross.ids->setNameHint(name);
  cross.ids_op = cross.ids->definingOp();
  Val v = Val::none();
  v.kind = Val::Kind::Sparse;
  v.sparse = {cross};
  v.single = true;
  return v;
}

// batch_norm(x, momentum = 0.1, eps = 1e-5): (x - mean) / sqrt(var + eps) * weight + bias per
// channel (the last axis), with the batch's statistics in training and running ones in eval.
Val fnBatchNorm(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"x", "momentum", "eps", "name"}, 1);
  ir::Value* x = floatTensor(L, *b.get(0), b.locs[0], "batch_norm's input");
  if (x->type().rank() < 2)
    L.fail(b.locs[0], fmt::format("batch_norm needs a [B, ..., C] input, got {}", typeStr(x->type())));
  const double momentum = b.get(1) ? L.numberArg(*b.get(1), b.locs[1], "momentum") : 0.1;
  if (!(momentum >= 0 && momentum <= 1))
    L.fail(b.locs[1], fmt::format("batch_norm's momentum must lie in [0, 1], got {}", momentum));
  const double eps = b.get(2) ? L.numberArg(*b.get(2), b.locs[2], "eps") : 1e-5;
  if (!(eps > 0)) L.fail(b.locs[2], fmt::format("batch_norm's eps must be positive, got {}", eps));
  const std::string name = L.layerName(a, "batch_norm", b.get(3));
  const ir::DType dt = x->type().dtype();
  const ir::TensorType channel(dt, {ir::Dim::fixed(staticLastDim(L, x, a.loc, "batch_norm"))});
  ir::Value* gamma = L.makeParam(name + ".weight", channel, Val::builtin("ones"), a.loc);
  ir::Value* beta = L.makeParam(name + ".bias", channel, Val::builtin("zeros"), a.loc);
  NormStatistics s = normStatistics(L, x, name, momentum, a.loc);
  ir::Value* inv = L.emit(ir::OpCode::Rsqrt, {L.emit(ir::OpCode::Add, {s.var, L.scalarConstant(eps, dt)})});
  ir::Value* y =
      L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Sub, {x, s.mean}), L.emit(ir::OpCode::Mul, {inv, gamma})});
  return Val::ofTensor(L.emit(ir::OpCode::Add, {y, beta}));
}

// The [B, D] query and candidate towers' outputs of an in-batch retrieval builtin, with scores
// s[i, j] = <q_i, c_j> / temperature ([B, B]): candidate j is the positive of query i = j.
struct InBatch {
  ir::Value* scores = nullptr;
  ir::Value* positive = nullptr;  // s[i, i], [B, 1]
};

InBatch inBatchScores(ModelLowering& L, const ModelLowering::Bound& b, double temperature,
                      const Location& loc) {
  ir::Value* q = floatTensor(L, *b.get(0), b.locs[0], "the query embeddings");
  ir::Value* c = floatTensor(L, *b.get(1), b.locs[1], "the candidate embeddings");
  if (q->type().rank() != 2 || !(q->type() == c->type()))
    L.fail(loc,
           fmt::format("in-batch retrieval needs query and candidate embeddings of one type [B, D], got {} "
                       "and {}",
                       typeStr(q->type()), typeStr(c->type())));
  L.builder().setLocation(loc);
  const ir::DType dt = q->type().dtype();
  ir::Value* inv_t = L.scalarConstant(1.0 / temperature, dt);
  InBatch r;
  r.scores = L.emit(ir::OpCode::Mul, {L.emit(ir::OpCode::Matmul, {q, c}, {{"transpose_b", true}}), inv_t});
  r.positive = L.emit(ir::OpCode::Mul, {reduce(L, L.emit(ir::OpCode::Mul, {q, c}), "sum", {1}, true), inv_t});
  return r;
}

double temperatureArg(ModelLowering& L, const Val* v, const Location& loc) {
  const double t = v ? L.numberArg(*v, loc, "temperature") : 0.05;
  if (!(t > 0)) L.fail(loc, fmt::format("temperature must be positive, got {}", t));
  return t;
}

// in_batch_softmax(query, candidate, ids, temperature = 0.05, logq = true, alpha = 0.01): the
// sampled softmax loss of retrieval with the batch's other candidates as negatives, the mean
// over queries of logsumexp_j(s[i, j] - log q_j) - (s[i, i] - log q_i). `ids` is the candidates'
// single-id feature; with logq, log q_j is the streaming frequency estimate of candidate j
// (kiln.log_frequency: state `name.frequency`, rate alpha), which removes the popularity bias
// of in-batch negatives; logq = false leaves the scores as they are.
Val fnInBatchSoftmax(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"query", "candidate", "ids", "temperature", "logq", "alpha", "name"}, 3);
  const double temperature = temperatureArg(L, b.get(3), b.locs[3]);
  const bool logq = b.get(4) ? L.boolArg(*b.get(4), b.locs[4], "logq") : true;
  const double alpha = b.get(5) ? L.numberArg(*b.get(5), b.locs[5], "alpha") : 0.01;
  if (!(alpha > 0 && alpha <= 1)) L.fail(b.locs[5], fmt::format("alpha must lie in (0, 1], got {}", alpha));
  const std::string name = L.layerName(a, "in_batch_softmax", b.get(6));
  InBatch s = inBatchScores(L, b, temperature, a.loc);
  ir::Value* scores = s.scores;
  ir::Value* positive = s.positive;
  const ir::DType dt = scores->type().dtype();
  const ir::Dim batch = scores->type().dim(0);
  const Val& ids = *b.get(2);
  L.checkNotError(ids);
  if (ids.kind != Val::Kind::Sparse || ids.sparse.size() != 1 || ids.sparse[0].lengths ||
      ids.sparse[0].ids->type().rank() != 2 || ids.sparse[0].ids->type().dim(1).size() != 1)
    L.fail(b.locs[2], fmt::format("in_batch_softmax's ids are the candidates' single-id feature, got {}",
                                  describe(ids)));
  const SparseFeature& f = ids.sparse[0];
  const ir::Attribute* rows = f.ids_op->attr("rows");
  if (!rows)
    L.fail(b.locs[2], fmt::format("look the candidates' ids '{}' up in their table before in_batch_softmax "
                                  "(its rows size the frequency estimator)",
                                  f.name));
  // The synthetic generator draws these ids for the query (docs/data.md, "Synthetic retrieval").
  if (f.ids_op->is(ir::OpCode::Input)) f.ids_op->setAttr("retrieval", std::string("candidate"));
  if (logq) {
    ir::Value* state =
        L.makeParam(name + ".frequency",
                    ir::TensorType(ir::DType::f32, {ir::Dim::fixed(rows->asInt()), ir::Dim::fixed(2)}),
                    Val::builtin("zeros"), a.loc, {{"trainable", false}});
    L.builder().setLocation(a.loc);
    // An id never seen is taken to come once in `rows` steps.
    ir::Value* log_q = L.emit(ir::OpCode::LogFrequency, {L.reshape(f.ids, {batch}), state},
                              {{"prior", static_cast<double>(rows->asInt())}, {"alpha", alpha}});
    log_q->setNameHint(name + ".log_q");
    if (dt != ir::DType::f32)
      log_q = L.emit(ir::OpCode::Cast, {log_q}, {{"to", std::string(ir::dtypeName(dt))}});
    scores = L.emit(ir::OpCode::Sub, {scores, log_q});  // column j less log q_j
    positive = L.emit(ir::OpCode::Sub, {positive, L.reshape(log_q, {batch, ir::Dim::fixed(1)})});
  }
  ir::Value* top = reduce(L, scores, "max", {1}, true);
  ir::Value* sum =
      reduce(L, L.emit(ir::OpCode::Exp, {L.emit(ir::OpCode::Sub, {scores, top})}), "sum", {1}, true);
  ir::Value* lse = L.emit(ir::OpCode::Add, {top, L.emit(ir::OpCode::Log, {sum})});
  ir::Value* loss = reduce(L, L.emit(ir::OpCode::Sub, {lse, positive}), "mean", {0, 1}, false);
  loss->setNameHint("in_batch_softmax");
  return Val::ofTensor(loss);
}

// in_batch_recall(query, candidate, k = 10): the fraction of queries whose positive ranks among
// the top k of the batch's candidates by score (ties count against it); an f32 scalar, and the
// statistic metric.recall@k that training's evaluations, the metrics file and kiln eval report.
Val fnInBatchRecall(ModelLowering& L, CallArgs& a) {
  auto b = L.bindArgs(a, {"query", "candidate", "k"}, 2);
  const int64_t k = b.get(2) ? positiveInt(L, *b.get(2), b.locs[2], "k") : 10;
  InBatch s = inBatchScores(L, b, 1.0, a.loc);
  const ir::DType dt = s.scores->type().dtype();
  ir::Value* above = L.emit(ir::OpCode::Compare, {s.scores, s.positive}, {{"predicate", "ge"}});
  // s[i, i] >= itself: the positive counts once, so rank < k is count <= k.
  ir::Value* rank =
      reduce(L, L.emit(ir::OpCode::Select, {above, L.scalarConstant(1, dt), L.scalarConstant(0, dt)}), "sum",
             {1}, false);
  ir::Value* hit = L.emit(ir::OpCode::Compare, {rank, L.scalarConstant(static_cast<double>(k), dt)},
                          {{"predicate", "le"}});
  ir::Value* recall =
      reduce(L, L.emit(ir::OpCode::Select, {hit, L.scalarConstant(1, dt), L.scalarConstant(0, dt)}), "mean",
             {0}, false);
  recall->setNameHint(fmt::format("recall@{}", k));
  // A batch metric of every step, averaged over evaluation (docs/language.md, "Two towers").
  L.addStat(fmt::format("metric.recall@{}", k), recall);
  return Val::ofTensor(recall);
}

}  // namespace

void addRecsysBuiltins(std::map<std::string, BuiltinInfo>& m) {
  m["cross_ids"] = {fnCrossIds, "hashed cross of single-id features into a new feature (Wide & Deep)"};
  m["batch_norm"] = {fnBatchNorm, "batch normalization: batch statistics in training, running ones in eval"};
  m["in_batch_softmax"] = {fnInBatchSoftmax, "two-tower loss over in-batch negatives, log-Q corrected"};
  m["in_batch_recall"] = {fnInBatchRecall, "fraction of queries whose positive is in the batch's top k"};
}

}  // namespace kiln::frontend
