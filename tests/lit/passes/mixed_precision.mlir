// precision = "bf16": GEMM operands and results in bf16, the rest f32; autodiff then follows
// the casts, so parameters still get f32 updates. The pass must run before autodiff.
// RUN: %kiln opt %s --passes=mixed-precision,autodiff | FileCheck %s
// RUN: not %kiln opt %s --passes=autodiff,mixed-precision 2>&1 | FileCheck %s --check-prefix=ORDER

module attributes {kiln.outputs = ["logit", "loss"], kiln.train = {loss = "loss", optimizer = {kind = "sgd", lr = 0.1}, precision = "bf16", prediction = "logit"}} {
  func.func @forward() -> (!kiln.tensor<Bxf32>, !kiln.tensor<f32>) {
    %x = "kiln.input"() {name = "dense", role = "dense"} : () -> !kiln.tensor<Bx4xf32>
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %w = "kiln.parameter"() {name = "w"} : () -> !kiln.tensor<1x4xf32>
    %y = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<1x4xf32>) -> !kiln.tensor<Bx1xf32>
    %logit = "kiln.reshape"(%y) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %logit, %loss : !kiln.tensor<Bxf32>, !kiln.tensor<f32>
  }
}

// CHECK-LABEL: func.func @forward()
// CHECK:         %[[X:.*]] = "kiln.cast"(%x) {to = "bf16"} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xbf16>
// CHECK-NEXT:    %[[W:.*]] = "kiln.cast"(%w) {to = "bf16"} : (!kiln.tensor<1x4xf32>) -> !kiln.tensor<1x4xbf16>
// CHECK-NEXT:    %[[Y:.*]] = "kiln.matmul"(%[[X]], %[[W]]) {{{.*}}transpose_b = true} : (!kiln.tensor<Bx4xbf16>, !kiln.tensor<1x4xbf16>) -> !kiln.tensor<Bx1xbf16>
// CHECK-NEXT:    %y = "kiln.cast"(%[[Y]]) {to = "f32"} : (!kiln.tensor<Bx1xbf16>) -> !kiln.tensor<Bx1xf32>
// CHECK-LABEL: func.func @train_step()
// CHECK:         "kiln.optimizer_update"(%w, %{{.*}}) {{.*}} : (!kiln.tensor<1x4xf32>, !kiln.tensor<1x4xf32>,

// ORDER: error: pass 'mixed-precision' (position 2) must not run after 'autodiff' (position 1)
