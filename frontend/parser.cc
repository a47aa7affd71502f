#include "frontend/parser.h"

#include <fmt/format.h>

namespace kiln::frontend {
namespace {

using ast::Expr;
using ast::ExprPtr;
using ast::Stmt;
using ast::StmtPtr;

// Thrown to unwind out of a statement after its error was reported; caught at statement level.
struct SyntaxError {};

class Parser {
 public:
  Parser(std::vector<Token> toks, DiagnosticEngine& diags) : toks_(std::move(toks)), diags_(diags) {}

  std::unique_ptr<ast::File> file(const std::string& path) {
    auto f = std::make_unique<ast::File>();
    f->path = path;
    while (!at(Tok::Eof)) {
      if (accept(Tok::Newline) || accept(Tok::Semi)) continue;
      try {
        if (at(Tok::KwImport)) {
          Location loc = next().loc;
          Token s = expect(Tok::String, "a file name in quotes after 'import'");
          f->imports.push_back({s.text, loc});
          endStatement();
        } else if (at(Tok::KwFn)) {
          f->fns.push_back(fnDecl());
        } else if (at(Tok::KwModel)) {
          auto m = std::make_unique<ast::ModelDecl>();
          m->loc = next().loc;
          m->name = expect(Tok::Ident, "the model's name").text;
          m->body = block();
          f->models.push_back(std::move(m));
        } else {
          fail(peek(), fmt::format("expected 'model', 'fn' or 'import' at the top level, found {}", describe(peek())));
        }
      } catch (SyntaxError&) {
        recover();
        if (at(Tok::RBrace)) next();
      }
    }
    return f;
  }

  ExprPtr exprOnly() {
    try {
      while (accept(Tok::Newline)) {
      }
      ExprPtr e = expr();
      while (accept(Tok::Newline)) {
      }
      if (!at(Tok::Eof)) fail(peek(), fmt::format("unexpected {} after the value", describe(peek())));
      return e;
    } catch (SyntaxError&) {
      return nullptr;
    }
  }

 private:
  static bool isKeyword(Tok k) { return k >= Tok::KwModel && k <= Tok::KwNot; }

  // ---- token helpers ----
  const Token& peek(size_t k = 0) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  bool at(Tok k) const { return peek().kind == k; }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool accept(Tok k) {
    if (!at(k)) return false;
    next();
    return true;
  }
  std::string describe(const Token& t) const {
    if (t.kind == Tok::Ident) return fmt::format("'{}'", t.text);
    if (t.kind == Tok::Int || t.kind == Tok::Float) return fmt::format("number {}", t.text);
    return tokName(t.kind);
  }
  [[noreturn]] void fail(const Token& t, std::string msg) {
    // An Error token was already reported by the lexer; do not pile a second error on it.
    if (t.kind != Tok::Error) diags_.error(t.loc, std::move(msg));
    // Past the error limit nothing more is printed: skip to the end instead of recovering from
    // each of a garbage file's millions of errors (a 16 MB one took 30 s).
    if (diags_.errorCount() > DiagnosticEngine::kMaxErrors) pos_ = toks_.size() - 1;
    throw SyntaxError{};
  }
  Token expect(Tok k, const char* what) {
    if (!at(k)) fail(peek(), fmt::format("expected {}, found {}", what, describe(peek())));
    return next();
  }
  void endStatement() {
    if (accept(Tok::Newline) || accept(Tok::Semi) || at(Tok::RBrace) || at(Tok::Eof)) return;
    fail(peek(), fmt::format("expected the end of the statement, found {}", describe(peek())));
  }
  // Skips to the end of the broken statement: a newline or ';' at this nesting level, or the
  // '}' that closes the enclosing block (left for the caller).
  void recover() {
    int braces = 0;
    while (!at(Tok::Eof)) {
      if (braces == 0 && (at(Tok::Newline) || at(Tok::Semi))) {
        next();
        return;
      }
      if (at(Tok::LBrace)) ++braces;
      if (at(Tok::RBrace)) {
        if (braces == 0) return;
        --braces;
      }
      next();
    }
  }

  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser, const Token& t) : p(parser) {
      // Deep nesting is never a real model; stop before the stack runs out.
      if (++p.depth_ > kMaxDepth) p.fail(t, "expression or block nested too deeply");
    }
    ~DepthGuard() { --p.depth_; }
  };
  static constexpr int kMaxDepth = 200;

