// Optimizer ops: the in-place parameter updates that end a training step (ir/optimizer.h has the
// operand layouts). They have side effects and no results: each writes its parameter and state
// operands, which must therefore be kiln.parameter values (named storage the runtime owns).
//
// Math (g is the gradient times grad_scale, lr the attribute times the lr operand, t the step):
//   sgd      g += wd*p; with momentum mu: m = mu*m + g, d = nesterov ? g + mu*m : m; p -= lr*d
//   adagrad  g += wd*p; s += g^2; p -= lr * g / (sqrt(s) + eps)
//   adam     g += wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
//            p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
//   adamw    p -= lr*wd*p (decoupled), then adam without the L2 term
// The embedding update first combines the pooled-output gradient of every occurrence of a row
// (duplicates within the batch summed, scaled by per-id weights and 1/length for mean pooling),
// then applies the optimizer to the touched rows only; untouched rows and their state do not
// move (so "adam" is lazy Adam). rowwise_adagrad keeps one accumulator per row, grown by the
// mean of g^2 over the row (FBGEMM's row-wise Adagrad). Weight decay acts on touched rows only.
#include <algorithm>
#include <cmath>
#include <utility>

#include "ir/op_def.h"
#include "ir/optimizer.h"

namespace kiln::ir {

// ---- State slots and layouts (declared in ir/optimizer.h) --------------------------------------

bool isDenseOptimizer(std::string_view kind) {
  return kind == "sgd" || kind == "adagrad" || kind == "adam" || kind == "adamw";
}
bool isSparseOptimizer(std::string_view kind) {
  return kind == "sgd" || kind == "adagrad" || kind == "rowwise_adagrad" || kind == "adam";
}

static double attrOr(const AttrDict& attrs, std::string_view key, double dflt) {
  auto it = attrs.find(key);
  return it != attrs.end() && it->second.isNumber() ? it->second.asDouble() : dflt;
}

std::vector<OptimizerStateSlot> denseOptimizerState(std::string_view kind, const AttrDict& attrs) {
  if (kind == "sgd") {
    if (attrOr(attrs, "momentum", 0) != 0) return {{"momentum"}};
    return {};
  }
  if (kind == "adagrad") return {{"adagrad_sum", false, attrOr(attrs, "initial_accumulator", 0)}};
  if (kind == "adam" || kind == "adamw") return {{"adam_m"}, {"adam_v"}};
  return {};
}

std::vector<OptimizerStateSlot> sparseOptimizerState(std::string_view kind, const AttrDict& attrs) {
  if (kind == "adagrad") return {{"adagrad_sum", false, attrOr(attrs, "initial_accumulator", 0)}};
  if (kind == "rowwise_adagrad")
    return {{"rowwise_adagrad_sum", true, attrOr(attrs, "initial_accumulator", 0)}};
  if (kind == "adam") return {{"adam_m"}, {"adam_v"}};
  return {};
}

std::optional<EmbeddingUpdateLayout> embeddingUpdateLayout(const Op& op) {
  EmbeddingUpdateLayout l;
  bool is_update = op.name() == "kiln.embedding_bag_update";
  int next = 0;
  if (is_update) l.table = next++;
  l.ids = next++;
  if (static_cast<int>(op.numOperands()) <= l.ids) return std::nullopt;
  if (op.operand(static_cast<unsigned>(l.ids))->type().rank() == 1) l.lengths = next++;
  if (op.boolAttr("weighted")) l.weights = next++;
  l.grad_out = next++;
  if (is_update) {
    std::string kind = op.strAttr("optimizer");
    if (!isSparseOptimizer(kind)) return std::nullopt;
    l.num_state = static_cast<int>(sparseOptimizerState(kind, op.attrs()).size());
    l.state_begin = next;
    next += l.num_state;
    l.lr = next++;
    l.step = next++;
    if (op.boolAttr("scaled")) l.grad_scale = next++;
  }
  l.num_operands = next;
  return l;
}

Expected<DenseHyper> denseHyper(const Op& op, double lr_factor, double step, double scale) {
  const std::string kind = op.strAttr("kind");
  DenseHyper h;
  h.lr = op.floatAttr("lr") * lr_factor;
  h.scale = scale;
  h.momentum = op.floatAttr("momentum");
  h.nesterov = op.boolAttr("nesterov");
  h.eps = op.floatAttr("eps", 1e-8);
  h.beta1 = op.floatAttr("beta1", 0.9);
  h.beta2 = op.floatAttr("beta2", 0.999);
  h.weight_decay = op.floatAttr("weight_decay");
  if (kind == "sgd") {
    h.step = denseOptimizerState(kind, op.attrs()).empty() ? DenseStep::kSgd : DenseStep::kSgdMomentum;
  } else if (kind == "adagrad") {
    h.step = DenseStep::kAdagrad;
  } else if (kind == "adam" || kind == "adamw") {
    if (step < 1) return Status::errorf("'{}' ({}): step must be >= 1, got {}", op.name(), kind, step);
    h.bias1 = 1 - std::pow(h.beta1, step);
    h.bias2 = 1 - std::pow(h.beta2, step);
    h.step = kind == "adamw" ? DenseStep::kAdamW : DenseStep::kAdam;
  } else {
    return Status::errorf("'{}': unknown optimizer '{}'", op.name(), kind);
  }
  return h;
}

namespace {

// ---- Verification -------------------------------------------------------------------------------

bool isParameterValue(const Value* v) {
  return v->definingOp() && v->definingOp()->name() == "kiln.parameter";
}

Status expectScalar(const Op& op, unsigned i, const char* what) {
  const TensorType& t = op.operand(i)->type();
  if (t.rank() != 0 || !isFloat(t.dtype()))
    return Status::errorf("'{}' operand #{} ({}) must be a float scalar, got {}", op.name(), i, what, t.str());
  return Status::ok();
}

Status expectWritable(const Op& op, unsigned i, const char* what) {
  if (!isParameterValue(op.operand(i)))
    return Status::errorf("'{}' operand #{} ({}) must be a kiln.parameter: it is updated in place",
                          op.name(), i, what);
  return Status::ok();
}

Status inferOptimizerUpdate(const Op& op, std::vector<TensorType>& out) {
  out.clear();
  std::string kind = op.strAttr("kind");
  auto slots = denseOptimizerState(kind, op.attrs());
  unsigned expected = 2 + static_cast<unsigned>(slots.size()) + 2 + (op.boolAttr("scaled") ? 1 : 0);
  if (op.numOperands() != expected)
    return Status::errorf("'kiln.optimizer_update' ({}) expects {} operands (param, grad, {} state, lr, step{}), got {}",
                          kind, expected, slots.size(), op.boolAttr("scaled") ? ", grad_scale" : "",
                          op.numOperands());
  const TensorType& p = op.operand(0)->type();
  if (!isFloat(p.dtype()))
    return Status::errorf("'kiln.optimizer_update' parameter must be float, got {}", p.str());
  for (unsigned i = 1; i < 2 + slots.size(); ++i) {
    const TensorType& t = op.operand(i)->type();
    if (t.dtype() != p.dtype() || t.shape() != p.shape())
      return Status::errorf("'kiln.optimizer_update' operand #{} has type {}, expected the parameter's {}", i,
                            t.str(), p.str());
  }
  unsigned s = 2 + static_cast<unsigned>(slots.size());
  KILN_RETURN_IF_ERROR(expectScalar(op, s, "lr"));
  KILN_RETURN_IF_ERROR(expectScalar(op, s + 1, "step"));
  if (op.boolAttr("scaled")) KILN_RETURN_IF_ERROR(expectScalar(op, s + 2, "grad_scale"));
  return Status::ok();
}

Status verifyOptimizerUpdate(const Op& op) {
  KILN_RETURN_IF_ERROR(expectWritable(op, 0, "param"));
  auto slots = denseOptimizerState(op.strAttr("kind"), op.attrs());
  for (unsigned i = 0; i < slots.size(); ++i) KILN_RETURN_IF_ERROR(expectWritable(op, 2 + i, "state"));
  return Status::ok();
}

// Shared by the update and the squared-norm op: ids, lengths, weights and grad_out agree.
Status checkSparseGradOperands(const Op& op, const EmbeddingUpdateLayout& l, const Dim& dim) {
  const TensorType& ids = op.operand(l.ids)->type();
  if (!isInteger(ids.dtype()) || (ids.rank() != 1 && ids.rank() != 2))
    return Status::errorf("'{}' ids must be integer [B, H] or [N], got {}", op.name(), ids.str());
  Dim batch = ids.rank() == 2 ? ids.dim(0) : Dim();
  if (l.lengths >= 0) {
    const TensorType& len = op.operand(l.lengths)->type();
    if (len.rank() != 1 || !isInteger(len.dtype()))
      return Status::errorf("'{}' lengths must be a 1-d integer tensor, got {}", op.name(), len.str());
    batch = len.dim(0);
  }
  if (l.weights >= 0) {
    const TensorType& w = op.operand(l.weights)->type();
    if (w.shape() != ids.shape() || !isFloat(w.dtype()))
      return Status::errorf("'{}' weights {} must be float and shaped like ids {}", op.name(), w.str(), ids.str());
  }
  const TensorType& g = op.operand(l.grad_out)->type();
  if (g.rank() != 2 || !(g.dim(0) == batch) || !(g.dim(1) == dim) || !isFloat(g.dtype()))
    return Status::errorf("'{}' grad_out must be float [{}x{}], got {}", op.name(), batch.str(), dim.str(), g.str());
  return Status::ok();
}

Status inferEmbeddingUpdate(const Op& op, std::vector<TensorType>& out) {
  out.clear();
  std::string kind = op.strAttr("optimizer");
  auto layout = embeddingUpdateLayout(op);
  if (!layout) return Status::errorf("'kiln.embedding_bag_update' has unknown optimizer '{}'", kind);
  const EmbeddingUpdateLayout& l = *layout;
  if (static_cast<int>(op.numOperands()) != l.num_operands)
    return Status::errorf("'kiln.embedding_bag_update' ({}) expects {} operands, got {}", kind, l.num_operands,
                          op.numOperands());
  const TensorType& table = op.operand(l.table)->type();
  if (table.rank() != 2 || !isFloat(table.dtype()))
    return Status::errorf("'kiln.embedding_bag_update' table must be float [rows, dim], got {}", table.str());
  // A column shard (the shard pass's column_wise) may get whole rows of gradient: it updates its
  // columns [column_offset, column_offset + dim), and rowwise_adagrad's statistic spans the row.
  Dim grad_dim = table.dim(1);
  if (const Attribute* off = op.attr("column_offset")) {
    const TensorType& g = op.operand(l.grad_out)->type();
    if (g.rank() != 2 || !g.dim(1).isStatic() || !table.dim(1).isStatic() || off->asInt() < 0 ||
        off->asInt() + table.dim(1).size() > g.dim(1).size())
      return Status::errorf(
          "'kiln.embedding_bag_update' columns [{}, +{}) of the table do not lie in grad_out {}",
          off->asInt(), table.dim(1).str(), g.str());
    grad_dim = g.dim(1);
  }
  KILN_RETURN_IF_ERROR(checkSparseGradOperands(op, l, grad_dim));
  if (op.operand(l.grad_out)->type().dtype() != table.dtype())
    return Status::errorf("'kiln.embedding_bag_update' grad_out {} and table {} differ in element type",
                          op.operand(l.grad_out)->type().str(), table.str());
  auto slots = sparseOptimizerState(kind, op.attrs());
  for (int i = 0; i < l.num_state; ++i) {
    const TensorType& st = op.operand(l.state_begin + i)->type();
    TensorType want = slots[i].rowwise ? TensorType(table.dtype(), {table.dim(0)}) : table.withSharding(std::nullopt);
    if (st.withSharding(std::nullopt) != want)
      return Status::errorf("'kiln.embedding_bag_update' state '{}' has type {}, expected {}", slots[i].suffix,
                            st.str(), want.str());
  }
  KILN_RETURN_IF_ERROR(expectScalar(op, l.lr, "lr"));
  KILN_RETURN_IF_ERROR(expectScalar(op, l.step, "step"));
  if (l.grad_scale >= 0) KILN_RETURN_IF_ERROR(expectScalar(op, l.grad_scale, "grad_scale"));
  return Status::ok();
}

Status verifyEmbeddingUpdate(const Op& op) {
  auto l = embeddingUpdateLayout(op);
  KILN_RETURN_IF_ERROR(expectWritable(op, l->table, "table"));
  for (int i = 0; i < l->num_state; ++i) KILN_RETURN_IF_ERROR(expectWritable(op, l->state_begin + i, "state"));
  return Status::ok();
}

Status inferGradSqnorm(const Op& op, std::vector<TensorType>& out) {
  auto layout = embeddingUpdateLayout(op);
  if (static_cast<int>(op.numOperands()) != layout->num_operands)
    return Status::errorf("'kiln.embedding_bag_grad_sqnorm' expects {} operands, got {}", layout->num_operands,
                          op.numOperands());
  const TensorType& g = op.operand(layout->grad_out)->type();
  if (g.rank() != 2) return Status::errorf("'kiln.embedding_bag_grad_sqnorm' grad_out must be [B, D], got {}", g.str());
  KILN_RETURN_IF_ERROR(checkSparseGradOperands(op, *layout, g.dim(1)));
  out = {TensorType(g.dtype(), {})};
  return Status::ok();
}

// ---- Costs --------------------------------------------------------------------------------------

double numel(const Value* v, const SymbolBindings& symbols) {
  return static_cast<double>(v->type().numElements(symbols).value_or(0));
}

double denseFlopsPerElement(std::string_view kind) {
  if (kind == "sgd") return 4;
  if (kind == "adagrad") return 7;
  return 14;  // adam, adamw
}

OpCost costOptimizerUpdate(const Op& op, const SymbolBindings& symbols) {
  double n = numel(op.operand(0), symbols);
  double tensors = 2.0 * (1 + denseOptimizerState(op.strAttr("kind"), op.attrs()).size()) + 1;  // rw + grad
  return {n * denseFlopsPerElement(op.strAttr("kind")),
          n * tensors * static_cast<double>(dtypeBytes(op.operand(0)->type().dtype()))};
}

OpCost costEmbeddingUpdate(const Op& op, const SymbolBindings& symbols) {
  auto l = embeddingUpdateLayout(op);
  const TensorType& table = op.operand(l->table)->type();
  const double ids = numel(op.operand(l->ids), symbols);
  const double dim = static_cast<double>(table.dim(1).factor());
  const double elem = static_cast<double>(dtypeBytes(table.dtype()));
  // The touched rows: at most one per id, and no more than the table has (duplicates are
  // combined first). Each is read and written with its state rows: a per-element state holds a
  // row of dim values, rowwise_adagrad's one value.
  const double touched = table.dim(0).isStatic() ? std::min(ids, static_cast<double>(table.dim(0).size())) : ids;
  double row_bytes = dim * elem;
  for (int s = 0; s < l->num_state; ++s) {
    const TensorType& st = op.operand(static_cast<unsigned>(l->state_begin + s))->type();
    row_bytes += (st.rank() >= 2 ? static_cast<double>(st.dim(1).factor()) : 1.0) *
                 static_cast<double>(dtypeBytes(st.dtype()));
  }
  const TensorType& grad = op.operand(l->grad_out)->type();
  // Every occurrence reads its sample's gradient row and its id.
  const double grad_read = ids * static_cast<double>(grad.dim(1).factor()) * static_cast<double>(dtypeBytes(grad.dtype()));
  const double id_bytes = ids * static_cast<double>(dtypeBytes(op.operand(l->ids)->type().dtype()));
  return {ids * dim * 2 + touched * dim * denseFlopsPerElement(op.strAttr("optimizer")),
          2 * touched * row_bytes + grad_read + id_bytes};
}

OpCost costGradSqnorm(const Op& op, const SymbolBindings& symbols) {
  auto l = embeddingUpdateLayout(op);
  double ids = numel(op.operand(l->ids), symbols);
  double dim = static_cast<double>(op.operand(l->grad_out)->type().dim(1).factor());
  double elem = static_cast<double>(dtypeBytes(op.operand(l->grad_out)->type().dtype()));
  return {ids * dim * 4, ids * dim * elem};
}

// ---- CPU kernels --------------------------------------------------------------------------------

double readScalar(const TensorView& v) {
  switch (v.dtype) {
    case DType::f64: return *v.as<double>();
    case DType::bf16: return bf16ToFloat(*v.as<uint16_t>());
    default: return *v.as<float>();
  }
}

int64_t readIndex(const TensorView& v, int64_t i) {
  return v.dtype == DType::i32 ? v.as<int32_t>()[i] : v.as<int64_t>()[i];
}

double readFloat(const TensorView& v, int64_t i) {
  switch (v.dtype) {
    case DType::f64: return v.as<double>()[i];
    case DType::bf16: return bf16ToFloat(v.as<uint16_t>()[i]);
    default: return v.as<float>()[i];
  }
}

// The parameter and its state slots; the gradient, lr, step and clipping scale are only read.
std::vector<unsigned> writtenByOptimizerUpdate(const Op& op) {
  std::vector<unsigned> out = {0};
  const size_t nstate = denseOptimizerState(op.strAttr("kind"), op.attrs()).size();
  for (unsigned i = 0; i < nstate; ++i) out.push_back(2 + i);
  return out;
}

// The table and its state slots.
std::vector<unsigned> writtenByEmbeddingUpdate(const Op& op) {
  auto l = embeddingUpdateLayout(op);
  if (!l) {  // an unknown optimizer (the verifier says so): assume everything is written
    std::vector<unsigned> all(op.numOperands());
    for (unsigned i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }
  std::vector<unsigned> out = {static_cast<unsigned>(l->table)};
  for (int i = 0; i < l->num_state; ++i) out.push_back(static_cast<unsigned>(l->state_begin + i));
  return out;
}

Status cpuOptimizerUpdate(const Op& op, const std::vector<const TensorView*>& in,
                          const std::vector<TensorView*>&, const CpuContext&) {
  const size_t nstate = denseOptimizerState(op.strAttr("kind"), op.attrs()).size();
  const size_t s = 2 + nstate;
  auto h = denseHyper(op, readScalar(*in[s]), readScalar(*in[s + 1]), op.boolAttr("scaled") ? readScalar(*in[s + 2]) : 1.0);
  if (!h) return h.status();
  const TensorView& p = *in[0];
  int64_t n = p.numel();
  if (in[1]->numel() != n) return Status::error("'kiln.optimizer_update': gradient size differs from the parameter");
  auto state = [&](size_t k) { return k < nstate ? in[2 + k]->data : nullptr; };
  if (p.dtype == DType::f64) {
    denseStep<double>(*h, 0, n, p.as<double>(), in[1]->as<double>(), static_cast<double*>(state(0)),
                      static_cast<double*>(state(1)));
  } else if (p.dtype == DType::f32) {
    denseStep<float>(*h, 0, n, p.as<float>(), in[1]->as<float>(), static_cast<float*>(state(0)),
                     static_cast<float*>(state(1)));
  } else {
    return Status::errorf("'kiln.optimizer_update' has no CPU kernel for {} parameters", dtypeName(p.dtype));
  }
  return Status::ok();
}

// The occurrences of each touched row, grouped: rows[k] is a touched row, its occurrences are
// positions order[begin[k] .. begin[k+1]) of the ids, in id order (so sums are deterministic).
struct RowGroups {
  std::vector<int64_t> rows;
  std::vector<int64_t> begin;
  std::vector<int64_t> positions;
  std::vector<int64_t> sample;  // sample of each id position
  std::vector<double> coeff;    // weight * (1/length for mean) of each id position
};

Expected<RowGroups> groupRows(const Op& op, const EmbeddingUpdateLayout& l,
                              const std::vector<const TensorView*>& in, int64_t num_rows) {
  const TensorView& ids = *in[l.ids];
  int64_t n = ids.numel();
  RowGroups g;
  auto samples = idSamples(op, l, in);
  if (!samples) return samples.status();
  g.sample = std::move(samples->sample);
  g.coeff = std::move(samples->coeff);
  if (l.weights >= 0)
    for (int64_t pos = 0; pos < n; ++pos) g.coeff[static_cast<size_t>(pos)] *= readFloat(*in[l.weights], pos);

  std::vector<std::pair<int64_t, int64_t>> keyed(static_cast<size_t>(n));
  for (int64_t pos = 0; pos < n; ++pos) {
    int64_t row = readIndex(ids, pos);
    if (num_rows >= 0 && (row < 0 || row >= num_rows))
      return Status::errorf("embedding table '{}': id {} at position {} is out of range [0, {})",
                            op.strAttr("table", "?"), row, pos, num_rows);
    keyed[static_cast<size_t>(pos)] = {row, pos};
  }
  std::sort(keyed.begin(), keyed.end());
  g.positions.reserve(keyed.size());
  for (size_t i = 0; i < keyed.size(); ++i) {
    if (i == 0 || keyed[i].first != keyed[i - 1].first) {
      g.rows.push_back(keyed[i].first);
      g.begin.push_back(static_cast<int64_t>(i));
    }
    g.positions.push_back(keyed[i].second);
  }
  g.begin.push_back(n);
  return g;
}

// The combined gradient of group k's row: sum over its occurrences of coeff * grad_out[sample].
void rowGradient(const RowGroups& g, size_t k, const TensorView& grad_out, int64_t dim, double scale,
                 std::vector<double>& out) {
  std::fill(out.begin(), out.end(), 0.0);
  for (int64_t i = g.begin[k]; i < g.begin[k + 1]; ++i) {
    int64_t pos = g.positions[static_cast<size_t>(i)];
    double c = g.coeff[static_cast<size_t>(pos)] * scale;
    int64_t base = g.sample[static_cast<size_t>(pos)] * dim;
    for (int64_t d = 0; d < dim; ++d) out[static_cast<size_t>(d)] += c * readFloat(grad_out, base + d);
  }
}

struct SparseHyper {
  std::string kind;
  double lr, eps, beta1, beta2, weight_decay, scale;
  double bias1 = 1, bias2 = 1;  // Adam's 1 - beta^t
};

// grad_out rows are `width` wide; the table's `dim` columns are [offset, offset + dim) of them.
template <typename T>
void sparseUpdate(const SparseHyper& h, const RowGroups& groups, const TensorView& grad_out, int64_t dim,
                  int64_t offset, T* table, T* s0, T* s1) {
  const int64_t width = grad_out.shape[1];
  std::vector<double> whole(static_cast<size_t>(width));
  for (size_t k = 0; k < groups.rows.size(); ++k) {
    rowGradient(groups, k, grad_out, width, h.scale, whole);
    int64_t r = groups.rows[k];
    T* w = table + r * dim;
    // rowwise_adagrad's statistic: the mean square over the whole row.
    double whole_sq = 0;
    for (double gd : whole) whole_sq += gd * gd;
    std::vector<double> g(whole.begin() + offset, whole.begin() + offset + dim);
    for (int64_t d = 0; d < dim; ++d) g[static_cast<size_t>(d)] += h.weight_decay * static_cast<double>(w[d]);
    if (h.kind == "sgd") {
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<T>(w[d] - h.lr * g[static_cast<size_t>(d)]);
    } else if (h.kind == "adagrad") {
      T* s = s0 + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        double gd = g[static_cast<size_t>(d)];
        double sd = static_cast<double>(s[d]) + gd * gd;
        s[d] = static_cast<T>(sd);
        w[d] = static_cast<T>(w[d] - h.lr * gd / (std::sqrt(sd) + h.eps));
      }
    } else if (h.kind == "rowwise_adagrad") {
      double sq = 0;
      for (double gd : g) sq += gd * gd;
      if (width != dim) sq = whole_sq;  // a column shard (no weight decay: the shard pass checks)
      double s = static_cast<double>(s0[r]) + sq / static_cast<double>(width);
      s0[r] = static_cast<T>(s);
      double step = h.lr / (std::sqrt(s) + h.eps);
      for (int64_t d = 0; d < dim; ++d) w[d] = static_cast<T>(w[d] - step * g[static_cast<size_t>(d)]);
    } else {  // lazy adam
      T* m = s0 + r * dim;
      T* v = s1 + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        double gd = g[static_cast<size_t>(d)];
        double md = h.beta1 * static_cast<double>(m[d]) + (1 - h.beta1) * gd;
        double vd = h.beta2 * static_cast<double>(v[d]) + (1 - h.beta2) * gd * gd;
        m[d] = static_cast<T>(md);
        v[d] = static_cast<T>(vd);
        w[d] = static_cast<T>(w[d] - h.lr * (md / h.bias1) / (std::sqrt(vd / h.bias2) + h.eps));
      }
    }
  }
}

Status cpuEmbeddingUpdate(const Op& op, const std::vector<const TensorView*>& in,
                          const std::vector<TensorView*>&, const CpuContext&) {
  auto l = embeddingUpdateLayout(op);
  const TensorView& table = *in[l->table];
  int64_t rows = table.shape[0], dim = table.shape[1];
  auto groups = groupRows(op, *l, in, rows);
  if (!groups) return groups.status();
  SparseHyper h;
  h.kind = op.strAttr("optimizer");
  h.lr = op.floatAttr("lr") * readScalar(*in[l->lr]);
  double step = readScalar(*in[l->step]);
  h.scale = l->grad_scale >= 0 ? readScalar(*in[l->grad_scale]) : 1.0;
  h.eps = op.floatAttr("eps", 1e-8);
  h.beta1 = op.floatAttr("beta1", 0.9);
  h.beta2 = op.floatAttr("beta2", 0.999);
  h.weight_decay = op.floatAttr("weight_decay");
  if (h.kind == "adam") {
    if (step < 1) return Status::errorf("'kiln.embedding_bag_update' (adam): step must be >= 1, got {}", step);
    h.bias1 = 1 - std::pow(h.beta1, step);
    h.bias2 = 1 - std::pow(h.beta2, step);
  }
  void* s0 = l->num_state > 0 ? in[l->state_begin]->data : nullptr;
  void* s1 = l->num_state > 1 ? in[l->state_begin + 1]->data : nullptr;
  const TensorView& grad_out = *in[l->grad_out];
  if (table.dtype == DType::f64) {
    sparseUpdate<double>(h, *groups, grad_out, dim, op.intAttr("column_offset", 0), table.as<double>(),
                         static_cast<double*>(s0), static_cast<double*>(s1));
  } else if (table.dtype == DType::f32) {
    sparseUpdate<float>(h, *groups, grad_out, dim, op.intAttr("column_offset", 0), table.as<float>(),
                        static_cast<float*>(s0), static_cast<float*>(s1));
  } else {
    return Status::errorf("'kiln.embedding_bag_update' has no CPU kernel for {} tables", dtypeName(table.dtype));
  }
  return Status::ok();
}

Status cpuGradSqnorm(const Op& op, const std::vector<const TensorView*>& in, const std::vector<TensorView*>& out,
                     const CpuContext&) {
  auto l = embeddingUpdateLayout(op);
  auto groups = groupRows(op, *l, in, /*num_rows=*/-1);
  if (!groups) return groups.status();
  const TensorView& grad_out = *in[l->grad_out];
  int64_t dim = grad_out.shape[1];
  std::vector<double> g(static_cast<size_t>(dim));
  double total = 0;
  for (size_t k = 0; k < groups->rows.size(); ++k) {
    rowGradient(*groups, k, grad_out, dim, 1.0, g);
    for (double gd : g) total += gd * gd;
  }
  TensorView& r = *out[0];
  if (r.dtype == DType::f64)
    *r.as<double>() = total;
  else
    *r.as<float>() = static_cast<float>(total);
  return Status::ok();
}

}  // namespace

