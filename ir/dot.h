// Graphviz view of a function: one node per op (its name and result types), one edge per use of
// a value, labeled with the value's printed name. Ops inside a region (a fused group's body)
// are drawn inside a cluster for the op that holds them. `kiln opt --format=dot`.
#pragma once

#include <ostream>
#include <string>

#include "ir/ir.h"

namespace kiln::ir {

std::string functionToDot(const Function& f);
void functionToDot(const Function& f, std::ostream& os);

}  // namespace kiln::ir