  // ---- declarations and statements ----
  std::unique_ptr<ast::FnDecl> fnDecl() {
    auto fn = std::make_unique<ast::FnDecl>();
    fn->loc = next().loc;
    fn->name = expect(Tok::Ident, "the function's name").text;
    expect(Tok::LParen, "'(' after the function's name");
    if (!at(Tok::RParen)) {
      do {
        if (at(Tok::RParen)) break;
        ast::FnParam p;
        Token n = expect(Tok::Ident, "a parameter name");
        p.name = n.text;
        p.loc = n.loc;
        if (accept(Tok::Assign)) p.default_value = expr();
        fn->params.push_back(std::move(p));
      } while (accept(Tok::Comma));
    }
    expect(Tok::RParen, "')' after the parameters");
    fn->body = block();
    return fn;
  }

  ast::Block block() {
    DepthGuard g(*this, peek());
    expect(Tok::LBrace, "'{'");
    ast::Block b;
    while (true) {
      if (accept(Tok::Newline) || accept(Tok::Semi)) continue;
      if (accept(Tok::RBrace)) return b;
      if (at(Tok::Eof)) fail(peek(), "expected '}' before the end of the file");
      try {
        b.push_back(statement());
      } catch (SyntaxError&) {
        recover();
      }
    }
  }

