#include "ir/parser.h"

#include <charconv>
#include <cstring>
#include <unordered_map>

#include "ir/builder.h"
#include "ir/op_def.h"
#include "ir/printer.h"
#include "ir/verifier.h"

namespace kiln::ir {
namespace {

// ---- Lexer ------------------------------------------------------------------------------------

enum class Tok {
  Eof,
  BareId,    // module, func.func, attributes, return, true, attribute keys
  ValueId,   // %name (text without the %)
  SymbolId,  // @name or @"name" (text is the unquoted name)
  BlockId,   // ^bb0
  String,    // "..." (text is the unescaped contents)
  Integer,   // 42, -3, 0x7FF8000000000000
  Float,     // 1.5, -2.0e-03
  Type,      // !kiln.tensor<...> (text is the whole type)
  LParen,
  RParen,
  LBrace,
  RBrace,
  LSquare,
  RSquare,
  Comma,
  Colon,
  Equal,
  Arrow,
  Hash,
};

struct Token {
  Tok kind = Tok::Eof;
  std::string text;
  int line = 1, col = 1;
};

bool isIdStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool isDigit(char c) { return c >= '0' && c <= '9'; }
bool isSuffixIdChar(char c) { return isIdStart(c) || isDigit(c) || c == '$' || c == '.' || c == '-'; }
bool isBareIdChar(char c) { return isIdStart(c) || isDigit(c) || c == '$' || c == '.'; }

class Lexer {
 public:
  Lexer(std::string_view text, const std::string& file) : text_(text), file_(file) {}

  struct State {
    size_t pos;
    int line, col;
  };
  State state() const { return {pos_, line_, col_}; }
  void restore(State s) {
    pos_ = s.pos;
    line_ = s.line;
    col_ = s.col;
  }

  Location loc(int line, int col) const { return Location{file_, line, col}; }

  Expected<Token> next() {
    skipSpaceAndComments();
    Token t;
    t.line = line_;
    t.col = col_;
    if (pos_ >= text_.size()) return t;
    char c = text_[pos_];
    auto single = [&](Tok k) {
      advance(1);
      t.kind = k;
      t.text = std::string(1, c);
      return t;
    };
    switch (c) {
      case '(':
        return single(Tok::LParen);
      case ')':
        return single(Tok::RParen);
      case '{':
        return single(Tok::LBrace);
      case '}':
        return single(Tok::RBrace);
      case '[':
        return single(Tok::LSquare);
      case ']':
        return single(Tok::RSquare);
      case ',':
        return single(Tok::Comma);
      case ':':
        return single(Tok::Colon);
      case '=':
        return single(Tok::Equal);
      case '#':
        return single(Tok::Hash);
      default:
        break;
    }
    if (c == '-' && peek(1) == '>') {
      advance(2);
      t.kind = Tok::Arrow;
      t.text = "->";
      return t;
    }
    if (isDigit(c) || (c == '-' && isDigit(peek(1)))) return lexNumber(t);
    if (c == '"') {
      KILN_ASSIGN_OR_RETURN(auto s, lexString(t));
      t.kind = Tok::String;
      t.text = std::move(s);
      return t;
    }
    if (c == '%' || c == '^') {
      advance(1);
      size_t start = pos_;
      while (pos_ < text_.size() && isSuffixIdChar(text_[pos_])) advance(1);
      if (pos_ == start)
        return Status::error(fmt::format("expected a name after '{}'", c), loc(t.line, t.col));
      t.kind = c == '%' ? Tok::ValueId : Tok::BlockId;
      t.text = std::string(text_.substr(start, pos_ - start));
      return t;
    }
    if (c == '@') {
      advance(1);
      t.kind = Tok::SymbolId;
      if (peek(0) == '"') {
        KILN_ASSIGN_OR_RETURN(auto s, lexString(t));
        t.text = std::move(s);
        return t;
      }
      size_t start = pos_;
      while (pos_ < text_.size() && isBareIdChar(text_[pos_])) advance(1);
      if (pos_ == start) return Status::error("expected a symbol name after '@'", loc(t.line, t.col));
      t.text = std::string(text_.substr(start, pos_ - start));
      return t;
    }
    if (c == '!') return lexType(t);
    if (isIdStart(c)) {
      size_t start = pos_;
      while (pos_ < text_.size() && isBareIdChar(text_[pos_])) advance(1);
      t.kind = Tok::BareId;
      t.text = std::string(text_.substr(start, pos_ - start));
      return t;
    }
    return Status::error(fmt::format("unexpected character '{}'", c), loc(t.line, t.col));
  }

