// RUN: %kiln opt %s --passes=canonicalize --split-input-file | FileCheck %s

// Splat constants fold, broadcasting to the result type; the folded constants go away.
// CHECK-LABEL: func.func @fold_add_broadcast
// CHECK-NEXT:    %c = "kiln.constant"() {value = 5.0} : () -> !kiln.tensor<4xf32>
// CHECK-NEXT:    return %c : !kiln.tensor<4xf32>
func.func @fold_add_broadcast() -> !kiln.tensor<4xf32> {
  %a = "kiln.constant"() {value = 2.0} : () -> !kiln.tensor<4xf32>
  %b = "kiln.constant"() {value = 3.0} : () -> !kiln.tensor<f32>
  %c = "kiln.add"(%a, %b) : (!kiln.tensor<4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<4xf32>
  return %c : !kiln.tensor<4xf32>
}

// -----

// A chain folds to one constant: neg(sqrt(4)) * 1.5 = -3.
// CHECK-LABEL: func.func @fold_chain
// CHECK-NEXT:    %{{.*}} = "kiln.constant"() {value = -3.0} : () -> !kiln.tensor<2x2xf32>
// CHECK-NEXT:    return
func.func @fold_chain() -> !kiln.tensor<2x2xf32> {
  %four = "kiln.constant"() {value = 4.0} : () -> !kiln.tensor<2x2xf32>
  %s = "kiln.sqrt"(%four) : (!kiln.tensor<2x2xf32>) -> !kiln.tensor<2x2xf32>
  %n = "kiln.neg"(%s) : (!kiln.tensor<2x2xf32>) -> !kiln.tensor<2x2xf32>
  %k = "kiln.constant"() {value = 1.5} : () -> !kiln.tensor<f32>
  %r = "kiln.mul"(%n, %k) : (!kiln.tensor<2x2xf32>, !kiln.tensor<f32>) -> !kiln.tensor<2x2xf32>
  return %r : !kiln.tensor<2x2xf32>
}

// -----

// Folding rounds to the element type: exp(1) in f32 is 2.71828174591064453125.
// CHECK-LABEL: func.func @fold_rounds_to_f32
// CHECK-NEXT:    "kiln.constant"() {value = 2.7182817459106445} : () -> !kiln.tensor<f32>
func.func @fold_rounds_to_f32() -> !kiln.tensor<f32> {
  %one = "kiln.constant"() {value = 1.0} : () -> !kiln.tensor<f32>
  %e = "kiln.exp"(%one) : (!kiln.tensor<f32>) -> !kiln.tensor<f32>
  return %e : !kiln.tensor<f32>
}

// -----

// Integer arithmetic folds to an integer; a comparison folds to an i1 0 or 1.
// CHECK-LABEL: func.func @fold_integers
// CHECK-NEXT:    %p = "kiln.constant"() {value = 42} : () -> !kiln.tensor<8xi32>
// CHECK-NEXT:    %gt = "kiln.constant"() {value = 1} : () -> !kiln.tensor<8xi1>
// CHECK-NEXT:    return %p, %gt
func.func @fold_integers() -> (!kiln.tensor<8xi32>, !kiln.tensor<8xi1>) {
  %a = "kiln.constant"() {value = 6} : () -> !kiln.tensor<8xi32>
  %b = "kiln.constant"() {value = 7} : () -> !kiln.tensor<i32>
  %p = "kiln.mul"(%a, %b) : (!kiln.tensor<8xi32>, !kiln.tensor<i32>) -> !kiln.tensor<8xi32>
  %gt = "kiln.compare"(%a, %b) {predicate = "lt"} : (!kiln.tensor<8xi32>, !kiln.tensor<i32>) -> !kiln.tensor<8xi1>
  return %p, %gt : !kiln.tensor<8xi32>, !kiln.tensor<8xi1>
}

// -----

// f16 rounding is not modeled, so f16 arithmetic is left for the backends.
// CHECK-LABEL: func.func @no_fold_f16
// CHECK:         "kiln.add"
func.func @no_fold_f16() -> !kiln.tensor<f16> {
  %a = "kiln.constant"() {value = 0.1} : () -> !kiln.tensor<f16>
  %b = "kiln.add"(%a, %a) : (!kiln.tensor<f16>, !kiln.tensor<f16>) -> !kiln.tensor<f16>
  return %b : !kiln.tensor<f16>
}

// -----

// x*1, 1*x, x+0, 0+x, x-0, x/1 all return x itself.
// CHECK-LABEL: func.func @identities
// CHECK-SAME:    (%x: !kiln.tensor<Bx4xf32>)
// CHECK-NOT:     kiln.mul
// CHECK-NOT:     kiln.add
// CHECK-NOT:     kiln.sub
// CHECK-NOT:     kiln.div
// CHECK:         return %x, %x, %x, %x, %x, %x :
func.func @identities(%x: !kiln.tensor<Bx4xf32>) -> (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) {
  %one = "kiln.constant"() {value = 1.0} : () -> !kiln.tensor<f32>
  %zero = "kiln.constant"() {value = 0.0} : () -> !kiln.tensor<4xf32>
  %0 = "kiln.mul"(%x, %one) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<Bx4xf32>
  %1 = "kiln.mul"(%one, %x) : (!kiln.tensor<f32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %2 = "kiln.add"(%x, %zero) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %3 = "kiln.add"(%zero, %x) : (!kiln.tensor<4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %4 = "kiln.sub"(%x, %zero) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %5 = "kiln.div"(%x, %one) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<Bx4xf32>
  return %0, %1, %2, %3, %4, %5 : !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>
}

// -----

// An identity that broadcasts x is not an identity: x*1 with a [4] one makes Bx1 into Bx4.
// 0 - x is not x either.
// CHECK-LABEL: func.func @not_identities
// CHECK:         %y = "kiln.mul"(%x, %one)
// CHECK:         %z = "kiln.sub"(%zero, %x)
// CHECK:         return %y, %z
func.func @not_identities(%x: !kiln.tensor<Bx1xf32>) -> (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx1xf32>) {
  %one = "kiln.constant"() {value = 1.0} : () -> !kiln.tensor<4xf32>
  %zero = "kiln.constant"() {value = 0.0} : () -> !kiln.tensor<f32>
  %y = "kiln.mul"(%x, %one) : (!kiln.tensor<Bx1xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %z = "kiln.sub"(%zero, %x) : (!kiln.tensor<f32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx1xf32>
  return %y, %z : !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx1xf32>
}

// -----

// CHECK-LABEL: func.func @neg_neg
// CHECK-NEXT:    return %x : !kiln.tensor<Bxf32>
func.func @neg_neg(%x: !kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32> {
  %a = "kiln.neg"(%x) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  %b = "kiln.neg"(%a) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  return %b : !kiln.tensor<Bxf32>
}

// -----

// A reshape to the same type goes; a reshape of a reshape reads the source; reshaping back
// to the source type goes entirely.
// CHECK-LABEL: func.func @reshapes
// CHECK-NEXT:    %b = "kiln.reshape"(%x) : (!kiln.tensor<Bx2x3xf32>) -> !kiln.tensor<6xBxf32>
// CHECK-NEXT:    return %x, %b, %x :
func.func @reshapes(%x: !kiln.tensor<Bx2x3xf32>) -> (!kiln.tensor<Bx2x3xf32>, !kiln.tensor<6xBxf32>, !kiln.tensor<Bx2x3xf32>) {
  %same = "kiln.reshape"(%x) : (!kiln.tensor<Bx2x3xf32>) -> !kiln.tensor<Bx2x3xf32>
  %a = "kiln.reshape"(%x) : (!kiln.tensor<Bx2x3xf32>) -> !kiln.tensor<Bx6xf32>
  %b = "kiln.reshape"(%a) : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<6xBxf32>
  %back = "kiln.reshape"(%a) : (!kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx2x3xf32>
  return %same, %b, %back : !kiln.tensor<Bx2x3xf32>, !kiln.tensor<6xBxf32>, !kiln.tensor<Bx2x3xf32>
}

// -----

// transpose(transpose(x, [1, 2, 0]), [1, 2, 0]) == transpose(x, [2, 0, 1]); three of them
// cancel; an identity perm goes.
// CHECK-LABEL: func.func @transposes
// CHECK-NEXT:    %t2 = "kiln.transpose"(%x) {perm = [2, 0, 1]} : (!kiln.tensor<2x3x4xf32>) -> !kiln.tensor<4x2x3xf32>
// CHECK-NEXT:    return %t2, %x, %x :
func.func @transposes(%x: !kiln.tensor<2x3x4xf32>) -> (!kiln.tensor<4x2x3xf32>, !kiln.tensor<2x3x4xf32>, !kiln.tensor<2x3x4xf32>) {
  %t1 = "kiln.transpose"(%x) {perm = [1, 2, 0]} : (!kiln.tensor<2x3x4xf32>) -> !kiln.tensor<3x4x2xf32>
  %t2 = "kiln.transpose"(%t1) {perm = [1, 2, 0]} : (!kiln.tensor<3x4x2xf32>) -> !kiln.tensor<4x2x3xf32>
  %t3 = "kiln.transpose"(%t2) {perm = [1, 2, 0]} : (!kiln.tensor<4x2x3xf32>) -> !kiln.tensor<2x3x4xf32>
  %id = "kiln.transpose"(%x) {perm = [0, 1, 2]} : (!kiln.tensor<2x3x4xf32>) -> !kiln.tensor<2x3x4xf32>
  return %t2, %t3, %id : !kiln.tensor<4x2x3xf32>, !kiln.tensor<2x3x4xf32>, !kiln.tensor<2x3x4xf32>
}

// -----

// A cast to the same type goes; a cast of a splat constant folds, rounding to bf16
// (0.1 in bf16 is 0.10009765625); float to integer casts are left to the backends.
// CHECK-LABEL: func.func @casts
// CHECK-NEXT:    %c = "kiln.constant"() {value = 0.1} : () -> !kiln.tensor<4xf32>
// CHECK-NEXT:    %h = "kiln.constant"() {value = 0.10009765625} : () -> !kiln.tensor<4xbf16>
// CHECK-NEXT:    %i = "kiln.cast"(%c) {to = "i32"}
// CHECK-NEXT:    return %x, %h, %i :
func.func @casts(%x: !kiln.tensor<Bxf32>) -> (!kiln.tensor<Bxf32>, !kiln.tensor<4xbf16>, !kiln.tensor<4xi32>) {
  %same = "kiln.cast"(%x) {to = "f32"} : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  %c = "kiln.constant"() {value = 0.1} : () -> !kiln.tensor<4xf32>
  %h = "kiln.cast"(%c) {to = "bf16"} : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xbf16>
  %i = "kiln.cast"(%c) {to = "i32"} : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xi32>
  return %same, %h, %i : !kiln.tensor<Bxf32>, !kiln.tensor<4xbf16>, !kiln.tensor<4xi32>
}

// -----

// The gradient of a value split in three by slices (attention's q, k, v; SwiGLU's two halves)
// arrives as a sum of zero pads that tile it: one concat, written once.
// CHECK-LABEL: func.func @pads_tiling_to_concat
// CHECK-NEXT:    %s = "kiln.concat"(%a, %b, %c) {axis = 1} : (!kiln.tensor<Bx2xf32>, !kiln.tensor<Bx3xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx6xf32>
// CHECK-NEXT:    return %s
func.func @pads_tiling_to_concat(%a: !kiln.tensor<Bx2xf32>, %b: !kiln.tensor<Bx3xf32>, %c: !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx6xf32> {
  %pb = "kiln.pad"(%b) {axis = 1, low = 2, high = 1} : (!kiln.tensor<Bx3xf32>) -> !kiln.tensor<Bx6xf32>
  %pa = "kiln.pad"(%a) {axis = 1, low = 0, high = 4} : (!kiln.tensor<Bx2xf32>) -> !kiln.tensor<Bx6xf32>
  %pc = "kiln.pad"(%c) {axis = 1, low = 5, high = 0} : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx6xf32>
  %t = "kiln.add"(%pb, %pa) : (!kiln.tensor<Bx6xf32>, !kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx6xf32>
  %s = "kiln.add"(%t, %pc) : (!kiln.tensor<Bx6xf32>, !kiln.tensor<Bx6xf32>) -> !kiln.tensor<Bx6xf32>
  return %s : !kiln.tensor<Bx6xf32>
}

// -----

// Pads that overlap, leave a gap, or are read elsewhere too stay a sum.
// CHECK-LABEL: func.func @pads_not_tiling
// CHECK-COUNT-2: "kiln.add"
// CHECK-NOT:     "kiln.concat"
// CHECK:         return
func.func @pads_not_tiling(%a: !kiln.tensor<4x2xf32>, %b: !kiln.tensor<4x3xf32>) -> (!kiln.tensor<4x4xf32>, !kiln.tensor<4x6xf32>, !kiln.tensor<4x6xf32>) {
  %pa = "kiln.pad"(%a) {axis = 1, low = 0, high = 2} : (!kiln.tensor<4x2xf32>) -> !kiln.tensor<4x4xf32>
  %pa2 = "kiln.pad"(%a) {axis = 1, low = 1, high = 1} : (!kiln.tensor<4x2xf32>) -> !kiln.tensor<4x4xf32>
  %overlap = "kiln.add"(%pa, %pa2) : (!kiln.tensor<4x4xf32>, !kiln.tensor<4x4xf32>) -> !kiln.tensor<4x4xf32>
  %qa = "kiln.pad"(%a) {axis = 1, low = 0, high = 4} : (!kiln.tensor<4x2xf32>) -> !kiln.tensor<4x6xf32>
  %qb = "kiln.pad"(%b) {axis = 1, low = 3, high = 0} : (!kiln.tensor<4x3xf32>) -> !kiln.tensor<4x6xf32>
  %gap = "kiln.add"(%qa, %qb) : (!kiln.tensor<4x6xf32>, !kiln.tensor<4x6xf32>) -> !kiln.tensor<4x6xf32>
  return %overlap, %gap, %qb : !kiln.tensor<4x4xf32>, !kiln.tensor<4x6xf32>, !kiln.tensor<4x6xf32>
}
