// RUN: %kiln opt %s --passes=shape-inference | FileCheck %s

// Parsed IR is already consistent (the parser checks every op against the op table), so here
// shape inference changes nothing. Its real work, after an input's type is edited in memory,
// is tested in tests/passes/pass_test.cc.
// CHECK-LABEL: func.func @forward
// CHECK-NEXT:    %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx13xf32>
// CHECK-NEXT:    %w = "kiln.parameter"() {init = "zeros", name = "w"} : () -> !kiln.tensor<4x13xf32>
// CHECK-NEXT:    %y = "kiln.matmul"(%x, %w) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx13xf32>, !kiln.tensor<4x13xf32>) -> !kiln.tensor<Bx4xf32>
// CHECK-NEXT:    return %y : !kiln.tensor<Bx4xf32>
func.func @forward() -> !kiln.tensor<Bx4xf32> {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx13xf32>
  %w = "kiln.parameter"() {init = "zeros", name = "w"} : () -> !kiln.tensor<4x13xf32>
  %y = "kiln.matmul"(%x, %w) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx13xf32>, !kiln.tensor<4x13xf32>) -> !kiln.tensor<Bx4xf32>
  return %y : !kiln.tensor<Bx4xf32>
}
