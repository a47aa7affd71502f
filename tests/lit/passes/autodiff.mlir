// autodiff builds @train_step: lr and step inputs, the backward of each op, sparse embedding
// updates fed by the pooled-output gradient, state parameters, dense updates, and a return of
// the loss and the prediction.
// RUN: %kiln opt %s --passes=autodiff | FileCheck %s

module attributes {kiln.outputs = ["logit", "loss"], kiln.train = {embedding_optimizer = {kind = "rowwise_adagrad", lr = 0.05}, label = "label", loss = "loss", optimizer = {kind = "adam", lr = 0.001}, prediction = "logit"}} {
  func.func @forward() -> (!kiln.tensor<Bxf32>, !kiln.tensor<f32>) {
    %dense = "kiln.input"() {name = "dense", role = "dense"} : () -> !kiln.tensor<Bx4xf32>
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %ids = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0, rows = 100, hotness = 2} : () -> !kiln.tensor<Bx2xi64>
    %table = "kiln.parameter"() {name = "tables.0", embedding = true, init = "normal"} : () -> !kiln.tensor<100x4xf32>
    %w = "kiln.parameter"() {name = "top.weight", init = "xavier_uniform"} : () -> !kiln.tensor<1x8xf32>
    %emb = "kiln.embedding_bag"(%table, %ids) {mode = "sum"} : (!kiln.tensor<100x4xf32>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<Bx4xf32>
    %x = "kiln.concat"(%dense, %emb) {axis = 1} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx8xf32>
    %y = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<1x8xf32>) -> !kiln.tensor<Bx1xf32>
    %logit = "kiln.reshape"(%y) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %logit, %loss : !kiln.tensor<Bxf32>, !kiln.tensor<f32>
  }
}

// @forward is left as it was.
// CHECK-LABEL: func.func @forward()
// CHECK-NOT:   kiln.embedding_bag_update
// CHECK:       return %logit, %loss

// CHECK-LABEL: func.func @train_step() -> (!kiln.tensor<f32>, !kiln.tensor<Bxf32>)
// CHECK-NEXT:    %lr = "kiln.input"() {name = "lr", role = "lr"} : () -> !kiln.tensor<f32>
// CHECK-NEXT:    %step = "kiln.input"() {name = "step", role = "step"} : () -> !kiln.tensor<f32>
// CHECK:         %table = "kiln.parameter"()
// CHECK-NEXT:    %tables.0.rowwise_adagrad_sum = "kiln.parameter"() {init = "zeros", name = "tables.0.rowwise_adagrad_sum", state_of = "tables.0", trainable = false} : () -> !kiln.tensor<100xf32>
// CHECK-NEXT:    %w = "kiln.parameter"()
// CHECK-NEXT:    %top.weight.adam_m = "kiln.parameter"() {init = "zeros", name = "top.weight.adam_m", state_of = "top.weight", trainable = false} : () -> !kiln.tensor<1x8xf32>
// CHECK-NEXT:    %top.weight.adam_v = "kiln.parameter"() {init = "zeros", name = "top.weight.adam_v", state_of = "top.weight", trainable = false} : () -> !kiln.tensor<1x8xf32>
// The table is read by its lookup and its update only: no dense [100, 4] gradient.
// CHECK-NOT:     -> !kiln.tensor<100x4xf32>
// CHECK:         %loss = "kiln.bce_with_logits"
// CHECK-NOT:     -> !kiln.tensor<100x4xf32>
// The pooled-output gradient is the [B, 4] slice of the concat's gradient.
// CHECK:         %[[GEMB:.*]] = "kiln.slice"(%{{.*}}) {axis = 1, limit = 8, start = 4}
// CHECK-NOT:     -> !kiln.tensor<100x4xf32>
// CHECK:         "kiln.embedding_bag_update"(%table, %ids, %[[GEMB]], %tables.0.rowwise_adagrad_sum, %lr, %step) {{{.*}}eps = 1.0e-10, initial_accumulator = 0.0, lr = 0.05, mode = "sum", optimizer = "rowwise_adagrad", scaled = false, table = "tables.0", weight_decay = 0.0, weighted = false}
// CHECK-NEXT:    "kiln.optimizer_update"(%w, %{{.*}}, %top.weight.adam_m, %top.weight.adam_v, %lr, %step) {beta1 = 0.9, beta2 = 0.999, eps = 1.0e-08, kind = "adam", lr = 0.001, {{.*}}param = "top.weight"
// CHECK-NEXT:    return %loss, %logit : !kiln.tensor<f32>, !kiln.tensor<Bxf32>
