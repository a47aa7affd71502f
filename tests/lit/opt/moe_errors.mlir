// MoE ops with bad attributes or operand types get located errors naming the op.
// RUN: not %kiln opt %s --split-input-file 2>&1 | FileCheck %s

func.func @topk_above_experts(%l: !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx5xf32> {
  %r:2 = "kiln.moe_router"(%l) {topk = 5} : (!kiln.tensor<Bx4xf32>) -> (!kiln.tensor<Bx5xf32>, !kiln.tensor<Bx5xi32>)
  return %r#0 : !kiln.tensor<Bx5xf32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_router' needs 1 <= topk <= E = 4, got topk = 5

// -----

func.func @groups_not_dividing(%l: !kiln.tensor<Bx8xf32>) -> !kiln.tensor<Bx2xf32> {
  %r:2 = "kiln.moe_router"(%l) {topk = 2, groups = 3} : (!kiln.tensor<Bx8xf32>) -> (!kiln.tensor<Bx2xf32>, !kiln.tensor<Bx2xi32>)
  return %r#0 : !kiln.tensor<Bx2xf32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_router' needs groups >= 1 dividing E = 8, got groups = 3

// -----

func.func @integer_logits(%l: !kiln.tensor<Bx8xi32>) -> !kiln.tensor<Bx2xi32> {
  %r:2 = "kiln.moe_router"(%l) {topk = 2} : (!kiln.tensor<Bx8xi32>) -> (!kiln.tensor<Bx2xi32>, !kiln.tensor<Bx2xi32>)
  return %r#1 : !kiln.tensor<Bx2xi32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_router' logits must be f32 (or f64), got !kiln.tensor<Bx8xi32>

// -----

func.func @float_experts(%e: !kiln.tensor<Bx2xf32>, %p: !kiln.tensor<Bx2xf32>) -> !kiln.tensor<4xi32> {
  %d:3 = "kiln.moe_dispatch"(%e, %p) {experts = 4} : (!kiln.tensor<Bx2xf32>, !kiln.tensor<Bx2xf32>) -> (!kiln.tensor<?(2*B)xi32>, !kiln.tensor<5xi32>, !kiln.tensor<4xi32>)
  return %d#2 : !kiln.tensor<4xi32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_dispatch' experts must be i32 [N, k] with a static k, got !kiln.tensor<Bx2xf32>

// -----

func.func @padding_without_capacity(%e: !kiln.tensor<Bx2xi32>, %p: !kiln.tensor<Bx2xf32>) -> !kiln.tensor<4xi32> {
  %d:3 = "kiln.moe_dispatch"(%e, %p) {experts = 4, pad_to_capacity = true} : (!kiln.tensor<Bx2xi32>, !kiln.tensor<Bx2xf32>) -> (!kiln.tensor<?(6*B)xi32>, !kiln.tensor<5xi32>, !kiln.tensor<4xi32>)
  return %d#2 : !kiln.tensor<4xi32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_dispatch' pads to a capacity only with capacity_factor > 0

// -----

func.func @expert_parallel_size(%e: !kiln.tensor<Bx2xi32>, %p: !kiln.tensor<Bx2xf32>) -> !kiln.tensor<4xi32> {
  %d:3 = "kiln.moe_dispatch"(%e, %p) {experts = 4, ep = 0} : (!kiln.tensor<Bx2xi32>, !kiln.tensor<Bx2xf32>) -> (!kiln.tensor<?(2*B)xi32>, !kiln.tensor<5xi32>, !kiln.tensor<4xi32>)
  return %d#2 : !kiln.tensor<4xi32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_dispatch' needs ep >= 1, got 0

// -----

func.func @sequences_do_not_split(%l: !kiln.tensor<6x4xf32>, %e: !kiln.tensor<6x2xi32>) -> !kiln.tensor<f32> {
  %a = "kiln.moe_aux_loss"(%l, %e) {coeff = 1.0e-02, score = "softmax", topk = 2, seq_len = 4} : (!kiln.tensor<6x4xf32>, !kiln.tensor<6x2xi32>) -> !kiln.tensor<f32>
  return %a : !kiln.tensor<f32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_aux_loss': 6 tokens do not split into sequences of seq_len = 4

// -----

func.func @indices_off_shape(%x: !kiln.tensor<2x5xf32>, %i: !kiln.tensor<3x2xi32>) -> !kiln.tensor<3x2xf32> {
  %t = "kiln.take_along_axis"(%x, %i) {axis = 1} : (!kiln.tensor<2x5xf32>, !kiln.tensor<3x2xi32>) -> !kiln.tensor<3x2xf32>
  return %t : !kiln.tensor<3x2xf32>
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.take_along_axis' indices !kiln.tensor<3x2xi32> must have the dims of !kiln.tensor<2x5xf32> except along axis 1

// -----

func.func @float_counts(%b: !kiln.tensor<4xf32>, %c: !kiln.tensor<4xf32>) {
  "kiln.moe_expert_bias_update"(%b, %c) {rate = 1.0e-03} : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> ()
  return
}
// CHECK: moe_errors.mlir:[[@LINE-3]]:3: error: 'kiln.moe_expert_bias_update' counts must be integers [4] like the bias, got !kiln.tensor<4xf32>
