// Helpers for the op tests: tensors from literal values, and a harness that wraps one op in a
// function and runs it through the reference interpreter.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "ir/interpreter.h"
#include "ir/ir.h"
#include "ir/op_def.h"
#include "ir/tensor_view.h"
#include "ir/verifier.h"

namespace kiln::ir::testing {

// A host tensor of the given type filled with `values` (converted to the element type).
HostTensor tensor(DType t, std::vector<int64_t> shape, const std::vector<double>& values);
inline HostTensor f32(std::vector<int64_t> shape, const std::vector<double>& v) {
  return tensor(DType::f32, std::move(shape), v);
}
inline HostTensor f64(std::vector<int64_t> shape, const std::vector<double>& v) {
  return tensor(DType::f64, std::move(shape), v);
}
inline HostTensor i64(std::vector<int64_t> shape, const std::vector<double>& v) {
  return tensor(DType::i64, std::move(shape), v);
}
inline HostTensor i32(std::vector<int64_t> shape, const std::vector<double>& v) {
  return tensor(DType::i32, std::move(shape), v);
}

// Every element as a double.
std::vector<double> values(const HostTensor& t);

// The static type of a host tensor.
TensorType typeOf(const HostTensor& t);

struct OpCall {
  std::string name;
  std::vector<HostTensor> operands;
  AttrDict attrs;
  // Operand types when they should differ from the tensors' static types (symbolic, bounded).
  std::vector<TensorType> operand_types;
  // Result types for ops whose results are stated (kTypeGiven).
  std::vector<TensorType> result_types;
  SymbolBindings symbols;
};

// Builds `@f` = one op over inputs "x0", "x1", ..., returning its results, and runs it.
Expected<std::vector<HostTensor>> run(const OpCall& call);
// Same, for a single result; fails the test on error.
HostTensor runOk(const OpCall& call);

// Expects a tensor's shape and values (within tol, absolute plus relative).
void expectTensor(const HostTensor& t, const std::vector<int64_t>& shape, const std::vector<double>& want,
                  double tol = 1e-6);

}  // namespace kiln::ir::testing
