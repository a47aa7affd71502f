// precision = "bf16" on a MoE layer: the experts' grouped GEMMs store their operands and
// results in bf16 (the offsets stay i32), while the router's logits GEMM, marked
// kiln.precision = "f32", stays f32 (routing is computed in f32, Megatron's moe_router_dtype).
// RUN: %kiln opt %s --passes=mixed-precision | FileCheck %s

module attributes {kiln.outputs = ["y"], kiln.train = {loss = "y", optimizer = {kind = "sgd", lr = 0.1}, precision = "bf16"}} {
  func.func @forward() -> (!kiln.tensor<f32>) {
    %x = "kiln.input"() {name = "x", role = "dense"} : () -> !kiln.tensor<Bx8xf32>
    %wr = "kiln.parameter"() {name = "wr"} : () -> !kiln.tensor<4x8xf32>
    %w1 = "kiln.parameter"() {name = "w1"} : () -> !kiln.tensor<4x8x6xf32>
    %logits = "kiln.matmul"(%x, %wr) {transpose_b = true, kiln.precision = "f32"} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<4x8xf32>) -> !kiln.tensor<Bx4xf32>
    %r:2 = "kiln.moe_router"(%logits) {topk = 2} : (!kiln.tensor<Bx4xf32>) -> (!kiln.tensor<Bx2xf32>, !kiln.tensor<Bx2xi32>)
    %d:3 = "kiln.moe_dispatch"(%r#1, %r#0) {experts = 4} : (!kiln.tensor<Bx2xi32>, !kiln.tensor<Bx2xf32>) -> (!kiln.tensor<?(2*B)xi32>, !kiln.tensor<5xi32>, !kiln.tensor<4xi32>)
    %xp = "kiln.moe_permute"(%x, %d#0, %r#0) : (!kiln.tensor<Bx8xf32>, !kiln.tensor<?(2*B)xi32>, !kiln.tensor<Bx2xf32>) -> !kiln.tensor<?(2*B)x8xf32>
    %h = "kiln.grouped_matmul"(%xp, %w1, %d#1) : (!kiln.tensor<?(2*B)x8xf32>, !kiln.tensor<4x8x6xf32>, !kiln.tensor<5xi32>) -> !kiln.tensor<?(2*B)x6xf32>
    %y = "kiln.reduce"(%h) {axes = [0, 1], kind = "sum"} : (!kiln.tensor<?(2*B)x6xf32>) -> !kiln.tensor<f32>
    return %y : !kiln.tensor<f32>
  }
}

// CHECK:      %logits = "kiln.matmul"(%x, %wr) {kiln.precision = "f32", transpose_b = true} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<4x8xf32>) -> !kiln.tensor<Bx4xf32>
// CHECK:      %[[X:.*]] = "kiln.cast"(%xp) {to = "bf16"} : (!kiln.tensor<?(2*B)x8xf32>) -> !kiln.tensor<?(2*B)x8xbf16>
// CHECK-NEXT: %[[W:.*]] = "kiln.cast"(%w1) {to = "bf16"} : (!kiln.tensor<4x8x6xf32>) -> !kiln.tensor<4x8x6xbf16>
// CHECK-NEXT: %[[H:.*]] = "kiln.grouped_matmul"(%[[X]], %[[W]], %{{.*}}) {{.*}} -> !kiln.tensor<?(2*B)x6xbf16>
// CHECK-NEXT: %h = "kiln.cast"(%[[H]]) {to = "f32"} : (!kiln.tensor<?(2*B)x6xbf16>) -> !kiln.tensor<?(2*B)x6xf32>
