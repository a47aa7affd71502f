#include "runtime/data/batch.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>

namespace kiln::data {

std::string StreamPosition::str() const {
  return fmt::format("epoch={},file={},offset={},line={},sample={}", epoch, file, offset, line, sample);
}

Expected<StreamPosition> StreamPosition::parse(std::string_view s) {
  StreamPosition p;
  int64_t* fields[] = {&p.epoch, &p.file, &p.offset, &p.line, &p.sample};
  const char* keys[] = {"epoch", "file", "offset", "line", "sample"};
  for (int i = 0; i < 5; ++i) {
    std::string_view key = keys[i];
    if (s.substr(0, key.size()) != key || s.size() <= key.size() || s[key.size()] != '=')
      return Status::errorf("bad data position '{}': expected '{}=' at '{}'", s, key, s);
    s.remove_prefix(key.size() + 1);
    size_t end = s.find(',');
    std::string num(s.substr(0, end));
    char* stop = nullptr;
    errno = 0;
    long long v = std::strtoll(num.c_str(), &stop, 10);
    if (num.empty() || *stop != '\0' || errno || v < 0) return Status::errorf("bad data position: '{}' is not a count", num);
    *fields[i] = v;
    if (i < 4 && end == std::string_view::npos) return Status::error("bad data position: too few fields");
    s = end == std::string_view::npos ? std::string_view() : s.substr(end + 1);
  }
  if (!s.empty()) return Status::errorf("bad data position: trailing '{}'", s);
  return p;
}


std::string_view roleName(InputRole r) {
  switch (r) {
    case InputRole::Dense: return "dense";
    case InputRole::Label: return "label";
    case InputRole::Sparse: return "sparse";
    case InputRole::Lengths: return "lengths";
    case InputRole::Weights: return "weights";
    case InputRole::Tokens:
      return "tokens";
    case InputRole::Targets:
      return "targets";
  }
  return "?";
}

const InputSpec* BatchSpec::find(const std::string& name) const {
  int i = indexOf(name);
  return i < 0 ? nullptr : &inputs[static_cast<size_t>(i)];
}

int BatchSpec::indexOf(const std::string& name) const {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].name == name) return static_cast<int>(i);
  return -1;
}

int BatchSpec::labelIndex() const {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].role == InputRole::Label) return static_cast<int>(i);
  return -1;
}

int BatchSpec::tokensIndex() const {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].role == InputRole::Tokens) return static_cast<int>(i);
  return -1;
}

int BatchSpec::targetsIndex() const {
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].role == InputRole::Targets) return static_cast<int>(i);
  return -1;
}

std::string ColumnRef::str() const {
  return named() ? fmt::format("'{}'", name) : fmt::format("#{}", position);
}

const ir::HostTensor* Batch::find(const std::string& name) const {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return &tensors[i];
  return nullptr;
}

ir::HostTensor* Batch::find(const std::string& name) {
  return const_cast<ir::HostTensor*>(static_cast<const Batch*>(this)->find(name));
}

float batchLabel(const Batch& b, const BatchSpec& spec, int64_t i) {
  int li = spec.labelIndex();
  assert(li >= 0);
  return b.tensors[static_cast<size_t>(li)].as<float>()[i * spec.inputs[static_cast<size_t>(li)].label_count];
}

