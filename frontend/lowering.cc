// The evaluator's core: statements, names, operators, indexing, calls, and the module it builds.
#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "frontend/model_lowering.h"
#include "frontend/parser.h"
#include "ir/verifier.h"

namespace kiln::frontend {

std::string typeStr(const ir::TensorType& t) {
  std::string out = std::string(ir::dtypeName(t.dtype())) + "[";
  for (int64_t i = 0; i < t.rank(); ++i) out.append(i ? "," : "").append(t.dim(i).str());
  return out + "]";
}

std::string describe(const Val& v) {
  switch (v.kind) {
    case Val::Kind::Error: return "an erroneous value";
    case Val::Kind::None: return "nothing";
    case Val::Kind::Int: return fmt::format("the integer {}", v.i);
    case Val::Kind::Float: return fmt::format("the number {}", v.f);
    case Val::Kind::Bool: return v.b ? "true" : "false";
    case Val::Kind::Str: return fmt::format("the string \"{}\"", v.s);
    case Val::Kind::Word: return fmt::format("'{}'", v.s);
    case Val::Kind::List: return fmt::format("a list of {}", v.items.size());
    case Val::Kind::Tensor: return "a tensor " + typeStr(v.tensor->type());
    case Val::Kind::Dim: return fmt::format("the dimension {}", v.dim.str());
    case Val::Kind::Func: return fmt::format("the function '{}'", v.s);
    case Val::Kind::Record: return fmt::format("{}(...)", v.s);
    case Val::Kind::Sparse: return fmt::format("sparse input of {} feature(s)", v.sparse.size());
    case Val::Kind::Tables: return fmt::format("an embedding collection of {} table(s)", v.tables.size());
  }
  return "a value";
}

// ---- diagnostics helpers -------------------------------------------------------------------

void ModelLowering::fail(const Location& loc, std::string msg) {
  diags_.error(loc, std::move(msg));
  throw EvalError{};
}

void ModelLowering::warn(const Location& loc, std::string msg) {
  // A user function called N times would repeat its warnings N times.
  std::string key = fmt::format("{}:{}", loc.str(), msg);
  if (warned_.insert(key).second) diags_.warning(loc, std::move(msg));
}

ir::Value* ModelLowering::tensorArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (v.kind != Val::Kind::Tensor) fail(loc, fmt::format("{} must be a tensor, got {}", what, describe(v)));
  return v.tensor;
}

int64_t ModelLowering::intArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (v.kind != Val::Kind::Int) fail(loc, fmt::format("{} must be an integer, got {}", what, describe(v)));
  return v.i;
}

double ModelLowering::numberArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (!v.isNumber()) fail(loc, fmt::format("{} must be a number, got {}", what, describe(v)));
  return v.asDouble();
}

bool ModelLowering::boolArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (v.kind != Val::Kind::Bool) fail(loc, fmt::format("{} must be true or false, got {}", what, describe(v)));
  return v.b;
}

std::string ModelLowering::wordArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (v.kind == Val::Kind::Word || v.kind == Val::Kind::Str || (v.kind == Val::Kind::Func && !v.fn)) return v.s;
  fail(loc, fmt::format("{} must be a name, got {}", what, describe(v)));
}

std::vector<int64_t> ModelLowering::intsArg(const Val& v, const Location& loc, const char* what, size_t n) {
  checkNotError(v);
  if (v.kind == Val::Kind::Int) return std::vector<int64_t>(std::max<size_t>(n, 1), v.i);
  if (v.kind != Val::Kind::List)
    fail(loc, fmt::format("{} must be an integer or a list of integers, got {}", what, describe(v)));
  if (n && v.items.size() != n) fail(loc, fmt::format("{} has {} entries, expected {}", what, v.items.size(), n));
  std::vector<int64_t> out;
  for (const Val& x : v.items) out.push_back(intArg(x, loc, what));
  return out;
}

Val ModelLowering::recordArg(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  if (v.kind == Val::Kind::Record) return v;
  if ((v.kind == Val::Kind::Func && !v.fn) || v.kind == Val::Kind::Word) {
    Val r = Val::none();
    r.kind = Val::Kind::Record;
    r.s = v.s;
    return r;
  }
  fail(loc, fmt::format("{} must be a setting such as adagrad(lr = 0.01), got {}", what, describe(v)));
}

// ---- IR construction -----------------------------------------------------------------------

ir::Value* ModelLowering::emit(ir::OpCode op, const std::vector<ir::Value*>& operands, ir::AttrDict attrs) {
  auto v = builder_.createValue(op, operands, std::move(attrs));
  if (!v) fail(builder_.location(), v.status().message());
  return *v;
}

ir::Value* ModelLowering::emitTyped(ir::OpCode op, const std::vector<ir::Value*>& operands,
                                    const ir::TensorType& type, ir::AttrDict attrs) {
  auto o = builder_.createWithTypes(op, operands, {type}, std::move(attrs));
  if (!o) fail(builder_.location(), o.status().message());
  return (*o)->result();
}

std::vector<ir::Value*> ModelLowering::emitResults(ir::OpCode op, const std::vector<ir::Value*>& operands,
                                                   ir::AttrDict attrs) {
  auto o = builder_.create(op, operands, std::move(attrs));
  if (!o) fail(builder_.location(), o.status().message());
  std::vector<ir::Value*> results;
  for (unsigned i = 0; i < (*o)->numResults(); ++i) results.push_back((*o)->result(i));
  return results;
}

