// The lexer of the Kiln model language. Newlines end statements, except inside parentheses
// and brackets, so a long call may span lines; `;` also ends a statement. Comments are `//` to
// the end of the line and `/* ... */`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/diagnostics.h"

namespace kiln::frontend {

enum class Tok {
  Eof, Newline, Ident, Int, Float, String,
  // keywords
  KwModel, KwFn, KwDim, KwParam, KwInput, KwOutput, KwTrain, KwFor, KwIn, KwIf, KwElse,
  KwReturn, KwImport, KwTrue, KwFalse, KwAnd, KwOr, KwNot,
  // punctuation
  LParen, RParen, LBracket, RBracket, LBrace, RBrace, Comma, Colon, Semi, Dot, DotDot,
  Assign, Eq, Ne, Lt, Le, Gt, Ge, Plus, Minus, Star, Slash, Percent,
  Error,
};

const char* tokName(Tok t);

struct Token {
  Tok kind = Tok::Eof;
  std::string text;  // identifier, literal spelling, or the decoded string
  Location loc;
  int64_t int_value = 0;
  double float_value = 0;
};

// Lexes a whole file; errors (a stray character, an unterminated string) are reported to diags
// and the lexer carries on, so the parser still sees the rest of the file.
std::vector<Token> lex(const std::string& file, std::string_view text, DiagnosticEngine& diags);

}  // namespace kiln::frontend
