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

// Mixed precision's widened bf16 product is the GEMM's f32 accumulator: the bias add and relu
// after it join the epilogue; the cast to bf16 for the next GEMM does not (relu's result has
// another user).
// CHECK-LABEL: func.func @bf16_epilogue
// CHECK:         %[[G:.*]] = "kiln.fused"(%x, %w, %b) ({
// CHECK:           "kiln.matmul"
// CHECK-NEXT:      "kiln.cast"
// CHECK-NEXT:      "kiln.add"
// CHECK-NEXT:      "kiln.relu"
// CHECK-NEXT:      "kiln.yield"
// CHECK:         }) {kind = "gemm_epilogue"}
// CHECK-NOT:     "kiln.matmul"
// CHECK:         "kiln.cast"(%[[G]])
func.func @bf16_epilogue(%x: !kiln.tensor<Bx8xbf16>, %w: !kiln.tensor<4x8xbf16>, %b: !kiln.tensor<4xf32>) -> (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xbf16>) {
  %0 = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx8xbf16>, !kiln.tensor<4x8xbf16>) -> !kiln.tensor<Bx4xbf16>
  %1 = "kiln.cast"(%0) {to = "f32"} : (!kiln.tensor<Bx4xbf16>) -> !kiln.tensor<Bx4xf32>
  %2 = "kiln.add"(%1, %b) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
  %3 = "kiln.relu"(%2) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %4 = "kiln.cast"(%3) {to = "bf16"} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xbf16>
  return %3, %4 : !kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xbf16>
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

// -----

// Fusion must not raise the planned peak: %s may not join %p's group, which would run %p where %s
// is and keep %t1 and %t2 live while %big is made; it joins %u's instead.
// CHECK-LABEL: func.func @lifetime
// CHECK:         %p = "kiln.mul"(%t1, %t2)
// CHECK-NEXT:    %big = "kiln.concat"
// CHECK-NEXT:    %s = "kiln.fused"(%y, %p) ({
// CHECK:           "kiln.exp"
// CHECK-NEXT:      "kiln.add"
// CHECK:         }) {kind = "pointwise"}
func.func @lifetime(%x: !kiln.tensor<Bx64xf32>, %y: !kiln.tensor<Bx64xf32>, %w: !kiln.tensor<64x64xf32>) -> (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx256xf32>) {
  %t1 = "kiln.matmul"(%x, %w) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx64xf32>, !kiln.tensor<64x64xf32>) -> !kiln.tensor<Bx64xf32>
  %t2 = "kiln.matmul"(%y, %w) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx64xf32>, !kiln.tensor<64x64xf32>) -> !kiln.tensor<Bx64xf32>
  %p = "kiln.mul"(%t1, %t2) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
  %big = "kiln.concat"(%x, %y, %x, %y) {axis = 1} : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx256xf32>
  %u = "kiln.exp"(%y) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
  %s = "kiln.add"(%p, %u) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
  return %s, %big : !kiln.tensor<Bx64xf32>, !kiln.tensor<Bx256xf32>
}

// -----

// A linear layer's backward: the bias gradient sum_to(%g) joins the weight gradient's GEMM
// (%g^T %x, K = B) as cuBLASLt's bias-gradient epilogue; the data gradient %g %w contracts %g's
// trailing dim and stays alone. The group runs as early as its operands allow: first here.
// CHECK-LABEL: func.func @bias_gradient
// CHECK:         %[[G:.*]]:2 = "kiln.fused"(%g, %x) ({
// CHECK-NEXT:    ^bb0(%[[A0:.*]]: !kiln.tensor<Bx4xf32>, %[[A1:.*]]: !kiln.tensor<Bx8xf32>):
// CHECK-NEXT:      %[[DB:.*]] = "kiln.sum_to"(%[[A0]])
// CHECK-NEXT:      %[[DW:.*]] = "kiln.matmul"(%[[A0]], %[[A1]]) {transpose_a = true}
// CHECK-NEXT:      "kiln.yield"(%[[DB]], %[[DW]])
// CHECK:         }) {kind = "gemm_epilogue"}
// CHECK-NEXT:    %[[DX:.*]] = "kiln.matmul"(%g, %w)
// CHECK-NEXT:    return %[[DX]], %[[G]]#1, %[[G]]#0
func.func @bias_gradient(%g: !kiln.tensor<Bx4xf32>, %x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<4x8xf32>) -> (!kiln.tensor<Bx8xf32>, !kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>) {
  %db = "kiln.sum_to"(%g) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<4xf32>
  %dx = "kiln.matmul"(%g, %w) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4x8xf32>) -> !kiln.tensor<Bx8xf32>
  %dw = "kiln.matmul"(%g, %x) {transpose_a = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx8xf32>) -> !kiln.tensor<4x8xf32>
  return %dx, %dw, %db : !kiln.tensor<Bx8xf32>, !kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>
}

// -----

