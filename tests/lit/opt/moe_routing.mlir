// The routing ops of an MoE layer read, verify and print through `kiln opt`: a DeepSeek-style
// group-limited sigmoid router with an expert bias, its balancing losses, capacity dispatch with
// padding and the bias update; the gradients of the router and the losses; the generic top-k
// and the take/scatter pair along a middle axis.
// RUN: %kiln opt %s | FileCheck %s
// RUN: %kiln opt %s | %kiln opt - | FileCheck %s

func.func @route(%logits: !kiln.tensor<4*Bx8xf32>, %bias: !kiln.tensor<8xf32>) -> (!kiln.tensor<4*Bx2xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>, !kiln.tensor<?(44*B)xi32>, !kiln.tensor<9xi32>) {
  %r:2 = "kiln.moe_router"(%logits, %bias) {topk = 2, score = "sigmoid", groups = 4, group_topk = 2, scale = 2.5} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<8xf32>) -> (!kiln.tensor<4*Bx2xf32>, !kiln.tensor<4*Bx2xi32>)
  %aux = "kiln.moe_aux_loss"(%logits, %r#1) {coeff = 1.0e-02, score = "sigmoid", topk = 2, seq_len = 4} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx2xi32>) -> !kiln.tensor<f32>
  %z = "kiln.moe_z_loss"(%logits) {coeff = 1.0e-03} : (!kiln.tensor<4*Bx8xf32>) -> !kiln.tensor<f32>
  %d:3 = "kiln.moe_dispatch"(%r#1, %r#0) {experts = 8, capacity_factor = 1.5, pad_to_capacity = true} : (!kiln.tensor<4*Bx2xi32>, !kiln.tensor<4*Bx2xf32>) -> (!kiln.tensor<?(44*B)xi32>, !kiln.tensor<9xi32>, !kiln.tensor<8xi32>)
  "kiln.moe_expert_bias_update"(%bias, %d#2) {rate = 1.0e-03} : (!kiln.tensor<8xf32>, !kiln.tensor<8xi32>) -> ()
  return %r#0, %aux, %z, %d#0, %d#1 : !kiln.tensor<4*Bx2xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>, !kiln.tensor<?(44*B)xi32>, !kiln.tensor<9xi32>
}

// CHECK-LABEL: func.func @route
// CHECK: :2 = "kiln.moe_router"(%logits, %bias) {group_topk = 2, groups = 4, scale = 2.5, score = "sigmoid", topk = 2} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<8xf32>) -> (!kiln.tensor<4*Bx2xf32>, !kiln.tensor<4*Bx2xi32>)
// CHECK: "kiln.moe_aux_loss"(%logits, %{{.*}}#1) {coeff = 0.01, score = "sigmoid", seq_len = 4, topk = 2} : (!kiln.tensor<4*Bx8xf32>, !kiln.tensor<4*Bx2xi32>) -> !kiln.tensor<f32>
// CHECK: "kiln.moe_z_loss"(%logits) {coeff = 0.001} : (!kiln.tensor<4*Bx8xf32>) -> !kiln.tensor<f32>
// CHECK: :3 = "kiln.moe_dispatch"({{.*}}) {capacity_factor = 1.5, experts = 8, pad_to_capacity = true} : (!kiln.tensor<4*Bx2xi32>, !kiln.tensor<4*Bx2xf32>) -> (!kiln.tensor<?(44*B)xi32>, !kiln.tensor<9xi32>, !kiln.tensor<8xi32>)
// CHECK: "kiln.moe_expert_bias_update"(%bias, %{{.*}}#2) {rate = 0.001} : (!kiln.tensor<8xf32>, !kiln.tensor<8xi32>) -> ()

func.func @backward(%logits: !kiln.tensor<Tx4xf32>, %experts: !kiln.tensor<Tx2xi32>, %dprobs: !kiln.tensor<Tx2xf32>, %g: !kiln.tensor<f32>) -> (!kiln.tensor<Tx4xf32>, !kiln.tensor<Tx4xf32>, !kiln.tensor<Tx4xf32>) {
  %dr = "kiln.moe_router_grad"(%logits, %experts, %dprobs) {topk = 2, pre_softmax = true} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<Tx2xi32>, !kiln.tensor<Tx2xf32>) -> !kiln.tensor<Tx4xf32>
  %da = "kiln.moe_aux_loss_grad"(%logits, %experts, %g) {coeff = 1.0e-02, score = "softmax", topk = 2} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<Tx2xi32>, !kiln.tensor<f32>) -> !kiln.tensor<Tx4xf32>
  %dz = "kiln.moe_z_loss_grad"(%logits, %g) {coeff = 1.0e-03} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<Tx4xf32>
  return %dr, %da, %dz : !kiln.tensor<Tx4xf32>, !kiln.tensor<Tx4xf32>, !kiln.tensor<Tx4xf32>
}

// CHECK-LABEL: func.func @backward
// CHECK: "kiln.moe_router_grad"(%logits, %experts, %dprobs) {pre_softmax = true, topk = 2} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<Tx2xi32>, !kiln.tensor<Tx2xf32>) -> !kiln.tensor<Tx4xf32>
// CHECK: "kiln.moe_aux_loss_grad"(%logits, %experts, %g) {coeff = 0.01, score = "softmax", topk = 2} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<Tx2xi32>, !kiln.tensor<f32>) -> !kiln.tensor<Tx4xf32>
// CHECK: "kiln.moe_z_loss_grad"(%logits, %g) {coeff = 0.001} : (!kiln.tensor<Tx4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<Tx4xf32>

func.func @select(%x: !kiln.tensor<2x5x3xf32>) -> (!kiln.tensor<2x2x3xf32>, !kiln.tensor<2x5x3xf32>) {
  %top:2 = "kiln.topk"(%x) {k = 2, axis = 1} : (!kiln.tensor<2x5x3xf32>) -> (!kiln.tensor<2x2x3xf32>, !kiln.tensor<2x2x3xi32>)
  %taken = "kiln.take_along_axis"(%x, %top#1) {axis = 1} : (!kiln.tensor<2x5x3xf32>, !kiln.tensor<2x2x3xi32>) -> !kiln.tensor<2x2x3xf32>
  %back = "kiln.scatter_along_axis"(%taken, %top#1) {axis = 1, size = 5} : (!kiln.tensor<2x2x3xf32>, !kiln.tensor<2x2x3xi32>) -> !kiln.tensor<2x5x3xf32>
  return %top#0, %back : !kiln.tensor<2x2x3xf32>, !kiln.tensor<2x5x3xf32>
}

// CHECK-LABEL: func.func @select
// CHECK: :2 = "kiln.topk"(%x) {axis = 1, k = 2} : (!kiln.tensor<2x5x3xf32>) -> (!kiln.tensor<2x2x3xf32>, !kiln.tensor<2x2x3xi32>)
// CHECK: "kiln.take_along_axis"(%x, %{{.*}}#1) {axis = 1} : (!kiln.tensor<2x5x3xf32>, !kiln.tensor<2x2x3xi32>) -> !kiln.tensor<2x2x3xf32>
// CHECK: "kiln.scatter_along_axis"(%taken, %{{.*}}#1) {axis = 1, size = 5} : (!kiln.tensor<2x2x3xf32>, !kiln.tensor<2x2x3xi32>) -> !kiln.tensor<2x5x3xf32>