  StmtPtr statement() {
    const Token& t = peek();
    switch (t.kind) {
      case Tok::KwDim: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Dim, next().loc);
        do {
          Token n = expect(Tok::Ident, "a dimension name");
          s->names.push_back(n.text);
          s->name_locs.push_back(n.loc);
        } while (accept(Tok::Comma));
        endStatement();
        return s;
      }
      case Tok::KwParam: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Param, next().loc);
        Token n = expect(Tok::Ident, "a parameter name");
        s->names = {n.text};
        s->name_locs = {n.loc};
        expect(Tok::Assign, "'=' and a default value");
        s->value = expr();
        endStatement();
        return s;
      }
      case Tok::KwInput: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Input, next().loc);
        Token n = expect(Tok::Ident, "an input name");
        s->names = {n.text};
        s->name_locs = {n.loc};
        expect(Tok::Colon, "':' and the input's type");
        Token dt = expect(Tok::Ident, "an element type (f32, ids, ...)");
        s->type.dtype = dt.text;
        s->type.loc = dt.loc;
        expect(Tok::LBracket, "'[' and the shape");
        if (!at(Tok::RBracket)) {
          do s->type.dims.push_back(expr());
          while (accept(Tok::Comma));
        }
        expect(Tok::RBracket, "']' after the shape");
        while (at(Tok::Ident)) {
          ast::Modifier m;
          m.loc = peek().loc;
          m.name = next().text;
          if (accept(Tok::LParen)) m.args = args();
          s->modifiers.push_back(std::move(m));
        }
        endStatement();
        return s;
      }
      case Tok::KwOutput: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Output, next().loc);
        do {
          Token n = expect(Tok::Ident, "an output name");
          s->names.push_back(n.text);
          s->name_locs.push_back(n.loc);
        } while (accept(Tok::Comma));
        endStatement();
        return s;
      }
      case Tok::KwFor: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::For, next().loc);
        Token n = expect(Tok::Ident, "a loop variable");
        s->names = {n.text};
        s->name_locs = {n.loc};
        expect(Tok::KwIn, "'in'");
        s->value = expr();
        s->body = block();
        return s;
      }
      case Tok::KwIf: return ifStatement();
      case Tok::KwReturn: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Return, next().loc);
        s->value = expr();
        endStatement();
        return s;
      }
      case Tok::KwTrain: {
        auto s = std::make_unique<Stmt>(Stmt::Kind::Train, next().loc);
        s->body = block();
        return s;
      }
      case Tok::Ident:
        if (size_t n = assignedNames(); n > 0) {
          auto s = std::make_unique<Stmt>(Stmt::Kind::Assign, t.loc);
          for (size_t i = 0; i < n; ++i) {
            const Token& name = next();
            s->names.push_back(name.text);
            s->name_locs.push_back(name.loc);
            next();  // ',' or '='
          }
          try {
            s->value = expr();
            endStatement();
          } catch (SyntaxError&) {
            // Keep the assignment with a poison value, so that later uses of the name do not
            // report a second, misleading "unknown name".
            recover();
            s->value = std::make_unique<Expr>(Expr::Kind::Error, t.loc);
          }
          return s;
        }
        break;
      default: break;
    }
    auto s = std::make_unique<Stmt>(Stmt::Kind::Expr, t.loc);
    s->value = expr();
    if (at(Tok::Assign)) fail(peek(), "only a plain name can be assigned to");
    endStatement();
    return s;
  }

  // How many names `a = ...` or `a, b = ...` (unpacking a list) assigns: 0 when the tokens
  // ahead are not an assignment.
  size_t assignedNames() {
    for (size_t i = 0; peek(2 * i).kind == Tok::Ident; ++i) {
      if (peek(2 * i + 1).kind == Tok::Assign) return i + 1;
      if (peek(2 * i + 1).kind != Tok::Comma) return 0;
    }
    return 0;
  }

  StmtPtr ifStatement() {
    auto s = std::make_unique<Stmt>(Stmt::Kind::If, next().loc);
    s->value = expr();
    s->body = block();
    // `else` may follow on the next line.
    size_t save = pos_;
    while (accept(Tok::Newline)) {
    }
    if (accept(Tok::KwElse)) {
      if (at(Tok::KwIf)) {
        s->else_body.push_back(ifStatement());
      } else {
        s->else_body = block();
      }
    } else {
      pos_ = save;
    }
    return s;
  }

  // ---- expressions ----
  std::vector<ast::Arg> args() {  // after '(' up to and including ')'
    std::vector<ast::Arg> out;
    bool named_seen = false;
    while (!at(Tok::RParen)) {
      ast::Arg a;
      a.loc = peek().loc;
      // Keywords may name arguments too: embeddings(rows = r, dim = 128).
      if (!peek().text.empty() && (at(Tok::Ident) || isKeyword(peek().kind)) && peek(1).kind == Tok::Assign) {
        a.name = next().text;
        next();
        named_seen = true;
      } else if (named_seen) {
        fail(peek(), "a positional argument cannot follow a named one");
      }
      a.value = expr();
      out.push_back(std::move(a));
      if (!accept(Tok::Comma)) break;
    }
    expect(Tok::RParen, "')' to close the call");
    return out;
  }

  ExprPtr expr() {
    DepthGuard g(*this, peek());
    return orExpr();
  }

  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b, Location loc) {
    auto e = std::make_unique<Expr>(Expr::Kind::Binary, std::move(loc));
    e->text = std::move(op);
    e->items.push_back(std::move(a));
    e->items.push_back(std::move(b));
    return e;
  }

  ExprPtr orExpr() {
    ExprPtr a = andExpr();
    while (at(Tok::KwOr)) {
      Location l = next().loc;
      a = binary("or", std::move(a), andExpr(), l);
    }
    return a;
  }
  ExprPtr andExpr() {
    ExprPtr a = notExpr();
    while (at(Tok::KwAnd)) {
      Location l = next().loc;
      a = binary("and", std::move(a), notExpr(), l);
    }
    return a;
  }
  ExprPtr notExpr() {
    if (at(Tok::KwNot)) {
      DepthGuard g(*this, peek());
      auto e = std::make_unique<Expr>(Expr::Kind::Unary, next().loc);
      e->text = "not";
      e->items.push_back(notExpr());
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr a = range();
    static const std::pair<Tok, const char*> ops[] = {{Tok::Eq, "=="}, {Tok::Ne, "!="}, {Tok::Lt, "<"},
                                                      {Tok::Le, "<="}, {Tok::Gt, ">"},  {Tok::Ge, ">="}};
    for (auto [k, name] : ops) {
      if (at(k)) {
        Location l = next().loc;
        return binary(name, std::move(a), range(), l);
      }
    }
    return a;
  }
  ExprPtr range() {
    ExprPtr a = additive();
    if (at(Tok::DotDot)) {
      auto e = std::make_unique<Expr>(Expr::Kind::Range, next().loc);
      e->items.push_back(std::move(a));
      e->items.push_back(additive());
      return e;
    }
    return a;
  }
  ExprPtr additive() {
    ExprPtr a = multiplicative();
    while (at(Tok::Plus) || at(Tok::Minus)) {
      Token t = next();
      a = binary(t.kind == Tok::Plus ? "+" : "-", std::move(a), multiplicative(), t.loc);
    }
    return a;
  }
  ExprPtr multiplicative() {
    ExprPtr a = unary();
    while (at(Tok::Star) || at(Tok::Slash) || at(Tok::Percent)) {
      Token t = next();
      a = binary(t.kind == Tok::Star ? "*" : t.kind == Tok::Slash ? "/" : "%", std::move(a), unary(), t.loc);
    }
    return a;
  }
  ExprPtr unary() {
    if (at(Tok::Minus)) {
      DepthGuard g(*this, peek());
      auto e = std::make_unique<Expr>(Expr::Kind::Unary, next().loc);
      e->text = std::string(1, '-');
      e->items.push_back(unary());
      return e;
    }
    return postfix();
  }
  ExprPtr postfix() {
    ExprPtr e = primary();
    while (true) {
      if (at(Tok::LParen)) {
        DepthGuard g(*this, peek());
        auto c = std::make_unique<Expr>(Expr::Kind::Call, next().loc);
        c->callee = std::move(e);
        c->args = args();
        e = std::move(c);
      } else if (at(Tok::LBracket)) {
        DepthGuard g(*this, peek());
        auto ix = std::make_unique<Expr>(Expr::Kind::Index, next().loc);
        ix->callee = std::move(e);
        do {
          ast::Subscript s;
          s.loc = peek().loc;
          if (!at(Tok::Colon)) s.index = expr();
          if (accept(Tok::Colon)) {
            s.is_slice = true;
            if (!at(Tok::Comma) && !at(Tok::RBracket)) s.stop = expr();
          }
          ix->subs.push_back(std::move(s));
        } while (accept(Tok::Comma));
        expect(Tok::RBracket, "']' to close the subscript");
        e = std::move(ix);
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token& t = peek();
    switch (t.kind) {
      case Tok::Int: {
        auto e = std::make_unique<Expr>(Expr::Kind::Int, t.loc);
        e->int_value = next().int_value;
        return e;
      }
      case Tok::Float: {
        auto e = std::make_unique<Expr>(Expr::Kind::Float, t.loc);
        e->float_value = next().float_value;
        return e;
      }
      case Tok::String: {
        auto e = std::make_unique<Expr>(Expr::Kind::String, t.loc);
        e->text = next().text;
        return e;
      }
      case Tok::KwTrue:
      case Tok::KwFalse: {
        auto e = std::make_unique<Expr>(Expr::Kind::Bool, t.loc);
        e->bool_value = next().kind == Tok::KwTrue;
        return e;
      }
      case Tok::Ident: {
        auto e = std::make_unique<Expr>(Expr::Kind::Name, t.loc);
        e->text = next().text;
        return e;
      }
      case Tok::LParen: {
        next();
        ExprPtr e = expr();
        expect(Tok::RParen, "')'");
        return e;
      }
      case Tok::LBracket: {
        auto e = std::make_unique<Expr>(Expr::Kind::List, next().loc);
        while (!at(Tok::RBracket)) {
          e->items.push_back(expr());
          if (!accept(Tok::Comma)) break;
        }
        expect(Tok::RBracket, "']' to close the list");
        return e;
      }
      default:
        fail(t, fmt::format("expected a value, found {}", describe(t)));
    }
  }

  std::vector<Token> toks_;
  DiagnosticEngine& diags_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

std::unique_ptr<ast::File> parseFile(const std::string& path, std::string_view text, DiagnosticEngine& diags) {
  diags.addSource(path, std::string(text));
  return Parser(lex(path, text, diags), diags).file(path);
}

ast::ExprPtr parseExpression(const std::string& origin, std::string_view text, DiagnosticEngine& diags) {
  diags.addSource(origin, std::string(text));
  int before = diags.errorCount();
  ast::ExprPtr e = Parser(lex(origin, text, diags), diags).exprOnly();
  if (diags.errorCount() != before) return nullptr;
  return e;
}

}  // namespace kiln::frontend