Expected<IdSamples> idSamples(const Op& op, const EmbeddingUpdateLayout& l,
                              const std::vector<const TensorView*>& in) {
  const TensorView& ids = *in[static_cast<size_t>(l.ids)];
  const int64_t n = ids.numel();
  const bool mean = op.strAttr("mode", "sum") == "mean";
  IdSamples s;
  s.sample.resize(static_cast<size_t>(n));
  s.coeff.assign(static_cast<size_t>(n), 1.0);
  if (l.lengths >= 0) {
    const TensorView& len = *in[static_cast<size_t>(l.lengths)];
    int64_t pos = 0;
    for (int64_t b = 0; b < len.numel(); ++b) {
      int64_t k = readIndex(len, b);
      if (k < 0 || pos + k > n)
        return Status::errorf("'{}': lengths do not match the {} ids (sample {} has length {})", op.name(), n,
                              b, k);
      for (int64_t j = 0; j < k; ++j, ++pos) {
        s.sample[static_cast<size_t>(pos)] = b;
        if (mean) s.coeff[static_cast<size_t>(pos)] = 1.0 / static_cast<double>(k);
      }
    }
    if (pos != n) return Status::errorf("'{}': lengths sum to {} but there are {} ids", op.name(), pos, n);
  } else {
    const int64_t hot = ids.rank() == 2 ? ids.shape[1] : 1;
    for (int64_t pos = 0; pos < n; ++pos) {
      s.sample[static_cast<size_t>(pos)] = pos / hot;
      if (mean) s.coeff[static_cast<size_t>(pos)] = 1.0 / static_cast<double>(hot);
    }
  }
  return s;
}