 private:
  char peek(size_t k) const { return pos_ + k < text_.size() ? text_[pos_ + k] : '\0'; }
  void advance(size_t n) {
    for (size_t i = 0; i < n && pos_ < text_.size(); ++i, ++pos_) {
      if (text_[pos_] == '\n') {
        ++line_;
        col_ = 1;
      } else {
        ++col_;
      }
    }
  }
  void skipSpaceAndComments() {
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        advance(1);
      } else if (c == '/' && peek(1) == '/') {
        while (pos_ < text_.size() && text_[pos_] != '\n') advance(1);
      } else {
        break;
      }
    }
  }

  Expected<Token> lexNumber(Token t) {
    size_t start = pos_;
    if (peek(0) == '-') advance(1);
    if (peek(0) == '0' && (peek(1) == 'x' || peek(1) == 'X')) {
      advance(2);
      while (pos_ < text_.size() && std::isxdigit(static_cast<unsigned char>(text_[pos_]))) advance(1);
      t.kind = Tok::Integer;
      t.text = std::string(text_.substr(start, pos_ - start));
      return t;
    }
    bool is_float = false;
    while (isDigit(peek(0))) advance(1);
    if (peek(0) == '.') {
      is_float = true;
      advance(1);
      while (isDigit(peek(0))) advance(1);
    }
    if ((peek(0) == 'e' || peek(0) == 'E') &&
        (isDigit(peek(1)) || ((peek(1) == '+' || peek(1) == '-') && isDigit(peek(2))))) {
      is_float = true;
      advance(2);
      while (isDigit(peek(0))) advance(1);
    }
    t.kind = is_float ? Tok::Float : Tok::Integer;
    t.text = std::string(text_.substr(start, pos_ - start));
    return t;
  }

  // At a '"': the unescaped contents (quoteString's escapes: \" \\ \XX, plus \n \t).
  Expected<std::string> lexString(const Token& t) {
    advance(1);
    std::string out;
    while (true) {
      if (pos_ >= text_.size() || text_[pos_] == '\n')
        return Status::error("unterminated string", loc(t.line, t.col));
      char c = text_[pos_];
      if (c == '"') {
        advance(1);
        return out;
      }
      if (c != '\\') {
        out += c;
        advance(1);
        continue;
      }
      char e = peek(1);
      if (e == '"' || e == '\\') {
        out += e;
        advance(2);
      } else if (e == 'n') {
        out += '\n';
        advance(2);
      } else if (e == 't') {
        out += '\t';
        advance(2);
      } else if (std::isxdigit(static_cast<unsigned char>(e)) &&
                 std::isxdigit(static_cast<unsigned char>(peek(2)))) {
        out += static_cast<char>(std::stoi(std::string(text_.substr(pos_ + 1, 2)), nullptr, 16));
        advance(3);
      } else {
        return Status::error("bad escape in string", loc(line_, col_));
      }
    }
  }

  // `!dialect.name<body>` with balanced brackets in the body.
  Expected<Token> lexType(Token t) {
    size_t start = pos_;
    advance(1);
    while (pos_ < text_.size() && isBareIdChar(text_[pos_])) advance(1);
    if (peek(0) == '<') {
      int depth = 0;
      do {
        char c = peek(0);
        if (c == '\0' || c == '\n')
          return Status::error("unterminated type: missing '>'", loc(t.line, t.col));
        if (c == '<') ++depth;
        if (c == '>') --depth;
        advance(1);
      } while (depth > 0);
    }
    t.kind = Tok::Type;
    t.text = std::string(text_.substr(start, pos_ - start));
    return t;
  }

  std::string_view text_;
  const std::string& file_;
  size_t pos_ = 0;
  int line_ = 1, col_ = 1;
};

std::string_view tokName(Tok k) {
  switch (k) {
    case Tok::Eof:
      return "end of file";
    case Tok::BareId:
      return "identifier";
    case Tok::ValueId:
      return "value name";
    case Tok::SymbolId:
      return "'@' symbol";
    case Tok::BlockId:
      return "block label";
    case Tok::String:
      return "string";
    case Tok::Integer:
      return "integer";
    case Tok::Float:
      return "float";
    case Tok::Type:
      return "type";
    case Tok::LParen:
      return "'('";
    case Tok::RParen:
      return "')'";
    case Tok::LBrace:
      return "'{'";
    case Tok::RBrace:
      return "'}'";
    case Tok::LSquare:
      return "'['";
    case Tok::RSquare:
      return "']'";
    case Tok::Comma:
      return "','";
    case Tok::Colon:
      return "':'";
    case Tok::Equal:
      return "'='";
    case Tok::Arrow:
      return "'->'";
    case Tok::Hash:
      return "'#'";
  }
  return "token";
}