namespace {

const ir::Attribute* get(const ir::AttrDict& a, std::string_view key) {
  auto it = a.find(key);
  return it == a.end() ? nullptr : &it->second;
}

// The leading dim must be the batch symbol (times 1).
bool isBatchDim(const ir::Dim& d, const std::string& sym) { return d.isSymbolic() && d.sym() == sym && d.factor() == 1; }

Status inputError(const std::string& name, const std::string& msg) {
  return Status::errorf("input '{}': {}", name, msg);
}

Expected<int64_t> intAttr(const ir::AttrDict& a, const std::string& name, std::string_view key, bool required) {
  const ir::Attribute* v = get(a, key);
  if (!v) {
    if (required) return inputError(name, fmt::format("missing integer attribute '{}'", key));
    return int64_t{0};
  }
  if (!v->isInt()) return inputError(name, fmt::format("attribute '{}' must be an integer, got {}", key, v->str()));
  return v->asInt();
}

// The `columns` attribute of a dense, label or sparse input: `n` names or positions, or none.
Expected<std::vector<ColumnRef>> columnsAttr(const ir::AttrDict& a, const std::string& name, int n) {
  std::vector<ColumnRef> out;
  const ir::Attribute* v = get(a, "columns");
  if (!v) return out;
  if (!v->isArray() || v->asArray().size() != static_cast<size_t>(n))
    return inputError(name, fmt::format("'columns' must list {} file column(s), got {}", n, v->str()));
  for (const ir::Attribute& c : v->asArray()) {
    if (c.isString() && !c.asString().empty()) {
      out.push_back(ColumnRef{.name = c.asString()});
    } else if (c.isInt() && c.asInt() >= 0) {
      out.push_back(ColumnRef{.position = c.asInt()});
    } else {
      return inputError(name, fmt::format("a file column is a name or a position >= 0, got {}", c.str()));
    }
  }
  return out;
}

// Bound columns make a schema layout, and then every input the files fill names its columns,
// all by name or all by position; each input learns where its columns start among the schema's
// columns of its kind (label, dense, categorical: schema.h).
Status assignLayout(BatchSpec& spec) {
  const InputSpec* bound = nullptr;
  for (const InputSpec& in : spec.inputs)
    if (!in.columns.empty()) {
      bound = &in;
      break;
    }
  if (!bound) return Status::ok();
  spec.layout = bound->columns[0].named() ? DataLayout::Named : DataLayout::Positional;
  int labels = 0, dense = 0, cats = 0;
  for (InputSpec& in : spec.inputs) {
    if (in.role != InputRole::Dense && in.role != InputRole::Label && in.role != InputRole::Sparse) continue;
    if (in.columns.empty())
      return inputError(in.name,
                        fmt::format("binds no file columns, but '{}' does (columns(...)): when one input "
                                    "names its columns every input read from the files does",
                                    bound->name));
    for (const ColumnRef& c : in.columns)
      if (c.named() != bound->columns[0].named())
        return inputError(in.name,
                          fmt::format("reads column {} but '{}' reads column {}: bind every column by "
                                      "name (a header line) or every one by position",
                                      c.str(), bound->name, bound->columns[0].str()));
    int& next = in.role == InputRole::Label ? labels : in.role == InputRole::Dense ? dense : cats;
    in.first_column = next;
    next += static_cast<int>(in.columns.size());
  }
  return Status::ok();
}

// A token stream is the model's only data: the loaders fill tokens and targets from windows of
// one stream and know no Criteo features beside them.
Status checkTokenInputs(const BatchSpec& spec) {
  const int tokens = spec.tokensIndex(), targets = spec.targetsIndex();
  if (targets >= 0 && tokens < 0)
    return inputError(spec.inputs[static_cast<size_t>(targets)].name,
                      "next-token targets need a token input (role = \"tokens\")");
  if (tokens < 0) return Status::ok();
  const InputSpec& tok = spec.inputs[static_cast<size_t>(tokens)];
  for (const InputSpec& in : spec.inputs) {
    if (in.role == InputRole::Targets && in.seq_len != tok.seq_len)
      return inputError(in.name, fmt::format("targets {} must be shaped like the tokens {}", in.type.str(),
                                             tok.type.str()));
    if (in.role != InputRole::Tokens && in.role != InputRole::Targets)
      return inputError(
          in.name, fmt::format("a model reading the token stream '{}' reads no {} input beside it", tok.name,
                               roleName(in.role)));
  }
  return Status::ok();
}

}  // namespace

