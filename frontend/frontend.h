// The Kiln language frontend: from a .kiln file to an ir::Module of the shape docs/model-ir.md
// fixes. Diagnostics (errors and warnings, clang style) go to the DiagnosticEngine; the result
// is an error Status whenever any error was reported.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/ast.h"
#include "frontend/diagnostics.h"
#include "ir/ir.h"

namespace kiln::frontend {

// `--set name=value` overrides of model params; values are Kiln expressions ("1000", "[1, 2]").
using ParamOverrides = std::map<std::string, std::string>;

// Reads, parses and lowers a model file (its imports resolved relative to it).
Expected<std::unique_ptr<ir::Module>> compileModelFile(const std::string& path, const ParamOverrides& overrides,
                                                       DiagnosticEngine& diags);
// Same, for source text already in memory; imports resolve relative to `path`'s folder.
Expected<std::unique_ptr<ir::Module>> compileModelSource(const std::string& path, std::string_view text,
                                                         const ParamOverrides& overrides, DiagnosticEngine& diags);

// Parses one file without imports or lowering, for `kiln dump --stage=ast`.
Expected<std::unique_ptr<ast::File>> parseModelFile(const std::string& path, DiagnosticEngine& diags);

// Splits "name=value" (a --set flag) into the overrides map; an error names the bad flag.
Status addOverride(const std::string& flag, ParamOverrides& overrides);

}  // namespace kiln::frontend
