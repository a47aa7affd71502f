// The evaluator moved to the driver (driver/evaluator.h, issue 34). The serving files still name
// three of its functions unqualified from kiln::cli; this header keeps them compiling until they
// include driver/evaluator.h and say driver:: themselves.
#pragma once

#include "driver/evaluator.h"

namespace kiln::cli {

using driver::checkpointFile;
using driver::clickProbability;
using driver::taskNames;

}  // namespace kiln::cli
