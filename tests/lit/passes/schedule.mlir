// RUN: %kiln opt %s --passes=schedule | FileCheck %s

// Embedding updates and the gradient slices feeding them go to stream 1.
// CHECK-LABEL: func.func @f
// CHECK:         "kiln.slice"(%g) {{{.*}}kiln.stream = 1
// CHECK:         "kiln.embedding_bag_update"{{.*}}kiln.stream = 1
module {
  func.func @f(%g: !kiln.tensor<Bx4xf32>) -> () {
    %t = "kiln.parameter"() {name = "tables.0", embedding = true} : () -> !kiln.tensor<10x4xf32>
    %ids = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0, rows = 10, hotness = 1} : () -> !kiln.tensor<Bx1xi64>
    %m = "kiln.parameter"() {name = "tables.0.adam_m", trainable = false, state_of = "tables.0"} : () -> !kiln.tensor<10x4xf32>
    %v = "kiln.parameter"() {name = "tables.0.adam_v", trainable = false, state_of = "tables.0"} : () -> !kiln.tensor<10x4xf32>
    %lr = "kiln.input"() {name = "lr", role = "lr"} : () -> !kiln.tensor<f32>
    %step = "kiln.input"() {name = "step", role = "step"} : () -> !kiln.tensor<f32>
    %s = "kiln.slice"(%g) {axis = 1, start = 0, limit = 4} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
    "kiln.embedding_bag_update"(%t, %ids, %s, %m, %v, %lr, %step) {beta1 = 0.9, beta2 = 0.999, eps = 1.0e-08, lr = 0.001, mode = "sum", optimizer = "adam", scaled = false, table = "tables.0", weight_decay = 0.0, weighted = false} : (!kiln.tensor<10x4xf32>, !kiln.tensor<Bx1xi64>, !kiln.tensor<Bx4xf32>, !kiln.tensor<10x4xf32>, !kiln.tensor<10x4xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
    return
  }
}
