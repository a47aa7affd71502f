// autodiff of running state: batch norm's kiln.running_stat takes the batch's statistic in the
// train step (training = true), @forward keeps the running one; after the optimizer updates the
// pass moves each running statistic toward the batch's and steps the log-Q estimator over the
// batch's candidate ids. Canonicalization then folds each kiln.running_stat into its operand.
// RUN: %kiln opt %s --passes=autodiff | FileCheck %s
// RUN: %kiln opt %s --passes=autodiff,canonicalize | FileCheck %s --check-prefix=FOLD

module attributes {kiln.outputs = ["loss"], kiln.train = {label = "label", loss = "loss", optimizer = {kind = "sgd", lr = 0.1}}} {
  func.func @forward() -> (!kiln.tensor<f32>) {
    %x = "kiln.input"() {name = "x", role = "dense"} : () -> !kiln.tensor<Bx4xf32>
    %item = "kiln.input"() {name = "item", role = "sparse", feature = 0, rows = 10, hotness = 1} : () -> !kiln.tensor<Bx1xi64>
    %rm = "kiln.parameter"() {name = "bn.running_mean", init = "zeros", trainable = false} : () -> !kiln.tensor<4xf32>
    %w = "kiln.parameter"() {name = "w", init = "ones"} : () -> !kiln.tensor<4xf32>
    %freq = "kiln.parameter"() {name = "softmax.frequency", init = "zeros", trainable = false} : () -> !kiln.tensor<10x2xf32>
    %bm = "kiln.reduce"(%x) {kind = "mean", axes = [0], keepdims = false} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<4xf32>
    %m = "kiln.running_stat"(%bm, %rm) {momentum = 0.25} : (!kiln.tensor<4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
    %c = "kiln.sub"(%x, %m) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
    %y = "kiln.mul"(%c, %w) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<4xf32>) -> !kiln.tensor<Bx4xf32>
    %ids = "kiln.reshape"(%item) : (!kiln.tensor<Bx1xi64>) -> !kiln.tensor<Bxi64>
    %lq = "kiln.log_frequency"(%ids, %freq) {prior = 10.0, alpha = 0.05} : (!kiln.tensor<Bxi64>, !kiln.tensor<10x2xf32>) -> !kiln.tensor<Bxf32>
    %s = "kiln.reduce"(%y) {kind = "sum", axes = [1], keepdims = false} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bxf32>
    %t = "kiln.sub"(%s, %lq) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.reduce"(%t) {kind = "mean", axes = [0], keepdims = false} : (!kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %loss : !kiln.tensor<f32>
  }
}

// @forward (eval, predict) keeps the running statistic.
// CHECK-LABEL: func.func @forward()
// CHECK:         "kiln.running_stat"(%bm, %rm) {momentum = 0.25}
// CHECK-NOT:     kiln.running_stat_update
// CHECK-NOT:     kiln.frequency_update
// CHECK:         return
// CHECK-LABEL: func.func @train_step()
// CHECK:         "kiln.running_stat"(%bm, %rm) {momentum = 0.25, training = true}
// CHECK:         "kiln.optimizer_update"(%w,
// CHECK:         "kiln.running_stat_update"(%rm, %bm) {momentum = 0.25}
// CHECK-NEXT:    "kiln.frequency_update"(%freq, %ids, %step) {alpha = 0.05}
// CHECK:         return

// FOLD-LABEL: func.func @forward()
// FOLD-NOT:     kiln.running_stat
// FOLD:         "kiln.sub"(%x, %rm)
// FOLD-LABEL: func.func @train_step()
// FOLD-NOT:     "kiln.running_stat"(
// FOLD:         "kiln.sub"(%x, %bm)
// FOLD:         "kiln.running_stat_update"(%rm, %bm)

// Before autodiff, @forward's running statistic stays: the step's training form is cloned from it.
// RUN: %kiln opt %s --passes=canonicalize | FileCheck %s --check-prefix=KEEP
// KEEP-LABEL: func.func @forward()
// KEEP:         "kiln.running_stat"(%bm, %rm)
