// RUN: %kiln opt %s --split-input-file --passes=schedule | FileCheck %s

// Two independent chains, one feeding an all_reduce: the other chain runs between the
// all_reduce (on the comm stream) and its consumer while the transfer is in flight. The
// reduction of %big first sets the block's peak, so holding the transfer's buffers longer stays
// within it.
// CHECK-LABEL: func.func @two_chains
// CHECK:         "kiln.tanh"(%x)
// CHECK-NEXT:    "kiln.all_reduce"{{.*}}kiln.stream = 2
// CHECK-NEXT:    "kiln.sigmoid"(%w)
// CHECK-NEXT:    "kiln.exp"
// CHECK-NEXT:    "kiln.neg"
// CHECK-NEXT:    "kiln.add"
module {
  func.func @two_chains(%x: !kiln.tensor<256x256xf32>, %w: !kiln.tensor<256x256xf32>, %big: !kiln.tensor<1024x256xf32>) -> (!kiln.tensor<256x256xf32>, !kiln.tensor<256xf32>) {
    %t = "kiln.exp"(%big) : (!kiln.tensor<1024x256xf32>) -> !kiln.tensor<1024x256xf32>
    %s = "kiln.reduce"(%t) {axes = [0], keepdims = false, kind = "sum"} : (!kiln.tensor<1024x256xf32>) -> !kiln.tensor<256xf32>
    %a = "kiln.tanh"(%x) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %r = "kiln.all_reduce"(%a) {ranks = 2} : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %c = "kiln.neg"(%r) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %b = "kiln.sigmoid"(%w) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %e = "kiln.exp"(%b) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %out = "kiln.add"(%c, %e) : (!kiln.tensor<256x256xf32>, !kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    return %out, %s : !kiln.tensor<256x256xf32>, !kiln.tensor<256xf32>
  }
}

// -----

// A collective whose operand comes late in the block is hoisted to right after that operand's
// producer, ahead of compute that does not feed it.
// CHECK-LABEL: func.func @hoist
// CHECK:         "kiln.tanh"(%x)
// CHECK-NEXT:    "kiln.all_reduce"{{.*}}kiln.stream = 2
// CHECK-NEXT:    "kiln.sigmoid"(%w)
// CHECK-NEXT:    "kiln.neg"
// CHECK-NEXT:    "kiln.add"
module {
  func.func @hoist(%x: !kiln.tensor<256x256xf32>, %w: !kiln.tensor<256x256xf32>) -> (!kiln.tensor<256x256xf32>) {
    %a = "kiln.tanh"(%x) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %b = "kiln.sigmoid"(%w) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %e = "kiln.neg"(%b) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %r = "kiln.all_reduce"(%a) {ranks = 2} : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %out = "kiln.add"(%r, %e) : (!kiln.tensor<256x256xf32>, !kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    return %out : !kiln.tensor<256x256xf32>
  }
}

// -----

// The same chains without anything that sets a higher peak: holding the all_reduce's buffers
// while the other chain runs would raise the peak, so the order stays.
// CHECK-LABEL: func.func @over_budget
// CHECK:         "kiln.tanh"(%x)
// CHECK-NEXT:    "kiln.all_reduce"{{.*}}kiln.stream = 2
// CHECK-NEXT:    "kiln.neg"
// CHECK-NEXT:    "kiln.sigmoid"(%w)
// CHECK-NEXT:    "kiln.exp"
// CHECK-NEXT:    "kiln.add"
module {
  func.func @over_budget(%x: !kiln.tensor<256x256xf32>, %w: !kiln.tensor<256x256xf32>) -> (!kiln.tensor<256x256xf32>) {
    %a = "kiln.tanh"(%x) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %r = "kiln.all_reduce"(%a) {ranks = 2} : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %c = "kiln.neg"(%r) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %b = "kiln.sigmoid"(%w) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %e = "kiln.exp"(%b) : (!kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    %out = "kiln.add"(%c, %e) : (!kiln.tensor<256x256xf32>, !kiln.tensor<256x256xf32>) -> !kiln.tensor<256x256xf32>
    return %out : !kiln.tensor<256x256xf32>
  }
}
