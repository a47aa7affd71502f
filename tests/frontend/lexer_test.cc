#include <gtest/gtest.h>

#include "frontend/lexer.h"

namespace kiln::frontend {
namespace {

std::vector<Tok> kinds(const std::string& text, DiagnosticEngine& d) {
  std::vector<Tok> out;
  for (const Token& t : lex("t.kiln", text, d)) out.push_back(t.kind);
  return out;
}

TEST(Lexer, TokensAndRanges) {
  DiagnosticEngine d;
  auto toks = lex("t.kiln", "for i in 0..3 { x = 1.5e-3 * y }", d);
  std::vector<Tok> want = {Tok::KwFor, Tok::Ident, Tok::KwIn, Tok::Int, Tok::DotDot, Tok::Int, Tok::LBrace,
                           Tok::Ident, Tok::Assign, Tok::Float, Tok::Star, Tok::Ident, Tok::RBrace, Tok::Eof};
  ASSERT_EQ(toks.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(toks[i].kind, want[i]) << i;
  EXPECT_EQ(toks[3].int_value, 0);
  EXPECT_EQ(toks[5].int_value, 3);
  EXPECT_DOUBLE_EQ(toks[9].float_value, 0.0015);
  EXPECT_FALSE(d.hasErrors());
}

TEST(Lexer, NewlinesEndStatementsExceptInsideBrackets) {
  DiagnosticEngine d;
  auto k = kinds("a = f(1,\n 2)\nb = [1,\n2]\n", d);
  int newlines = 0;
  for (Tok t : k) newlines += t == Tok::Newline;
  EXPECT_EQ(newlines, 2);
}

TEST(Lexer, CommentsAndUnderscoresInNumbers) {
  DiagnosticEngine d;
  auto toks = lex("t.kiln", "// c\nx /* a\nb */ 1_000_000", d);
  ASSERT_EQ(toks.size(), 4u);  // newline, x, number, eof
  EXPECT_EQ(toks[2].int_value, 1000000);
  EXPECT_EQ(toks[2].loc.line, 3);
  EXPECT_EQ(toks[2].loc.col, 6);
}

TEST(Lexer, ErrorsAreLocatedAndLexingGoesOn) {
  DiagnosticEngine d;
  auto toks = lex("t.kiln", "a $ b\n\"open", d);
  EXPECT_EQ(d.errorCount(), 2);
  EXPECT_EQ(d.diagnostics()[0].loc.col, 3);
  EXPECT_EQ(d.diagnostics()[1].message, "unterminated string");
  EXPECT_EQ(toks[2].kind, Tok::Ident);  // b survives the bad character
}

TEST(Lexer, HugeIntegerIsAnError) {
  DiagnosticEngine d;
  lex("t.kiln", "99999999999999999999", d);
  EXPECT_EQ(d.errorCount(), 1);
}

}  // namespace
}  // namespace kiln::frontend