// Mixed precision: the GEMM reads %g narrowed to bf16 and widens its product at once. The
// group holds the sum_to of the f32 %g, the matmul and the widening cast; the narrowing cast
// stays outside (cuBLASLt sums the bf16 values it multiplies, codegen/emit/gemm.cc).
// CHECK-LABEL: func.func @bias_gradient_bf16
// CHECK:         %[[G16:.*]] = "kiln.cast"(%g) {to = "bf16"}
// CHECK:         %[[G:.*]]:2 = "kiln.fused"(%g, %[[G16]], %x) ({
// CHECK:           "kiln.sum_to"
// CHECK-NEXT:      "kiln.matmul"
// CHECK-NEXT:      "kiln.cast"
// CHECK-NEXT:      "kiln.yield"
// CHECK:         }) {kind = "gemm_epilogue"}
func.func @bias_gradient_bf16(%g: !kiln.tensor<Bx4xf32>, %x: !kiln.tensor<Bx8xbf16>) -> (!kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>) {
  %db = "kiln.sum_to"(%g) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<4xf32>
  %g16 = "kiln.cast"(%g) {to = "bf16"} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xbf16>
  %p = "kiln.matmul"(%g16, %x) {transpose_a = true} : (!kiln.tensor<Bx4xbf16>, !kiln.tensor<Bx8xbf16>) -> !kiln.tensor<4x8xbf16>
  %dw = "kiln.cast"(%p) {to = "f32"} : (!kiln.tensor<4x8xbf16>) -> !kiln.tensor<4x8xf32>
  return %dw, %db : !kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>
}

// -----

// The bias gradient is read before the weight gradient's GEMM: the sum_to may not move past
// that reader, so it stays a reduction of its own and --explain says why.
// CHECK-LABEL: func.func @bias_gradient_read_between
// CHECK:         %db = "kiln.sum_to"(%g)
// CHECK-NEXT:    %e = "kiln.exp"(%db)
// CHECK-NEXT:    %dw = "kiln.matmul"(%g, %x)
// CHECK-NOT:     "kiln.fused"
func.func @bias_gradient_read_between(%g: !kiln.tensor<Bx4xf32>, %x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<4x8xf32>) -> (!kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>) {
  %db = "kiln.sum_to"(%g) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<4xf32>
  %e = "kiln.exp"(%db) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  %dw = "kiln.matmul"(%g, %x) {transpose_a = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx8xf32>) -> !kiln.tensor<4x8xf32>
  %r = "kiln.mul"(%dw, %w) : (!kiln.tensor<4x8xf32>, !kiln.tensor<4x8xf32>) -> !kiln.tensor<4x8xf32>
  return %r, %e : !kiln.tensor<4x8xf32>, !kiln.tensor<4xf32>
}

// -----

// A ReLU layer's backward: the data gradient of the layer above (%gn %w2^T) is scaled by relu'
// in its GEMM's epilogue (cuBLASLt's DRELU), which reads the bit mask the forward GEMM of that
// ReLU writes beside %h: the forward relu is marked kiln.relu_mask.
// CHECK-LABEL: func.func @drelu
// CHECK:         "kiln.fused"
// CHECK:           "kiln.matmul"
// CHECK-NEXT:      "kiln.add"
// CHECK-NEXT:      "kiln.relu"({{.*}}) {kiln.relu_mask = true}
// CHECK:         }) {kind = "gemm_epilogue"}
// CHECK:         "kiln.fused"
// CHECK-NEXT:    ^bb0
// CHECK-NEXT:      %[[GH:.*]] = "kiln.matmul"({{.*}}) {transpose_b = true}
// CHECK-NEXT:      %[[GZ:.*]] = "kiln.activation_grad"({{.*}}, %[[GH]]) {activation = "relu"}
// CHECK-NEXT:      "kiln.yield"(%[[GZ]])
// CHECK:         }) {kind = "gemm_epilogue"}
func.func @drelu(%x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<8x16xf32>, %b: !kiln.tensor<16xf32>, %gn: !kiln.tensor<Bx4xf32>, %w2: !kiln.tensor<16x4xf32>) -> (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) {
  %p = "kiln.matmul"(%x, %w) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<8x16xf32>) -> !kiln.tensor<Bx16xf32>
  %z = "kiln.add"(%p, %b) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<16xf32>) -> !kiln.tensor<Bx16xf32>
  %h = "kiln.relu"(%z) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %gh = "kiln.matmul"(%gn, %w2) {transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<16x4xf32>) -> !kiln.tensor<Bx16xf32>
  %gz = "kiln.activation_grad"(%h, %gh) {activation = "relu"} : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %h, %gz : !kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>
}

// -----

