// Pass options in the pipeline text, MLIR's syntax: `--passes=remat{budget=60%},fusion`.
// RUN: %kiln opt %s "--passes=cse, remat{budget=60%} ,dce" | FileCheck %s
// RUN: %kiln opt --list-passes | FileCheck %s --check-prefix=LIST
// Malformed text is a usage error pointing at the column; so is an option a pass lacks.
// RUN: %kiln opt %s "--passes=cse,remat{budget=60%" 2>/dev/null; test $? -eq 2
// RUN: not %kiln opt %s "--passes=cse,remat{budget=60%" 2>&1 | FileCheck %s --check-prefix=OPEN --strict-whitespace
// RUN: not %kiln opt %s "--passes=remat{budgt=60%}" 2>&1 | FileCheck %s --check-prefix=OPTION
// RUN: not %kiln opt %s "--passes=cse{aggressive=1}" 2>&1 | FileCheck %s --check-prefix=NONE
// RUN: not %kiln opt %s "--passes=remat{budget=lots}" 2>&1 | FileCheck %s --check-prefix=VALUE
// The budget is remat's option; the module attribute that carried it before is refused.
// RUN: sed 's/module {/module attributes {kiln.memory_budget = "60%"} {/' %s > %t.mlir
// RUN: not %kiln opt %t.mlir --passes=remat 2>&1 | FileCheck %s --check-prefix=ATTR
// CHECK:      func.func @f
// CHECK-NEXT:   %a = "kiln.relu"(%x)
// CHECK-NEXT:   return %a
// LIST:      remat {{.*}}
// LIST-NEXT:   budget= {{.*}}bytes, or N% of the unbudgeted peak{{.*}}(default: none)
// LIST-NEXT: fusion
// OPEN:      kiln opt: error: malformed pipeline at column 10: the options of 'remat' have no closing '}'
// OPEN-NEXT: {{^}}  cse,remat{budget=60%{{$}}
// OPEN-NEXT: {{^}}           ^{{$}}
// OPTION: kiln opt: error: pass 'remat' has no option 'budgt'; its options: budget
// NONE: kiln opt: error: pass 'cse' takes no options (given 'aggressive')
// VALUE: kiln opt: error: pass 'remat': option 'budget': expected bytes or a percentage such as 60%, got 'lots'
// ATTR: error: in pass 'remat': the module attribute kiln.memory_budget is not read: give the budget as remat's option, e.g. --passes=remat{budget=60%}
module {
  func.func @f(%x: !kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32> {
    %a = "kiln.relu"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
    %b = "kiln.relu"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
    %dead = "kiln.exp"(%x) : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx4xf32>
    return %a : !kiln.tensor<Bx4xf32>
  }
}