Expected<BatchSpec> fromInputs(const std::vector<std::pair<ir::AttrDict, ir::TensorType>>& decls) {
  BatchSpec spec;
  std::map<int, int> sparse_of_feature;  // feature -> index of its sparse input
  for (const auto& [attrs, type] : decls) {
    const ir::Attribute* name_attr = get(attrs, "name");
    if (!name_attr || !name_attr->isString()) return Status::error("a 'kiln.input' has no string attribute 'name'");
    InputSpec in;
    in.name = name_attr->asString();
    in.type = type;
    const ir::Attribute* role_attr = get(attrs, "role");
    if (!role_attr || !role_attr->isString()) return inputError(in.name, "missing string attribute 'role'");
    const std::string& role = role_attr->asString();
    // Fed by the trainer, not by the data: the learning rate, the step, and the pipelined step's
    // next batch and carried routes.
    if (role == "lr" || role == "step" || role == "pipeline") continue;
    if (spec.find(in.name)) return inputError(in.name, "declared twice");
    const ir::Shape& s = type.shape();
    auto need = [&](bool ok, const std::string& what) { return ok ? Status::ok() : inputError(in.name, what); };
    if (role == "dense") {
      in.role = InputRole::Dense;
      // Wider than the Criteo layout's 13 is a tensor the caller fills (a benchmark feeding a
      // layer); the data loaders refuse it (openBatchReader).
      KILN_RETURN_IF_ERROR(
          need(type.dtype() == ir::DType::f32 && s.size() == 2 && isBatchDim(s[0], spec.batch_symbol) &&
                   s[1].isStatic() && s[1].size() >= 1 && s[1].size() <= (int64_t{1} << 24),
               fmt::format("dense features must be f32[Bxn] with n >= 1, got {}", type.str())));
      in.dense_count = static_cast<int>(s[1].size());
      KILN_ASSIGN_OR_RETURN(in.columns, columnsAttr(attrs, in.name, in.dense_count));
    } else if (role == "label") {
      in.role = InputRole::Label;
      bool shape_ok =
          (s.size() == 1 && isBatchDim(s[0], spec.batch_symbol)) ||
          (s.size() == 2 && isBatchDim(s[0], spec.batch_symbol) && s[1].isStatic() && s[1].size() >= 1);
      KILN_RETURN_IF_ERROR(need(type.dtype() == ir::DType::f32 && shape_ok,
                                fmt::format("a label must be f32[B] or f32[Bxk], got {}", type.str())));
      in.label_count = s.size() == 2 ? static_cast<int>(s[1].size()) : 1;
      KILN_ASSIGN_OR_RETURN(in.columns, columnsAttr(attrs, in.name, in.label_count));
    } else if (role == "sparse" || role == "lengths" || role == "weights") {
      KILN_ASSIGN_OR_RETURN(auto f, intAttr(attrs, in.name, "feature", true));
      if (f < 0 || f >= (int64_t{1} << 20))
        return inputError(in.name, fmt::format("feature {} is outside [0, 2^20)", f));
      in.feature = static_cast<int>(f);
      if (role == "sparse") {
        KILN_ASSIGN_OR_RETURN(in.columns, columnsAttr(attrs, in.name, 1));
      }
      if (role == "sparse") {
        in.role = InputRole::Sparse;
        if (sparse_of_feature.count(in.feature))
          return inputError(in.name, fmt::format("feature {} is already read by '{}'", in.feature,
                                                 spec.inputs[static_cast<size_t>(sparse_of_feature[in.feature])].name));
        KILN_ASSIGN_OR_RETURN(auto rows, intAttr(attrs, in.name, "rows", true));
        if (rows <= 0) return inputError(in.name, fmt::format("rows must be positive, got {}", rows));
        in.rows = rows;
        if (const ir::Attribute* t = get(attrs, "table")) {
          if (!t->isString())
            return inputError(in.name, fmt::format("table must be a string, got {}", t->str()));
          in.table = t->asString();
        }
        if (const ir::Attribute* t = get(attrs, "retrieval"))
          in.retrieval_candidate = t->isString() && t->asString() == "candidate";
        if (const ir::Attribute* m = get(attrs, "id_map")) {
          if (!m->isString() || (m->asString() != "modulo" && m->asString() != "hash"))
            return inputError(in.name, fmt::format("id_map must be \"modulo\" or \"hash\", got {}", m->str()));
          in.id_map = m->asString() == "hash" ? IdMap::Hash : IdMap::Modulo;
        }
        KILN_RETURN_IF_ERROR(need(ir::isInteger(type.dtype()), fmt::format("ids must be i32 or i64, got {}", type.str())));
        if (type.dtype() == ir::DType::i32 && in.rows > (int64_t{1} << 31))
          return inputError(in.name, fmt::format("{} rows do not fit i32 ids", in.rows));
        auto hot = intAttr(attrs, in.name, "hotness", false);
        auto max_hot = intAttr(attrs, in.name, "max_hotness", false);
        if (!hot) return hot.status();
        if (!max_hot) return max_hot.status();
        if (*max_hot > 0) {
          in.max_hotness = static_cast<int>(*max_hot);
          ir::Dim bound = ir::Dim::symbol(spec.batch_symbol, *max_hot);
          KILN_RETURN_IF_ERROR(need(s.size() == 1 && s[0].isBounded() && s[0].upperBound() == bound,
                                    fmt::format("variable-length ids with max_hotness {} must be shaped [?({}*{})], got {}",
                                                *max_hot, *max_hot, spec.batch_symbol, type.str())));
        } else {
          KILN_RETURN_IF_ERROR(need(s.size() == 2 && isBatchDim(s[0], spec.batch_symbol) && s[1].isStatic() && s[1].size() >= 1,
                                    fmt::format("fixed-hotness ids must be shaped [BxH], got {}", type.str())));
          if (*hot != 0 && *hot != s[1].size())
            return inputError(in.name, fmt::format("hotness {} does not match the type {}", *hot, type.str()));
          in.hotness = static_cast<int>(s[1].size());
        }
        sparse_of_feature[in.feature] = static_cast<int>(spec.inputs.size());
      } else if (role == "lengths") {
        in.role = InputRole::Lengths;
        KILN_RETURN_IF_ERROR(need(type.dtype() == ir::DType::i32 && s.size() == 1 && isBatchDim(s[0], spec.batch_symbol),
                                  fmt::format("lengths must be i32[B], got {}", type.str())));
      } else {
        in.role = InputRole::Weights;
        KILN_RETURN_IF_ERROR(need(type.dtype() == ir::DType::f32, fmt::format("weights must be f32, got {}", type.str())));
      }
    } else if (role == "tokens" || role == "targets") {
      in.role = role == "tokens" ? InputRole::Tokens : InputRole::Targets;
      KILN_RETURN_IF_ERROR(
          need(ir::isInteger(type.dtype()) && s.size() == 2 && isBatchDim(s[0], spec.batch_symbol) &&
                   s[1].isStatic() && s[1].size() >= 1,
               fmt::format("{} must be integer [BxT] with a static T, got {}", role, type.str())));
      in.seq_len = s[1].size();
      if (in.role == InputRole::Tokens) {
        if (spec.tokensIndex() >= 0)
          return inputError(in.name, "a second token input (a model reads one token stream)");
        KILN_ASSIGN_OR_RETURN(in.vocab, intAttr(attrs, in.name, "vocab", true));
        if (in.vocab <= 0)
          return inputError(in.name, fmt::format("vocab must be positive, got {}", in.vocab));
        if (in.vocab > kMaxVocab)
          return inputError(in.name, fmt::format("vocab {} is above {}", in.vocab, kMaxVocab));
      } else if (spec.targetsIndex() >= 0) {
        return inputError(in.name, "a second targets input");
      }
    } else {
      return inputError(
          in.name,
          fmt::format(
              "unknown role '{}' (expected dense, label, sparse, lengths, weights, tokens or targets)",
              role));
    }
    spec.inputs.push_back(std::move(in));
  }
  // Link lengths and weights to their feature's ids, and check they agree.
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    InputSpec& in = spec.inputs[i];
    if (in.role != InputRole::Lengths && in.role != InputRole::Weights) continue;
    auto it = sparse_of_feature.find(in.feature);
    if (it == sparse_of_feature.end())
      return inputError(in.name, fmt::format("no sparse input reads feature {}", in.feature));
    InputSpec& ids = spec.inputs[static_cast<size_t>(it->second)];
    if (in.role == InputRole::Lengths) {
      if (!ids.variableLength())
        return inputError(in.name, fmt::format("'{}' has a fixed hotness and takes no lengths", ids.name));
      if (ids.lengths_input >= 0) return inputError(in.name, fmt::format("a second lengths input for '{}'", ids.name));
      ids.lengths_input = static_cast<int>(i);
    } else {
      if (in.type.shape() != ids.type.shape())
        return inputError(in.name, fmt::format("weights {} must be shaped like the ids {}", in.type.str(), ids.type.str()));
      if (ids.weights_input >= 0) return inputError(in.name, fmt::format("a second weights input for '{}'", ids.name));
      ids.weights_input = static_cast<int>(i);
    }
  }
  for (const InputSpec& in : spec.inputs)
    if (in.role == InputRole::Sparse && in.variableLength() && in.lengths_input < 0)
      return inputError(in.name, fmt::format("variable-length ids need a lengths input (role = \"lengths\", feature = {})", in.feature));
  KILN_RETURN_IF_ERROR(checkTokenInputs(spec));
  KILN_RETURN_IF_ERROR(assignLayout(spec));
  return spec;
}

