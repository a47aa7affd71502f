// RUN: %kiln opt %s --passes=dce --split-input-file | FileCheck %s

// A chain of unused pure ops goes in one run; inputs and parameters stay (they are the
// model's interface), even unused.
// CHECK-LABEL: func.func @chain
// CHECK-NEXT:    %x = "kiln.input"() {name = "x"}
// CHECK-NEXT:    %w = "kiln.parameter"() {init = "zeros", name = "w"}
// CHECK-NEXT:    %used = "kiln.exp"(%x)
// CHECK-NEXT:    return %used
func.func @chain() -> !kiln.tensor<Bxf32> {
  %x = "kiln.input"() {name = "x"} : () -> !kiln.tensor<Bxf32>
  %w = "kiln.parameter"() {init = "zeros", name = "w"} : () -> !kiln.tensor<4xf32>
  %a = "kiln.relu"(%x) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  %b = "kiln.tanh"(%a) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  %c = "kiln.add"(%b, %a) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  %used = "kiln.exp"(%x) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bxf32>
  return %used : !kiln.tensor<Bxf32>
}

// -----

// Nothing to remove: the IR comes out as it went in.
// CHECK-LABEL: func.func @live
// CHECK-NEXT:    %y = "kiln.sigmoid"(%x)
// CHECK-NEXT:    return %y
func.func @live(%x: !kiln.tensor<4xf32>) -> !kiln.tensor<4xf32> {
  %y = "kiln.sigmoid"(%x) : (!kiln.tensor<4xf32>) -> !kiln.tensor<4xf32>
  return %y : !kiln.tensor<4xf32>
}
