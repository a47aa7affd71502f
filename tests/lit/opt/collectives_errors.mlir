// Collectives with shapes their group cannot split get located errors.
// RUN: not %kiln opt %s --split-input-file 2>&1 | FileCheck %s

func.func @uneven(%x: !kiln.tensor<6x2xf32>) -> !kiln.tensor<6x2xf32> {
  %y = "kiln.all_to_all"(%x) {ranks = 4} : (!kiln.tensor<6x2xf32>) -> !kiln.tensor<6x2xf32>
  return %y : !kiln.tensor<6x2xf32>
}
// CHECK: collectives_errors.mlir:[[@LINE-3]]:3: error: 'kiln.all_to_all' splits dim 0 of !kiln.tensor<6x2xf32> (6) into 4 equal parts, but 6 does not divide by 4

// -----

func.func @counts(%x: !kiln.tensor<?(64)x2xf32>, %c: !kiln.tensor<3xi64>) -> !kiln.tensor<4xi64> {
  %y:2 = "kiln.all_to_all_v"(%x, %c) {ranks = 4} : (!kiln.tensor<?(64)x2xf32>, !kiln.tensor<3xi64>) -> (!kiln.tensor<?(256)x2xf32>, !kiln.tensor<4xi64>)
  return %y#1 : !kiln.tensor<4xi64>
}
// CHECK: collectives_errors.mlir:[[@LINE-3]]:3: error: 'kiln.all_to_all_v' send counts must be an integer tensor of 4 elements (one per rank), got !kiln.tensor<3xi64>
