// Every stage of a pipeline can be seen: printed after each pass or a chosen one, dumped to
// numbered files, timed; passes can be disabled.
// RUN: %kiln opt %s --passes=canonicalize,cse,dce --print-ir-after-all 2>&1 | FileCheck %s --check-prefix=ALL
// RUN: %kiln opt %s --passes=canonicalize,cse,dce --print-ir-after=cse 2>&1 >/dev/null | FileCheck %s --check-prefix=ONE
// RUN: %kiln opt %s --passes=canonicalize,cse,dce --disable-pass=cse | FileCheck %s --check-prefix=NOCSE
// RUN: rm -rf %t && %kiln opt %s --passes=canonicalize,cse,dce --dump-dir %t >/dev/null && ls %t | FileCheck %s --check-prefix=DUMP
// RUN: FileCheck %s --check-prefix=DUMPCSE < %t/0002.cse.mlir
// RUN: %kiln opt %s --passes=canonicalize,cse --pass-timing 2>&1 >/dev/null | FileCheck %s --check-prefix=TIME

func.func @f(%x: !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32> {
  %one = "kiln.constant"() {value = 1.0} : () -> !kiln.tensor<f32>
  %m = "kiln.mul"(%x, %one) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<f32>) -> !kiln.tensor<Bx4xf32>
  %a = "kiln.relu"(%m) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %b = "kiln.relu"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %dead = "kiln.exp"(%a) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  %s = "kiln.add"(%a, %b) : (!kiln.tensor<Bx4xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
  return %s : !kiln.tensor<Bx4xf32>
}

// ALL:      // -----// IR Dump After canonicalize //----- //
// ALL:        %a = "kiln.relu"(%x)
// ALL-NEXT:   %b = "kiln.relu"(%x)
// ALL:      // -----// IR Dump After cse //----- //
// ALL:        %a = "kiln.relu"(%x)
// ALL-NEXT:   %dead = "kiln.exp"(%a)
// ALL-NEXT:   %s = "kiln.add"(%a, %a)
// ALL:      // -----// IR Dump After dce //----- //
// ALL:        %a = "kiln.relu"(%x)
// ALL-NEXT:   %s = "kiln.add"(%a, %a)
// ALL-NEXT:   return %s
// The final output follows on stdout.
// ALL:      module {

// ONE-NOT:  IR Dump After canonicalize
// ONE:      // -----// IR Dump After cse //----- //
// ONE-NOT:  IR Dump After dce

// NOCSE:      %b = "kiln.relu"(%x)
// NOCSE-NOT:  %dead
// NOCSE:      %s = "kiln.add"(%a, %b)

// DUMP:      0000.input.mlir
// DUMP-NEXT: 0001.canonicalize.mlir
// DUMP-NEXT: 0002.cse.mlir
// DUMP-NEXT: 0003.dce.mlir
// DUMP-NOT:  .mlir

// DUMPCSE:      %s = "kiln.add"(%a, %a)

// TIME:      Pass execution timing report
// TIME:      Wall (ms)
// TIME-NEXT: canonicalize
// TIME-NEXT: cse
// TIME-NEXT: Total
