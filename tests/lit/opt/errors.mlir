// A damaged IR file gets a located error, the line and a caret, and exit code 1.
// RUN: not %kiln opt %s --split-input-file 2>&1 | FileCheck %s
// RUN: %kiln opt %s --split-input-file >/dev/null 2>&1; test $? -eq 1

func.func @undefined(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  %y = "kiln.add"(%x, %nope) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  return %y : !kiln.tensor<4xf32>
}
// CHECK:      errors.mlir:[[@LINE-3]]:23: error: use of undefined value '%nope'
// CHECK-NEXT:   %y = "kiln.add"(%x, %nope) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
// CHECK-NEXT: {{^                      \^$}}

// -----

func.func @wrong_result(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<5xf32> {
  %y = "kiln.exp"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<5xf32>
  return %y : !kiln.tensor<5xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:3: error: 'kiln.exp' result #0 has type !kiln.tensor<5xf32> but its operands give !kiln.tensor<4xf32>

// -----

func.func @operand_type(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  %y = "kiln.exp"(%x) : (!kiln.tensor<8xf32>) -> !kiln.tensor<4xf32>
  return %y : !kiln.tensor<4xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:19: error: '%x' has type !kiln.tensor<4xf32> but is used as !kiln.tensor<8xf32>

// -----

func.func @unknown_op(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  %y = "kiln.frobnicate"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  return %y : !kiln.tensor<4xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:8: error: unknown op 'kiln.frobnicate'

// -----

func.func @bad_type(%x: !kiln.tensor<4xf31>) -> !kiln.tensor<4xf32> {
  return %x : !kiln.tensor<4xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:25: error: bad type '!kiln.tensor<4xf31>': unknown element type 'f31'

// -----

func.func @missing_attr() -> !kiln.tensor<4xf32> {
  %p = "kiln.parameter"() : () -> !kiln.tensor<4xf32>
  return %p : !kiln.tensor<4xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:3: error: 'kiln.parameter' requires attribute 'name'

// -----

func.func @no_return(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  %y = "kiln.exp"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
}
// CHECK: errors.mlir:[[@LINE-3]]:1: error: function @no_return must end with func.return

// -----

func.func @unclosed(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  return %x : !kiln.tensor<4xf32>
// CHECK: errors.mlir:[[@LINE-2]]:69: error: unbalanced braces: the '{' of this function is never closed

