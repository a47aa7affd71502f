// RUN: %kiln opt %s "--passes=remat{budget=70%}" --split-input-file | FileCheck %s

// Under a 70% budget the relu saved for the backward pass (live while %a and %b are) is
// recomputed right before its backward use, and the backward reads the copy.
// CHECK-LABEL: func.func @train_step
// CHECK:         %h = "kiln.relu"(%x)
// CHECK:         %loss = "kiln.reduce"(%h)
// CHECK:         %big = "kiln.add"(%a, %b)
// CHECK:         %h.recompute = "kiln.relu"(%x) {kiln.recompute = true}
// CHECK-NEXT:    %gh = "kiln.mul"(%big, %h.recompute)
module attributes {kiln.symbols = {B = 1024}} {
  func.func @train_step() -> (!kiln.tensor<f32>, !kiln.tensor<Bx64xf32>) {
    %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx64xf32>
    %h = "kiln.relu"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %loss = "kiln.reduce"(%h) {axes = [0, 1], kind = "sum"} : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<f32>
    %a = "kiln.exp"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %b = "kiln.log"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %big = "kiln.add"(%a, %b) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %gh = "kiln.mul"(%big, %h) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    return %loss, %gh : !kiln.tensor<f32>, !kiln.tensor<Bx64xf32>
  }
}

// -----

// %h's operand %y is dead where %h is needed again: its producer is recomputed along (a chain),
// so that neither stays live across %a and %b.
// CHECK-LABEL: func.func @train_step
// CHECK:         %big = "kiln.add"(%a, %b)
// CHECK-NEXT:    %y.recompute = "kiln.exp"(%x) {kiln.recompute = true}
// CHECK-NEXT:    %h.recompute = "kiln.tanh"(%y.recompute) {kiln.recompute = true}
// CHECK-NEXT:    %gh = "kiln.mul"(%big, %h.recompute)
module attributes {kiln.symbols = {B = 1024}} {
  func.func @train_step() -> (!kiln.tensor<f32>, !kiln.tensor<Bx64xf32>) {
    %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx64xf32>
    %y = "kiln.exp"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %h = "kiln.tanh"(%y) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %loss = "kiln.reduce"(%h) {axes = [0, 1], kind = "sum"} : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<f32>
    %a = "kiln.exp"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %b = "kiln.log"(%x) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %big = "kiln.add"(%a, %b) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %gh = "kiln.mul"(%big, %h) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    return %loss, %gh : !kiln.tensor<f32>, !kiln.tensor<Bx64xf32>
  }
}
