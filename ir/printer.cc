#include "ir/printer.h"

#include <fmt/format.h>

#include <sstream>

namespace kiln::ir {
namespace {

bool isIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '$' ||
         c == '.' || c == '-';
}

bool isBareSymbol(std::string_view s) {
  if (s.empty() || !((s[0] >= 'a' && s[0] <= 'z') || (s[0] >= 'A' && s[0] <= 'Z') || s[0] == '_'))
    return false;
  for (char c : s)
    if (!isIdChar(c) || c == '-') return false;
  return true;
}

std::string symbolStr(const std::string& name) {
  return fmt::format("@{}", isBareSymbol(name) ? name : quoteString(name));
}

std::string typeList(const std::vector<TensorType>& types) {
  std::string out;
  for (size_t i = 0; i < types.size(); ++i) {
    if (i) out += ", ";
    out += types[i].str();
  }
  return out;
}

// `-> t` for one result, `-> (t1, t2)` otherwise, as MLIR prints function types.
std::string resultTypes(const std::vector<TensorType>& types) {
  if (types.size() == 1) return types[0].str();
  return fmt::format("({})", typeList(types));
}

std::vector<TensorType> typesOf(const std::vector<Value*>& values) {
  std::vector<TensorType> out;
  out.reserve(values.size());
  for (const Value* v : values) out.push_back(v->type());
  return out;
}

class Printer {
 public:
  Printer(std::ostream& os, const ValueNamer& namer) : os_(os), namer_(namer) {}

  void op(const Op& op, int indent) {
    pad(indent);
    if (op.numResults() > 0) {
      os_ << namer_.groupName(op);
      if (op.numResults() > 1) os_ << ':' << op.numResults();
      os_ << " = ";
    }
    if (op.name() == "func.return" && op.regions().empty()) {
      os_ << "return";
      if (op.numOperands() > 0) os_ << ' ' << operandList(op) << " : " << typeList(typesOf(op.operands()));
      os_ << '\n';
      return;
    }
    os_ << quoteString(op.name()) << '(' << operandList(op) << ')';
    if (!op.regions().empty()) {
      os_ << " (";
      for (size_t i = 0; i < op.regions().size(); ++i) {
        if (i) os_ << ", ";
        region(*op.regions()[i], indent);
      }
      os_ << ')';
    }
    if (!op.attrs().empty()) os_ << ' ' << attrDictStr(op.attrs());
    os_ << " : (" << typeList(typesOf(op.operands())) << ") -> " << resultTypes(typesOf(op.results()))
        << '\n';
  }

  void function(const Function& f, int indent) {
    pad(indent);
    os_ << "func.func " << symbolStr(f.name()) << '(';
    const Block& entry = f.entry();
    for (unsigned i = 0; i < entry.numArguments(); ++i) {
      if (i) os_ << ", ";
      os_ << namer_.name(entry.argument(i)) << ": " << entry.argument(i)->type().str();
    }
    os_ << ')';
    if (!f.resultTypes().empty()) os_ << " -> " << resultTypes(f.resultTypes());
    if (!f.attrs().empty()) os_ << " attributes " << attrDictStr(f.attrs());
    os_ << " {\n";
    for (const auto& o : entry.ops()) op(*o, indent + 2);
    pad(indent);
    os_ << "}\n";
  }

 private:
  void pad(int n) {
    for (int i = 0; i < n; ++i) os_ << ' ';
  }

  std::string operandList(const Op& op) {
    std::string out;
    for (unsigned i = 0; i < op.numOperands(); ++i) {
      if (i) out += ", ";
      out += namer_.name(op.operand(i));
    }
    return out;
  }

  // MLIR's layout: the block label at the op's indentation, the block's ops one step in.
  void region(const Region& r, int indent) {
    os_ << "{\n";
    for (size_t bi = 0; bi < r.blocks().size(); ++bi) {
      const Block& b = *r.blocks()[bi];
      if (b.numArguments() > 0 || bi > 0) {
        pad(indent);
        os_ << "^bb" << bi;
        if (b.numArguments() > 0) {
          os_ << '(';
          for (unsigned i = 0; i < b.numArguments(); ++i) {
            if (i) os_ << ", ";
            os_ << namer_.name(b.argument(i)) << ": " << b.argument(i)->type().str();
          }
          os_ << ')';
        }
        os_ << ":\n";
      }
      for (const auto& o : b.ops()) op(*o, indent + 2);
    }
    pad(indent);
    os_ << '}';
  }

