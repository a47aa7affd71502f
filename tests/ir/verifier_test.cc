// The verifier: one test per way IR can be wrong, each checking the message and location.
#include "ir/verifier.h"

#include <gtest/gtest.h>

#include "ir/ir.h"
#include "ir/op_def.h"

namespace kiln::ir {
namespace {

TensorType f32(std::vector<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(Dim::fixed(d));
  return TensorType(DType::f32, s);
}

// @f(%x: 4xf32) -> 4xf32 with a body filled by each test.
struct Fn {
  Module m;
  Function* f;
  Value* x;
  Fn() {
    f = &m.addFunction("f");
    f->loc = Location{"t.mlir", 1, 1};
    x = f->entry().addArgument(f32({4}), "x");
    f->setResultTypes({f32({4})});
  }
  Op* add(std::string name, std::vector<Value*> operands, std::vector<TensorType> types, AttrDict attrs = {},
          int line = 0) {
    return f->entry().push_back(
        Op::create(std::move(name), operands, types, std::move(attrs), Location{"t.mlir", line, 3}));
  }
  void ret(Value* v, int line = 9) { add("func.return", {v}, {}, {}, line); }
  Status check() const { return verify(m); }
};

void expectError(const Status& s, std::string_view fragment, int line) {
  ASSERT_FALSE(s.isOk()) << "expected an error containing: " << fragment;
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.str();
  EXPECT_EQ(s.location().line, line) << s.str();
}

TEST(Verifier, AcceptsValidFunction) {
  Fn fn;
  Op* e = fn.add("kiln.exp", {fn.x}, {f32({4})});
  fn.ret(e->result());
  EXPECT_TRUE(fn.check().isOk()) << fn.check().str();
}

TEST(Verifier, UseBeforeDefinitionViolatesDominance) {
  Fn fn;
  Op* a = fn.add("kiln.exp", {fn.x}, {f32({4})}, {}, 2);
  Op* b = fn.add("kiln.neg", {fn.x}, {f32({4})}, {}, 3);
  a->setOperand(0, b->result());  // a now uses b, which comes after it
  fn.ret(b->result());
  expectError(fn.check(), "'kiln.exp' operand #0 does not dominate its use", 2);
  a->setOperand(0, fn.x);  // ops are destroyed back to front: users must come after producers
}

TEST(Verifier, ValueFromAnotherFunctionDoesNotDominate) {
  Fn fn;
  Function& g = fn.m.addFunction("g");
  Value* y = g.entry().addArgument(f32({4}));
  g.setResultTypes({f32({4})});
  g.entry().push_back(Op::create("func.return", {y}, {}));
  fn.ret(y);  // @f returns @g's argument
  expectError(fn.check(), "does not dominate", 9);
}

TEST(Verifier, MissingTerminator) {
  Fn fn;
  fn.add("kiln.exp", {fn.x}, {f32({4})}, {}, 2);
  expectError(fn.check(), "function @f must end with func.return", 1);
}

TEST(Verifier, TerminatorInTheMiddle) {
  Fn fn;
  fn.ret(fn.x, 2);
  fn.add("kiln.exp", {fn.x}, {f32({4})}, {}, 3);
  expectError(fn.check(), "'func.return' must be the last op of its block", 2);
}

TEST(Verifier, ReturnTypeDiffersFromSignature) {
  Fn fn;
  fn.f->setResultTypes({f32({5})});
  fn.ret(fn.x, 4);
  expectError(fn.check(),
              "func.return operand #0 has type !kiln.tensor<4xf32> but @f declares !kiln.tensor<5xf32>", 4);
}

TEST(Verifier, ReturnArityDiffersFromSignature) {
  Fn fn;
  fn.add("func.return", {fn.x, fn.x}, {}, {}, 4);
  expectError(fn.check(), "func.return has 2 operands but @f returns 1 values", 4);
}

TEST(Verifier, WrongResultType) {
  Fn fn;
  Op* e = fn.add("kiln.exp", {fn.x}, {f32({5})}, {}, 2);
  fn.ret(e->result());
  expectError(fn.check(),
              "'kiln.exp' result #0 has type !kiln.tensor<5xf32> but its operands give !kiln.tensor<4xf32>",
              2);
}

TEST(Verifier, UnknownOp) {
  Fn fn;
  Op* e = fn.add("kiln.nonesuch", {fn.x}, {f32({4})}, {}, 2);
  EXPECT_EQ(e->def(), nullptr);
  fn.ret(e->result());
  expectError(fn.check(), "unknown op 'kiln.nonesuch'", 2);
}

TEST(Verifier, MissingRequiredAttribute) {
  Fn fn;
  Op* c = fn.add("kiln.compare", {fn.x, fn.x}, {TensorType(DType::i1, {Dim::fixed(4)})}, {}, 2);
  fn.add("func.return", {fn.x}, {}, {}, 3);
  (void)c;
  expectError(fn.check(), "'kiln.compare' requires attribute 'predicate'", 2);
}

TEST(Verifier, AttributeOfTheWrongKind) {
  Fn fn;
  fn.add("kiln.compare", {fn.x, fn.x}, {TensorType(DType::i1, {Dim::fixed(4)})}, {{"predicate", int64_t{3}}},
         2);
  fn.ret(fn.x);
  expectError(fn.check(), "'kiln.compare' attribute 'predicate' has the wrong kind", 2);
}

TEST(Verifier, AttributeNotAmongItsChoices) {
  Fn fn;
  fn.add("kiln.compare", {fn.x, fn.x}, {TensorType(DType::i1, {Dim::fixed(4)})}, {{"predicate", "lte"}}, 2);
  fn.ret(fn.x);
  expectError(fn.check(),
              "'kiln.compare' attribute 'predicate' is \"lte\"; expected one of: eq, ne, lt, le, gt, ge", 2);
}

TEST(Verifier, WrongOperandCount) {
  Fn fn;
  Op* e = fn.add("kiln.add", {fn.x}, {f32({4})}, {}, 2);
  fn.ret(e->result());
  expectError(fn.check(), "'kiln.add' expects 2 operands, got 1", 2);
}

TEST(Verifier, WrongResultCount) {
  Fn fn;
  Op* e = fn.add("kiln.exp", {fn.x}, {f32({4}), f32({4})}, {}, 2);
  fn.ret(e->result());
  expectError(fn.check(), "'kiln.exp' expects 1 results, got 2", 2);
}

TEST(Verifier, OpRuleViolation) {
  Fn fn;
  // The op's own verify hook: an array constant needs one value per element.
  Op* c = fn.add("kiln.constant", {}, {f32({4})}, {{"value", Attribute::ints({1, 2, 3})}}, 2);
  fn.ret(c->result());
  expectError(fn.check(), "'kiln.constant' has 3 values for type !kiln.tensor<4xf32>", 2);
}

TEST(Verifier, FunctionDefinedTwice) {
  Fn fn;
  fn.ret(fn.x);
  Function& again = fn.m.addFunction("f");
  again.loc = Location{"t.mlir", 20, 1};
  again.entry().push_back(Op::create("func.return", {}, {}));
  expectError(fn.check(), "function @f is defined twice", 20);
}

TEST(Verifier, ErrorsInRegionsAreFound) {
  Fn fn;
  Op* e = fn.add("kiln.exp", {fn.x}, {f32({4})}, {}, 2);
  Block& body = e->addRegion().addBlock();
  body.push_back(Op::create("kiln.neg", {fn.x}, {f32({7})}, {}, Location{"t.mlir", 3, 5}));
  fn.ret(e->result());
  expectError(fn.check(), "'kiln.neg' result #0", 3);
}

}  // namespace
}  // namespace kiln::ir
