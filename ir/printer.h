// The IR's text form, in MLIR syntax: `module {}` around `func.func` functions in their custom
// form, `return` for func.return, and every other op in MLIR's generic form, e.g.
//   %y = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx13xf32>, !kiln.tensor<512x13xf32>) ->
//   !kiln.tensor<Bx512xf32>
// The parser (ir/parser.h) reads exactly this back; print(parse(print(m))) == print(m).
#pragma once

#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "ir/ir.h"

namespace kiln::ir {

std::string printModule(const Module& m);
void printModule(const Module& m, std::ostream& os);

// A function on its own (no `module {}` around it), at column 0.
std::string printFunction(const Function& f);
void printFunction(const Function& f, std::ostream& os);

// One op (with its regions), values named as the whole enclosing function would name them, so
// that the line matches what printModule shows. A detached op is named on its own.
std::string printOp(const Op& op);

// The name the printer gives values: a value's nameHint() when it is a valid MLIR identifier
// (else sanitized), unique within the function (`%x`, `%x_1`); unnamed values are numbered.
// Exposed so that other dumps (Graphviz, diagnostics) use the same names.
class ValueNamer {
 public:
  explicit ValueNamer(const Function& f);
  explicit ValueNamer(const Op& detached_op);
  // "%x", or "%r#1" for the second result of a multi-result op named %r; "<<unknown>>" for a
  // value defined outside what was named.
  std::string name(const Value* v) const;
  // The name of an op's result group without `#i` (e.g. "%r"), or "" when the op has no results.
  std::string groupName(const Op& op) const;

 private:
  void nameBlock(const Block& b);
  void nameOp(const Op& op);
  std::string take(const std::string& hint);

  struct Entry {
    std::string group;  // "%r"
    int index = -1;     // -1: the group has one value
  };
  std::unordered_map<const Value*, Entry> names_;
  std::unordered_set<std::string> used_;
  int next_number_ = 0;
};

// Turns a name hint into an MLIR suffix-id ([A-Za-z_$.-][A-Za-z0-9_$.-]*), or "" when it is
// empty or only digits (those are reserved for numbered values).
std::string sanitizeValueName(std::string_view hint);

}  // namespace kiln::ir
