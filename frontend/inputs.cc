// Inputs and embedding collections: `input ...` declarations become kiln.input ops with the
// roles of docs/model-ir.md, and applying a collection to sparse features becomes one
// kiln.embedding_bag per table.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "frontend/model_lowering.h"

namespace kiln::frontend {

namespace {

// An integer [B, T] with B a 'dim' and T static: the shape of token windows.
bool isTokenShape(const ir::Shape& shape) {
  return shape.size() == 2 && shape[0].isSymbolic() && shape[1].isStatic();
}

// Whether `v` is a token input (a kiln.input of role "tokens").
bool isTokenInput(const Val& v) {
  if (v.kind != Val::Kind::Tensor || !v.tensor) return false;
  const ir::Op* op = v.tensor->definingOp();
  const ir::Attribute* role = op && op->is(ir::OpCode::Input) ? op->attr("role") : nullptr;
  return role && role->isString() && role->asString() == "tokens";
}

}  // namespace

// The file columns `columns(...)` binds to an input's n features (docs/data.md, "Schemas"):
//   columns(k)              n consecutive positions from k (0-based)
//   columns([k0, k1, ...])  n positions
//   columns("click")        one name (n = 1)
//   columns("I{}")          n names, {} replaced by 0 .. n-1 (or first .. first+n-1 with
//                           columns("I{}", first = 1))
//   columns(["a", "b"])     n names
// Each entry is an Attribute: an integer position or a string name.
ir::AttrArray ModelLowering::columnsArg(const ast::Modifier& m, size_t n) {
  // A data line is at most 1 MiB (kMaxTsvLineBytes, runtime/data/record_source.h), so it holds at
  // most 2^20 + 1 fields (all empty): no file has more columns, nor a column past that. Checked
  // before any entry is made: columns(...) of an input of 4e9 features took 18.9 GB in kiln check.
  constexpr int64_t kMaxColumns = (int64_t{1} << 20) + 1;
  if (n > static_cast<size_t>(kMaxColumns))
    fail(m.loc, fmt::format("columns(...) for {} features: a data line (at most 1 MiB) holds at most {} "
                            "columns",
                            n, kMaxColumns));
  if (m.args.empty() || !m.args[0].name.empty())
    fail(m.loc,
         "'columns' takes the file columns: a position, a list of positions, a name or a list of names");
  int64_t first = 0;
  for (size_t i = 1; i < m.args.size(); ++i) {
    if (m.args[i].name != "first") fail(m.args[i].value->loc, "'columns' takes one value and first = k");
    first = intArg(eval(*m.args[i].value), m.args[i].value->loc, "first");
    if (first < 0 || first > kMaxColumns)
      fail(m.args[i].value->loc,
           fmt::format("first = {} is outside [0, {}] (the columns a data line holds)", first, kMaxColumns));
  }
  const Location& loc = m.args[0].value->loc;
  Val v = eval(*m.args[0].value);
  checkNotError(v);
  ir::AttrArray out;
  auto position = [&](const Val& x) {
    int64_t k = intArg(x, loc, "a column position");
    if (k < 0) fail(loc, fmt::format("a column position is 0 or more, got {}", k));
    if (k >= kMaxColumns)
      fail(loc, fmt::format("column position {} is past the {} columns a data line (at most 1 MiB) holds", k,
                            kMaxColumns));
    return ir::Attribute(k);
  };
  if (v.kind == Val::Kind::Int) {
    // The last position first: k + n - 1 past the bound (or past int64) is one error.
    if (v.i >= 0 && v.i > kMaxColumns - static_cast<int64_t>(n))
      fail(loc, fmt::format("columns({}) for {} features run past the {} columns a data line (at most 1 MiB) "
                            "holds",
                            v.i, n, kMaxColumns));
    for (size_t i = 0; i < n; ++i) out.push_back(position(Val::integer(v.i + static_cast<int64_t>(i))));
  } else if (v.kind == Val::Kind::Str) {
    const size_t at = v.s.find("{}");
    if (at == std::string::npos && n != 1)
      fail(loc,
           fmt::format(
               "one column name for {} features: write a pattern such as \"{}{{}}\" or a list of {} names", n,
               v.s, n));
    for (size_t i = 0; i < n; ++i)
      out.push_back(at == std::string::npos
                        ? ir::Attribute(v.s)
                        : ir::Attribute(v.s.substr(0, at) + std::to_string(first + static_cast<int64_t>(i)) +
                                        v.s.substr(at + 2)));
  } else if (v.kind == Val::Kind::List) {
    if (v.items.size() != n)
      fail(loc, fmt::format("{} column(s) given for {} feature(s)", v.items.size(), n));
    for (const Val& x : v.items) {
      if (x.kind == Val::Kind::Str) {
        if (x.s.empty()) fail(loc, "a column name is not empty");
        out.push_back(ir::Attribute(x.s));
      } else {
        out.push_back(position(x));
      }
    }
  } else {
    fail(loc, fmt::format("'columns' takes a position, a name or a list of them, got {}", describe(v)));
  }
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].isString() != out[0].isString()) fail(loc, "columns are all names or all positions");
  return out;
}

