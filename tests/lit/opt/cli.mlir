// The command line: stdin, -o, dot output, listings and usage errors (exit code 2).
// RUN: cat %s | %kiln opt - | FileCheck %s --check-prefix=STDIN
// RUN: %kiln opt %s -o %t.out && FileCheck %s --check-prefix=STDIN < %t.out
// RUN: %kiln opt %s --format=dot | FileCheck %s --check-prefix=DOT
// RUN: %kiln opt --list-ops | FileCheck %s --check-prefix=OPS
// RUN: %kiln opt --list-passes | FileCheck %s --check-prefix=PASSES
// RUN: %kiln opt %t.does-not-exist.mlir 2>/dev/null; test $? -eq 2
// RUN: not %kiln opt %t.does-not-exist.mlir 2>&1 | FileCheck %s --check-prefix=MISSING
// RUN: %kiln opt %s --no-such-flag 2>/dev/null; test $? -eq 2
// RUN: not %kiln opt %s --no-such-flag 2>&1 | FileCheck %s --check-prefix=FLAG
// RUN: %kiln opt %s --passes=cse,nosuchpass 2>/dev/null; test $? -eq 2
// RUN: not %kiln opt %s --passes=cse,nosuchpass 2>&1 | FileCheck %s --check-prefix=PASS

func.func @g(%x: !kiln.tensor<Bx4xf32>, %w: !kiln.tensor<8x4xf32>) -> !kiln.tensor<Bx8xf32> {
  %y = "kiln.matmul"(%x, %w) {transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<8x4xf32>) -> !kiln.tensor<Bx8xf32>
  return %y : !kiln.tensor<Bx8xf32>
}

// STDIN:      module {
// STDIN-NEXT:   func.func @g(%x: !kiln.tensor<Bx4xf32>, %w: !kiln.tensor<8x4xf32>) -> !kiln.tensor<Bx8xf32> {
// STDIN-NEXT:     %y = "kiln.matmul"(%x, %w) {transpose_b = true}
// STDIN-NEXT:     return %y : !kiln.tensor<Bx8xf32>
// STDIN-NEXT:   }
// STDIN-NEXT: }

// DOT:      digraph "g" {
// DOT:        arg0 [shape=ellipse, label="%x\n!kiln.tensor<Bx4xf32>"];
// DOT:        op0 [label="kiln.matmul\n!kiln.tensor<Bx8xf32>"];
// DOT:        op1 [label="func.return"];
// DOT-DAG:    arg0 -> op0 [label="%x"];
// DOT-DAG:    arg1 -> op0 [label="%w"];
// DOT-DAG:    op0 -> op1 [label="%y"];
// DOT:      }

// OPS:      kiln.add a + b
// OPS:      kiln.matmul

// PASSES:      shape-inference
// PASSES-NEXT: canonicalize
// PASSES-NEXT: cse
// PASSES-NEXT: dce

// MISSING: kiln opt: error: cannot read '{{.*}}does-not-exist.mlir': No such file or directory
// FLAG: kiln opt: error: unknown flag '--no-such-flag'
// PASS: kiln opt: error: unknown pass 'nosuchpass'; known passes: shape-inference, canonicalize, cse, dce
