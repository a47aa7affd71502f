// RUN: %kiln opt %s --passes=cse --split-input-file | FileCheck %s

// Equal pure ops merge; the later one's uses go to the first.
// CHECK-LABEL: func.func @merge
// CHECK-NEXT:    %a = "kiln.relu"(%x)
// CHECK-NEXT:    %s = "kiln.add"(%a, %a)
// CHECK-NEXT:    return %s
func.func @merge(%x: !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32> {
  %a = "kiln.relu"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %b = "kiln.relu"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %s = "kiln.add"(%a, %b) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  return %s : !kiln.tensor<Bx4xf32>
}

// -----

// Commutative ops match with their operands swapped; others do not.
// CHECK-LABEL: func.func @commutative
// CHECK-NEXT:    %m1 = "kiln.mul"(%x, %y)
// CHECK-NEXT:    %d1 = "kiln.sub"(%x, %y)
// CHECK-NEXT:    %d2 = "kiln.sub"(%y, %x)
// CHECK-NEXT:    return %m1, %m1, %d1, %d2 :
func.func @commutative(%x: !kiln.tensor<4xf32>, %y: !kiln.tensor<4xf32>) -> (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>, !kiln.tensor<4xf32>, !kiln.tensor<4xf32>) {
  %m1 = "kiln.mul"(%x, %y) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %m2 = "kiln.mul"(%y, %x) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %d1 = "kiln.sub"(%x, %y) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %d2 = "kiln.sub"(%y, %x) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  return %m1, %m2, %d1, %d2 : !kiln.tensor<4xf32>, !kiln.tensor<4xf32>, !kiln.tensor<4xf32>, !kiln.tensor<4xf32>
}

// -----

// Different attributes or result types keep ops apart; sources (inputs, parameters) are not
// pure and never merge, even when equal.
// CHECK-LABEL: func.func @distinct
// CHECK-NEXT:    %p = "kiln.parameter"()
// CHECK-NEXT:    %q = "kiln.parameter"()
// CHECK-NEXT:    %a = "kiln.matmul"(%x, %p) {transpose_a = false, transpose_b = false}
// CHECK-NEXT:    %b = "kiln.matmul"(%x, %p) {transpose_a = false, transpose_b = true}
// CHECK-NEXT:    %r1 = "kiln.reshape"(%x) : (!kiln.tensor<4x4xf32>) -> !kiln.tensor<16xf32>
// CHECK-NEXT:    %r2 = "kiln.reshape"(%x) : (!kiln.tensor<4x4xf32>) -> !kiln.tensor<2x8xf32>
func.func @distinct(%x: !kiln.tensor<4x4xf32>) -> (!kiln.tensor<4x4xf32>, !kiln.tensor<4x4xf32>, !kiln.tensor<16xf32>, !kiln.tensor<2x8xf32>, !kiln.tensor<4x4xf32>) {
  %p = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<4x4xf32>
  %q = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<4x4xf32>
  %a = "kiln.matmul"(%x, %p) {transpose_a = false, transpose_b = false} : (!kiln.tensor<4x4xf32>, !kiln.tensor<4x4xf32>) -> !kiln.tensor<4x4xf32>
  %b = "kiln.matmul"(%x, %p) {transpose_a = false, transpose_b = true} : (!kiln.tensor<4x4xf32>, !kiln.tensor<4x4xf32>) -> !kiln.tensor<4x4xf32>
  %r1 = "kiln.reshape"(%x) : (!kiln.tensor<4x4xf32>) -> !kiln.tensor<16xf32>
  %r2 = "kiln.reshape"(%x) : (!kiln.tensor<4x4xf32>) -> !kiln.tensor<2x8xf32>
  return %a, %b, %r1, %r2, %q : !kiln.tensor<4x4xf32>, !kiln.tensor<4x4xf32>, !kiln.tensor<16xf32>, !kiln.tensor<2x8xf32>, !kiln.tensor<4x4xf32>
}

// -----

// Merging cascades: once the relus merge, the two adds that used them are equal too.
// CHECK-LABEL: func.func @cascade
// CHECK-COUNT-1: "kiln.relu"
// CHECK-COUNT-1: "kiln.add"
// CHECK-NOT:     "kiln.
// CHECK:         return %s, %s
func.func @cascade(%x: !kiln.tensor<4xf32>) -> (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) {
  %a = "kiln.relu"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %b = "kiln.relu"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %s = "kiln.add"(%a, %x) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %t = "kiln.add"(%b, %x) : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  return %s, %t : !kiln.tensor<4xf32>, !kiln.tensor<4xf32>
}
