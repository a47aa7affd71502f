// With grad_clip, every update is scaled by min(1, clip / global norm); the norm adds up the
// dense gradients' squares and each table's combined row gradients (kiln.embedding_bag_grad_sqnorm).
// RUN: %kiln opt %s --passes=autodiff | FileCheck %s
// A bad optimizer is a one-line error and a failing exit.
// RUN: sed 's/kind = "sgd"/kind = "lamb"/' %s > %t.mlir && not %kiln opt %t.mlir --passes=autodiff 2>&1 | FileCheck %s --check-prefix=ERR

module attributes {kiln.outputs = ["logit", "loss"], kiln.train = {grad_clip = 1.0, loss = "loss", optimizer = {kind = "sgd", lr = 0.1, momentum = 0.9}, embedding_optimizer = {kind = "sgd", lr = 0.1}, prediction = "logit"}} {
  func.func @forward() -> (!kiln.tensor<Bxf32>, !kiln.tensor<f32>) {
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %ids = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0, rows = 10, max_hotness = 3} : () -> !kiln.tensor<?(3*B)xi64>
    %len = "kiln.input"() {name = "cats.0.lengths", role = "lengths", feature = 0} : () -> !kiln.tensor<Bxi32>
    %table = "kiln.parameter"() {name = "tables.0", embedding = true} : () -> !kiln.tensor<10x2xf32>
    %w = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<2xf32>
    %emb = "kiln.embedding_bag"(%table, %ids, %len) {mode = "mean"} : (!kiln.tensor<10x2xf32>, !kiln.tensor<?(3*B)xi64>, !kiln.tensor<Bxi32>) -> !kiln.tensor<Bx2xf32>
    %p = "kiln.mul"(%emb, %w) : (!kiln.tensor<Bx2xf32>, !kiln.tensor<2xf32>) -> !kiln.tensor<Bx2xf32>
    %logit = "kiln.reduce"(%p) {axes = [1], kind = "sum"} : (!kiln.tensor<Bx2xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %logit, %loss : !kiln.tensor<Bxf32>, !kiln.tensor<f32>
  }
}

// CHECK-LABEL: func.func @train_step()
// CHECK:         %w.momentum = "kiln.parameter"() {init = "zeros", name = "w.momentum", state_of = "w", trainable = false}
// CHECK:         %[[SQW:.*]] = "kiln.reduce"(%{{.*}}) {axes = [0], keepdims = false, kind = "sum"}
// CHECK-NEXT:    %[[SQT:.*]] = "kiln.embedding_bag_grad_sqnorm"(%ids, %len, %[[GOUT:[0-9]+]]) {mode = "mean", weighted = false}
// CHECK-NEXT:    %[[SUM:.*]] = "kiln.add"(%[[SQW]], %[[SQT]])
// CHECK-NEXT:    %[[NORM:.*]] = "kiln.sqrt"(%[[SUM]])
// CHECK-NEXT:    %[[CLIP:.*]] = "kiln.constant"() {value = 1.0}
// CHECK-NEXT:    %[[DEN:.*]] = "kiln.max"(%[[NORM]], %[[CLIP]])
// CHECK-NEXT:    %grad_scale = "kiln.div"(%[[CLIP]], %[[DEN]])
// CHECK-NEXT:    "kiln.embedding_bag_update"(%table, %ids, %len, %[[GOUT]], %lr, %step, %grad_scale) {{{.*}}mode = "mean", optimizer = "sgd", scaled = true
// CHECK-NEXT:    "kiln.optimizer_update"(%w, %{{.*}}, %w.momentum, %lr, %step, %grad_scale) {{{.*}}kind = "sgd", lr = 0.1, momentum = 0.9, nesterov = false, param = "w", scaled = true

// ERR: error: in pass 'autodiff': kiln.train optimizer: unknown optimizer 'lamb'; expected one of sgd, adagrad, adam, adamw