void registerOptimizerOps(OpRegistry& r) {
  using K = Attribute::Kind;
  r.add({.name = "kiln.optimizer_update",
         .summary = "Updates a dense parameter and its optimizer state in place from its gradient",
         .min_operands = 4, .max_operands = -1, .num_results = 0,
         .attrs = {{"kind", K::String, true, std::nullopt, {"sgd", "adagrad", "adam", "adamw"}},
                   {"lr", K::Float, true},
                   {"momentum", K::Float, false, Attribute(0.0)},
                   {"nesterov", K::Bool, false, Attribute(false)},
                   {"eps", K::Float, false, Attribute(1e-8)},
                   {"beta1", K::Float, false, Attribute(0.9)},
                   {"beta2", K::Float, false, Attribute(0.999)},
                   {"weight_decay", K::Float, false, Attribute(0.0)},
                   {"initial_accumulator", K::Float},
                   {"scaled", K::Bool, false, Attribute(false)},
                   {"param", K::String}},
         .traits = kSideEffect,
         .infer = inferOptimizerUpdate,
         .verify = verifyOptimizerUpdate,
         .cost = costOptimizerUpdate,
         .cpu = cpuOptimizerUpdate,
         .written = writtenByOptimizerUpdate});

  r.add(
      {.name = "kiln.embedding_bag_update",
       .summary = "Sparse optimizer step on the embedding rows a kiln.embedding_bag looked up",
       .min_operands = 5,
       .max_operands = -1,
       .num_results = 0,
       .attrs = {{"optimizer", K::String, true, std::nullopt, {"sgd", "adagrad", "rowwise_adagrad", "adam"}},
                 {"lr", K::Float, true},
                 {"eps", K::Float, false, Attribute(1e-8)},
                 {"beta1", K::Float, false, Attribute(0.9)},
                 {"beta2", K::Float, false, Attribute(0.999)},
                 {"weight_decay", K::Float, false, Attribute(0.0)},
                 {"initial_accumulator", K::Float},
                 {"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                 {"weighted", K::Bool, false, Attribute(false)},
                 {"scaled", K::Bool, false, Attribute(false)},
                 {"table", K::String},
                 {"column_offset", K::Int}},
       .traits = kSideEffect,
       .infer = inferEmbeddingUpdate,
       .verify = verifyEmbeddingUpdate,
       .cost = costEmbeddingUpdate,
       .cpu = cpuEmbeddingUpdate,
       .written = writtenByEmbeddingUpdate});

  r.add({.name = "kiln.embedding_bag_grad_sqnorm",
         .summary = "Squared L2 norm of an embedding table's gradient, duplicates combined, never materialized",
         .min_operands = 2, .max_operands = 4,
         .attrs = {{"mode", K::String, false, Attribute("sum"), {"sum", "mean"}},
                   {"weighted", K::Bool, false, Attribute(false)}},
         .traits = kPure | kNonDifferentiable,
         .infer = inferGradSqnorm,
         .cost = costGradSqnorm,
         .cpu = cpuGradSqnorm});
}

}  // namespace kiln::ir