Status checkReadable(const BatchSpec& spec, bool files) {
  if (spec.layout != DataLayout::Criteo || spec.readsTokens()) return Status::ok();
  int labels = 0;
  for (const InputSpec& in : spec.inputs) {
    if (in.role == InputRole::Dense && in.dense_count > kNumDense && files)
      return inputError(
          in.name,
          fmt::format("reads {} dense features, but the Criteo layout has {}: bind the model's inputs "
                      "to the columns of your files with columns(...) (docs/data.md, \"Schemas\"), or "
                      "feed the input from your own program (as bench/moe_bench does)",
                      in.dense_count, kNumDense));
    if (in.role == InputRole::Label && (in.label_count != 1 || ++labels > 1))
      return inputError(in.name,
                        "the Criteo layout has one label: bind several labels to the columns of your files "
                        "with columns(...) (docs/data.md, \"Schemas\")");
    if (in.role == InputRole::Sparse && in.feature >= kNumSparse && files)
      return inputError(in.name,
                        fmt::format("reads categorical feature {}, but the Criteo layout has {}: bind the "
                                    "model's inputs to the columns of your files with columns(...) "
                                    "(docs/data.md, \"Schemas\")",
                                    in.feature + 1, kNumSparse));
  }
  return Status::ok();
}

Expected<BatchSpec> fromFunction(const ir::Function& fn) {
  std::vector<std::pair<ir::AttrDict, ir::TensorType>> decls;
  for (const auto& blk : fn.body().blocks())
    for (const auto& op : blk->ops())
      if (op->is(ir::OpCode::Input)) decls.emplace_back(op->attrs(), op->result()->type());
  auto spec = fromInputs(decls);
  if (!spec) return Status::error(fmt::format("function @{}: {}", fn.name(), spec.status().message()), fn.loc);
  return spec;
}

