// autodiff of a shared table: one table read by two kiln.embedding_bag ops gets one sparse
// update, its lookups' ids and pooled-output gradients side by side along the bag axis (2*B
// bags), so a row both features read takes one optimizer step with the summed gradient. A
// table read by lookups of two hotnesses is an error at the lookup.
// RUN: %kiln opt %s --passes=autodiff | FileCheck %s
// RUN: not %kiln opt %S/Inputs/autodiff_shared_hotness.mlir --passes=autodiff 2>&1 | FileCheck %s --check-prefix=BAD

module attributes {kiln.outputs = ["logit", "loss"], kiln.train = {embedding_optimizer = {kind = "adagrad", lr = 0.05}, label = "label", loss = "loss", optimizer = {kind = "sgd", lr = 0.1}, prediction = "logit"}} {
  func.func @forward() -> (!kiln.tensor<Bxf32>, !kiln.tensor<f32>) {
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %home = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0, rows = 100, hotness = 2} : () -> !kiln.tensor<Bx2xi64>
    %away = "kiln.input"() {name = "cats.1", role = "sparse", feature = 1, rows = 100, hotness = 2} : () -> !kiln.tensor<Bx2xi64>
    %table = "kiln.parameter"() {name = "city.0", embedding = true, init = "normal"} : () -> !kiln.tensor<100x4xf32>
    %w = "kiln.parameter"() {name = "top.weight", init = "xavier_uniform"} : () -> !kiln.tensor<1x8xf32>
    %e0 = "kiln.embedding_bag"(%table, %home) {mode = "sum", table = "city.0"} : (!kiln.tensor<100x4xf32>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<Bx4xf32>
    %e1 = "kiln.embedding_bag"(%table, %away) {mode = "sum", table = "city.0"} : (!kiln.tensor<100x4xf32>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<Bx4xf32>
    %x = "kiln.concat"(%e0, %e1) {axis = 1} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx8xf32>
    %y = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx8xf32>, !kiln.tensor<1x8xf32>) -> !kiln.tensor<Bx1xf32>
    %logit = "kiln.reshape"(%y) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %logit, %loss : !kiln.tensor<Bxf32>, !kiln.tensor<f32>
  }
}

// CHECK-LABEL: func.func @train_step()
// CHECK:         %table = "kiln.parameter"()
// CHECK-NEXT:    %city.0.adagrad_sum = "kiln.parameter"() {init = "zeros", name = "city.0.adagrad_sum", state_of = "city.0", trainable = false} : () -> !kiln.tensor<100x4xf32>
// The two pooled gradients are the halves of the concat's gradient.
// CHECK:         %[[G0:.*]] = "kiln.slice"(%{{.*}}) {axis = 1, limit = 4, start = 0}
// CHECK:         %[[G1:.*]] = "kiln.slice"(%{{.*}}) {axis = 1, limit = 8, start = 4}
// CHECK:         %[[IDS:.*]] = "kiln.concat"(%home, %away) {axis = 0} : (!kiln.tensor<Bx2xi64>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<2*Bx2xi64>
// CHECK-NEXT:    %[[G:.*]] = "kiln.concat"(%[[G0]], %[[G1]]) {axis = 0} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<2*Bx4xf32>
// CHECK:         "kiln.embedding_bag_update"(%table, %[[IDS]], %[[G]], %city.0.adagrad_sum, %lr, %step) {{{.*}}optimizer = "adagrad"{{.*}}table = "city.0"
// CHECK-NOT:     "kiln.embedding_bag_update"
// CHECK:         return

// BAD: autodiff_shared_hotness.mlir:8:{{[0-9]+}}: error: {{.*}}embedding table 'city.0' is shared by lookups of different forms (!kiln.tensor<Bx2xi64> and !kiln.tensor<Bx1xi64>); a shared table's lookups need one hotness, weighting and id type
