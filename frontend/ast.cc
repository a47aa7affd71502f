#include "frontend/ast.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ir/attribute.h"

namespace kiln::frontend::ast {
namespace {

std::string printArgs(const std::vector<Arg>& args) {
  std::string out;
  for (const Arg& a : args) {
    out += ' ';
    if (!a.name.empty()) out += a.name + "=";
    out += printExpr(*a.value);
  }
  return out;
}

void printBlock(const Block& b, int indent, std::string& out);

void printStmt(const Stmt& s, int indent, std::string& out) {
  std::string pad(static_cast<size_t>(indent), ' ');
  auto join = [](const std::vector<std::string>& v) {
    std::string r;
    for (const auto& x : v) r.append(" ").append(x);
    return r;
  };
  switch (s.kind) {
    case Stmt::Kind::Assign:
      out += fmt::format("{}(assign {} {})\n", pad, fmt::join(s.names, ","), printExpr(*s.value));
      return;
    case Stmt::Kind::Dim:
      out += fmt::format("{}(dim{})\n", pad, join(s.names));
      return;
    case Stmt::Kind::Param:
      out += fmt::format("{}(param {} {})\n", pad, s.names[0], printExpr(*s.value));
      return;
    case Stmt::Kind::Input: {
      std::string dims;
      for (const auto& d : s.type.dims) dims.append(" ").append(printExpr(*d));
      std::string mods;
      for (const auto& m : s.modifiers) mods += fmt::format(" ({}{})", m.name, printArgs(m.args));
      out += fmt::format("{}(input {} (type {}{}){})\n", pad, s.names[0], s.type.dtype, dims, mods);
      return;
    }
    case Stmt::Kind::Output:
      out += fmt::format("{}(output{})\n", pad, join(s.names));
      return;
    case Stmt::Kind::Return:
      out += fmt::format("{}(return {})\n", pad, printExpr(*s.value));
      return;
    case Stmt::Kind::Expr:
      out += fmt::format("{}(expr {})\n", pad, printExpr(*s.value));
      return;
    case Stmt::Kind::For:
      out += fmt::format("{}(for {} {}\n", pad, s.names[0], printExpr(*s.value));
      printBlock(s.body, indent + 2, out);
      out += pad + ")\n";
      return;
    case Stmt::Kind::If:
      out += fmt::format("{}(if {}\n", pad, printExpr(*s.value));
      printBlock(s.body, indent + 2, out);
      if (!s.else_body.empty()) {
        out += pad + " else\n";
        printBlock(s.else_body, indent + 2, out);
      }
      out += pad + ")\n";
      return;
    case Stmt::Kind::Train:
      out += pad + "(train\n";
      printBlock(s.body, indent + 2, out);
      out += pad + ")\n";
      return;
  }
}

void printBlock(const Block& b, int indent, std::string& out) {
  for (const auto& s : b) printStmt(*s, indent, out);
}

}  // namespace

std::string printExpr(const Expr& e) {
  switch (e.kind) {
    case Expr::Kind::Int: return std::to_string(e.int_value);
    case Expr::Kind::Float: return ir::formatFloat(e.float_value);
    case Expr::Kind::Bool: return e.bool_value ? "true" : "false";
    case Expr::Kind::String: return ir::quoteString(e.text);
    case Expr::Kind::Name: return e.text;
    case Expr::Kind::Error: return "<error>";
    case Expr::Kind::List: {
      std::string out = "(list";
      for (const auto& i : e.items) out.append(" ").append(printExpr(*i));
      return out + ")";
    }
    case Expr::Kind::Range: return fmt::format("(range {} {})", printExpr(*e.items[0]), printExpr(*e.items[1]));
    case Expr::Kind::Unary: return fmt::format("({} {})", e.text, printExpr(*e.items[0]));
    case Expr::Kind::Binary:
      return fmt::format("({} {} {})", e.text, printExpr(*e.items[0]), printExpr(*e.items[1]));
    case Expr::Kind::Call: return fmt::format("(call {}{})", printExpr(*e.callee), printArgs(e.args));
    case Expr::Kind::Index: {
      std::string out = "(index " + printExpr(*e.callee);
      for (const auto& s : e.subs) {
        if (!s.is_slice) {
          out.append(" ").append(printExpr(*s.index));
        } else {
          out += fmt::format(" (slice {} {})", s.index ? printExpr(*s.index) : "_", s.stop ? printExpr(*s.stop) : "_");
        }
      }
      return out + ")";
    }
  }
  return "?";
}

std::string printFile(const File& f) {
  std::string out;
  for (const auto& i : f.imports) out += fmt::format("(import {})\n", ir::quoteString(i.path));
  for (const auto& fn : f.fns) {
    out += "(fn " + fn->name + " (";
    for (size_t i = 0; i < fn->params.size(); ++i) {
      if (i) out += ' ';
      out += fn->params[i].name;
      if (fn->params[i].default_value) out.append("=").append(printExpr(*fn->params[i].default_value));
    }
    out += ")\n";
    printBlock(fn->body, 2, out);
    out += ")\n";
  }
  for (const auto& m : f.models) {
    out += "(model " + m->name + "\n";
    printBlock(m->body, 2, out);
    out += ")\n";
  }
  return out;
}

}  // namespace kiln::frontend::ast
