// Clang-style rendering of a located error, for .mlir and .kiln sources alike:
//   model.kiln:3:14: error: unknown op 'kiln.foo'
//     %0 = "kiln.foo"(%x) : ...
//          ^
#pragma once

#include <string>
#include <string_view>

#include "ir/status.h"

namespace kiln {

// status.str(), then (when the location's line exists in `source`) that line and a caret under
// the column. No trailing newline. Given `source_name`, a location in another file (a plan or
// data file a pass read) gets the message alone: `source` is not its text.
std::string formatDiagnostic(const Status& status, std::string_view source, std::string_view source_name = {});

}  // namespace kiln
