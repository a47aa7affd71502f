// The collectives read, verify and print through `kiln opt`: a data-parallel gradient sum, the
// row-wise pair (reduce_scatter of pooled partial sums, all_gather back), the equal all_to_all
// of table-wise pooled vectors and the variable all_to_all of ids bucketed by owner.
// RUN: %kiln opt %s | FileCheck %s
// RUN: %kiln opt %s | %kiln opt - | FileCheck %s

func.func @step(%g: !kiln.tensor<Bx16xf32>, %ids: !kiln.tensor<?(4096)xi64>, %counts: !kiln.tensor<4xi64>, %pooled: !kiln.tensor<4*Bx8xf32>) -> (!kiln.tensor<Bx16xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4xi64>) {
  %sum = "kiln.all_reduce"(%g) {ranks = 4} : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %part = "kiln.reduce_scatter"(%sum) {ranks = 4, axis = 1} : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx4xf32>
  %whole = "kiln.all_gather"(%part) {ranks = 4, axis = 1} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx16xf32>
  %swapped = "kiln.all_to_all"(%pooled) {ranks = 4} : (!kiln.tensor<4*Bx8xf32>) -> !kiln.tensor<4*Bx8xf32>
  %owned:2 = "kiln.all_to_all_v"(%ids, %counts) {ranks = 4} : (!kiln.tensor<?(4096)xi64>, !kiln.tensor<4xi64>) -> (!kiln.tensor<?(16384)xi64>, !kiln.tensor<4xi64>)
  return %whole, %swapped, %owned#1 : !kiln.tensor<Bx16xf32>, !kiln.tensor<4*Bx8xf32>, !kiln.tensor<4xi64>
}

// CHECK-LABEL: func.func @step
// CHECK: "kiln.all_reduce"(%g) {ranks = 4} : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
// CHECK: "kiln.reduce_scatter"({{.*}}) {axis = 1, ranks = 4} : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx4xf32>
// CHECK: "kiln.all_gather"({{.*}}) {axis = 1, ranks = 4} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx16xf32>
// CHECK: "kiln.all_to_all"(%pooled) {ranks = 4} : (!kiln.tensor<4*Bx8xf32>) -> !kiln.tensor<4*Bx8xf32>
// CHECK: :2 = "kiln.all_to_all_v"(%ids, %counts) {ranks = 4} : (!kiln.tensor<?(4096)xi64>, !kiln.tensor<4xi64>) -> (!kiln.tensor<?(16384)xi64>, !kiln.tensor<4xi64>)