void ModelLowering::execInput(const ast::Stmt& s) {
  Frame& f = frame();
  if (f.is_function) fail(s.loc, "'input' belongs in a model, not in a function");
  const std::string& name = s.names[0];
  if (f.vars.count(name)) fail(s.name_locs[0], fmt::format("'{}' is already defined", name));

  ir::Shape shape;
  for (const auto& d : s.type.dims) {
    Val v = eval(*d);
    checkNotError(v);
    if (v.kind == Val::Kind::Int) {
      if (v.i <= 0) fail(d->loc, fmt::format("a dimension must be positive, got {}", v.i));
      shape.push_back(ir::Dim::fixed(v.i));
    } else if (v.kind == Val::Kind::Dim) {
      shape.push_back(v.dim);
    } else {
      fail(d->loc, fmt::format("a dimension must be an integer or a 'dim', got {}", describe(v)));
    }
  }
  builder_.setLocation(s.loc);

  if (s.type.dtype != "ids") {
    auto dt_parsed = ir::parseDType(s.type.dtype);
    if (!dt_parsed || *dt_parsed == ir::DType::f64)
      fail(s.type.loc, fmt::format("unknown element type '{}' (use f32, bf16, f16, i32, i64 or ids)", s.type.dtype));
    // A dense input: Criteo dense features or a label; with `vocab(n)` a language model's tokens,
    // and then an integer [B, T] label holds the next-token targets (docs/model-ir.md).
    const ir::DType dt = *dt_parsed;
    bool declares_tokens = false;
    for (const auto& [other, b] : f.vars) declares_tokens |= isTokenInput(b.value);
    std::optional<int64_t> vocab;
    std::optional<ir::AttrArray> columns;
    for (const auto& m : s.modifiers) {
      if (m.name == "columns") {
        if (columns) fail(m.loc, "'columns' is given twice");
        const bool matrix = shape.size() == 2 && shape[1].isStatic();
        if (shape.empty() || !shape[0].isSymbolic() || shape.size() > 2 || (shape.size() == 2 && !matrix))
          fail(m.loc, "columns(...) binds an input shaped [B] or [B, n] (n static) to file columns");
        columns = columnsArg(m, matrix ? static_cast<size_t>(shape[1].size()) : 1);
        continue;
      }
      if (m.name != "vocab")
        fail(
            m.loc,
            fmt::format(
                "'{}' applies only to sparse inputs (ids[...]); a dense input takes vocab(n) or columns(...)",
                m.name));
      if (vocab) fail(m.loc, "'vocab' is given twice");
      if (m.args.size() != 1 || !m.args[0].name.empty()) fail(m.loc, "'vocab' takes 1 argument(s)");
      if (!ir::isInteger(dt))
        fail(m.loc,
             fmt::format("vocab(n) marks integer token ids, not {} values (declare the input i32[B, T])",
                         s.type.dtype));
      int64_t n = intArg(eval(*m.args[0].value), m.args[0].value->loc, "vocab");
      if (n <= 0) fail(m.args[0].value->loc, fmt::format("vocab must be positive, got {}", n));
      if (!isTokenShape(shape))
        fail(s.type.loc, fmt::format("a token input is shaped [B, T] with B a 'dim' and T static, got {}",
                                     typeStr(ir::TensorType(dt, shape))));
      vocab = n;
    }
    ir::AttrDict attrs{{"name", name}, {"role", std::string("dense")}};
    if (columns) {
      if (vocab) fail(s.type.loc, "a token input reads a token stream, not file columns");
      attrs["columns"] = ir::Attribute(std::move(*columns));
    }
    if (vocab) {
      attrs["role"] = std::string("tokens");
      attrs["vocab"] = *vocab;
    } else if (name == label_name_) {
      attrs["role"] = std::string("label");
      if (ir::isInteger(dt) && isTokenShape(shape)) {
        if (!declares_tokens)
          fail(s.type.loc,
               "an integer [B, T] label holds next-token targets: declare the token input (with vocab(n)) "
               "before it");
        attrs["role"] = std::string("targets");
      }
    }
    ir::Value* v = emitTyped(ir::OpCode::Input, {}, ir::TensorType(dt, shape), attrs);
    v->setNameHint(name);
    bind(name, Val::ofTensor(v), s.name_locs[0], "input");
    return;
  }

  // Sparse: ids[B] is one feature, ids[B, N] is N features named NAME.0 .. NAME.<N-1>.
  if (shape.empty() || shape.size() > 2 || !shape[0].isSymbolic())
    fail(s.type.loc, "sparse ids are shaped [B] (one feature) or [B, N] (N features), with B a 'dim'");
  if (shape.size() == 2 && !shape[1].isStatic()) fail(s.type.loc, "the feature count N of ids[B, N] must be static");
  size_t n = shape.size() == 2 ? static_cast<size_t>(shape[1].size()) : 1;
  if (n > 4096) fail(s.type.loc, fmt::format("{} sparse features in one input is too many (at most 4096)", n));
  const ir::Dim batch = shape[0];

  std::vector<int64_t> hotness(n, 1);
  bool variable = false, weighted = false;
  std::string id_map = "modulo";
  bool hot_given = false;
  std::optional<ir::AttrArray> columns;
  for (const auto& m : s.modifiers) {
    auto argVal = [&](size_t want) -> Val {
      if (m.args.size() != want || (want && !m.args[0].name.empty()))
        fail(m.loc, fmt::format("'{}' takes {} argument(s)", m.name, want));
      return want ? eval(*m.args[0].value) : Val::none();
    };
    if (m.name == "hotness" || m.name == "max_hotness") {
      if (hot_given) fail(m.loc, "give one of 'hotness' or 'max_hotness'");
      hot_given = true;
      variable = m.name == "max_hotness";
      hotness = intsArg(argVal(1), m.loc, m.name.c_str(), n);
      for (int64_t h : hotness)
        if (h <= 0 || h > 100000) fail(m.loc, fmt::format("{} {} must lie in [1, 100000]", m.name, h));
    } else if (m.name == "weighted") {
      argVal(0);
      weighted = true;
    } else if (m.name == "id_map") {
      id_map = wordArg(argVal(1), m.loc, "id_map");
      if (id_map != "modulo" && id_map != "hash") fail(m.loc, fmt::format("id_map must be modulo or hash, got '{}'", id_map));
    } else if (m.name == "columns") {
      if (columns) fail(m.loc, "'columns' is given twice");
      columns = columnsArg(m, n);
    } else {
      fail(m.loc,
           fmt::format("unknown input option '{}' (use hotness, max_hotness, weighted, id_map, columns)",
                       m.name));
    }
  }

  Val group = Val::none();
  group.kind = Val::Kind::Sparse;
  for (size_t i = 0; i < n; ++i) {
    SparseFeature sf;
    sf.name = shape.size() == 2 ? fmt::format("{}.{}", name, i) : name;
    sf.feature = next_feature_++;
    ir::AttrDict attrs{{"name", sf.name}, {"role", "sparse"}, {"feature", sf.feature}, {"id_map", id_map}};
    if (columns) attrs["columns"] = ir::Attribute(ir::AttrArray{(*columns)[i]});
    ir::TensorType ids_type;
    if (variable) {
      attrs["max_hotness"] = hotness[i];
      ids_type = ir::TensorType(ir::DType::i64, {ir::Dim::bounded(batch.times(hotness[i]))});
    } else {
      attrs["hotness"] = hotness[i];
      ids_type = ir::TensorType(ir::DType::i64, {batch, ir::Dim::fixed(hotness[i])});
    }
    sf.ids = emitTyped(ir::OpCode::Input, {}, ids_type, attrs);
    sf.ids_op = sf.ids->definingOp();
    sf.ids->setNameHint(sf.name);
    if (variable) {
      sf.lengths = emitTyped(ir::OpCode::Input, {}, ir::TensorType(ir::DType::i32, {batch}),
                             {{"name", sf.name + ".lengths"}, {"role", "lengths"}, {"feature", sf.feature}});
      sf.lengths->setNameHint(sf.name + ".lengths");
    }
    if (weighted) {
      sf.weights = emitTyped(ir::OpCode::Input, {}, ids_type.withDType(ir::DType::f32),
                             {{"name", sf.name + ".weights"}, {"role", "weights"}, {"feature", sf.feature}});
      sf.weights->setNameHint(sf.name + ".weights");
    }
    group.sparse.push_back(sf);
  }
  group.single = shape.size() == 1;
  bind(name, std::move(group), s.name_locs[0], "input");
}

