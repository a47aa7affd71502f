#include "frontend/lexer.h"

#include <cerrno>
#include <cstdlib>
#include <unordered_map>

#include <fmt/format.h>

namespace kiln::frontend {

const char* tokName(Tok t) {
  switch (t) {
    case Tok::Eof: return "end of file";
    case Tok::Newline: return "newline";
    case Tok::Ident: return "identifier";
    case Tok::Int: return "integer";
    case Tok::Float: return "number";
    case Tok::String: return "string";
    case Tok::KwModel: return "'model'";
    case Tok::KwFn: return "'fn'";
    case Tok::KwDim: return "'dim'";
    case Tok::KwParam: return "'param'";
    case Tok::KwInput: return "'input'";
    case Tok::KwOutput: return "'output'";
    case Tok::KwTrain: return "'train'";
    case Tok::KwFor: return "'for'";
    case Tok::KwIn: return "'in'";
    case Tok::KwIf: return "'if'";
    case Tok::KwElse: return "'else'";
    case Tok::KwReturn: return "'return'";
    case Tok::KwImport: return "'import'";
    case Tok::KwTrue: return "'true'";
    case Tok::KwFalse: return "'false'";
    case Tok::KwAnd: return "'and'";
    case Tok::KwOr: return "'or'";
    case Tok::KwNot: return "'not'";
    case Tok::LParen: return "'('";
    case Tok::RParen: return "')'";
    case Tok::LBracket: return "'['";
    case Tok::RBracket: return "']'";
    case Tok::LBrace: return "'{'";
    case Tok::RBrace: return "'}'";
    case Tok::Comma: return "','";
    case Tok::Colon: return "':'";
    case Tok::Semi: return "';'";
    case Tok::Dot: return "'.'";
    case Tok::DotDot: return "'..'";
    case Tok::Assign: return "'='";
    case Tok::Eq: return "'=='";
    case Tok::Ne: return "'!='";
    case Tok::Lt: return "'<'";
    case Tok::Le: return "'<='";
    case Tok::Gt: return "'>'";
    case Tok::Ge: return "'>='";
    case Tok::Plus: return "'+'";
    case Tok::Minus: return "'-'";
    case Tok::Star: return "'*'";
    case Tok::Slash: return "'/'";
    case Tok::Percent: return "'%'";
    case Tok::Error: return "invalid token";
  }
  return "token";
}

namespace {

const std::unordered_map<std::string_view, Tok>& keywords() {
  static const std::unordered_map<std::string_view, Tok> k = {
      {"model", Tok::KwModel}, {"fn", Tok::KwFn},         {"dim", Tok::KwDim},       {"param", Tok::KwParam},
      {"input", Tok::KwInput}, {"output", Tok::KwOutput}, {"train", Tok::KwTrain},   {"for", Tok::KwFor},
      {"in", Tok::KwIn},       {"if", Tok::KwIf},         {"else", Tok::KwElse},     {"return", Tok::KwReturn},
      {"import", Tok::KwImport}, {"true", Tok::KwTrue},   {"false", Tok::KwFalse},   {"and", Tok::KwAnd},
      {"or", Tok::KwOr},       {"not", Tok::KwNot}};
  return k;
}

bool isIdentStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool isDigit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  Lexer(const std::string& file, std::string_view text, DiagnosticEngine& diags)
      : file_(file), text_(text), diags_(diags) {}

  std::vector<Token> run() {
    std::vector<Token> out;
    while (true) {
      skipSpaceAndComments();
      Token t;
      t.loc = here();
      if (pos_ >= text_.size()) {
        t.kind = Tok::Eof;
        out.push_back(std::move(t));
        return out;
      }
      char c = text_[pos_];
      if (c == '\n') {
        advance();
        if (depth_ > 0) continue;  // inside () or []: a newline is only space
        t.kind = Tok::Newline;
      } else if (isIdentStart(c)) {
        size_t b = pos_;
        while (pos_ < text_.size() && (isIdentStart(text_[pos_]) || isDigit(text_[pos_]))) advance();
        t.text = std::string(text_.substr(b, pos_ - b));
        auto kw = keywords().find(t.text);
        t.kind = kw == keywords().end() ? Tok::Ident : kw->second;
      } else if (isDigit(c)) {
        lexNumber(t);
      } else if (c == '"') {
        lexString(t);
      } else {
        lexPunct(t);
      }
      out.push_back(std::move(t));
    }
  }

 private:
  Location here() const { return Location{file_, line_, col_}; }
  void advance() {
    if (text_[pos_] == '\n') {
      ++line_;
      col_ = 1;
    } else {
      ++col_;
    }
    ++pos_;
  }
  char peek(size_t k = 0) const { return pos_ + k < text_.size() ? text_[pos_ + k] : '\0'; }