ir::Value* ModelLowering::scalarConstant(double v, ir::DType dtype) {
  ir::Attribute value = ir::isInteger(dtype) ? ir::Attribute(static_cast<int64_t>(v)) : ir::Attribute(v);
  return emitTyped(ir::OpCode::Constant, {}, ir::TensorType(dtype, {}), {{"value", value}});
}

ir::Value* ModelLowering::reshape(ir::Value* x, ir::Shape shape) {
  if (x->type().shape() == shape) return x;
  return emitTyped(ir::OpCode::Reshape, {x}, ir::TensorType(x->type().dtype(), std::move(shape)));
}

ir::Value* ModelLowering::binaryOp(const char* op, ir::Value* a, ir::Value* b, const Location& loc) {
  static const std::map<std::string, std::pair<ir::OpCode, const char*>> kOps = {
      {"+", {ir::OpCode::Add, "add"}},
      {"-", {ir::OpCode::Sub, "subtract"}},
      {"*", {ir::OpCode::Mul, "multiply"}},
      {"/", {ir::OpCode::Div, "divide"}}};
  auto it = kOps.find(op);
  if (it == kOps.end()) fail(loc, fmt::format("operator '{}' is not defined on tensors", op));
  const auto& ta = a->type();
  const auto& tb = b->type();
  if (ta.dtype() != tb.dtype() || !ir::broadcastShapes(ta.shape(), tb.shape()))
    fail(loc, fmt::format("cannot {} {} and {}", it->second.second, typeStr(ta), typeStr(tb)));
  builder_.setLocation(loc);
  return emit(it->second.first, {a, b});
}

ir::Value* ModelLowering::makeParam(const std::string& name, const ir::TensorType& type, const Val& init,
                                    const Location& loc, ir::AttrDict extra) {
  if (!param_names_.insert(name).second) fail(loc, fmt::format("parameter '{}' is defined twice", name));
  for (const ir::Dim& d : type.shape())
    if (!d.isStatic()) fail(loc, fmt::format("parameter '{}' must have a static shape, got {}", name, typeStr(type)));
  ir::AttrDict attrs = std::move(extra);
  attrs["name"] = name;
  static const std::map<std::string, std::string> kAliases = {{"glorot_uniform", "xavier_uniform"},
                                                              {"glorot_normal", "xavier_normal"}};
  std::string kind = init.s;
  if (auto a = kAliases.find(kind); a != kAliases.end()) kind = a->second;
  attrs["init"] = kind;
  for (const auto& [k, v] : init.fields) attrs[k] = v.asDouble();
  // Put parameters at the top of @forward so that the function reads inputs, weights, then math.
  ir::Builder top(forward_->entry());
  top.setLocation(loc);
  ir::Block& entry = forward_->entry();
  ir::Op* first_math = nullptr;
  for (ir::Op* op : entry.opList())
    if (!op->hasTrait(ir::kSource)) {
      first_math = op;
      break;
    }
  if (first_math) top.setInsertionPoint(first_math);
  auto op = top.createWithTypes(ir::OpCode::Parameter, {}, {type}, std::move(attrs));
  if (!op) fail(loc, op.status().message());
  (*op)->result()->setNameHint(name);
  return (*op)->result();
}

void ModelLowering::addAuxLoss(const std::string& name, ir::Value* loss) {
  aux_losses_.push_back({name, loss});
  addStat(name, loss);
}

void ModelLowering::addStat(const std::string& name, ir::Value* v) { stats_.push_back({name, v}); }

std::string ModelLowering::layerName(const CallArgs& args, const std::string& kind, const Val* explicit_name) {
  Frame& f = frame();
  std::string name;
  if (explicit_name) {
    name = f.prefix + wordArg(*explicit_name, args.loc, "name");
    if (!layer_prefixes_.insert(name).second) fail(args.loc, fmt::format("the layer name '{}' is taken", name));
    return name;
  }
  if (!args.target.empty() && f.loop_depth == 0 && layer_prefixes_.insert(f.prefix + args.target).second)
    return f.prefix + args.target;
  // In loops, and for anonymous calls, number the layers of each kind: cross.0, cross.1, ...
  while (true) {
    name = fmt::format("{}{}.{}", f.prefix, kind, f.kind_counters[kind]++);
    if (layer_prefixes_.insert(name).second) return name;
  }
}

ir::Value* ModelLowering::activate(const Val& act, ir::Value* x, const Location& loc) {
  CallArgs a;
  a.loc = loc;
  a.callee = act.s;
  a.positional = {Val::ofTensor(x)};
  a.positional_locs = {loc};
  Val r = call(act, a);
  return tensorArg(r, loc, fmt::format("the result of '{}'", act.s).c_str());
}