std::string describe(const Token& t) {
  switch (t.kind) {
    case Tok::Eof:
      return "end of file";
    case Tok::ValueId:
      return fmt::format("'%{}'", t.text);
    case Tok::SymbolId:
      return fmt::format("'@{}'", t.text);
    case Tok::BlockId:
      return fmt::format("'^{}'", t.text);
    case Tok::String:
      return quoteString(t.text);
    default:
      return fmt::format("'{}'", t.text);
  }
}

// ---- Parser -----------------------------------------------------------------------------------

#define KILN_TRY_ASSIGN(var, expr)         \
  auto var##_or = (expr);                  \
  if (!var##_or) return var##_or.status(); \
  auto var = var##_or.take()

class Parser {
 public:
  Parser(std::string_view text, std::string file) : file_(std::move(file)), lex_(text, file_) {}

  Expected<std::unique_ptr<Module>> run() {
    module_ = std::make_unique<Module>();
    module_->source_file = file_;
    KILN_RETURN_IF_ERROR(advance());
    if (isKeyword("module")) {
      KILN_RETURN_IF_ERROR(advance());
      if (isKeyword("attributes")) {
        KILN_RETURN_IF_ERROR(advance());
        KILN_TRY_ASSIGN(attrs, parseDict());
        module_->mutableAttrs() = std::move(attrs);
      }
      Token open = tok_;
      KILN_RETURN_IF_ERROR(expect(Tok::LBrace, "to open the module"));
      while (tok_.kind != Tok::RBrace) {
        if (tok_.kind == Tok::Eof) return unclosed(open, "module");
        KILN_RETURN_IF_ERROR(parseFunction());
      }
      KILN_RETURN_IF_ERROR(advance());
      if (tok_.kind != Tok::Eof)
        return errorHere(fmt::format("expected end of file after the module, got {}", describe(tok_)));
    } else {
      while (tok_.kind != Tok::Eof) KILN_RETURN_IF_ERROR(parseFunction());
    }
    KILN_RETURN_IF_ERROR(verify(*module_));
    return std::move(module_);
  }

 private:
  // ---- tokens ----
  Status advance() {
    KILN_ASSIGN_OR_RETURN(auto t, lex_.next());
    tok_ = std::move(t);
    return Status::ok();
  }
  Location locOf(const Token& t) const { return lex_.loc(t.line, t.col); }
  Status errorAt(const Token& t, std::string msg) const { return Status::error(std::move(msg), locOf(t)); }

  // Arrays, dictionaries and regions nest through recursion: past kMaxNesting levels the input
  // is an error at the opening token, not a stack overflow (hostile or generated IR files).
  static constexpr int kMaxNesting = 256;
  struct NestingGuard {
    Parser& p;
    explicit NestingGuard(Parser& parser) : p(parser) { ++p.nesting_; }
    ~NestingGuard() { --p.nesting_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;
  };
  Status checkNesting(const Token& open, const char* what) const {
    if (nesting_ <= kMaxNesting) return Status::ok();
    return errorAt(open, fmt::format("{} nested more than {} levels deep", what, kMaxNesting));
  }
  Status errorHere(std::string msg) const { return errorAt(tok_, std::move(msg)); }
  bool isKeyword(std::string_view k) const { return tok_.kind == Tok::BareId && tok_.text == k; }
  Status expect(Tok k, std::string_view what) {
    if (tok_.kind != k)
      return errorHere(fmt::format("expected {} {}, got {}", tokName(k), what, describe(tok_)));
    return advance();
  }
  Status unclosed(const Token& open, std::string_view what) const {
    return errorAt(open, fmt::format("unbalanced braces: the '{{' of this {} is never closed", what));
  }

  // ---- types ----
  Expected<TensorType> parseType() {
    if (tok_.kind != Tok::Type)
      return errorHere(fmt::format("expected a type '!kiln.tensor<...>', got {}", describe(tok_)));
    Token t = tok_;
    constexpr std::string_view kPrefix = "!kiln.tensor<";
    if (t.text.size() <= kPrefix.size() || t.text.compare(0, kPrefix.size(), kPrefix) != 0)
      return errorAt(t, fmt::format("unknown type '{}'; expected '!kiln.tensor<...>'", t.text));
    auto type = parseTensorTypeBody(
        std::string_view(t.text).substr(kPrefix.size(), t.text.size() - kPrefix.size() - 1));
    if (!type) return errorAt(t, fmt::format("bad type '{}': {}", t.text, type.status().message()));
    // A static type's size is known now: one past int64 would wrap in every later count.
    if (type->isStatic())
      if (auto bytes = type->checkedBytes({}); !bytes)
        return errorAt(t, fmt::format("bad type '{}': {}", t.text, bytes.status().message()));
    KILN_RETURN_IF_ERROR(advance());
    return type.take();
  }

  // `(t1, t2)`, `()`.
  Expected<std::vector<TensorType>> parseParenTypes() {
    KILN_RETURN_IF_ERROR(expect(Tok::LParen, "to open a type list"));
    std::vector<TensorType> out;
    if (tok_.kind != Tok::RParen) {
      while (true) {
        KILN_TRY_ASSIGN(t, parseType());
        out.push_back(std::move(t));
        if (tok_.kind != Tok::Comma) break;
        KILN_RETURN_IF_ERROR(advance());
      }
    }
    KILN_RETURN_IF_ERROR(expect(Tok::RParen, "to close a type list"));
    return out;
  }

  // A result type list after `->`: one type, or a parenthesized list.
  Expected<std::vector<TensorType>> parseResultTypes() {
    if (tok_.kind == Tok::LParen) return parseParenTypes();
    KILN_TRY_ASSIGN(t, parseType());
    return std::vector<TensorType>{std::move(t)};
  }

  // ---- attributes ----
  Expected<Attribute> parseAttribute() {
    Token t = tok_;
    switch (t.kind) {
      case Tok::BareId:
        if (t.text == "true" || t.text == "false") {
          KILN_RETURN_IF_ERROR(advance());
          return Attribute(t.text == "true");
        }
        if (t.text == "unit") {
          KILN_RETURN_IF_ERROR(advance());
          return Attribute(true);
        }
        return errorAt(t, fmt::format("expected an attribute value, got '{}'", t.text));
      case Tok::String:
        KILN_RETURN_IF_ERROR(advance());
        return Attribute(t.text);
      case Tok::Integer:
      case Tok::Float:
        return parseNumber();
      case Tok::LSquare: {
        NestingGuard nested(*this);
        KILN_RETURN_IF_ERROR(checkNesting(t, "an array attribute"));
        KILN_RETURN_IF_ERROR(advance());
        AttrArray items;
        if (tok_.kind != Tok::RSquare) {
          while (true) {
            KILN_TRY_ASSIGN(a, parseAttribute());
            items.push_back(std::move(a));
            if (tok_.kind != Tok::Comma) break;
            KILN_RETURN_IF_ERROR(advance());
          }
        }
        KILN_RETURN_IF_ERROR(expect(Tok::RSquare, "to close an array"));
        return Attribute(std::move(items));
      }
      case Tok::LBrace: {
        KILN_TRY_ASSIGN(d, parseDict());
        return Attribute(std::move(d));
      }
      case Tok::Type: {
        KILN_TRY_ASSIGN(type, parseType());
        return Attribute(std::move(type));
      }
      default:
        return errorAt(t, fmt::format("expected an attribute value, got {}", describe(t)));
    }
  }

  // 42, -1.5e-03, 0x7FF8000000000000 (a double's bits, as formatFloat prints NaN and infinities),
  // each with an optional MLIR type suffix `: i64` / `: f32`.
  Expected<Attribute> parseNumber() {
    Token t = tok_;
    KILN_RETURN_IF_ERROR(advance());
    std::optional<char> suffix;  // 'i' or 'f'
    if (tok_.kind == Tok::Colon) {
      // Only `: i64`, `: f32`, ... is a suffix; anything else after ':' belongs to the caller
      // (e.g. the op signature after a dictionary missing its '}').
      Lexer::State colon_state = lex_.state();
      Token colon = tok_;
      KILN_RETURN_IF_ERROR(advance());
      if (isNumberType(tok_)) {
        suffix = tok_.text[0];
        KILN_RETURN_IF_ERROR(advance());
      } else {
        lex_.restore(colon_state);
        tok_ = colon;
      }
    }
    bool negative = !t.text.empty() && t.text[0] == '-';
    std::string_view digits = std::string_view(t.text).substr(negative ? 1 : 0);
    if (t.kind == Tok::Integer && digits.size() > 2 && (digits[1] == 'x' || digits[1] == 'X')) {
      uint64_t bits = 0;
      auto [p, ec] = std::from_chars(digits.data() + 2, digits.data() + digits.size(), bits, 16);
      if (ec != std::errc() || p != digits.data() + digits.size() || digits.size() == 2)
        return errorAt(t, fmt::format("bad hexadecimal literal '{}'", t.text));
      if (suffix == 'i') {
        // Negated as bits, modulo 2^64: -0x8000000000000000 is INT64_MIN, not an overflow.
        return Attribute(static_cast<int64_t>(negative ? 0 - bits : bits));
      }
      double d;
      std::memcpy(&d, &bits, sizeof d);
      return Attribute(negative ? -d : d);
    }
    if (t.kind == Tok::Integer && suffix != 'f') {
      int64_t v = 0;
      auto [p, ec] = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
      if (ec != std::errc() || p != t.text.data() + t.text.size())
        return errorAt(t, fmt::format("integer literal '{}' is out of range", t.text));
      return Attribute(v);
    }
    if (suffix == 'i') return errorAt(t, fmt::format("'{}' is not an integer", t.text));
    char* end = nullptr;
    double d = std::strtod(t.text.c_str(), &end);
    if (end != t.text.c_str() + t.text.size()) return errorAt(t, fmt::format("bad number '{}'", t.text));
    return Attribute(d);
  }

  static bool isNumberType(const Token& t) {
    if (t.kind != Tok::BareId || t.text.size() < 2 || (t.text[0] != 'i' && t.text[0] != 'f')) return false;
    for (size_t i = 1; i < t.text.size(); ++i)
      if (!isDigit(t.text[i])) return false;
    return true;
  }

  // `{a = 1, "b c" = [2], unit_flag}`
  Expected<AttrDict> parseDict() {
    Token open = tok_;
    NestingGuard nested(*this);
    KILN_RETURN_IF_ERROR(checkNesting(open, "an attribute dictionary"));
    KILN_RETURN_IF_ERROR(expect(Tok::LBrace, "to open an attribute dictionary"));
    AttrDict d;
    if (tok_.kind != Tok::RBrace) {
      while (true) {
        if (tok_.kind != Tok::BareId && tok_.kind != Tok::String)
          return errorHere(fmt::format("expected an attribute name, got {}", describe(tok_)));
        Token key = tok_;
        KILN_RETURN_IF_ERROR(advance());
        Attribute value(true);  // a bare key is MLIR's unit attribute
        if (tok_.kind == Tok::Equal) {
          KILN_RETURN_IF_ERROR(advance());
          KILN_TRY_ASSIGN(v, parseAttribute());
          value = std::move(v);
        }
        if (!d.emplace(key.text, std::move(value)).second)
          return errorAt(key, fmt::format("attribute '{}' is given twice", key.text));
        if (tok_.kind != Tok::Comma) break;
        KILN_RETURN_IF_ERROR(advance());
      }
    }
    if (tok_.kind == Tok::Eof) return unclosed(open, "attribute dictionary");
    KILN_RETURN_IF_ERROR(expect(Tok::RBrace, "to close an attribute dictionary"));
    return d;
  }

  // ---- values ----
  struct Group {
    std::vector<Value*> values;
  };
  using Scope = std::unordered_map<std::string, Group>;

  Status define(const Token& name_tok, std::vector<Value*> values) {
    for (const Scope& s : scopes_)
      if (s.count(name_tok.text))
        return errorAt(name_tok, fmt::format("redefinition of value '%{}'", name_tok.text));
    // Numbered names (%0) carry no meaning; keep the rest as hints.
    std::string hint = sanitizeValueName(name_tok.text).empty() ? "" : name_tok.text;
    for (Value* v : values) v->setNameHint(hint);
    scopes_.back().emplace(name_tok.text, Group{std::move(values)});
    return Status::ok();
  }

  // `%x` or `%r#1`.
  Expected<Value*> parseUse() {
    if (tok_.kind != Tok::ValueId) return errorHere(fmt::format("expected a value, got {}", describe(tok_)));
    Token name = tok_;
    KILN_RETURN_IF_ERROR(advance());
    const Group* group = nullptr;
    for (auto it = scopes_.rbegin(); it != scopes_.rend() && !group; ++it) {
      auto f = it->find(name.text);
      if (f != it->end()) group = &f->second;
    }
    if (!group) return errorAt(name, fmt::format("use of undefined value '%{}'", name.text));
    if (tok_.kind == Tok::Hash) {
      KILN_RETURN_IF_ERROR(advance());
      if (tok_.kind != Tok::Integer)
        return errorHere(fmt::format("expected a result number after '#', got {}", describe(tok_)));
      int64_t i = -1;
      std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), i);
      if (i < 0 || i >= static_cast<int64_t>(group->values.size()))
        return errorAt(name, fmt::format("'%{}' has {} result(s); there is no #{}", name.text,
                                         group->values.size(), tok_.text));
      KILN_RETURN_IF_ERROR(advance());
      return group->values[static_cast<size_t>(i)];
    }
    if (group->values.size() != 1)
      return errorAt(name, fmt::format("'%{}' names {} results; use '%{}#0' ...", name.text,
                                       group->values.size(), name.text));
    return group->values[0];
  }

  struct UseList {
    std::vector<Value*> values;
    std::vector<Token> tokens;  // where each use is, for type errors
  };
  Expected<UseList> parseUses(Tok end) {
    UseList out;
    if (tok_.kind == end) return out;
    while (true) {
      out.tokens.push_back(tok_);
      KILN_TRY_ASSIGN(v, parseUse());
      out.values.push_back(v);
      if (tok_.kind != Tok::Comma) break;
      KILN_RETURN_IF_ERROR(advance());
    }
    return out;
  }

  // The signature's operand types must be the operands' types.
  Status checkOperandTypes(const UseList& uses, const std::vector<TensorType>& types, const Token& at) {
    if (types.size() != uses.values.size())
      return errorAt(at,
                     fmt::format("{} operand(s) but {} operand type(s)", uses.values.size(), types.size()));
    for (size_t i = 0; i < types.size(); ++i)
      if (!(uses.values[i]->type() == types[i]))
        return errorAt(uses.tokens[i], fmt::format("'%{}' has type {} but is used as {}", uses.tokens[i].text,
                                                   uses.values[i]->type().str(), types[i].str()));
    return Status::ok();
  }

  // ---- functions, blocks, ops ----
  Status parseFunction() {
    if (tok_.kind == Tok::RBrace) return errorHere("unbalanced braces: this '}' closes nothing");
    if (!isKeyword("func.func"))
      return errorHere(fmt::format("expected 'func.func', got {}", describe(tok_)));
    Token start = tok_;
    KILN_RETURN_IF_ERROR(advance());
    if (tok_.kind != Tok::SymbolId)
      return errorHere(fmt::format("expected a function name '@name', got {}", describe(tok_)));
    if (module_->lookup(tok_.text)) return errorHere(fmt::format("function @{} is defined twice", tok_.text));
    Function& f = module_->addFunction(tok_.text);
    f.loc = locOf(start);
    KILN_RETURN_IF_ERROR(advance());
    scopes_.emplace_back();
    KILN_RETURN_IF_ERROR(expect(Tok::LParen, "to open the argument list"));
    if (tok_.kind != Tok::RParen) {
      while (true) {
        if (tok_.kind != Tok::ValueId)
          return errorHere(fmt::format("expected an argument '%name: type', got {}", describe(tok_)));
        Token name = tok_;
        KILN_RETURN_IF_ERROR(advance());
        KILN_RETURN_IF_ERROR(expect(Tok::Colon, "after the argument name"));
        KILN_TRY_ASSIGN(type, parseType());
        KILN_RETURN_IF_ERROR(define(name, {f.entry().addArgument(std::move(type))}));
        if (tok_.kind != Tok::Comma) break;
        KILN_RETURN_IF_ERROR(advance());
      }
    }
    KILN_RETURN_IF_ERROR(expect(Tok::RParen, "to close the argument list"));
    if (tok_.kind == Tok::Arrow) {
      KILN_RETURN_IF_ERROR(advance());
      KILN_TRY_ASSIGN(types, parseResultTypes());
      f.setResultTypes(std::move(types));
    }
    if (isKeyword("attributes")) {
      KILN_RETURN_IF_ERROR(advance());
      KILN_TRY_ASSIGN(attrs, parseDict());
      f.mutableAttrs() = std::move(attrs);
    }
    Token open = tok_;
    KILN_RETURN_IF_ERROR(expect(Tok::LBrace, "to open the function body"));
    while (tok_.kind != Tok::RBrace) {
      if (tok_.kind == Tok::Eof) return unclosed(open, "function");
      if (tok_.kind == Tok::BlockId)
        return errorHere("a function has a single block; block labels are not allowed here");
      KILN_RETURN_IF_ERROR(parseOp(f.entry()));
    }
    KILN_RETURN_IF_ERROR(advance());
    scopes_.pop_back();
    return Status::ok();
  }

  // One region `{ [^bb0(%a: t):] ops }`, parsed into `region`.
  Status parseRegion(Region& region) {
    Token open = tok_;
    NestingGuard nested(*this);
    KILN_RETURN_IF_ERROR(checkNesting(open, "a region"));
    KILN_RETURN_IF_ERROR(expect(Tok::LBrace, "to open a region"));
    scopes_.emplace_back();
    Block* block = nullptr;
    while (tok_.kind != Tok::RBrace) {
      if (tok_.kind == Tok::Eof) return unclosed(open, "region");
      if (tok_.kind == Tok::BlockId) {
        // The entry block's label is optional; a later label starts a new block.
        if (!block || !block->empty() || block->numArguments() > 0 || &region.front() != block)
          block = &region.addBlock();
        KILN_RETURN_IF_ERROR(advance());
        if (tok_.kind == Tok::LParen) {
          KILN_RETURN_IF_ERROR(advance());
          if (tok_.kind != Tok::RParen) {
            while (true) {
              if (tok_.kind != Tok::ValueId)
                return errorHere(
                    fmt::format("expected a block argument '%name: type', got {}", describe(tok_)));
              Token name = tok_;
              KILN_RETURN_IF_ERROR(advance());
              KILN_RETURN_IF_ERROR(expect(Tok::Colon, "after the block argument name"));
              KILN_TRY_ASSIGN(type, parseType());
              KILN_RETURN_IF_ERROR(define(name, {block->addArgument(std::move(type))}));
              if (tok_.kind != Tok::Comma) break;
              KILN_RETURN_IF_ERROR(advance());
            }
          }
          KILN_RETURN_IF_ERROR(expect(Tok::RParen, "to close the block arguments"));
        }
        KILN_RETURN_IF_ERROR(expect(Tok::Colon, "after the block label"));
        continue;
      }
      if (!block) block = &region.addBlock();
      KILN_RETURN_IF_ERROR(parseOp(*block));
    }
    if (!block) region.addBlock();
    KILN_RETURN_IF_ERROR(advance());
    scopes_.pop_back();
    return Status::ok();
  }

  // Skips a balanced `( ... )` starting at the current '('.
  Status skipParens() {
    Token open = tok_;
    int depth = 0;
    do {
      if (tok_.kind == Tok::Eof) return errorAt(open, "unbalanced parentheses: this '(' is never closed");
      if (tok_.kind == Tok::LParen) ++depth;
      if (tok_.kind == Tok::RParen) --depth;
      KILN_RETURN_IF_ERROR(advance());
    } while (depth > 0);
    return Status::ok();
  }

  Status parseOp(Block& block) {
    Token start = tok_;
    // Result groups: `%a`, `%r:2`, `%a, %b`.
    std::vector<std::pair<Token, int64_t>> groups;
    if (tok_.kind == Tok::ValueId) {
      while (true) {
        if (tok_.kind != Tok::ValueId)
          return errorHere(fmt::format("expected a result name, got {}", describe(tok_)));
        Token name = tok_;
        int64_t count = 1;
        KILN_RETURN_IF_ERROR(advance());
        if (tok_.kind == Tok::Colon) {
          KILN_RETURN_IF_ERROR(advance());
          if (tok_.kind != Tok::Integer || tok_.text[0] == '-' || tok_.text == "0")
            return errorHere(fmt::format("expected a result count after ':', got {}", describe(tok_)));
          std::from_chars(tok_.text.data(), tok_.text.data() + tok_.text.size(), count);
          KILN_RETURN_IF_ERROR(advance());
        }
        groups.emplace_back(name, count);
        if (tok_.kind != Tok::Comma) break;
        KILN_RETURN_IF_ERROR(advance());
      }
      KILN_RETURN_IF_ERROR(expect(Tok::Equal, "after the result names"));
    }
    int64_t num_results = 0;
    for (const auto& g : groups) num_results += g.second;

    if (isKeyword("return") || isKeyword("func.return")) {
      Token ret = tok_;
      if (!groups.empty()) return errorAt(start, "'return' has no results");
      KILN_RETURN_IF_ERROR(advance());
      UseList uses;
      if (tok_.kind == Tok::ValueId) {
        KILN_TRY_ASSIGN(u, parseUses(Tok::Colon));
        uses = std::move(u);
        KILN_RETURN_IF_ERROR(expect(Tok::Colon, "before the returned types"));
        std::vector<TensorType> types;
        while (true) {
          KILN_TRY_ASSIGN(t, parseType());
          types.push_back(std::move(t));
          if (tok_.kind != Tok::Comma) break;
          KILN_RETURN_IF_ERROR(advance());
        }
        KILN_RETURN_IF_ERROR(checkOperandTypes(uses, types, ret));
      }
      auto op = Op::create("func.return", uses.values, {}, {}, locOf(start));
      KILN_RETURN_IF_ERROR(verifyOp(*op).withLocation(locOf(start)));
      block.push_back(std::move(op));
      return Status::ok();
    }

    if (tok_.kind != Tok::String)
      return errorHere(fmt::format("expected an op: a quoted op name or 'return', got {}", describe(tok_)));
    Token name = tok_;
    if (!OpRegistry::get().lookup(name.text)) return errorAt(name, fmt::format("unknown op '{}'", name.text));
    KILN_RETURN_IF_ERROR(advance());
    KILN_RETURN_IF_ERROR(expect(Tok::LParen, "to open the operand list"));
    KILN_TRY_ASSIGN(uses, parseUses(Tok::RParen));
    KILN_RETURN_IF_ERROR(expect(Tok::RParen, "to close the operand list"));
    // Regions come before the attributes and the signature in the generic form, but the op (and
    // so its result types) must exist before its regions are filled: skip them, read the rest,
    // then come back.
    std::optional<Lexer::State> regions_at;
    Token regions_tok;
    if (tok_.kind == Tok::LParen) {
      regions_tok = tok_;
      regions_at = lex_.state();
      KILN_RETURN_IF_ERROR(skipParens());
    }
    AttrDict attrs;
    if (tok_.kind == Tok::LBrace) {
      KILN_TRY_ASSIGN(d, parseDict());
      attrs = std::move(d);
    }
    Token sig = tok_;
    KILN_RETURN_IF_ERROR(expect(Tok::Colon, "before the op's type signature"));
    KILN_TRY_ASSIGN(operand_types, parseParenTypes());
    KILN_RETURN_IF_ERROR(expect(Tok::Arrow, "in the op's type signature"));
    KILN_TRY_ASSIGN(result_types, parseResultTypes());
    KILN_RETURN_IF_ERROR(checkOperandTypes(uses, operand_types, sig));
    if (static_cast<int64_t>(result_types.size()) != num_results)
      return errorAt(start, fmt::format("'{}' defines {} result(s) but its signature has {} result type(s)",
                                        name.text, num_results, result_types.size()));
    auto op = Op::create(name.text, uses.values, result_types, std::move(attrs), locOf(start));
    Op* op_ptr = op.get();

    if (regions_at) {
      Lexer::State after = lex_.state();
      Token after_tok = tok_;
      lex_.restore(*regions_at);
      tok_ = regions_tok;
      KILN_RETURN_IF_ERROR(advance());  // past '('
      while (true) {
        KILN_RETURN_IF_ERROR(parseRegion(op_ptr->addRegion()));
        if (tok_.kind != Tok::Comma) break;
        KILN_RETURN_IF_ERROR(advance());
      }
      if (tok_.kind != Tok::RParen)
        return errorHere(fmt::format("expected ')' after the regions, got {}", describe(tok_)));
      lex_.restore(after);
      tok_ = after_tok;
    }

    Status s = verifyOp(*op);
    if (!s) return Status::error(s.message(), locOf(start));
    block.push_back(std::move(op));
    size_t next = 0;
    for (const auto& [gtok, count] : groups) {
      std::vector<Value*> vals;
      for (int64_t i = 0; i < count; ++i) vals.push_back(op_ptr->result(static_cast<unsigned>(next++)));
      KILN_RETURN_IF_ERROR(define(gtok, std::move(vals)));
    }
    return Status::ok();
  }

  std::string file_;
  Lexer lex_;
  Token tok_;
  int nesting_ = 0;  // arrays, dictionaries and regions open at tok_ (NestingGuard)
  std::unique_ptr<Module> module_;
  std::vector<Scope> scopes_;
};

}  // namespace

Expected<std::unique_ptr<Module>> parseModule(std::string_view text, std::string filename) {
  Parser p(text, std::move(filename));
  return p.run();
}

}  // namespace kiln::ir
