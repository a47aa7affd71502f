// RUN: %kiln opt %s "--passes=remat{budget=80%}" --target cpu | FileCheck %s --check-prefix=CPU
// RUN: %kiln opt %s "--passes=remat{budget=80%}" --target h200 | FileCheck %s --check-prefix=H200
// RUN: %kiln opt %s "--passes=remat{budget=80%}" | FileCheck %s --check-prefix=CPU

// The target decides what is cheaper to recompute. Two values are live across the peak at
// %big, and recomputing either one fits the budget: %p, a GEMM with K = 1024 (134 MFLOP), or %q,
// a chain of two elementwise ops (exp, then tanh). The CPU computes the GEMM in ~0.7 ms and
// the chain in ~0.06 ms (bandwidth bound): it recomputes the chain. On the H200 the GEMM takes
// ~2 us (f32, on the CUDA cores) plus one launch, the chain two launches of ~4 us each: it
// recomputes the GEMM.
// CPU-LABEL: func.func @train_step
// CPU:         %big = "kiln.add"(%a, %b)
// CPU-NEXT:    %gp = "kiln.mul"(%big, %p)
// CPU-NEXT:    %y.recompute = "kiln.exp"(%z) {kiln.recompute = true}
// CPU-NEXT:    %q.recompute = "kiln.tanh"(%y.recompute) {kiln.recompute = true}
// CPU-NEXT:    %gq = "kiln.mul"(%gp, %q.recompute)
// CPU-NOT:     kiln.recompute
// H200-LABEL: func.func @train_step
// H200:         %big = "kiln.add"(%a, %b)
// H200-NEXT:    %p.recompute = "kiln.matmul"(%x, %w) {kiln.recompute = true
// H200-NEXT:    %gp = "kiln.mul"(%big, %p.recompute)
// H200-NEXT:    %gq = "kiln.mul"(%gp, %q)
// H200-NOT:     kiln.recompute
module attributes {kiln.symbols = {B = 1024}} {
  func.func @train_step() -> (!kiln.tensor<f32>, !kiln.tensor<Bx64xf32>) {
    %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bx1024xf32>
    %w = "kiln.input"() {name = "w"} : () -> !kiln.tensor<64x1024xf32>
    %z = "kiln.input"() {name = "z"} : () -> !kiln.tensor<Bx64xf32>
    %p = "kiln.matmul"(%x, %w) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx1024xf32>, !kiln.tensor<64x1024xf32>) -> !kiln.tensor<Bx64xf32>
    %y = "kiln.exp"(%z) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %q = "kiln.tanh"(%y) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %s = "kiln.add"(%p, %q) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %loss = "kiln.reduce"(%s) {axes = [0, 1], kind = "sum"} : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<f32>
    %a = "kiln.exp"(%z) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %b = "kiln.log"(%z) : (!kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %big = "kiln.add"(%a, %b) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %gp = "kiln.mul"(%big, %p) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    %gq = "kiln.mul"(%gp, %q) : (!kiln.tensor<Bx64xf32>, !kiln.tensor<Bx64xf32>) -> !kiln.tensor<Bx64xf32>
    return %loss, %gq : !kiln.tensor<f32>, !kiln.tensor<Bx64xf32>
  }
}
