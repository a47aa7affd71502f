// Reads the IR's text form (ir/printer.h) back into a Module. It accepts what the printer prints,
// a top level without the `module {}` wrapper, `//` comments and blank lines, and a few MLIR
// spellings the printer never uses (`-> (t)`, `42 : i64`, unit attributes). Every op is checked
// against the op table as it is read and every function is verified at the end, so a parsed
// module is valid IR. Errors are located: `file:line:col: error: message`.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "ir/ir.h"
#include "ir/status.h"

namespace kiln::ir {

Expected<std::unique_ptr<Module>> parseModule(std::string_view text, std::string filename = "<input>");

}  // namespace kiln::ir