namespace {

// A pool = none lookup: the rows of `t` picked by the ids of `f`, unpooled. Variable-length ids
// are padded to [B, L] (L = max_hotness) by kiln.jagged_to_padded, looked up by a dense
// kiln.gather and multiplied by the sequence mask, so padding rows are zero (and get no
// gradient); the result carries the lengths. Fixed hotness H gives [B, H, D]. The ids input
// names the table that reads it (attribute `table`): the synthetic generator pairs a history
// with a candidate read by one table (docs/data.md).
Val sequenceLookup(ModelLowering& L, const EmbeddingTable& t, const SparseFeature& f, const Location& loc) {
  if (f.weights)
    L.fail(loc, fmt::format("feature '{}' is weighted: pool = none looks rows up unweighted", f.name));
  if (const ir::Attribute* other = f.ids_op->attr("table"); other && other->asString() != t.name)
    L.fail(loc,
           fmt::format("feature '{}' is read by tables '{}' and '{}'", f.name, other->asString(), t.name));
  if (f.ids_op->is(ir::OpCode::Input)) f.ids_op->setAttr("table", t.name);
  L.builder().setLocation(loc);
  if (!f.lengths) {
    ir::Value* rows = L.emit(ir::OpCode::Gather, {t.table, f.ids}, {{"axis", int64_t{0}}});
    rows->setNameHint(t.name + ".rows");
    return Val::ofTensor(rows);
  }
  const int64_t len = f.ids_op->intAttr("max_hotness");
  ir::Value* padded = L.emit(ir::OpCode::JaggedToPadded, {f.ids, f.lengths}, {{"length", len}});
  ir::Value* rows = L.emit(ir::OpCode::Gather, {t.table, padded}, {{"axis", int64_t{0}}});  // [B, L, D]
  const ir::Dim batch = f.lengths->type().dim(0);
  ir::Value* mask = sequenceMask(L, f.lengths, len, rows->type().dtype());
  mask = L.reshape(mask, {batch, ir::Dim::fixed(len), ir::Dim::fixed(1)});
  ir::Value* seq = L.emit(ir::OpCode::Mul, {rows, mask});
  seq->setNameHint(t.name + ".sequence");
  Val v = Val::ofTensor(seq);
  v.lengths = f.lengths;
  return v;
}

}  // namespace