// A ReLU that no GEMM computes has no mask for DRELU to read: its backward stays out of the
// GEMM (here it joins the relu's pointwise kernel).
// CHECK-LABEL: func.func @drelu_without_forward_gemm
// CHECK-NOT:     kiln.relu_mask
// CHECK:         %gh = "kiln.matmul"
// CHECK-NEXT:    "kiln.fused"(%z, %gh)
// CHECK:           "kiln.relu"
// CHECK-NEXT:      "kiln.activation_grad"
// CHECK:         }) {kind = "pointwise"}
func.func @drelu_without_forward_gemm(%z: !kiln.tensor<Bx16xf32>, %gn: !kiln.tensor<Bx4xf32>, %w2: !kiln.tensor<16x4xf32>) -> (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) {
  %h = "kiln.relu"(%z) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %gh = "kiln.matmul"(%gn, %w2) {transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<16x4xf32>) -> !kiln.tensor<Bx16xf32>
  %gz = "kiln.activation_grad"(%h, %gh) {activation = "relu"} : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %h, %gz : !kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>
}

// -----

// GELU's backward reads the GELU input %z itself (cuBLASLt's DGELU), whoever computed it.
// CHECK-LABEL: func.func @dgelu
// CHECK:         "kiln.fused"(%gn, %w2, %z)
// CHECK-NEXT:    ^bb0
// CHECK-NEXT:      %[[GH:.*]] = "kiln.matmul"
// CHECK-NEXT:      %[[GZ:.*]] = "kiln.activation_grad"(%{{.*}}, %[[GH]]) {activation = "gelu"}
// CHECK:         }) {kind = "gemm_epilogue"}
func.func @dgelu(%z: !kiln.tensor<Bx16xf32>, %gn: !kiln.tensor<Bx4xf32>, %w2: !kiln.tensor<16x4xf32>) -> !kiln.tensor<Bx16xf32> {
  %gh = "kiln.matmul"(%gn, %w2) {transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<16x4xf32>) -> !kiln.tensor<Bx16xf32>
  %gz = "kiln.activation_grad"(%z, %gh) {activation = "gelu"} : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %gz : !kiln.tensor<Bx16xf32>
}

// -----

// A matrix of the product's type added before the activation is cuBLASLt's C (beta = 1): the
// residual joins the GEMM, after or before the bias add, and the relu still ends the epilogue.
// CHECK-LABEL: func.func @residual_add
// CHECK:         "kiln.fused"(%x, %w, %b, %res)
// CHECK-NEXT:    ^bb0
// CHECK-NEXT:      "kiln.matmul"
// CHECK-NEXT:      "kiln.add"
// CHECK-NEXT:      "kiln.add"
// CHECK-NEXT:      "kiln.relu"
// CHECK:         }) {kind = "gemm_epilogue"}
func.func @residual_add(%x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<8x16xf32>, %b: !kiln.tensor<16xf32>, %res: !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32> {
  %p = "kiln.matmul"(%x, %w) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<8x16xf32>) -> !kiln.tensor<Bx16xf32>
  %z = "kiln.add"(%p, %b) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<16xf32>) -> !kiln.tensor<Bx16xf32>
  %r = "kiln.add"(%res, %z) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %h = "kiln.relu"(%r) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %h : !kiln.tensor<Bx16xf32>
}

// -----

// After the activation an add is no longer cuBLASLt's C: it stays out of the GEMM.
// CHECK-LABEL: func.func @residual_after_activation
// CHECK:         %[[G:.*]] = "kiln.fused"(%x, %w, %b)
// CHECK:           "kiln.relu"
// CHECK-NEXT:      "kiln.yield"
// CHECK:         }) {kind = "gemm_epilogue"}
// CHECK:         "kiln.add"(%[[G]], %res)
func.func @residual_after_activation(%x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<8x16xf32>, %b: !kiln.tensor<16xf32>, %res: !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32> {
  %p = "kiln.matmul"(%x, %w) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<8x16xf32>) -> !kiln.tensor<Bx16xf32>
  %z = "kiln.add"(%p, %b) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<16xf32>) -> !kiln.tensor<Bx16xf32>
  %h = "kiln.relu"(%z) : (!kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %r = "kiln.add"(%h, %res) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %r : !kiln.tensor<Bx16xf32>
}

// -----

// Sibling fusion: two products of %g that no producer's group takes (a GEMM's epilogue has no
// multiply) share one pointwise kernel, which reads %g once and stores both.
// CHECK-LABEL: func.func @siblings
// CHECK:         %[[G:.*]] = "kiln.matmul"
// CHECK-NEXT:    "kiln.fused"(%[[G]], %u, %v)
// CHECK-NEXT:    ^bb0
// CHECK-NEXT:      "kiln.mul"
// CHECK-NEXT:      "kiln.mul"
// CHECK:         }) {kind = "pointwise"}
// CHECK-NOT:     "kiln.mul"
func.func @siblings(%x: !kiln.tensor<Bx8xf32>, %w: !kiln.tensor<8x16xf32>, %u: !kiln.tensor<Bx16xf32>, %v: !kiln.tensor<Bx16xf32>) -> (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) {
  %g = "kiln.matmul"(%x, %w) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<8x16xf32>) -> !kiln.tensor<Bx16xf32>
  %a = "kiln.mul"(%g, %u) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  %c = "kiln.mul"(%g, %v) : (!kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>) -> !kiln.tensor<Bx16xf32>
  return %a, %c : !kiln.tensor<Bx16xf32>, !kiln.tensor<Bx16xf32>
}