  void skipSpaceAndComments() {
    while (pos_ < text_.size()) {
      char c = text_[pos_];
      if (c == ' ' || c == '\t' || c == '\r') {
        advance();
      } else if (c == '/' && peek(1) == '/') {
        while (pos_ < text_.size() && text_[pos_] != '\n') advance();
      } else if (c == '/' && peek(1) == '*') {
        Location start = here();
        advance();
        advance();
        while (pos_ < text_.size() && !(text_[pos_] == '*' && peek(1) == '/')) advance();
        if (pos_ >= text_.size()) {
          diags_.error(start, "unterminated comment");
          return;
        }
        advance();
        advance();
      } else {
        return;
      }
    }
  }

  void lexNumber(Token& t) {
    size_t b = pos_;
    bool is_float = false;
    while (isDigit(peek()) || peek() == '_') advance();
    // "0..3" is a range, not the float "0."
    if (peek() == '.' && peek(1) != '.') {
      is_float = true;
      advance();
      while (isDigit(peek())) advance();
    }
    if (peek() == 'e' || peek() == 'E') {
      size_t k = 1;
      if (peek(1) == '+' || peek(1) == '-') k = 2;
      if (isDigit(peek(k))) {
        is_float = true;
        for (size_t i = 0; i < k; ++i) advance();
        while (isDigit(peek())) advance();
      }
    }
    std::string spelling;
    for (char c : text_.substr(b, pos_ - b))
      if (c != '_') spelling += c;  // 1_000_000 reads as 1000000
    t.text = spelling;
    errno = 0;
    if (is_float) {
      t.kind = Tok::Float;
      t.float_value = std::strtod(spelling.c_str(), nullptr);
    } else {
      t.kind = Tok::Int;
      t.int_value = std::strtoll(spelling.c_str(), nullptr, 10);
      if (errno == ERANGE) {
        diags_.error(t.loc, fmt::format("integer literal '{}' is too large", spelling));
        t.kind = Tok::Error;
      }
    }
    if (isIdentStart(peek())) {
      diags_.error(here(), fmt::format("unexpected character '{}' after number", peek()));
      while (isIdentStart(peek()) || isDigit(peek())) advance();
      t.kind = Tok::Error;
    }
  }

  void lexString(Token& t) {
    advance();  // opening quote
    t.kind = Tok::String;
    while (true) {
      if (pos_ >= text_.size() || text_[pos_] == '\n') {
        diags_.error(t.loc, "unterminated string");
        t.kind = Tok::Error;
        return;
      }
      char c = text_[pos_];
      advance();
      if (c == '"') return;
      if (c == '\\' && pos_ < text_.size()) {
        char e = text_[pos_];
        advance();
        t.text += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      } else {
        t.text += c;
      }
    }
  }

  void lexPunct(Token& t) {
    char c = text_[pos_];
    char n = peek(1);
    auto two = [&](Tok k) {
      advance();
      advance();
      t.kind = k;
    };
    auto one = [&](Tok k) {
      advance();
      t.kind = k;
    };
    switch (c) {
      case '(': ++depth_; return one(Tok::LParen);
      case ')': if (depth_ > 0) --depth_; return one(Tok::RParen);
      case '[': ++depth_; return one(Tok::LBracket);
      case ']': if (depth_ > 0) --depth_; return one(Tok::RBracket);
      // A brace resets the paren depth so that one unclosed '(' cannot swallow every later
      // newline of the file; the parser reports the '(' itself.
      case '{': depth_ = 0; return one(Tok::LBrace);
      case '}': depth_ = 0; return one(Tok::RBrace);
      case ',': return one(Tok::Comma);
      case ':': return one(Tok::Colon);
      case ';': return one(Tok::Semi);
      case '.': return n == '.' ? two(Tok::DotDot) : one(Tok::Dot);
      case '=': return n == '=' ? two(Tok::Eq) : one(Tok::Assign);
      case '!': if (n == '=') return two(Tok::Ne); break;
      case '<': return n == '=' ? two(Tok::Le) : one(Tok::Lt);
      case '>': return n == '=' ? two(Tok::Ge) : one(Tok::Gt);
      case '+': return one(Tok::Plus);
      case '-': return one(Tok::Minus);
      case '*': return one(Tok::Star);
      case '/': return one(Tok::Slash);
      case '%': return one(Tok::Percent);
      default: break;
    }
    unsigned char uc = static_cast<unsigned char>(c);
    diags_.error(t.loc, uc >= 0x20 && uc < 0x7f ? fmt::format("unexpected character '{}'", c)
                                                : fmt::format("unexpected byte 0x{:02x}", uc));
    advance();
    t.kind = Tok::Error;
  }

  std::string file_;
  std::string_view text_;
  DiagnosticEngine& diags_;
  size_t pos_ = 0;
  int line_ = 1, col_ = 1;
  int depth_ = 0;
};

}  // namespace

std::vector<Token> lex(const std::string& file, std::string_view text, DiagnosticEngine& diags) {
  return Lexer(file, text, diags).run();
}

}  // namespace kiln::frontend
