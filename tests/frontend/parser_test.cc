#include <gtest/gtest.h>

#include "frontend/parser.h"

namespace kiln::frontend {
namespace {

std::string parseExpr(const std::string& text) {
  DiagnosticEngine d;
  auto e = parseExpression("e", text, d);
  return e ? ast::printExpr(*e) : "ERR: " + d.str();
}

std::string parseAll(const std::string& text, int* errors = nullptr) {
  DiagnosticEngine d;
  auto f = parseFile("t.kiln", text, d);
  if (errors) *errors = d.errorCount();
  return ast::printFile(*f);
}

TEST(Parser, Precedence) {
  EXPECT_EQ(parseExpr("a + b * c"), "(+ a (* b c))");
  EXPECT_EQ(parseExpr("(a + b) * c"), "(* (+ a b) c)");
  EXPECT_EQ(parseExpr("-a * b"), "(* (- a) b)");
  EXPECT_EQ(parseExpr("a - b - c"), "(- (- a b) c)");
  EXPECT_EQ(parseExpr("0..n + 1"), "(range 0 (+ n 1))");
  EXPECT_EQ(parseExpr("a < b and not c or d"), "(or (and (< a b) (not c)) d)");
}

TEST(Parser, CallsWithNamedArguments) {
  EXPECT_EQ(parseExpr("mlp(x, [512, 256], last = identity)"), "(call mlp x (list 512 256) last=identity)");
  EXPECT_EQ(parseExpr("embeddings(rows = r, dim = 128)"), "(call embeddings rows=r dim=128)");
  EXPECT_NE(parseExpr("f(a = 1, b)").find("positional argument cannot follow"), std::string::npos);
}

TEST(Parser, Subscripts) {
  EXPECT_EQ(parseExpr("x[:, 0:13]"), "(index x (slice _ _) (slice 0 13))");
  EXPECT_EQ(parseExpr("rows[3]"), "(index rows 3)");
  EXPECT_EQ(parseExpr("t(c)[2:]"), "(index (call t c) (slice 2 _))");
}

TEST(Parser, Literals) {
  EXPECT_EQ(parseExpr("[1, 2.5, \"s\", true]"), "(list 1 2.5 \"s\" true)");
  EXPECT_EQ(parseExpr("[]"), "(list)");
}

TEST(Parser, ModelStatements) {
  std::string ast = parseAll(
      "import \"lib.kiln\"\n"
      "fn f(x, n = 2) { return x }\n"
      "model m {\n"
      "  dim B, T\n"
      "  param n = 3\n"
      "  input c: ids[B, 26] hotness(h) weighted\n"
      "  for i in 0..n { x = f(x) }\n"
      "  if n > 2 { y = x } else { y = z }\n"
      "  output x, y\n"
      "  train { loss = l; metrics = [auc] }\n"
      "}\n");
  EXPECT_EQ(ast,
            "(import \"lib.kiln\")\n"
            "(fn f (x n=2)\n  (return x)\n)\n"
            "(model m\n"
            "  (dim B T)\n"
            "  (param n 3)\n"
            "  (input c (type ids B 26) (hotness h) (weighted))\n"
            "  (for i (range 0 n)\n    (assign x (call f x))\n  )\n"
            "  (if (> n 2)\n    (assign y x)\n   else\n    (assign y z)\n  )\n"
            "  (output x y)\n"
            "  (train\n    (assign loss l)\n    (assign metrics (list auc))\n  )\n"
            ")\n");
}

TEST(Parser, RecoversAndReportsSeveralErrors) {
  int errors = 0;
  std::string ast = parseAll("model m {\n  a = 1 +\n  b = * 2\n  c = 3\n}\n", &errors);
  EXPECT_EQ(errors, 2);
  // The statement after the broken ones still parses; broken assignments keep a poison value.
  EXPECT_NE(ast.find("(assign c 3)"), std::string::npos);
}

TEST(Parser, DeepNestingIsAnErrorNotACrash) {
  int errors = 0;
  parseAll("model m { x = " + std::string(100000, '(') + " }", &errors);
  EXPECT_GE(errors, 1);
}

TEST(Parser, UnpackingAssignments) {
  int errors = 0;
  std::string ast = parseAll("model m {\n vals, idx = topk(x, 2)\n a, b, c = l\n}\n", &errors);
  EXPECT_EQ(errors, 0) << ast;
  EXPECT_NE(ast.find("(assign vals,idx (call topk x 2))"), std::string::npos) << ast;
  EXPECT_NE(ast.find("(assign a,b,c l)"), std::string::npos) << ast;
  // A list of names that is not followed by '=' is no assignment.
  parseAll("model m {\n a, b\n}\n", &errors);
  EXPECT_EQ(errors, 1);
}

}  // namespace
}  // namespace kiln::frontend