Val applyEmbeddings(ModelLowering& L, const Val& tables, ModelLowering::CallArgs& args) {
  auto b = L.bindArgs(args, {"ids"}, 1);
  const Val& ids = *b.get(0);
  L.checkNotError(ids);
  if (ids.kind != Val::Kind::Sparse)
    L.fail(b.locs[0], fmt::format("an embedding collection is applied to sparse ids, got {}", describe(ids)));
  // One table applied to several features is shared by them (TorchRec's
  // EmbeddingBagConfig(feature_names = [...])): one lookup per feature, one update of the table.
  const bool shared = tables.tables.size() == 1 && ids.sparse.size() > 1;
  if (ids.sparse.size() != tables.tables.size() && !shared)
    L.fail(args.loc,
           fmt::format("{} table(s) applied to {} sparse feature(s); the counts must match (or apply one "
                       "table to share it)",
                       tables.tables.size(), ids.sparse.size()));
  std::vector<Val> pooled;
  for (size_t i = 0; i < ids.sparse.size(); ++i) {
    const SparseFeature& f = ids.sparse[i];
    const EmbeddingTable& t = tables.tables[shared ? 0 : i];
    if (f.ids_op->is(ir::OpCode::HashCross)) {
      // A cross (cross_ids) hashes into its buckets, one per row of the table reading it.
      if (f.ids_op->intAttr("buckets") != t.rows)
        L.fail(args.loc,
               fmt::format("the cross '{}' hashes into {} buckets but is read by table '{}' of {} rows",
                           f.name, f.ids_op->intAttr("buckets"), t.name, t.rows));
    } else if (const ir::Attribute* r = f.ids_op->attr("rows");
               r && r->asInt() != t.rows && r->asInt() != kRawIdRows) {
      // The loader maps raw ids into [0, rows) of the table that reads them.
      L.fail(args.loc, fmt::format("feature '{}' is read by tables of {} and {} rows", f.name, r->asInt(), t.rows));
    }
    // The lookups of a shared table are combined into one sparse update (passes/autodiff.cc),
    // which needs them of one form: ids [B, H] of one hotness H, or variable length; weighted
    // or not.
    for (const ir::Use& u : t.table->uses()) {
      if (!u.user->is(ir::OpCode::EmbeddingBag) || u.operand_index != 0) continue;
      const ir::Value* other = u.user->operand(1);
      const bool other_weighted = u.user->numOperands() == (other->type().rank() == 1 ? 4u : 3u);
      const bool same_form = other->type().rank() == f.ids->type().rank() &&
                             (f.ids->type().rank() == 1 || other->type().dim(1) == f.ids->type().dim(1)) &&
                             other_weighted == (f.weights != nullptr);
      if (!same_form)
        L.fail(args.loc,
               fmt::format("table '{}' is shared by features of different forms: '{}' is {}{} but an earlier "
                           "lookup reads {}{}; a shared table's features need one hotness and weighting",
                           t.name, f.name, typeStr(f.ids->type()), f.weights ? " weighted" : "",
                           typeStr(other->type()), other_weighted ? " weighted" : ""));
      break;
    }
    if (f.ids_op->is(ir::OpCode::Input)) f.ids_op->setAttr("rows", t.rows);
    if (t.pool == "none") {
      pooled.push_back(sequenceLookup(L, t, f, args.loc));
      continue;
    }
    std::vector<ir::Value*> operands{t.table, f.ids};
    if (f.lengths) operands.push_back(f.lengths);
    if (f.weights) operands.push_back(f.weights);
    L.builder().setLocation(args.loc);
    ir::Value* v = L.emit(ir::OpCode::EmbeddingBag, operands, {{"mode", t.pool}, {"table", t.name}});
    v->setNameHint(t.name + ".pooled");
    pooled.push_back(Val::ofTensor(v));
  }
  if (pooled.size() == 1 && (ids.single || tables.single)) return pooled[0];
  return Val::list(std::move(pooled));
}

}  // namespace kiln::frontend