  std::ostream& os_;
  const ValueNamer& namer_;
};

}  // namespace

std::string sanitizeValueName(std::string_view hint) {
  std::string out;
  bool all_digits = true;
  for (char c : hint) {
    out += isIdChar(c) ? c : '_';
    all_digits &= (c >= '0' && c <= '9');
  }
  if (out.empty() || all_digits) return "";
  // A suffix-id that does not start with a digit must start with a letter or punctuation.
  if (out[0] >= '0' && out[0] <= '9') out.insert(out.begin(), '_');
  return out;
}

ValueNamer::ValueNamer(const Function& f) {
  for (const auto& b : f.body().blocks()) nameBlock(*b);
}

ValueNamer::ValueNamer(const Op& detached_op) { nameOp(detached_op); }

std::string ValueNamer::take(const std::string& hint) {
  std::string base = sanitizeValueName(hint);
  if (base.empty()) {
    // Numbers cannot collide with names: sanitized names are never all digits.
    return fmt::format("%{}", next_number_++);
  }
  std::string name = base;
  for (int k = 1; used_.count(name); ++k) name = base + "_" + std::to_string(k);
  used_.insert(name);
  return fmt::format("%{}", name);
}

void ValueNamer::nameBlock(const Block& b) {
  for (Value* a : b.arguments()) names_[a] = {take(a->nameHint()), -1};
  for (const auto& op : b.ops()) nameOp(*op);
}

void ValueNamer::nameOp(const Op& op) {
  // Operands defined outside a detached op still need a printable name.
  for (Value* v : op.operands())
    if (v && !names_.count(v)) names_[v] = {take(v->nameHint()), -1};
  // MLIR names an op's results as one group, defined before the op's regions are entered.
  if (op.numResults() > 0) {
    std::string group = take(op.result(0)->nameHint());
    for (unsigned i = 0; i < op.numResults(); ++i)
      names_[op.result(i)] = {group, op.numResults() > 1 ? static_cast<int>(i) : -1};
  }
  for (const auto& r : op.regions())
    for (const auto& b : r->blocks()) nameBlock(*b);
}

std::string ValueNamer::name(const Value* v) const {
  auto it = names_.find(v);
  if (it == names_.end()) return "<<unknown>>";
  if (it->second.index < 0) return it->second.group;
  return it->second.group + "#" + std::to_string(it->second.index);
}

std::string ValueNamer::groupName(const Op& op) const {
  if (op.numResults() == 0) return "";
  auto it = names_.find(op.result(0));
  return it == names_.end() ? "<<unknown>>" : it->second.group;
}

void printFunction(const Function& f, std::ostream& os) {
  ValueNamer namer(f);
  Printer(os, namer).function(f, 0);
}

std::string printFunction(const Function& f) {
  std::ostringstream os;
  printFunction(f, os);
  return os.str();
}

void printModule(const Module& m, std::ostream& os) {
  os << "module";
  if (!m.attrs().empty()) os << " attributes " << attrDictStr(m.attrs());
  os << " {\n";
  for (size_t i = 0; i < m.functions().size(); ++i) {
    if (i) os << '\n';
    ValueNamer namer(*m.functions()[i]);
    Printer(os, namer).function(*m.functions()[i], 2);
  }
  os << "}\n";
}

std::string printModule(const Module& m) {
  std::ostringstream os;
  printModule(m, os);
  return os.str();
}

std::string printOp(const Op& op) {
  std::ostringstream os;
  if (const Function* f = op.parentFunction()) {
    ValueNamer namer(*f);
    Printer(os, namer).op(op, 0);
  } else {
    ValueNamer namer(op);
    Printer(os, namer).op(op, 0);
  }
  return os.str();
}

}  // namespace kiln::ir