std::vector<ir::Value*> ModelLowering::tensorList(const Val& v, const Location& loc, const char* what) {
  checkNotError(v);
  std::vector<ir::Value*> out;
  if (v.kind == Val::Kind::Tensor) return {v.tensor};
  if (v.kind != Val::Kind::List) fail(loc, fmt::format("{} must be tensors, got {}", what, describe(v)));
  for (const Val& x : v.items) {
    auto sub = tensorList(x, loc, what);
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

// ---- statements ----------------------------------------------------------------------------

void ModelLowering::warnUnused(const Binding& b, const std::string& name) {
  if (b.used || name.empty() || name[0] == '_') return;
  // A statistic the step reports (in_batch_recall's metric) is used by the report.
  for (const auto& stat : stats_)
    if (b.value.kind == Val::Kind::Tensor && stat.second == b.value.tensor) return;
  bool interesting = b.value.kind == Val::Kind::Tensor || b.value.kind == Val::Kind::Sparse ||
                     b.value.kind == Val::Kind::Tables || std::string(b.what) == "param";
  if (interesting) warn(b.loc, fmt::format("{} '{}' is never used", b.what, name));
}

void ModelLowering::bind(const std::string& name, Val v, const Location& loc, const char* what) {
  Frame& f = frame();
  auto it = f.vars.find(name);
  if (it != f.vars.end()) {
    if (std::string(it->second.what) != "value")
      fail(loc, fmt::format("'{}' is already declared as {} {}", name,
                            std::string(it->second.what) == "input" ? "an" : "a", it->second.what));
    warnUnused(it->second, name);
  }
  if (v.kind == Val::Kind::Tensor && v.tensor->nameHint().empty() && v.tensor->definingOp() &&
      !v.tensor->definingOp()->hasTrait(ir::kSource))
    v.tensor->setNameHint(name);
  f.vars[name] = Binding{std::move(v), loc, false, what};
}

void ModelLowering::endFrame(Frame& f) {
  for (auto& [name, b] : f.vars) warnUnused(b, name);
}

void ModelLowering::execBlock(const ast::Block& b) {
  for (const auto& s : b) {
    if (out_of_fuel_ || frame().returned) return;
    exec(*s);
  }
}

void ModelLowering::exec(const ast::Stmt& s) {
  if (--fuel_ < 0) {
    if (!out_of_fuel_) diags_.error(s.loc, "the model takes too long to evaluate (a loop or recursion too deep?)");
    out_of_fuel_ = true;
    return;
  }
  Frame& f = frame();
  try {
    switch (s.kind) {
      case ast::Stmt::Kind::Assign: {
        if (s.names.size() > 1) return execUnpack(s);
        current_target_ = s.names[0];
        Val v = eval(*s.value, s.names[0]);
        current_target_.clear();
        if (v.kind == Val::Kind::None) fail(s.value->loc, fmt::format("the right side gives no value to assign to '{}'", s.names[0]));
        bind(s.names[0], std::move(v), s.name_locs[0]);
        return;
      }
      case ast::Stmt::Kind::Dim:
        if (f.is_function) fail(s.loc, "'dim' belongs in a model, not in a function");
        for (size_t i = 0; i < s.names.size(); ++i) {
          if (!ir::isSymbolName(s.names[i]))
            fail(s.name_locs[i], fmt::format("dimension '{}' must be upper case (like B or T)", s.names[i]));
          bind(s.names[i], Val::ofDim(ir::Dim::symbol(s.names[i])), s.name_locs[i], "dim");
          f.vars[s.names[i]].used = true;
        }
        return;
      case ast::Stmt::Kind::Param: return execParam(s);
      case ast::Stmt::Kind::Input: return execInput(s);
      case ast::Stmt::Kind::Output:
        if (f.is_function) fail(s.loc, "'output' belongs in a model, not in a function");
        for (size_t i = 0; i < s.names.size(); ++i) {
          auto it = f.vars.find(s.names[i]);
          if (it == f.vars.end()) fail(s.name_locs[i], fmt::format("unknown name '{}'", s.names[i]));
          it->second.used = true;
          ir::Value* t = tensorArg(it->second.value, s.name_locs[i], fmt::format("output '{}'", s.names[i]).c_str());
          for (const auto& o : outputs_)
            if (o.first == s.names[i]) fail(s.name_locs[i], fmt::format("'{}' is already an output", s.names[i]));
          outputs_.push_back({s.names[i], t});
          output_locs_.push_back(s.name_locs[i]);
        }
        return;
      case ast::Stmt::Kind::For: {
        Val it = eval(*s.value);
        checkNotError(it);
        if (it.kind != Val::Kind::List) fail(s.value->loc, fmt::format("a for loop needs a list or a range, got {}", describe(it)));
        ++f.loop_depth;
        for (const Val& x : it.items) {
          bind(s.names[0], x, s.name_locs[0]);
          frame().vars[s.names[0]].used = true;
          execBlock(s.body);
          if (out_of_fuel_ || frame().returned) break;
        }
        --frame().loop_depth;
        return;
      }
      case ast::Stmt::Kind::If: {
        Val c = eval(*s.value);
        bool cond = boolArg(c, s.value->loc, "the condition");
        execBlock(cond ? s.body : s.else_body);
        return;
      }
      case ast::Stmt::Kind::Return:
        if (!f.is_function) fail(s.loc, "'return' outside a function (a model names its results with 'output')");
        f.returned = eval(*s.value);
        checkNotError(*f.returned);
        return;
      case ast::Stmt::Kind::Train: return execTrain(s);
      case ast::Stmt::Kind::Expr: {
        Val v = eval(*s.value);
        if (v.kind != Val::Kind::None && v.kind != Val::Kind::Error)
          warn(s.loc, "the result of this expression is unused");
        return;
      }
    }
  } catch (EvalError&) {
    current_target_.clear();
    if (f.is_function && s.kind == ast::Stmt::Kind::Return) throw;
    // The names this statement would have bound become poison, so later uses stay quiet.
    if (s.kind == ast::Stmt::Kind::Assign || s.kind == ast::Stmt::Kind::Param || s.kind == ast::Stmt::Kind::Input) {
      Frame& fr = frame();
      for (const std::string& name : s.names) fr.vars[name] = Binding{Val::error(), s.loc, true, "value"};
    }
    // Inside a function an error aborts the call; the caller's statement reports nothing more.
    if (frame().is_function) throw;
  }
}

// `values, indices = topk(x, 2)`: a list of exactly as many entries as names.
void ModelLowering::execUnpack(const ast::Stmt& s) {
  Val v = eval(*s.value);
  checkNotError(v);
  if (v.kind != Val::Kind::List)
    fail(s.value->loc, fmt::format("cannot unpack {} into {} names", describe(v), s.names.size()));
  if (v.items.size() != s.names.size())
    fail(s.value->loc,
         fmt::format("cannot unpack a list of {} into {} names", v.items.size(), s.names.size()));
  for (size_t i = 0; i < s.names.size(); ++i) bind(s.names[i], v.items[i], s.name_locs[i]);
}

void ModelLowering::execParam(const ast::Stmt& s) {
  Frame& f = frame();
  if (f.is_function) fail(s.loc, "'param' belongs in a model, not in a function");
  const std::string& name = s.names[0];
  Val v;
  auto ov = overrides_.find(name);
  if (ov != overrides_.end()) {
    used_overrides_.insert(name);
    std::string origin = fmt::format("--set {}", name);
    ast::ExprPtr e = parseExpression(origin, ov->second, diags_);
    if (!e) throw EvalError{};
    v = eval(*e);
  } else {
    v = eval(*s.value);
  }
  checkNotError(v);
  if (v.kind == Val::Kind::Tensor || v.kind == Val::Kind::Sparse || v.kind == Val::Kind::Tables)
    fail(s.value->loc, fmt::format("param '{}' must be known at compile time, got {}", name, describe(v)));
  if (f.vars.count(name)) fail(s.name_locs[0], fmt::format("'{}' is already defined", name));
  bind(name, std::move(v), s.name_locs[0], "param");
}

// ---- expressions ---------------------------------------------------------------------------

Val ModelLowering::eval(const ast::Expr& e, const std::string& target) {
  if (out_of_fuel_) throw EvalError{};
  builder_.setLocation(e.loc);
  switch (e.kind) {
    case ast::Expr::Kind::Int: return Val::integer(e.int_value);
    case ast::Expr::Kind::Float: return Val::number(e.float_value);
    case ast::Expr::Kind::Bool: return Val::boolean(e.bool_value);
    case ast::Expr::Kind::String: return Val::string(e.text);
    case ast::Expr::Kind::Error: throw EvalError{};
    case ast::Expr::Kind::Name: return evalName(e);
    case ast::Expr::Kind::List: {
      std::vector<Val> items;
      for (const auto& i : e.items) {
        items.push_back(eval(*i));
        checkNotError(items.back());
      }
      return Val::list(std::move(items));
    }
    case ast::Expr::Kind::Range: {
      int64_t lo = intArg(eval(*e.items[0]), e.items[0]->loc, "a range's start");
      int64_t hi = intArg(eval(*e.items[1]), e.items[1]->loc, "a range's end");
      if (hi < lo) fail(e.loc, fmt::format("the range {}..{} is backwards", lo, hi));
      if (hi - lo > 100000) fail(e.loc, fmt::format("the range {}..{} is too long", lo, hi));
      std::vector<Val> items;
      for (int64_t i = lo; i < hi; ++i) items.push_back(Val::integer(i));
      return Val::list(std::move(items));
    }
    case ast::Expr::Kind::Unary: {
      Val x = eval(*e.items[0]);
      checkNotError(x);
      if (e.text == "not") return Val::boolean(!boolArg(x, e.items[0]->loc, "the operand of 'not'"));
      if (x.kind == Val::Kind::Int) {
        if (x.i == std::numeric_limits<int64_t>::min()) fail(e.loc, "integer overflow");
        return Val::integer(-x.i);
      }
      if (x.kind == Val::Kind::Float) return Val::number(-x.f);
      if (x.kind == Val::Kind::Tensor) {
        builder_.setLocation(e.loc);
        return Val::ofTensor(emit(ir::OpCode::Neg, {x.tensor}));
      }
      fail(e.loc, fmt::format("cannot negate {}", describe(x)));
    }
    case ast::Expr::Kind::Binary: return evalBinary(e);
    case ast::Expr::Kind::Index: return evalIndex(e);
    case ast::Expr::Kind::Call: return evalCall(e, target);
  }
  fail(e.loc, "unsupported expression");
}

Val ModelLowering::evalName(const ast::Expr& e) {
  Frame& f = frame();
  auto it = f.vars.find(e.text);
  if (it != f.vars.end()) {
    it->second.used = true;
    checkNotError(it->second.value);
    return it->second.value;
  }
  // A function sees the model's dims (B, T) so that it can shape tensors.
  if (f.is_function) {
    auto top = frames_.front().vars.find(e.text);
    if (top != frames_.front().vars.end() && top->second.value.kind == Val::Kind::Dim) return top->second.value;
  }
  if (auto fn = fns_.find(e.text); fn != fns_.end()) return Val::user(fn->second);
  if (findBuiltin(e.text)) return Val::builtin(e.text);
  if (isWord(e.text)) return Val::word(e.text);
  fail(e.loc, fmt::format("unknown name '{}'", e.text));
}

namespace {

bool checkedArith(char op, int64_t a, int64_t b, int64_t* out) {
  switch (op) {
    case '+': return !__builtin_add_overflow(a, b, out);
    case '-': return !__builtin_sub_overflow(a, b, out);
    case '*': return !__builtin_mul_overflow(a, b, out);
    default: return false;
  }
}

}  // namespace

Val ModelLowering::evalBinary(const ast::Expr& e) {
  const std::string& op = e.text;
  if (op == "and" || op == "or") {
    bool a = boolArg(eval(*e.items[0]), e.items[0]->loc, fmt::format("the left side of '{}'", op).c_str());
    if (op == "and" && !a) return Val::boolean(false);
    if (op == "or" && a) return Val::boolean(true);
    return Val::boolean(boolArg(eval(*e.items[1]), e.items[1]->loc, fmt::format("the right side of '{}'", op).c_str()));
  }
  Val a = eval(*e.items[0]);
  checkNotError(a);
  Val b = eval(*e.items[1]);
  checkNotError(b);
  builder_.setLocation(e.loc);

  // comparisons: a tensor on either side gives an i1 tensor; otherwise a compile-time bool
  if (op == "==" || op == "!=" || op == "<" || op == "<=" || op == ">" || op == ">=") {
    if (a.kind == Val::Kind::Tensor || b.kind == Val::Kind::Tensor)
      return Val::ofTensor(compareTensors(e, a, b));
    int cmp = 0;
    if (a.isNumber() && b.isNumber()) {
      if (a.kind == Val::Kind::Int && b.kind == Val::Kind::Int)
        cmp = a.i < b.i ? -1 : a.i > b.i ? 1 : 0;
      else
        cmp = a.asDouble() < b.asDouble() ? -1 : a.asDouble() > b.asDouble() ? 1 : 0;
    } else if ((a.kind == Val::Kind::Str || a.kind == Val::Kind::Word) && (b.kind == Val::Kind::Str || b.kind == Val::Kind::Word)) {
      cmp = a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
    } else if (a.kind == Val::Kind::Bool && b.kind == Val::Kind::Bool && (op == "==" || op == "!=")) {
      cmp = a.b == b.b ? 0 : 1;
    } else {
      fail(e.loc, fmt::format("cannot compare {} and {}", describe(a), describe(b)));
    }
    bool r = op == "==" ? cmp == 0 : op == "!=" ? cmp != 0 : op == "<" ? cmp < 0 : op == "<=" ? cmp <= 0 : op == ">" ? cmp > 0 : cmp >= 0;
    return Val::boolean(r);
  }

  // tensors: broadcasting arithmetic; numbers become scalar constants of the tensor's type
  if (a.kind == Val::Kind::Tensor || b.kind == Val::Kind::Tensor) {
    ir::DType dt = (a.kind == Val::Kind::Tensor ? a : b).tensor->type().dtype();
    auto asTensor = [&](const Val& v, const ast::Expr& src) -> ir::Value* {
      if (v.kind == Val::Kind::Tensor) return v.tensor;
      if (v.isNumber()) {
        builder_.setLocation(src.loc);
        return scalarConstant(v.asDouble(), dt);
      }
      fail(e.loc, fmt::format("cannot apply '{}' to {} and {}", op, describe(a), describe(b)));
    };
    ir::Value* ta = asTensor(a, *e.items[0]);
    ir::Value* tb = asTensor(b, *e.items[1]);
    return Val::ofTensor(binaryOp(op.c_str(), ta, tb, e.loc));
  }

  // symbolic dims: B * 26, 2 * B
  if ((a.kind == Val::Kind::Dim && b.kind == Val::Kind::Int) || (a.kind == Val::Kind::Int && b.kind == Val::Kind::Dim)) {
    const Val& d = a.kind == Val::Kind::Dim ? a : b;
    int64_t k = a.kind == Val::Kind::Int ? a.i : b.i;
    if (op != "*" || k <= 0) fail(e.loc, fmt::format("a dimension can only be multiplied by a positive integer"));
    if (d.dim.isBounded()) fail(e.loc, "cannot scale a data-dependent dimension");
    int64_t f;
    if (__builtin_mul_overflow(d.dim.factor(), k, &f)) fail(e.loc, "integer overflow");
    return Val::ofDim(ir::Dim::symbol(d.dim.sym(), f));
  }

  // lists: concatenation with +
  if (a.kind == Val::Kind::List && b.kind == Val::Kind::List && op == "+") {
    if (a.items.size() + b.items.size() > 1000000) fail(e.loc, "list too long");
    Val r = a;
    r.items.insert(r.items.end(), b.items.begin(), b.items.end());
    return r;
  }

  if (a.kind == Val::Kind::Int && b.kind == Val::Kind::Int) {
    int64_t r = 0;
    if (op == "/" || op == "%") {
      if (b.i == 0) fail(e.loc, "division by zero");
      if (a.i == std::numeric_limits<int64_t>::min() && b.i == -1) fail(e.loc, "integer overflow");
      // Integer division floors, like Python, so that sizes divide predictably.
      int64_t q = a.i / b.i, m = a.i % b.i;
      if (m != 0 && ((m < 0) != (b.i < 0))) {
        --q;
        m += b.i;
      }
      return Val::integer(op == "/" ? q : m);
    }
    if (!checkedArith(op[0], a.i, b.i, &r)) fail(e.loc, "integer overflow");
    return Val::integer(r);
  }
  if (a.isNumber() && b.isNumber()) {
    double x = a.asDouble(), y = b.asDouble();
    if (op == "+") return Val::number(x + y);
    if (op == "-") return Val::number(x - y);
    if (op == "*") return Val::number(x * y);
    if (op == "/") {
      if (y == 0) fail(e.loc, "division by zero");
      return Val::number(x / y);
    }
    if (op == "%") {
      if (y == 0) fail(e.loc, "division by zero");
      return Val::number(std::fmod(x, y));
    }
  }
  if (a.kind == Val::Kind::Str && b.kind == Val::Kind::Str && op == "+") return Val::string(a.s + b.s);
  fail(e.loc, fmt::format("cannot apply '{}' to {} and {}", op, describe(a), describe(b)));
}

ir::Value* ModelLowering::compareTensors(const ast::Expr& e, const Val& a, const Val& b) {
  static const std::map<std::string, const char*> kPredicates = {{"==", "eq"}, {"!=", "ne"}, {"<", "lt"},
                                                                 {"<=", "le"}, {">", "gt"},  {">=", "ge"}};
  ir::DType dt = (a.kind == Val::Kind::Tensor ? a : b).tensor->type().dtype();
  auto asTensor = [&](const Val& v, const ast::Expr& src) -> ir::Value* {
    if (v.kind == Val::Kind::Tensor) return v.tensor;
    // An integer tensor against 0.5 would compare with a truncated 0: say so instead.
    bool fits = v.kind == Val::Kind::Int || (v.kind == Val::Kind::Float && ir::isFloat(dt));
    if (!fits) fail(e.loc, fmt::format("cannot compare {} and {}", describe(a), describe(b)));
    builder_.setLocation(src.loc);
    return scalarConstant(v.asDouble(), dt);
  };
  ir::Value* ta = asTensor(a, *e.items[0]);
  ir::Value* tb = asTensor(b, *e.items[1]);
  if (ta->type().dtype() != tb->type().dtype() ||
      !ir::broadcastShapes(ta->type().shape(), tb->type().shape()))
    fail(e.loc, fmt::format("cannot compare {} and {}", typeStr(ta->type()), typeStr(tb->type())));
  builder_.setLocation(e.loc);
  return emit(ir::OpCode::Compare, {ta, tb}, {{"predicate", kPredicates.at(e.text)}});
}

Val ModelLowering::evalIndex(const ast::Expr& e) {
  Val base = eval(*e.callee);
  checkNotError(base);
  // Resolve each subscript to an index or a [start, stop) slice of a dimension of size n.
  struct Sub {
    bool is_slice;
    int64_t start, stop;
    bool full;
  };
  auto resolve = [&](const ast::Subscript& s, std::optional<int64_t> n) -> Sub {
    auto value = [&](const ast::ExprPtr& x, int64_t dflt) -> int64_t {
      if (!x) return dflt;
      int64_t v = intArg(eval(*x), x->loc, "an index");
      if (v < 0 && n) v += *n;
      return v;
    };
    if (!s.is_slice) {
      if (!n) fail(s.loc, "cannot index a dimension whose size is not static");
      int64_t i = value(s.index, 0);
      if (i < 0 || i >= *n) fail(s.loc, fmt::format("index {} is out of range for size {}", i, *n));
      return {false, i, i + 1, false};
    }
    if (!s.index && !s.stop) return {true, 0, n.value_or(0), true};
    if (!n) fail(s.loc, "cannot slice a dimension whose size is not static");
    int64_t a = value(s.index, 0), b = value(s.stop, *n);
    if (a < 0 || b > *n || a >= b) fail(s.loc, fmt::format("slice {}:{} is out of range for size {}", a, b, *n));
    return {true, a, b, false};
  };

  if (base.kind == Val::Kind::List || base.kind == Val::Kind::Sparse || base.kind == Val::Kind::Tables) {
    if (e.subs.size() != 1) fail(e.loc, fmt::format("{} takes one subscript", describe(base)));
    int64_t n = static_cast<int64_t>(base.kind == Val::Kind::List ? base.items.size()
                                     : base.kind == Val::Kind::Sparse ? base.sparse.size() : base.tables.size());
    Sub s = resolve(e.subs[0], n);
    if (base.kind == Val::Kind::List) {
      if (!s.is_slice) return base.items[static_cast<size_t>(s.start)];
      return Val::list(std::vector<Val>(base.items.begin() + s.start, base.items.begin() + s.stop));
    }
    Val r = base;
    r.single = !s.is_slice;
    if (base.kind == Val::Kind::Sparse)
      r.sparse.assign(base.sparse.begin() + s.start, base.sparse.begin() + s.stop);
    else
      r.tables.assign(base.tables.begin() + s.start, base.tables.begin() + s.stop);
    return r;
  }
  if (base.kind != Val::Kind::Tensor) fail(e.loc, fmt::format("cannot index {}", describe(base)));
  ir::Value* x = base.tensor;
  const ir::TensorType& t = x->type();
  if (static_cast<int64_t>(e.subs.size()) > t.rank())
    fail(e.loc, fmt::format("{} subscripts for a tensor of rank {} ({})", e.subs.size(), t.rank(), typeStr(t)));
  ir::Shape kept;
  bool dropped = false;
  for (size_t i = 0; i < e.subs.size(); ++i) {
    const ir::Dim& d = t.dim(static_cast<int64_t>(i));
    Sub s = resolve(e.subs[i], d.isStatic() ? std::optional<int64_t>(d.size()) : std::nullopt);
    builder_.setLocation(e.subs[i].loc);
    if (!s.full && !(s.start == 0 && d.isStatic() && s.stop == d.size()))
      x = emit(ir::OpCode::Slice, {x},
               {{"axis", static_cast<int64_t>(i)}, {"start", s.start}, {"limit", s.stop}});
    if (s.is_slice)
      kept.push_back(x->type().dim(static_cast<int64_t>(i)));
    else
      dropped = true;
  }
  for (int64_t i = static_cast<int64_t>(e.subs.size()); i < t.rank(); ++i) kept.push_back(t.dim(i));
  if (dropped) x = reshape(x, kept);
  return Val::ofTensor(x);
}

Val ModelLowering::evalCall(const ast::Expr& e, const std::string& target) {
  Val callee = eval(*e.callee);
  checkNotError(callee);
  CallArgs args;
  args.loc = e.loc;
  args.callee = callee.s;
  args.target = target;
  std::set<std::string> seen;
  for (const ast::Arg& a : e.args) {
    // `shard = NAME` names a sharding type, not a value: a name the model does not define goes to
    // the callee as a word, whose check lists the known types.
    bool shard_word =
        a.name == "shard" && a.value->kind == ast::Expr::Kind::Name && !frame().vars.count(a.value->text);
    Val v = shard_word ? Val::word(a.value->text) : eval(*a.value);
    checkNotError(v);
    if (a.name.empty()) {
      args.positional.push_back(std::move(v));
      args.positional_locs.push_back(a.loc);
    } else {
      if (!seen.insert(a.name).second) fail(a.loc, fmt::format("argument '{}' is given twice", a.name));
      args.named.push_back({a.name, std::move(v)});
      args.named_locs.push_back(a.loc);
    }
  }
  builder_.setLocation(e.loc);
  return call(callee, args);
}

ModelLowering::Bound ModelLowering::bindArgs(CallArgs& args, const std::vector<std::string>& params, size_t required) {
  Bound b;
  b.values.resize(params.size());
  b.locs.assign(params.size(), args.loc);
  if (args.positional.size() > params.size())
    fail(args.positional_locs[params.size()],
         fmt::format("'{}' takes at most {} positional argument(s), got {}", args.callee, params.size(), args.positional.size()));
  for (size_t i = 0; i < args.positional.size(); ++i) {
    b.values[i] = args.positional[i];
    b.locs[i] = args.positional_locs[i];
  }
  for (size_t k = 0; k < args.named.size(); ++k) {
    const auto& [name, v] = args.named[k];
    auto it = std::find(params.begin(), params.end(), name);
    if (it == params.end()) {
      std::string valid;
      for (const auto& p : params) valid += (valid.empty() ? "" : ", ") + p;
      fail(args.named_locs[k], fmt::format("'{}' has no argument '{}' (it takes: {})", args.callee, name, valid));
    }
    size_t i = static_cast<size_t>(it - params.begin());
    if (b.values[i]) fail(args.named_locs[k], fmt::format("argument '{}' is given twice", name));
    b.values[i] = v;
    b.locs[i] = args.named_locs[k];
  }
  for (size_t i = 0; i < required; ++i)
    if (!b.values[i]) fail(args.loc, fmt::format("'{}' needs the argument '{}'", args.callee, params[i]));
  return b;
}

Val ModelLowering::call(const Val& callee, CallArgs& args) {
  checkNotError(callee);
  if (callee.kind == Val::Kind::Tables) return applyEmbeddings(*this, callee, args);
  if (callee.kind != Val::Kind::Func) fail(args.loc, fmt::format("cannot call {}", describe(callee)));
  args.callee = callee.s;
  if (callee.fn) return callUser(*callee.fn, args);
  const BuiltinInfo* b = findBuiltin(callee.s);
  if (!b) fail(args.loc, fmt::format("unknown function '{}'", callee.s));
  return b->fn(*this, args);
}

Val ModelLowering::callUser(const ast::FnDecl& fn, CallArgs& args) {
  if (call_depth_ >= 64) fail(args.loc, fmt::format("calls nest too deeply (is '{}' recursive?)", fn.name));
  std::vector<std::string> names;
  for (const auto& p : fn.params) names.push_back(p.name);
  Bound bound = bindArgs(args, names, 0);
  Frame f;
  f.is_function = true;
  f.prefix = layerName(args, fn.name, nullptr) + ".";
  frames_.push_back(std::move(f));
  ++call_depth_;
  struct Pop {
    ModelLowering& L;
    ~Pop() {
      --L.call_depth_;
      L.frames_.pop_back();
    }
  } pop{*this};
  // Defaults are evaluated in the callee, after the arguments before them are bound.
  for (size_t i = 0; i < fn.params.size(); ++i) {
    Val v;
    if (bound.values[i]) {
      v = *bound.values[i];
    } else if (fn.params[i].default_value) {
      v = eval(*fn.params[i].default_value);
    } else {
      fail(args.loc, fmt::format("'{}' needs the argument '{}'", fn.name, fn.params[i].name));
    }
    frame().vars[fn.params[i].name] = Binding{std::move(v), fn.params[i].loc, true, "value"};
  }
  execBlock(fn.body);
  if (out_of_fuel_) throw EvalError{};
  endFrame(frame());
  Val r = frame().returned ? *frame().returned : Val::none();
  return r;
}

// ---- the model -----------------------------------------------------------------------------

std::unique_ptr<ir::Module> ModelLowering::run(const ast::ModelDecl& model) {
  module_ = std::make_unique<ir::Module>();
  module_->source_file = model.loc.file;
  module_->mutableAttrs()["kiln.model"] = model.name;
  forward_ = &module_->addFunction("forward");
  forward_->loc = model.loc;
  builder_.setInsertionPointToEnd(forward_->entry());
  frames_.push_back(Frame{});

  // The train block names the label input; inputs need their role when declared.
  for (const auto& s : model.body)
    if (s->kind == ast::Stmt::Kind::Train)
      for (const auto& t : s->body)
        if (t->kind == ast::Stmt::Kind::Assign && t->names[0] == "label" && t->value->kind == ast::Expr::Kind::Name)
          label_name_ = t->value->text;
  train_.label = label_name_;

  execBlock(model.body);
  for (const auto& [name, text] : overrides_)
    if (!used_overrides_.count(name))
      diags_.error(Location{"--set " + name, 0, 0}, fmt::format("model '{}' has no param '{}'", model.name, name));
  if (diags_.hasErrors()) return nullptr;

  // Outputs: the declared ones, then the prediction and the loss of the train block.
  if (train_.present) {
    if (train_.prediction.empty()) {
      if (outputs_.empty()) {
        diags_.error(train_.loc, "the train block needs 'prediction = NAME' when the model has no 'output'");
        return nullptr;
      }
      train_.prediction = outputs_.front().first;
    }
    bool listed = false;
    for (const auto& o : outputs_) listed |= o.first == train_.prediction;
    if (train_.prediction_value) {
      if (listed) {
        diags_.error(train_.prediction_loc,
                     "an output is named 'prediction', the name 'prediction = [...]' takes");
        return nullptr;
      }
      outputs_.push_back({train_.prediction, train_.prediction_value});
      // Column j of the prediction is scored against column j of the label.
      auto label = frames_.front().vars.find(train_.label);
      if (label != frames_.front().vars.end() && label->second.value.kind == Val::Kind::Tensor) {
        const ir::TensorType& lt = label->second.value.tensor->type();
        const int64_t tasks = lt.rank() == 2 && lt.dim(1).isStatic() ? lt.dim(1).size() : 1;
        const int64_t listed_tasks = train_.prediction_value->type().dim(1).size();
        if (tasks != listed_tasks) {
          diags_.error(train_.prediction_loc,
                       fmt::format("prediction lists {} task(s) but the label '{}' has {} column(s)",
                                   listed_tasks, train_.label, tasks));
          return nullptr;
        }
      }
    } else if (!listed) {
      auto it = frames_.front().vars.find(train_.prediction);
      if (it == frames_.front().vars.end() || it->second.value.kind != Val::Kind::Tensor) {
        diags_.error(train_.prediction_loc, fmt::format("prediction '{}' is not a tensor of the model", train_.prediction));
        return nullptr;
      }
      it->second.used = true;
      outputs_.push_back({train_.prediction, it->second.value.tensor});
    }
    for (const auto& o : outputs_)
      if (o.first == "loss") {
        diags_.error(train_.loc, "an output is named 'loss', the name the train block's loss takes");
        return nullptr;
      }
    // The layers' balancing losses join the loss here, each once (their coefficients are
    // applied inside their ops).
    ir::Value* loss = train_.loss;
    builder_.setLocation(train_.loc);
    for (const auto& [name, aux] : aux_losses_) {
      ir::Value* term = aux;
      if (term->type().dtype() != loss->type().dtype())
        term = emit(ir::OpCode::Cast, {term}, {{"to", std::string(ir::dtypeName(loss->type().dtype()))}});
      loss = emit(ir::OpCode::Add, {loss, term});
    }
    loss->setNameHint("loss");
    train_.loss = loss;
    outputs_.push_back({"loss", train_.loss});
  }
  // Step statistics come last, so that output 0 stays the prediction of a model without a
  // train block.
  ir::AttrArray stat_names;
  for (const auto& [name, v] : stats_) {
    for (const auto& o : outputs_)
      if (o.first == name) {
        diags_.error(model.loc,
                     fmt::format("an output is named '{}', the name of a layer's statistic", name));
        return nullptr;
      }
    outputs_.push_back({name, v});
    stat_names.push_back(name);
  }
  if (outputs_.empty()) {
    diags_.error(model.loc, fmt::format("model '{}' has no outputs: add 'output NAME' or a train block", model.name));
    return nullptr;
  }
  endFrame(frames_.front());

  ir::AttrArray names;
  std::vector<ir::Value*> results;
  std::vector<ir::TensorType> types;
  for (const auto& [name, v] : outputs_) {
    names.push_back(name);
    results.push_back(v);
    types.push_back(v->type());
  }
  module_->mutableAttrs()["kiln.outputs"] = names;
  if (train_.present) {
    ir::AttrDict t = train_.attrs;
    t["loss"] = std::string("loss");
    t["prediction"] = train_.prediction;
    t["label"] = train_.label;
    if (!stat_names.empty()) t["stats"] = stat_names;
    // The statistics the loss holds besides the model's own: evaluation reports the task loss
    // without them, and them on their own.
    if (!aux_losses_.empty()) {
      ir::AttrArray aux_names;
      for (const auto& entry : aux_losses_) aux_names.push_back(entry.first);
      t["aux_losses"] = aux_names;
    }
    if (!moe_layers_.empty()) t["moe"] = moe_layers_;
    module_->mutableAttrs()["kiln.train"] = t;
  }
  builder_.setLocation(model.loc);
  auto ret = builder_.createWithTypes(ir::OpCode::Return, results, {});
  if (!ret) {
    diags_.error(model.loc, ret.status().message());
    return nullptr;
  }
  forward_->setResultTypes(types);
  if (Status s = ir::verify(*module_); !s.isOk()) {
    diags_.error(s, model.loc);
    return nullptr;
  }
  return std::move(module_);
}

}  // namespace kiln::frontend