Expected<Batch> sliceBatch(const Batch& b, const BatchSpec& spec, int64_t first, int64_t n) {
  if (first < 0 || n < 0 || first + n > b.size)
    return Status::errorf("samples [{}, {}) are not in a batch of {}", first, first + n, b.size);
  Batch out;
  out.size = n;
  out.names = b.names;
  out.end = b.end;
  for (size_t i = 0; i < b.tensors.size(); ++i) {
    const ir::HostTensor& t = b.tensors[i];
    const InputSpec* in = spec.find(b.names[i]);
    // Flat ids (and their weights) of variable-length features: the positions of the samples'
    // ids, from the feature's lengths.
    const InputSpec* flat = nullptr;
    if (in && in->variableLength()) flat = in;
    if (in && in->role == InputRole::Weights)
      for (const InputSpec& s : spec.inputs)
        if (s.variableLength() && s.weights_input >= 0 &&
            spec.inputs[static_cast<size_t>(s.weights_input)].name == in->name)
          flat = &s;
    int64_t begin = first, end = first + n;
    if (flat) {
      const ir::HostTensor* lengths = b.find(spec.inputs[static_cast<size_t>(flat->lengths_input)].name);
      if (!lengths) return Status::errorf("batch has no lengths for '{}'", flat->name);
      begin = end = 0;
      for (int64_t s = 0; s < first + n; ++s) {
        const int64_t len =
            lengths->view.dtype == ir::DType::i32 ? lengths->as<int32_t>()[s] : lengths->as<int64_t>()[s];
        if (s < first) begin += len;
        end += len;
      }
    }
    std::vector<int64_t> shape = t.view.shape;
    const int64_t row = shape.empty() || shape[0] == 0 ? 0 : t.view.bytes() / shape[0];
    if (shape.empty()) {
      out.tensors.push_back(t);
      continue;
    }
    shape[0] = end - begin;
    ir::HostTensor piece(t.view.dtype, shape);
    if (row > 0 && end > begin)
      std::memcpy(piece.view.data, static_cast<const char*>(t.view.data) + begin * row,
                  static_cast<size_t>((end - begin) * row));
    out.tensors.push_back(std::move(piece));
  }
  return out;
}

}  // namespace kiln::data
