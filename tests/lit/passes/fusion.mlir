// RUN: %kiln opt %s --passes=fusion --split-input-file | FileCheck %s

// matmul + bias add + relu: one GEMM-epilogue group; the return reads the group's result.
// CHECK-LABEL: func.func @epilogue
// CHECK:         %[[G:.*]] = "kiln.fused"(%x, %w, %b) ({
// CHECK:           "kiln.matmul"
// CHECK-NEXT:      "kiln.add"
// CHECK-NEXT:      "kiln.relu"
// CHECK-NEXT:      "kiln.yield"
// CHECK:         }) {kind = "gemm_epilogue"}
// CHECK-NEXT:    return %[[G]]
func.func @epilogue(%x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<4x8xf32>, %b: !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32> {
  %0 = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<4x8xf32>) -> !kiln.tensor<Bx4xf32>
  %1 = "kiln.add"(%0, %b) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %2 = "kiln.relu"(%1) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  return %2 : !kiln.tensor<Bx4xf32>
}

// -----

// A pointwise chain of one shape is one group; the reduction of a value also returned is not.
// CHECK-LABEL: func.func @chain
// CHECK:         "kiln.fused"(%x, %y) ({
// CHECK:           "kiln.mul"
// CHECK-NEXT:      "kiln.exp"
// CHECK:         }) {kind = "pointwise"}
// CHECK-NEXT:    "kiln.reduce"
func.func @chain(%x: !kiln.tensor<Bx8xf32>, %y: !kiln.tensor<Bx8xf32>) -> (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bxf32>) {
  %a = "kiln.mul"(%x, %y) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<Bx8xf32>) -> !kiln.tensor<Bx8xf32>
  %e = "kiln.exp"(%a) : (!kiln.tensor<Bx8xf32>) -> !kiln.tensor<Bx8xf32>
  %s = "kiln.reduce"(%e) {axes = [1], kind = "sum"} : (!kiln.tensor<Bx8xf32>) -> !kiln.tensor<Bxf32>
  return %e, %s : !kiln.tensor<Bx8xf32>, !kiln.tensor<Bxf32>
}
